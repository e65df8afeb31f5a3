"""Flag values that were taken silently, or refused only after work was done: each is now a usage error
(exit 2) naming the flag, given before anything is computed or written (docs/errors.md)."""
import json

import pytest

SMALL_POOLS = ("--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB", "--store-host-size", "1MiB",
               "--state-host-size", "1MiB", "--store-hbm-size", "1MiB")


def refused(r, *words):
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_model_run_refuses_one_path_for_two_outputs(terrace, toy_model, tmp_path):
    """--dump-logits and --expert-prometheus naming one file: one output would be lost (with --force)
    or the run failed at its end saying the file was not Terrace's."""
    dup = tmp_path / "dup.out"
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--expert-cache", "25%")
    for extra in ((), ("--force",)):
        r = terrace(*run, "--dump-logits", dup, "--expert-prometheus", dup, *extra)
        refused(r, "--dump-logits", "--expert-prometheus")
        assert "prefill" not in r.stdout
        assert not dup.exists()
    # The same file by two spellings.
    (tmp_path / "sub").mkdir()
    refused(terrace(*run, "--dump-logits", dup, "--expert-prometheus", tmp_path / "sub" / ".." / "dup.out"),
            "--dump-logits", "--expert-prometheus")
    assert not dup.exists()


def test_model_init_residual_scale_that_would_underflow_is_refused(terrace, tmp_path):
    init = ("model", "init", "--preset", "k3-toy", "--routing-tokens", "0")
    for bad in ("1e-300", "1e-7", "0", "-1", "2"):
        refused(terrace(*init, "--out", tmp_path / "m", "--residual-scale", bad), "--residual-scale", bad, "1e-06")
    assert not (tmp_path / "m").exists()
    # Not a number: the flag's own message, not CLI11's "Could not convert".
    r = terrace(*init, "--out", tmp_path / "m", "--residual-scale", "0.5abc")
    refused(r, "--residual-scale", "0.5abc", "not a finite number")
    assert "Could not convert" not in r.stderr
    # The bound itself and the usual values are taken.
    for good in ("1e-6", "0.25", "1"):
        r = terrace(*init, "--out", tmp_path / good, "--residual-scale", good)
        assert r.returncode == 0, (good, r.stderr)


@pytest.mark.parametrize("flag", ["--store", "--expert-cache", "--dump-logits", "--expert-prometheus", "--tenant",
                                  "--kv-codec", "--state-codec", "--predictor", "--expert-policy", "--expert-home",
                                  "--tokens", "--model"])
def test_model_run_refuses_an_empty_value(terrace, toy_model, tmp_path, flag):
    """An empty value counted as "flag not given": --store "" ran with no cache, --expert-cache "" dense,
    --dump-logits "" wrote nothing."""
    args = {"--model": toy_model, "--tokens": "1,2,3"}
    if flag in ("--tenant", "--kv-codec", "--state-codec"):
        args["--store"] = tmp_path / "s"
    if flag in ("--predictor", "--expert-policy", "--expert-home", "--expert-prometheus"):
        args["--expert-cache"] = "25%"
    args[flag] = ""
    cmd = ["model", "run"]
    for k, v in args.items():
        cmd += [k, v]
    r = terrace(*cmd)
    refused(r, flag, "empty")
    assert "prefill" not in r.stdout
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("cmd", [
    ("bench", "kv", "--turns", "0", "--prefix-tokens", "64", "--chunk-tokens", "64"),
    ("bench", "experts", "--configs", "on-demand"),
])
def test_benches_refuse_an_empty_value(terrace, toy_model, tmp_path, cmd):
    base = (*cmd, "--model", toy_model)
    flags = ["--dir", "--model"] + (["--kv-codec", "--tenant", "--prefix-tokens", "--tier"] if cmd[1] == "kv"
                                    else ["--budgets", "--configs"])
    for flag in flags:
        args = list(base)
        if flag == "--model":
            args[args.index("--model") + 1] = ""
        else:
            args += [flag, ""]
        if flag != "--dir" and cmd[1] == "experts":
            args += ["--dir", tmp_path / "e"]
        refused(terrace(*args), flag, "the value is empty")
    assert not (tmp_path / "e").exists()


