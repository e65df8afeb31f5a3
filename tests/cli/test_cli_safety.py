"""CLI safety: never destroy what Terrace did not create, never hang or crash on bad input, exit 2
for bad arguments. Each test reproduces an item of the CLI safety issue against the built binary."""
import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import struct
import subprocess

import pytest

from conftest import snapshot, user_folder, wait_for, write_safetensors

API_FIELDS = ("capacity_bytes", "create_if_missing", "PutOptions", "index_dir", "chunk_bytes", "options.")


def assert_usage_error(r, *words):
    assert r.returncode == 2, f"exit {r.returncode}, want 2 (usage error)\n{r.stdout}\n{r.stderr}"
    assert r.stderr.startswith("terrace: error: "), r.stderr
    for w in words:
        assert w in r.stderr, f"{w!r} not in {r.stderr!r}"
    for f in API_FIELDS:
        assert f not in r.stderr, f"message names the API field {f!r}: {r.stderr!r}"


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---- commands and exit codes -------------------------------------------------------------------

def test_unknown_command_is_named(terrace):
    assert_usage_error(terrace("frobnicate"), "unknown command 'frobnicate'")
    assert_usage_error(terrace("model", "frobnicate"), "unknown command 'frobnicate'", "init")


@pytest.mark.parametrize("args,want", [
    # A near miss is named with the subcommand's own flag and help.
    (["model", "run", "--model", "x", "--tokens", "1", "--max_new", "3"],
     "unknown flag --max_new for 'terrace model run'; did you mean --max-new? (run 'terrace model run --help')"),
    (["demo", "--conversation", "2"],
     "unknown flag --conversation for 'terrace demo'; did you mean --conversations? (run 'terrace demo --help')"),
    (["bench", "tiers", "--tire=nvme"],
     "unknown flag --tire for 'terrace bench tiers'; did you mean --tier? (run 'terrace bench tiers --help')"),
    # Nothing close: no guess.
    (["model", "run", "--model", "x", "--tokens", "1", "--frobnicate"],
     "unknown flag --frobnicate for 'terrace model run' (run 'terrace model run --help')"),
    (["model", "run", "--model", "x", "--tokens", "1", "stray"],
     "unexpected argument 'stray' for 'terrace model run' (run 'terrace model run --help')"),
    # CLI11's count messages ("At Most 1 required but received 2") in plain words.
    (["plan", "--rate", "1", "--rate", "2"], "--rate given 2 times; give it once (run 'terrace plan --help')"),
    (["model", "run", "--model", "x", "--tokens", "1", "--max-new"],
     "--max-new needs a value (INT) (run 'terrace model run --help')"),
])
def test_an_unknown_flag_is_named_with_the_closest_one(terrace, tmp_path, args, want):
    r = terrace(*args, cwd=tmp_path)
    assert_usage_error(r, want)
    assert "not expected" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,words", [
    (["model", "init", "--out", "x"], ["--preset or --config"]),
    (["model", "inspect"], ["--preset"]),
    (["model", "init", "--preset", "no-such-preset", "--out", "x"], ["no-such-preset"]),
])
def test_missing_or_bad_arguments_exit_2(terrace, tmp_path, args, words):
    assert_usage_error(terrace(*args, cwd=tmp_path), *words)


def test_token_outside_vocabulary_is_a_usage_error(terrace, toy_model):
    assert_usage_error(terrace("model", "run", "--model", toy_model, "--tokens", "1,99999999"), "--tokens")


# ---- numbers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,flag", [
    (["model", "init", "--preset", "k3-toy", "--out", "m", "--routing-tokens", "-1"], "--routing-tokens"),
    (["model", "init", "--preset", "k3-toy", "--out", "m", "--seed", "-1"], "--seed"),
    (["model", "init", "--preset", "k3-toy", "--out", "m", "--shard-bytes", "-1"], "--shard-bytes"),
    (["model", "run", "--model", "m", "--tokens", "1", "--threads", "100000"], "--threads"),
    (["model", "run", "--model", "m", "--tokens", "1", "--max-new", "-1"], "--max-new"),
    (["demo", "--seed", "-1"], "--seed"),
    (["bench", "tiers", "--block-size", "1TiB", "--total-bytes", "1TiB"], "--block-size"),
    (["bench", "tiers", "--block-size", "-4096"], "--block-size"),
    (["bench", "tiers", "--total-bytes", "99999999999999999999"], "--total-bytes"),
    (["ref", "kda", "--in", "i", "--out", "o", "--chunk-size", "-1"], "--chunk-size"),
    (["ref", "mla", "--in", "i", "--out", "o", "--heads", "-1"], "--heads"),
    (["ref", "moe", "--in", "i", "--out", "o", "--top-k", "-5"], "--top-k"),
    (["ref", "moe", "--in", "i", "--out", "o", "--eps", "nan"], "--eps"),
    # The flags standing for config.json keys take the key's range: a zero SiTU beta divided by zero
    # (an all-zero output), a zero or negative routed scaling was computed.
    (["ref", "moe", "--in", "i", "--out", "o", "--situ-beta", "0"], "--situ-beta"),
    (["ref", "moe", "--in", "i", "--out", "o", "--situ-linear-beta", "-4"], "--situ-linear-beta"),
    (["ref", "moe", "--in", "i", "--out", "o", "--scaling", "0"], "--scaling"),
    (["ref", "moe", "--in", "i", "--out", "o", "--scaling", "-1"], "--scaling"),
    (["ref", "moe", "--in", "i", "--out", "o", "--eps", "0.5"], "--eps"),
    (["ref", "mla", "--in", "i", "--out", "o", "--heads", "2", "--eps", "0"], "--eps"),
])
def test_out_of_range_numbers_are_refused_naming_the_flag(terrace, tmp_path, args, flag):
    r = terrace(*args, cwd=tmp_path, timeout=60)
    assert_usage_error(r, flag)
    assert "range" in r.stderr or "not a finite number" in r.stderr or "negative" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == [], "a refused command created files"