def test_demo_refuses_an_empty_value(terrace, tmp_path):
    for flag in ("--dir", "--expert-cache", "--preset"):
        args = ["demo", "--preset", "k3-toy", "--dir", tmp_path / "d"]
        if flag in args:
            args[args.index(flag) + 1] = ""
        else:
            args += [flag, ""]
        refused(terrace(*args), flag, "empty")
    assert not (tmp_path / "d").exists()


def test_bench_experts_busy_rank_precision_must_exceed_the_minimum(terrace, toy_model, tmp_path):
    """A busy threshold at or below the minimum was off (LookaheadOptions::RankThreshold) while the JSON
    recorded it; 0 is the documented "off" value."""
    ex = ("bench", "experts", "--model", toy_model, "--dir", tmp_path / "e", "--configs", "lru+lookahead",
          "--budgets", "25%")
    for busy, minimum in (("0.5", "0.9"), ("0.9", "0.9"), ("0.6", None)):  # the minimum's default is 0.7
        extra = ("--lookahead-min-rank-precision", minimum) if minimum else ()
        refused(terrace(*ex, "--lookahead-busy-rank-precision", busy, *extra), "--lookahead-busy-rank-precision",
                "--lookahead-min-rank-precision")
    assert not (tmp_path / "e").exists()


def test_bench_experts_layer_flags_beyond_the_model_are_refused(terrace, toy_model, tmp_path):
    ex = ("bench", "experts", "--model", toy_model, "--dir", tmp_path / "e", "--configs", "lru+lookahead")
    refused(terrace(*ex, "--lead-protected-layers", "50"), "--lead-protected-layers", "50", "7 MoE layers")
    refused(terrace(*ex, "--lookahead-depth", "64"), "--lookahead-depth", "64", "8 layers")
    refused(terrace(*ex, "--lookahead-embedding-depth", "9"), "--lookahead-embedding-depth", "7 MoE layers")
    assert not (tmp_path / "e").exists()


def test_model_run_lookahead_depth_beyond_the_model_is_refused(terrace, toy_model, tmp_path):
    """k3-toy has 8 layers: a depth of 8 or more predicts layers that do not exist (it was taken)."""
    run = ("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--max-new", "1", "--expert-cache", "50%")
    refused(terrace(*run, "--lookahead-depth", "8"), "--lookahead-depth 8", "8 layers", "at most 7")
    assert terrace(*run, "--lookahead-depth", "7").returncode == 0


def test_model_init_over_the_safety_limit_is_a_usage_error(terrace, tmp_path):
    """Only --force gets past the 4 GiB limit: a missing flag, exit 2 like the other refusals (was 1)."""
    refused(terrace("model", "init", "--preset", "kimi-linear-48b", "--out", tmp_path / "big"),
            "--preset kimi-linear-48b", "4 GiB safety limit", "--force")
    assert not (tmp_path / "big").exists()


def test_bench_experts_link_gbps_help_and_check_agree(terrace, toy_model, tmp_path):
    help_text = terrace("bench", "experts", "--help").stdout
    line = " ".join(help_text[help_text.index("--link-gbps"):].split("\n--")[0].split())
    assert "0 to 1000000" not in line, line
    assert "above 0" in line, line
    ex = ("bench", "experts", "--model", toy_model, "--dir", tmp_path / "e", "--configs", "on-demand")
    refused(terrace(*ex, "--link-gbps", "0"), "--link-gbps", "above 0")