# Regression guards: these were already refused (CLI11 range checks) before the range-checked options
# replaced them; they must stay refused.
@pytest.mark.parametrize("args,flag", [
    (["demo", "--conversations", "-1"], "--conversations"),
    (["demo", "--turns", "4294967297"], "--turns"),
    (["bench", "tiers", "--threads", "100000"], "--threads"),
    (["bench", "tiers", "--threads", "-1"], "--threads"),
    (["bench", "tiers", "--queue-depth", "-1"], "--queue-depth"),
    (["bench", "tiers", "--batch", "65537"], "--batch"),
])
def test_range_checked_options_stay_refused(terrace, tmp_path, args, flag):
    assert_usage_error(terrace(*args, cwd=tmp_path, timeout=60), flag)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args,flags", [
    # Read buffers hold at most the data set's blocks: a batch larger than the RAM is refused only
    # when the data set is too (64 MiB of data with --batch 65536 runs, with 64 buffers).
    (["--batch", "65536", "--op", "read", "--total-bytes", "64GiB"], ["--batch", "--block-size"]),
    (["--batch", "65536", "--op", "read", "--total-bytes", "64GiB", "--tier", "nvme", "--dir", "b"], ["--batch"]),
    (["--block-size", "1GiB", "--total-bytes", "64TiB"], ["--total-bytes"]),
])
def test_bench_sizes_that_cannot_work_are_refused_not_segfaults(terrace, tmp_path, args, flags):
    r = terrace("bench", "tiers", *args, cwd=tmp_path, timeout=120)
    assert_usage_error(r, *flags)
    assert "Bad address" not in r.stderr


# ---- demo --fresh ------------------------------------------------------------------------------------

# The quickest demo run: the k3-toy model, one short turn, small NVMe pools.
DEMO = ["--preset", "k3-toy", "--conversations", "1", "--turns", "1", "--system-tokens", "8", "--user-tokens", "4",
        "--new-tokens", "1", "--kv-nvme-size", "4MiB", "--state-nvme-size", "4MiB"]


def test_demo_fresh_refuses_a_folder_of_user_files(terrace, tmp_path):
    d = user_folder(tmp_path / "mine")
    before = snapshot(d)
    r = terrace("demo", "--fresh", "--dir", d, *DEMO)
    assert_usage_error(r, "--dir", "thesis.txt", "nothing was removed")
    assert snapshot(d) == before


def test_demo_fresh_refuses_the_working_folder_and_a_regular_file(terrace, tmp_path):
    user_folder(tmp_path)
    (tmp_path / "notes").write_text("keep me\n")
    before = snapshot(tmp_path)
    assert_usage_error(terrace("demo", "--fresh", "--dir", ".", *DEMO, cwd=tmp_path), "--dir")
    assert_usage_error(terrace("demo", "--fresh", "--dir", "notes", *DEMO, cwd=tmp_path), "--dir",
                       "regular file")
    assert snapshot(tmp_path) == before


def test_demo_fresh_removes_only_its_own_data(terrace, tmp_path):
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    assert {p.name for p in d.iterdir()} == {"terrace-demo.marker", "model", "kv", "state", "experts", "demo-run.json",
                                        "report.html"}
    for where in (d, d / "kv", d / "model", d / "kv" / "index"):
        (where / "mine.txt").write_text("not Terrace's\n")  # a foreign file makes it not the demo's data
        before = snapshot(d)
        assert_usage_error(terrace("demo", "--fresh", "--dir", d, *DEMO), "mine.txt", "nothing was removed")
        assert snapshot(d) == before
        (where / "mine.txt").unlink()
    r = terrace("demo", "--fresh", "--dir", d, *DEMO, check=True)
    assert "removed the demo's data" in r.stderr  # progress, on stderr
    assert "built the model" in r.stderr and "0 KV chunk and 0 KDA state blocks from earlier runs" in r.stderr


def test_demo_fresh_refuses_data_the_demo_did_not_create(terrace, tmp_path):
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    (d / "terrace-demo.marker").unlink()  # as a folder written by another program would be
    before = snapshot(d)
    assert_usage_error(terrace("demo", "--fresh", "--dir", d, *DEMO), "did not create")
    assert_usage_error(terrace("demo", "--dir", d, *DEMO), "did not create")
    assert snapshot(d) == before


def test_demo_finishes_a_stopped_model_build_and_keeps_user_files(terrace, tmp_path):
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    shutil.rmtree(d / "model")  # as a run stopped while building the model leaves it
    (d / "model.tmp").mkdir()
    (d / "model.tmp" / "model.safetensors.tmp.12345").write_bytes(b"partial")
    r = terrace("demo", "--dir", d, *DEMO, check=True)
    assert "built the model" in r.stderr and not (d / "model.tmp").exists()
    (d / "model.tmp").mkdir()
    (d / "model.tmp" / "notes.txt").write_text("mine\n")
    before = snapshot(d)
    assert_usage_error(terrace("demo", "--dir", d, *DEMO), "model.tmp/notes.txt")
    assert_usage_error(terrace("demo", "--fresh", "--dir", d, *DEMO), "model.tmp/notes.txt", "nothing was removed")
    assert snapshot(d) == before


def test_demo_looks_inside_the_entries_an_earlier_version_left(terrace, tmp_path):
    """DIR/index, DIR/terrace.data (an earlier demo version's store) and files in DIR/model.tmp named
    like the model's were taken as the demo's by name alone, and --fresh (or a plain run, for
    model.tmp) removed them whatever they held."""
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    shutil.rmtree(d / "model")  # so that a plain run builds the model (and clears model.tmp)
    cases = [(d / "index", "notes.txt", "index/notes.txt"),
             (d, "terrace.data", "terrace.data (not a Terrace data file)"),
             (d / "model.tmp", "model.safetensors.bak", "model.tmp/model.safetensors.bak"),
             (d / "model.tmp", "config.json.orig", "model.tmp/config.json.orig"),
             # A stopped write's temp is "<name>.tmp.<pid>": a suffix that is not all digits is a user's.
             (d / "model.tmp", "config.json.tmp.notes", "model.tmp/config.json.tmp.notes")]
    for where, name, shown in cases:
        where.mkdir(exist_ok=True)
        (where / name).write_text("mine\n")
        before = snapshot(d)
        assert_usage_error(terrace("demo", "--fresh", "--dir", d, *DEMO), shown, "nothing was removed")
        assert_usage_error(terrace("demo", "--dir", d, *DEMO), shown)
        assert snapshot(d) == before
        (where / name).unlink()
        if where != d:
            where.rmdir()
    terrace("demo", "--fresh", "--dir", d, *DEMO, check=True)


def test_demo_fresh_refuses_a_symlink_to_its_data(terrace, tmp_path):
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    os.symlink(d, tmp_path / "link")
    before = snapshot(d)
    assert_usage_error(terrace("demo", "--fresh", "--dir", tmp_path / "link", *DEMO), "symbolic link")
    assert snapshot(d) == before


# ---- model init --out ------------------------------------------------------------------------------

def test_model_init_refuses_a_non_empty_out(terrace, tmp_path):
    d = tmp_path / "m"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", check=True)
    before = snapshot(d)
    r = terrace("model", "init", "--preset", "k3-toy", "--out", d, "--seed", "7", "--routing-tokens", "0")
    assert_usage_error(r, "--out", "not empty", "--force")
    assert snapshot(d) == before


def test_model_init_force_replaces_only_checkpoint_files(terrace, tmp_path):
    d = tmp_path / "m"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", check=True)
    user_folder(d / "notes")
    (d / "README.md").write_text("my model card\n")
    (d / "model.safetensors.bak").write_bytes(b"a backup")
    old = sha(d / "model.safetensors")
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--seed", "7", "--routing-tokens", "0", "--force",
            check=True)
    assert sha(d / "model.safetensors") != old  # replaced (another seed)
    assert (d / "README.md").read_text() == "my model card\n"
    assert (d / "model.safetensors.bak").read_bytes() == b"a backup"
    assert (d / "notes" / "thesis.txt").read_text() == "years of work\n"


def test_model_init_force_that_fails_leaves_the_old_checkpoint(terrace, tmp_path):
    d = tmp_path / "m"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", check=True)
    before = snapshot(d)

    def small_files():  # writes past 1 MiB fail (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    r = terrace("model", "init", "--preset", "k3-toy", "--out", d, "--seed", "9", "--routing-tokens", "0", "--force",
                preexec_fn=small_files)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "nothing in it was changed" in r.stderr
    assert snapshot(d) == before
    terrace("model", "inspect", d, "--summary", check=True)


def test_model_init_force_switches_between_single_file_and_shards(terrace, tmp_path):
    d = tmp_path / "m"
    (d / "keep").mkdir(parents=True)
    (d / "keep" / "model.safetensors").write_bytes(b"not the checkpoint")  # same name, another folder
    for shard in ["1MiB", "2GiB", "1MiB"]:
        terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", "--force",
                "--shard-bytes", shard, check=True)
        names = sorted(os.listdir(d))
        sharded = [n for n in names if n.startswith("model-")]
        if shard == "1MiB":
            assert "model.safetensors" not in names and "model.safetensors.index.json" in names and sharded
        else:
            assert "model.safetensors" in names and "model.safetensors.index.json" not in names and not sharded
        assert not [n for n in names if n.startswith(".terrace-tmp")], names
        terrace("model", "inspect", d, "--summary", check=True)
    assert (d / "keep" / "model.safetensors").read_bytes() == b"not the checkpoint"