def test_bench_experts_labels_a_budget_as_given(terrace, toy_model, tmp_path):
    r = terrace("bench", "experts", "--model", toy_model, "--dir", tmp_path / "e", "--prompt", "4", "--decode", "2",
                "--configs", "on-demand", "--budgets", "25.5%", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "26%" not in r.stdout, r.stdout
    assert "25.5%" in r.stdout, r.stdout


def test_bench_kv_refuses_a_prefix_under_one_chunk(terrace, toy_model, tmp_path):
    r = terrace("bench", "kv", "--model", toy_model, "--dir", tmp_path / "b", "--turns", "0", "--repeat", "1",
                "--chunk-tokens", "16", "--prefix-tokens", "16,16,10", *SMALL_POOLS)
    refused(r, "--prefix-tokens", "10", "--chunk-tokens", "16")
    assert r.stdout == ""
    assert not (tmp_path / "b").exists()


def test_bench_kv_dir_that_is_a_file(terrace, toy_model, tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("mine\n")
    r = terrace("bench", "kv", "--model", toy_model, "--dir", f, "--turns", "0", "--prefix-tokens", "64",
                "--chunk-tokens", "64")
    refused(r, "--dir", "is a regular file; give a directory")
    assert f.read_text() == "mine\n"


def test_bench_kv_refuses_a_bad_codec_before_any_work(terrace, toy_model, tmp_path):
    for flag in ("--kv-codec", "--state-codec"):
        r = terrace("bench", "kv", "--model", toy_model, "--dir", tmp_path / "b", "--turns", "1", "--prefix-tokens",
                    "16", "--chunk-tokens", "16", flag, "nosuch", *SMALL_POOLS)
        refused(r, flag, "nosuch")
        assert "turn 1" not in r.stderr, r.stderr
        assert not (tmp_path / "b").exists()


def test_expert_cache_below_one_block_is_refused_before_any_work(terrace, toy_model, tmp_path):
    r = terrace("demo", "--preset", "k3-toy", "--dir", tmp_path / "d", "--expert-cache", "25")
    refused(r, "--expert-cache", "25", "smaller than one expert block")
    assert "[2/4]" not in r.stdout + r.stderr
    assert "25 bytes is 25 bytes" not in r.stderr
    assert not (tmp_path / "d").exists()
    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--expert-cache", "25")
    refused(r, "--expert-cache", "25", "smaller than one expert block")
    assert "25 bytes is 25 bytes" not in r.stderr


def test_model_run_tokens_accept_surrounding_whitespace(terrace, toy_model):
    run = ("model", "run", "--model", toy_model, "--max-new", "1", "--json")
    digests = set()
    for tokens in ("1,2,3", " 1,2,3", "1,2,3 ", "1, 2 ,3"):
        r = terrace(*run, "--tokens", tokens, timeout=300)
        assert r.returncode == 0, (tokens, r.stderr)
        digests.add(json.loads(r.stdout)["logits_xxh3_64"])
    assert len(digests) == 1
    for bad in ("1 2,3", "1,,3", " "):
        refused(terrace(*run, "--tokens", bad), "--tokens")


@pytest.mark.parametrize("args", [
    ("plan", "--model", "k3-small", "--trace", ""),
    ("trace", "gen", "--requests", "2", "--out", ""),
    ("bench", "store", "--dir", ""),
    ("demo", "--inject-fault", ""),  # a hidden option: CLI11 leaves its name out, the message must not
    ("bench", "tiers", "--tier", ""),  # a set of allowed values answered "--tier:  not in {host,nvme,hbm}"
    ("model", "run", "--model", "m", "--tokens", "1", "--read-order", ""),
])
def test_every_command_refuses_an_empty_value(terrace, tmp_path, args):
    """An empty value was read as "flag not given" outside the four commands first fixed: plan ran
    without the trace, trace gen wrote to standard output, bench store ran in a temporary directory."""
    flag = args[-2]
    r = terrace(*args, cwd=tmp_path)
    refused(r, f"{flag}: the value is empty", f"leave {flag} out")
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_a_required_option_given_empty_is_not_told_to_leave_it_out(terrace):
    r = terrace("model", "run", "--model", "", "--tokens", "1")
    refused(r, "--model: the value is empty; give one")
    assert "leave --model out" not in r.stderr


def test_a_model_directory_is_refused_as_a_store(terrace, toy_model):
    """model run --store MODEL_DIR created kv/ and state/ among the model's weights."""
    import os
    before = sorted(os.listdir(toy_model))
    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--store", toy_model, *SMALL_POOLS)
    refused(r, f"--store {toy_model} is a model directory")
    assert sorted(os.listdir(toy_model)) == before