def test_model_init_force_refuses_a_checkpoint_name_that_is_not_a_regular_file(terrace, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    precious = tmp_path / "precious.json"
    precious.write_text("{}\n")
    os.symlink(precious, d / "config.json")
    r = terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", "--force")
    assert_usage_error(r, "config.json", "symbolic link")
    assert os.path.islink(d / "config.json") and precious.read_text() == "{}\n"


def test_model_init_refuses_a_regular_file_or_symlink_as_out(terrace, tmp_path):
    f = tmp_path / "file"
    f.write_text("x\n")
    assert_usage_error(terrace("model", "init", "--preset", "k3-toy", "--out", f, "--force"), "--out", "regular file")
    os.symlink(tmp_path, tmp_path / "link")
    assert_usage_error(terrace("model", "init", "--preset", "k3-toy", "--out", tmp_path / "link", "--force"),
                       "symbolic link")
    assert f.read_text() == "x\n"


# ---- output files ------------------------------------------------------------------------------------

def output_commands(model, tmp_path):
    """(name, argv builder taking the output path): every command that writes an output file."""
    tensors = tmp_path / "in.safetensors"
    write_safetensors(tensors, {"weight": ("F32", [2, 32], bytes(256)),
                                "weight_packed": ("U8", [2, 16], bytes(range(32))),
                                "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    packed = tmp_path / "packed.safetensors"  # only what ref mxfp4 reads (it refuses any other tensor)
    write_safetensors(packed, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                               "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    return [
        ("model run --dump-logits", lambda o: ["model", "run", "--model", model, "--tokens", "1,2", "--dump-logits", o]),
        ("ref mxfp4 --out", lambda o: ["ref", "mxfp4", "--in", packed, "--out", o]),
        ("model quantize-mxfp4 --out", lambda o: ["model", "quantize-mxfp4", "--in", tensors, "--out", o]),
        ("model copy-tensors --out", lambda o: ["model", "copy-tensors", "--in", tensors, "--out", o]),
    ]


def test_outputs_refuse_fifos_symlinks_and_directories(terrace, toy_model, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("do not replace\n")
    for name, argv in output_commands(toy_model, tmp_path):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        link = tmp_path / "link"
        os.symlink(victim, link)
        folder = user_folder(tmp_path / "folder")
        before = snapshot(folder)
        for target, kind in [(fifo, "FIFO"), (link, "symbolic link"), (folder, "directory")]:
            r = terrace(*argv(target), timeout=60)
            assert_usage_error(r, kind)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode), name
        assert os.path.islink(link) and os.readlink(link) == str(victim), name
        assert victim.read_text() == "do not replace\n", name
        assert snapshot(folder) == before, name
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".terrace-tmp")], name
        fifo.unlink()
        link.unlink()


def test_outputs_write_new_and_regular_files(terrace, toy_model, tmp_path):
    for i, (name, argv) in enumerate(output_commands(toy_model, tmp_path)):
        out = tmp_path / f"out{i}.safetensors"
        terrace(*argv(out), check=True)
        first = out.read_bytes()
        assert len(first) > 8, name
        terrace(*argv(out), check=True)  # over its own earlier output (a regular file): replaced
        assert out.read_bytes() == first, name


# ---- output files: replace only what Terrace wrote, or with --force --------------------------------------

def run_json_of_plan(terrace, d):
    run = d / "run.json"
    run.write_text(terrace("plan", "--model", "k3-toy", "--json", check=True).stdout)
    return run


def owned_output_cases(terrace, model, d):
    """(name, flag, target, argv, marked) for every output flag: the file the command writes in folder d and
    whether that format carries Terrace's mark (so that a second run may replace it without --force)."""
    run = run_json_of_plan(terrace, d)
    tensors = d / "in.safetensors"
    write_safetensors(tensors, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                                "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    x = d / "x.safetensors"
    write_safetensors(x, {"x": ("F32", [2, 32], struct.pack("<64f", *[i / 8 - 4 for i in range(64)]))})
    html, svg, png = d / "rep.html", d / "rep-memory-vs-context.svg", d / "rep-memory-vs-context.png"
    run_model = ["model", "run", "--model", model, "--tokens", "1,2"]
    cases = [
        ("report -o", "-o", html, ["report", run, "-o", html], True),
        ("report --svg", "--svg", svg, ["report", run, "-o", html, "--svg"], True),
        ("trace gen --out", "--out", d / "t.jsonl", ["trace", "gen", "--requests", "3", "-o", d / "t.jsonl"], False),
        ("ref mxfp4 --out", "--out", d / "w.safetensors", ["ref", "mxfp4", "--in", tensors, "--out", d / "w.safetensors"],
         True),
        ("ref codec --out", "--out", d / "c.safetensors",
         ["ref", "codec", "--codec", "int8", "--in", x, "--out", d / "c.safetensors"], True),
        ("model run --dump-logits", "--dump-logits", d / "l.safetensors", [*run_model, "--dump-logits", d / "l.safetensors"],
         True),
        ("model run --expert-prometheus", "--expert-prometheus", d / "e.prom",
         [*run_model, "--expert-cache", "25%", "--expert-prometheus", d / "e.prom"], True),
    ]
    wq = d / "wq.safetensors"
    write_safetensors(wq, {"weight": ("F32", [2, 32], struct.pack("<64f", *[i / 8 - 4 for i in range(64)]))})
    for helper, src in (("dequant-mxfp4", tensors), ("quantize-mxfp4", wq), ("copy-tensors", tensors)):
        out = d / f"{helper}.safetensors"
        cases.append((f"model {helper} --out", "--out", out, ["model", helper, "--in", src, "--out", out], True))
    if shutil.which("rsvg-convert"):
        cases.append(("report --png", "--png", png, ["report", run, "-o", html, "--png"], True))
    return cases


def test_the_model_helpers_never_write_over_their_own_input(terrace, tmp_path):
    tensors = tmp_path / "in.safetensors"
    write_safetensors(tensors, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                                "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    before = tensors.read_bytes()
    r = terrace("model", "copy-tensors", "--in", tensors, "--out", tensors, "--force")
    assert_usage_error(r, "--out", "is the same file as the input --in")
    assert tensors.read_bytes() == before


def test_an_output_inside_the_store_is_refused_even_with_force(terrace, toy_model, tmp_path):
    store = tmp_path / "S"
    terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--store", store, check=True)
    data = next(store.rglob("terrace.data"))
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file() and p.stat().st_size < (1 << 20)}
    for flag, extra in (("--dump-logits", []), ("--expert-prometheus", ["--expert-cache", "25%"])):
        for target in (data, store / "state" / "new.out"):
            r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--store", store, *extra, flag, target,
                        "--force")
            assert_usage_error(r, flag, f"is inside --store's pool {store / target.relative_to(store).parts[0]}",
                               "choose a path outside it")
    assert {p: p.read_bytes() for p in before} == before
    assert not (store / "state" / "new.out").exists()
    # Beside the pools, in --store itself, is not the store's: an output may go there.
    terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--store", store, "--dump-logits",
            store / "logits.safetensors", check=True)
    assert (store / "logits.safetensors").stat().st_size > 0


def no_temporaries(d):
    return not [p for p in os.listdir(d) if p.startswith(".terrace-tmp")]


def test_a_user_file_at_an_output_flag_is_refused_and_kept(terrace, toy_model, tmp_path):
    for name, flag, target, argv, _ in owned_output_cases(terrace, toy_model, tmp_path):
        target.write_bytes(b"precious, not Terrace's\n")
        before = snapshot(tmp_path)
        r = terrace(*argv, timeout=120)
        assert_usage_error(r, flag, str(target), "Terrace did not write it",
                           "choose another path or pass --force to replace it")
        assert snapshot(tmp_path) == before, name  # the user's file byte-identical, nothing else written
        target.unlink()


def test_a_second_run_replaces_terraces_own_output(terrace, toy_model, tmp_path):
    for name, flag, target, argv, marked in owned_output_cases(terrace, toy_model, tmp_path):
        terrace(*argv, check=True, timeout=120)
        first = target.read_bytes()
        if marked:
            terrace(*argv, check=True, timeout=120)  # its own file: replaced without --force
            assert target.stat().st_size > 0, name
            if "prometheus" not in name:  # the metrics hold timings; the others are deterministic
                assert target.read_bytes() == first, name
        else:  # no room for a mark: even its own earlier output needs --force
            assert_usage_error(terrace(*argv, timeout=120), flag, str(target), "--force")
            assert target.read_bytes() == first, name
            terrace(*argv, "--force", check=True, timeout=120)
        assert no_temporaries(tmp_path), name


def test_force_replaces_a_user_file_at_an_output_flag(terrace, toy_model, tmp_path):
    for name, flag, target, argv, _ in owned_output_cases(terrace, toy_model, tmp_path):
        target.write_bytes(b"precious, not Terrace's\n")
        terrace(*argv, "--force", check=True, timeout=120)
        assert target.read_bytes() != b"precious, not Terrace's\n", name
        assert no_temporaries(tmp_path), name


def test_an_output_that_is_the_commands_input_is_refused_even_with_force(terrace, toy_model, tmp_path):
    run = run_json_of_plan(terrace, tmp_path)
    os.link(run, tmp_path / "hard.json")
    os.symlink(run, tmp_path / "link.json")
    model = tmp_path / "model"
    shutil.copytree(toy_model, model)
    tensors = tmp_path / "in.safetensors"
    write_safetensors(tensors, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                                "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    terrace("ref", "mxfp4", "--in", tensors, "--out", tmp_path / "own.safetensors", check=True)  # marked as Terrace's
    cases = [
        (["report", run, "-o", run], "-o"),
        (["report", run, "-o", tmp_path / "hard.json"], "-o"),  # another name of the same file
        (["report", tmp_path / "link.json", "-o", run], "-o"),
        (["ref", "mxfp4", "--in", tensors, "--out", tensors], "--out"),
        (["ref", "mxfp4", "--in", tmp_path / "own.safetensors", "--out", tmp_path / "own.safetensors"], "--out"),
        (["ref", "codec", "--codec", "int8", "--in", tensors, "--out", tensors], "--out"),
        (["model", "run", "--model", model, "--tokens", "1,2", "--dump-logits", model / "model.safetensors"],
         "--dump-logits"),
        (["model", "run", "--model", model, "--tokens", "1,2", "--expert-cache", "25%", "--expert-prometheus",
          model / "config.json"], "--expert-prometheus"),
    ]
    before = snapshot(tmp_path)
    for argv, flag in cases:
        for force in ([], ["--force"]):
            r = terrace(*argv, *force, timeout=120)
            assert_usage_error(r, flag, "the same file as the input", "even with --force")
            assert snapshot(tmp_path) == before, argv


def kda_input(path, g=-0.5):
    """A valid `ref kda` input (docs/ref-cli.md): q, k, g, v [1, 4, 2, 8], beta [1, 4, 2]."""
    vals = struct.pack("<64f", *[(i % 7) / 8 - 0.4 for i in range(64)])
    write_safetensors(path, {"q": ("F32", [1, 4, 2, 8], vals), "k": ("F32", [1, 4, 2, 8], vals),
                             "g": ("F32", [1, 4, 2, 8], struct.pack("<64f", *[g] * 64)),
                             "v": ("F32", [1, 4, 2, 8], vals), "beta": ("F32", [1, 4, 2], struct.pack("<8f", *[0.5] * 8))})
    return path


def test_a_checkpoint_terrace_wrote_is_replaced_by_another_output_only_with_force(terrace, toy_model, tmp_path):
    # A checkpoint of `model init` carries Terrace's generator mark like the outputs do, yet it is a model, not
    # an output of these commands: like `model init --out`, they replace it only with --force.
    model = tmp_path / "toy"
    shutil.copytree(toy_model, model)  # not the input of the model run below, which reads toy_model
    sharded = tmp_path / "sharded"
    terrace("model", "init", "--preset", "k3-toy", "--out", sharded, "--routing-tokens", "0", "--shard-bytes", "4MiB",
            check=True)
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[0]
    kda = kda_input(tmp_path / "kda.safetensors")
    mx = tmp_path / "mx.safetensors"
    write_safetensors(mx, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                           "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    x = tmp_path / "x.safetensors"
    write_safetensors(x, {"x": ("F32", [2, 32], struct.pack("<64f", *[i / 8 - 4 for i in range(64)]))})
    ckpt = model / "model.safetensors"
    cases = [
        (["ref", "kda", "--in", kda, "--out", ckpt], "--out", ckpt),
        (["ref", "mxfp4", "--in", mx, "--out", ckpt], "--out", ckpt),
        (["ref", "codec", "--codec", "int8", "--in", x, "--out", shard], "--out", shard),
        (["model", "run", "--model", toy_model, "--tokens", "1,2", "--dump-logits", ckpt], "--dump-logits", ckpt),
        (["model", "run", "--model", toy_model, "--tokens", "1,2", "--dump-logits", shard], "--dump-logits", shard),
    ]
    before = snapshot(tmp_path)
    for argv, flag, target in cases:
        r = terrace(*argv, timeout=120)
        assert_usage_error(r, f"{flag} {target} is a model checkpoint", "pass --force to replace it")
        assert snapshot(tmp_path) == before, argv
    # The checkpoints still load.
    terrace("model", "run", "--model", model, "--tokens", "1,2", check=True)
    terrace("model", "run", "--model", sharded, "--tokens", "1,2", check=True)
    # Told to, the user gets what they asked for.
    terrace("ref", "kda", "--in", kda, "--out", ckpt, "--force", check=True)
    assert ckpt.stat().st_size < 4096
    # An output that is no checkpoint is still Terrace's to replace, also one written before outputs were told
    # apart from checkpoints (any marked file without the checkpoint's metadata).
    out = tmp_path / "o.safetensors"
    terrace("ref", "kda", "--in", kda, "--out", out, check=True)
    terrace("ref", "mxfp4", "--in", mx, "--out", out, check=True)
    terrace("model", "run", "--model", toy_model, "--tokens", "1,2", "--dump-logits", out, check=True)


@pytest.mark.parametrize("mech,extra,what", [
    ("kda", [], "o F32 [1, 4, 2, 8], final_state F32 [1, 2, 8, 8]"),
    ("mxfp4", [], "weight F32 [2, 32]"),
    ("codec", ["--codec", "int8"], "decoded F32 [2, 32], encoded U8 ["),
])
def test_ref_says_what_it_wrote(terrace, tmp_path, mech, extra, what):
    src = tmp_path / "in.safetensors"
    if mech == "kda":
        kda_input(src)
    elif mech == "mxfp4":
        write_safetensors(src, {"weight_packed": ("U8", [2, 16], bytes(range(32))),
                                "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    else:
        write_safetensors(src, {"x": ("F32", [2, 32], struct.pack("<64f", *[i / 8 - 4 for i in range(64)]))})
    out = tmp_path / "out.safetensors"
    r = terrace("ref", mech, *extra, "--in", src, "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {out} (") and what in r.stdout, r.stdout
    assert r.stdout.count("\n") == 1 and r.stdout.endswith(")\n"), r.stdout


def test_ref_shape_errors_show_any_size_without_internal_wildcards(terrace, tmp_path):
    src = tmp_path / "in.safetensors"
    # q of rank 3 where [B, T, H, K] is expected; then a missing tensor whose expected shape has free sizes.
    write_safetensors(src, {"q": ("F32", [1, 4, 2], bytes(32))})
    r = terrace("ref", "kda", "--in", src, "--out", tmp_path / "o.safetensors")
    assert r.returncode == 1, r.stderr
    assert "tensor 'q': expected shape [*, *, *, *]" in r.stderr, r.stderr
    write_safetensors(src, {"x": ("F32", [2, 3], bytes(24))})
    r = terrace("ref", "mla", "--heads", "1", "--in", src, "--out", tmp_path / "o.safetensors")
    assert r.returncode == 1, r.stderr
    assert "required tensor 'hidden_states' is missing (expected F32 [*, *])" in r.stderr, r.stderr
    assert "[-1" not in r.stderr and "-1 = any" not in r.stderr, r.stderr


def make_full_device(tmp_path):
    """A character device like /dev/full (1, 7) in the test's own folder (needs root)."""
    dev = tmp_path / "full"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except (PermissionError, OSError) as e:
        pytest.skip(f"WARN: cannot create a device node ({e}); run as root to test device targets")
    return dev


def test_dump_logits_to_a_device_fails_and_leaves_the_device(terrace, toy_model, tmp_path):
    dev = make_full_device(tmp_path)
    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2", "--dump-logits", dev)
    assert_usage_error(r, "--dump-logits", "character device")
    assert stat.S_ISCHR(os.lstat(dev).st_mode)
    # The same through the real /dev/full, now that a device target is known to be refused.
    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2", "--dump-logits", "/dev/full")
    assert_usage_error(r, "--dump-logits", "character device")
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


# ---- input files ------------------------------------------------------------------------------------

def test_inputs_that_are_fifos_or_devices_are_refused_not_waited_on(terrace, toy_model, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bad_model = tmp_path / "bad_model"
    bad_model.mkdir()
    os.mkfifo(bad_model / "config.json")
    cases = [
        (["model", "init", "--config", fifo, "--out", tmp_path / "m1"], "--config"),
        (["model", "init", "--config", "/dev/zero", "--out", tmp_path / "m2"], "--config"),
        (["model", "init", "--config", tmp_path, "--out", tmp_path / "m3"], "--config"),
        (["ref", "kda", "--in", fifo, "--out", tmp_path / "o"], "--in"),
        (["ref", "kda", "--in", "/dev/zero", "--out", tmp_path / "o"], "--in"),
        (["ref", "moe", "--in", toy_model / "model.safetensors", "--config", fifo, "--out", tmp_path / "o"],
         "--config"),
        (["model", "run", "--model", bad_model, "--tokens", "1"], "config.json"),
        (["model", "run", "--model", fifo, "--tokens", "1"], "--model"),
        (["model", "inspect", bad_model], "config.json"),
        (["model", "copy-tensors", "--in", fifo, "--out", tmp_path / "o"], "--in"),
        (["model", "dequant-mxfp4", "--in", "/dev/zero", "--out", tmp_path / "o"], "--in"),
    ]
    for argv, word in cases:
        assert_usage_error(terrace(*argv, timeout=20), word)
    assert not (tmp_path / "o").exists()


# ---- bench tiers: signals and leftovers -----------------------------------------------------------------

SLOW_NVME = ["bench", "tiers", "--tier", "nvme", "--block-size", "4KiB", "--total-bytes", "256MiB",
             "--durability", "sync", "--batch", "1"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_cleans_up_on_signal(terrace, tmp_path, sig):
    d = tmp_path / "bench"
    p = terrace.popen(*SLOW_NVME, "--dir", d)
    try:
        assert wait_for(d / "terrace-bench.marker"), "the bench did not mark its directory"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert "removed what it created" in err
    assert not d.exists(), os.listdir(d)


def kill_bench_once_marked(terrace, d):
    """Starts a slow `bench tiers` in d and SIGKILLs it once it has marked d (no cleanup runs)."""
    p = terrace.popen(*SLOW_NVME, "--dir", d)
    try:
        assert wait_for(d / "terrace-bench.marker"), "the bench did not mark its directory"
    finally:
        p.kill()
        p.communicate()
    assert d.exists()


def test_bench_recognises_and_removes_its_own_leftover(terrace, tmp_path):
    d = tmp_path / "bench"
    kill_bench_once_marked(terrace, d)
    r = terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", d, check=True)
    assert "left behind by an earlier" in r.stderr
    assert not d.exists()


# A second Ctrl-C during the bench's cleanup: the marker is removed last, so the next run finds
# the marker beside what was not removed yet (the index), or alone, and removes it as its own.
@pytest.mark.parametrize("left", ["marker+index", "marker"])
def test_bench_removes_what_a_stopped_cleanup_left(terrace, tmp_path, left):
    d = tmp_path / "bench"
    kill_bench_once_marked(terrace, d)
    (d / "terrace.data").unlink()
    if left == "marker":
        shutil.rmtree(d / "index", ignore_errors=True)
    r = terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", d, check=True)
    assert "left behind by an earlier" in r.stderr
    assert not d.exists()


def test_bench_keeps_a_users_file_in_an_index_dir_leftover(terrace, tmp_path):
    """A killed `bench tiers --index-dir I` leaves I holding RocksDB's files and the bench's marker. The
    marker makes the index files the bench's, not a file of the user's put beside them: the run must refuse
    (or leave it), never delete it."""
    idx = tmp_path / "idx"
    idx.mkdir()
    for f in ("terrace-bench.marker", "CURRENT", "IDENTITY", "LOCK", "MANIFEST-000005", "000004.log"):
        (idx / f).write_text("x")
    (idx / "precious.txt").write_text("mine\n")
    before = snapshot(idx)
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--total-bytes", "4MiB", "--block-size", "1MiB",
                "--dir", tmp_path / "bench", "--index-dir", idx)
    assert (idx / "precious.txt").exists(), (r.returncode, r.stderr)
    assert r.returncode == 2 and "--index-dir" in r.stderr and "precious.txt" in r.stderr, r.stderr
    assert snapshot(idx) == before


def test_bench_never_removes_a_directory_it_did_not_create(terrace, tmp_path):
    mine = user_folder(tmp_path / "mine")
    before = snapshot(mine)
    r = terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", mine)
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
    assert snapshot(mine) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    terrace("bench", "tiers", "--tier", "nvme", "--total-bytes", "4MiB", "--dir", empty, check=True)
    assert empty.is_dir()  # existed before: the bench keeps it (and marks nothing in it)
    assert not (empty / "terrace-bench.marker").exists()
    assert_usage_error(terrace("bench", "tiers", "--tier", "nvme", "--dir", mine / "thesis.txt"), "regular file")
    assert snapshot(mine) == before


# A directory flag whose first component does not exist yet ("x/..") names an existing folder; each
# command must see that folder as it is (not as a new one it may write into or remove).
DOTDOT_COMMANDS = [
    ("bench", "tiers", "--tier", "nvme", "--op", "write", "--dir", "x/..", "--total-bytes", "4MiB", "--block-size", "1MiB"),
    ("bench", "tiers", "--tier", "nvme", "--op", "write", "--dir", "x/../victim", "--total-bytes", "4MiB",
     "--block-size", "1MiB"),
    ("model", "init", "--preset", "k3-toy", "--out", "x/..", "--routing-tokens", "0"),
    ("store", "drill", "--dir", "x/..", "--faults", "eio", "--kills", "1", "--capacity", "16MiB", "--max-acks", "3"),
    ("store", "fill", "--dir", "x/..", "--count", "2", "--block-size", "4096", "--seed", "1"),
]


@pytest.mark.parametrize("args", DOTDOT_COMMANDS, ids=["bench-tiers-dir", "bench-tiers-dir-victim", "model-init-out",
                                                      "store-drill-dir", "store-fill-dir"])
def test_a_missing_component_then_dotdot_never_makes_an_existing_folder_new(terrace, tmp_path, args):
    work = user_folder(tmp_path / "work")
    user_folder(work / "victim")
    before = snapshot(work)
    r = terrace(*args, cwd=work)
    assert r.returncode != 0, r.stdout
    after = snapshot(work)
    # Nothing of the user's is gone or changed (a folder "x" may be left: it is new and empty).
    assert {k: v for k, v in after.items() if k != "x"} == before


def test_bench_tiers_index_dir_dotdot_leaves_the_working_folder(terrace, tmp_path):
    work = user_folder(tmp_path / "work")
    before = snapshot(work)
    terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--dir", tmp_path / "store", "--index-dir", "y/..",
            "--total-bytes", "4MiB", "--block-size", "1MiB", cwd=work)
    assert {k: v for k, v in snapshot(work).items() if k != "y"} == before


def test_demo_dir_dotdot_is_refused_and_leaves_the_folder(terrace, tmp_path):
    work = user_folder(tmp_path / "site")
    (work / "report.html").write_text("<h1>mine</h1>\n")
    before = snapshot(work)
    assert_usage_error(terrace("demo", "--dir", "x/..", *DEMO, cwd=work), "did not create")
    assert {k: v for k, v in snapshot(work).items() if k != "x"} == before


def test_drill_removes_only_its_own_stores(terrace, tmp_path):
    d = tmp_path / "drill"
    args = ("store", "drill", "--dir", d, "--faults", "eio", "--kills", "1", "--capacity", "16MiB", "--max-acks", "3")
    terrace(*args, check=True)
    (d / "short").mkdir()
    (d / "short" / "results.csv").write_text("mine\n")  # a user's folder with a fault kind's name
    before = snapshot(d / "short")
    assert_usage_error(terrace(*args), "short", "nothing was removed")
    assert snapshot(d / "short") == before
    assert (d / "eio").is_dir()  # nothing removed, not even the drill's own
    (d / "short" / "results.csv").unlink()
    (d / "short").rmdir()
    terrace(*args, check=True)  # its own stores alone: removed and run again


def test_an_output_file_never_removes_a_file_with_its_temporary_name(terrace, tmp_path):
    # The shell writes .terrace-tmp-<its pid>-0, then becomes terrace (same pid): the writer must pick
    # another temporary name, finish, and leave that file alone.
    r = subprocess.run(["bash", "-c", f'echo mine > .terrace-tmp-$$-0; exec "{terrace.path}" trace gen --requests 5 '
                                      f'--seed 1 -o out.jsonl'], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".terrace-tmp-")]
    assert len(left) == 1 and left[0].read_text() == "mine\n"
    assert (tmp_path / "out.jsonl").stat().st_size > 0


def test_demo_accepts_marks_and_fresh_removes_a_store_a_stopped_run_left_unmarked(terrace, tmp_path):
    d = tmp_path / "store"
    terrace("demo", "--dir", d, *DEMO, check=True)
    # A run stopped between a store's creation and its marker leaves it like this.
    (d / "experts" / "terrace-demo.marker").unlink()
    terrace("demo", "--dir", d, *DEMO, check=True)  # reused as the demo's, and marked now (it stayed unmarked)
    assert (d / "experts" / "terrace-demo.marker").exists()
    (d / "experts" / "terrace-demo.marker").unlink()
    r = terrace("demo", "--fresh", "--dir", d, *DEMO, check=True)
    assert "removed the demo's data" in r.stderr
    assert (d / "experts" / "terrace-demo.marker").exists()  # made anew, marked
    # Without the demo's own marker on DIR, such a store is not trusted.
    (d / "experts" / "terrace-demo.marker").unlink()
    (d / "terrace-demo.marker").unlink()
    before = snapshot(d)
    assert_usage_error(terrace("demo", "--fresh", "--dir", d, *DEMO), "did not create")
    assert snapshot(d) == before


# ---- deeply nested JSON input ------------------------------------------------------------------------

def test_deeply_nested_json_inputs_are_refused_not_a_crash(terrace, toy_model, tmp_path):
    """200 000 nested brackets parsed, then whatever walked the document (the report's flattening, a
    trace error's dump(), config.json's alias comparison) recursed per level: SIGSEGV, exit 139."""
    deep = "[" * 200000 + "1" + "]" * 200000
    run = tmp_path / "deep.json"
    run.write_text('{"a":' + deep + "}")
    r = terrace("report", run, "-o", tmp_path / "out.html")
    assert_usage_error(r, "nest 200001 levels deep", "over the limit of 64")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[' + deep + "]}\n")
    r = terrace("plan", "--model", "k3-toy", "--trace", trace)
    assert_usage_error(r, "over the limit of 64")
    config = json.loads((toy_model / "config.json").read_text())
    config["num_experts"] = "@DEEP@"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config).replace('"@DEEP@"', deep))
    r = terrace("plan", "--model", tmp_path / "m" / "config.json")  # a model that does not open: exit 1
    assert r.returncode == 1 and "over the limit of 64" in r.stderr, r.stderr
    # A trace line whose id is a (shallow) array names its type, not its text.
    trace.write_text('{"timestamp":0,"input_length":1,"output_length":1,"hash_ids":[[1,2]]}\n')
    assert_usage_error(terrace("plan", "--model", "k3-toy", "--trace", trace), "got an array")


def test_bench_never_removes_a_marked_store_a_running_process_holds(terrace, tmp_path):
    """A store beside the bench's marker is a killed run's leftover only when no process uses it: a
    run still going holds the flock on its data file (a reader's shared one counts too)."""
    import fcntl
    d = tmp_path / "d"
    r = terrace("store", "fill", "--dir", d, "--capacity", "16MiB", "--count", "2", "--block-size", "64KiB")
    assert r.returncode == 0, r.stderr
    (d / "terrace-bench.marker").write_text("created by 'terrace bench tiers'\n")
    before = snapshot(d)
    for mode in (fcntl.LOCK_EX, fcntl.LOCK_SH):
        fd = os.open(d / "terrace.data", os.O_RDONLY)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--total-bytes", "4MiB", "--block-size",
                        "1MiB", "--dir", d)
        finally:
            os.close(fd)
        assert r.returncode == 2, r.stderr
        assert f"(pid {os.getpid()})" in r.stderr and "using right now" in r.stderr and "nothing was removed" in r.stderr
        assert snapshot(d) == before


def test_bench_never_removes_an_index_dir_a_running_process_has_open(terrace, tmp_path):
    import fcntl
    idx = tmp_path / "idx"
    r = terrace("store", "fill", "--dir", tmp_path / "s", "--index-dir", idx, "--capacity", "16MiB", "--count", "2",
                "--block-size", "64KiB")
    assert r.returncode == 0, r.stderr
    (idx / "terrace-bench.marker").write_text("created by 'terrace bench tiers'\n")
    before = snapshot(idx)
    with open(idx / "LOCK", "r+") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as RocksDB holds it while the index is open
        r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--total-bytes", "4MiB", "--block-size", "1MiB",
                    "--dir", tmp_path / "bench", "--index-dir", idx)
    assert r.returncode == 2, r.stderr
    assert f"another process (pid {os.getpid()}) has open right now" in r.stderr and "nothing was removed" in r.stderr
    assert snapshot(idx) == before


def test_bench_kv_removes_no_pool_of_a_leftover_whose_other_pool_is_in_use(terrace, toy_model, tmp_path):
    """Every pool of a killed run's leftover is checked before any is removed: one still in use
    keeps the other too (the kv pool was removed before the state pool was found in use)."""
    import fcntl
    d = tmp_path / "bk"
    for pool in ("kv", "state"):
        r = terrace("store", "fill", "--dir", d / pool, "--capacity", "16MiB", "--count", "1", "--block-size", "64KiB")
        assert r.returncode == 0, r.stderr
        (d / pool / "terrace-bench-kv.marker").write_text("created by 'terrace bench kv'\n")
    before = snapshot(d)
    fd = os.open(d / "state" / "terrace.data", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = terrace("bench", "kv", "--model", toy_model, "--dir", d, "--prefix-tokens", "64", "--chunk-tokens", "64",
                    "--turns", "0")
    finally:
        os.close(fd)
    assert r.returncode == 2, r.stderr
    assert "using right now" in r.stderr and "nothing was removed" in r.stderr and "removing" not in r.stderr, r.stderr
    assert snapshot(d) == before
