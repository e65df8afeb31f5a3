"""terrace demo: the multi-turn chat through prefix-cache restore and expert offload, checked against a
full recompute. The figures come from DIR/demo-run.json; an independent recompute through
`terrace model run` (all experts resident, no store) checks them, so a demo whose own check were
broken would still fail here. Uses k3-toy and a short workload to stay fast; small NVMe pools."""
import json
import re
import shutil
import signal

import pytest

from conftest import assert_demo_refuses

SMALL = ["--preset", "k3-toy", "--conversations", "2", "--turns", "2", "--system-tokens", "80",
         "--user-tokens", "16", "--new-tokens", "3", "--kv-nvme-size", "8MiB", "--state-nvme-size", "16MiB"]


def run_demo(terrace, d, *extra, expect=0):
    r = terrace("demo", "--dir", d, *SMALL, *extra, timeout=300)
    assert r.returncode == expect, f"exit {r.returncode}, want {expect}\n{r.stdout}\n{r.stderr}"
    with open(d / "demo-run.json") as f:
        return r, json.load(f)


def recompute(terrace, model_dir, prompt, new_tokens, store):
    """The turn's greedy continuation and final logits digest from `model run`: every expert resident
    (no --expert-cache) and a new, empty prefix store, so the whole prompt is computed, in the same
    64-token pieces as the demo (one-shot and chunked prefill differ in the last bits)."""
    r = terrace("model", "run", "--model", model_dir, "--tokens", ",".join(map(str, prompt)),
                "--max-new", new_tokens, "--json", "--store", store, "--chunk-tokens", "64", "--kv-codec", "f32",
                "--state-codec", "f32", "--store-nvme-size", "4MiB", "--state-nvme-size", "4MiB",
                timeout=300, check=True)
    j = json.loads(r.stdout)
    assert j["restored_tokens"] == 0
    return j["generated"], j["logits_xxh3_64"]


@pytest.fixture(scope="module")
def two_runs(terrace, tmp_path_factory):
    d = tmp_path_factory.mktemp("demo") / "data"
    first = run_demo(terrace, d)
    second = run_demo(terrace, d)
    return d, first, second


def test_demo_verifies_every_turn_and_restores_on_a_later_turn(two_runs):
    _, (r, j), _ = two_runs
    assert j["verified"] is True
    assert all(t["equal"] for t in j["turns"])
    assert len(j["turns"]) == 4
    assert j["turns"][0]["restored_tokens"] == 0  # a fresh directory has nothing to restore
    assert any(t["restored_tokens"] > 0 for t in j["turns"][1:])
    assert j["reused_previous_run"] is False and j["model"]["reused"] is False
    for t in j["turns"]:
        assert t["restored_tokens"] % 64 == 0 and t["restored_tokens"] < t["prompt_tokens"]
        assert t["restored_tokens"] + t["computed_tokens"] == t["prompt_tokens"] == len(t["prompt"])
    s = j["summary"]
    assert 0 < s["restored_share"] < 1
    for k in ("prefetch_precision", "prefetch_recall"):  # null: undefined (nothing predicted / routed)
        assert s["experts"][k] is None or 0 <= s["experts"][k] <= 1
    assert s["experts"]["hits"] + s["experts"]["late_hits"] + s["experts"]["misses"] > 0
    assert s["bytes_moved"]["prefix_restored"] > 0 and s["bytes_moved"]["prefix_written"] > 0
    assert "verified:" in r.stdout and "demo-run.json" in r.stdout
    # The per-turn figures are the run's counters split by turn: they add up to the summary's.
    e = s["experts"]
    per_turn = [t["experts"] for t in j["turns"]]
    for k in ("hits", "late_hits", "misses"):
        assert sum(x[k] for x in per_turn) == e[k], k
    assert sum(x["stall_prefill_s"] + x["stall_decode_s"] for x in per_turn) == pytest.approx(e["stall_s"], rel=1e-6)
    steps = sum(len(t["generated"]) - 1 for t in j["turns"])
    assert e["stall_s_per_decode_token"] == pytest.approx(sum(x["stall_decode_s"] for x in per_turn) / steps)
    for t in j["turns"]:
        x = t["experts"]
        assert x["hit_rate"] == pytest.approx(x["hits"] / (x["hits"] + x["late_hits"] + x["misses"]))
        assert set(t["prefix_hit_rate"]) == {"hbm", "host", "nvme"}
    assert j["turns"][0]["prefix_hit_rate"]["nvme"] is None  # a fresh directory: nothing read from NVMe
    assert any(t["prefix_hit_rate"]["host"] for t in j["turns"][1:])
    assert r.stdout.rstrip().splitlines()[-2].startswith("report:")  # it ends by pointing at the report


def test_a_second_run_reuses_the_data_and_restores_on_its_first_turn(two_runs):
    _, (_, first), (r, j) = two_runs
    assert j["verified"] is True
    assert j["reused_previous_run"] is True and j["model"]["reused"] is True
    assert j["turns"][0]["restored_tokens"] > 0
    assert "reused the last run's data" in r.stdout
    # The same workload: the same prompts and outputs as the first run.
    assert [t["prompt"] for t in j["turns"]] == [t["prompt"] for t in first["turns"]]
    assert [t["generated"] for t in j["turns"]] == [t["generated"] for t in first["turns"]]
    assert j["summary"]["restored_share"] > first["summary"]["restored_share"]


def test_the_text_and_the_json_give_the_same_figures_and_numbers(two_runs):
    """The expert store's HBM hit rate is the expert cache's count in the text and in the JSON alike
    (the store's own HBM counters see none of the cache's reads), and conversations and turns are
    numbered from 1 in both, in the order played (as `bench kv --json` numbers them)."""
    _, (r, j), _ = two_runs
    s = j["summary"]
    hbm = s["tiers"]["experts"]["hbm"]
    e = s["experts"]
    assert hbm["counted_by"] == "expert_cache"
    assert hbm["hits"] == e["hits"] and hbm["misses"] == e["late_hits"] + e["misses"]
    assert hbm["hit_rate"] == pytest.approx(e["hit_rate"]) and hbm["hit_rate"] > 0
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("experts store:"))
    assert f"hbm {100 * hbm['hit_rate']:.1f}% (expert cache: hits / acquires)" in line, line
    for pool in ("kv", "state"):
        assert all("counted_by" not in v for v in s["tiers"][pool].values())
    numbers = [(t["conversation"], t["turn"]) for t in j["turns"]]
    assert numbers == [(1, 1), (2, 1), (1, 2), (2, 2)]
    assert re.findall(r"conversation (\d+) turn (\d+):", r.stderr) == [(str(c), str(t)) for c, t in numbers]


def test_progress_goes_to_stderr_and_the_summary_to_stdout(two_runs):
    """The steps and turns are progress (stderr, as every long command's); stdout holds only the result:
    the summary from its "[4/4] summary" line to the pointer at the report."""
    _, (r, _), _ = two_runs
    assert r.stdout.startswith("[4/4] summary"), r.stdout[:300]
    for step in ("terrace demo: data in", "[1/4] model:", "built the model", "[2/4] stores:", "stores open in",
                 "[3/4] chat:", "conversation 1 turn 1:"):
        assert step in r.stderr and step not in r.stdout, step


def test_the_expert_store_line_counts_the_expert_loads_by_the_tier_they_came_from(two_runs):
    """The offload loads experts with Store::Prefetch, whose reads the store's per-tier hit counters
    leave out: the expert store's host and NVMe figures used to say "n/a (no reads)" while the NVMe
    tier had read every loaded expert, and on a second run "nvme 100.0%" counted the start-up
    read-back of the stored experts, not the loads. Now the lower tiers count the expert loads by
    the tier each block was read from, and the start-up reads are counted apart."""
    _, (r1, first), (r2, second) = two_runs
    for r, j in ((r1, first), (r2, second)):
        s = j["summary"]
        e, tiers = s["experts"], s["tiers"]["experts"]
        lower = [t for t in ("host", "nvme") if t in tiers]
        assert "nvme" in lower
        for t in lower:
            v = tiers[t]
            assert v["counted_by"] == "expert_loads", t
            assert v["hits"] == v["loads"], t
            slower = sum(tiers[u]["loads"] for u in lower[lower.index(t) + 1:])
            assert v["misses"] == slower, t
            want = v["hits"] / (v["hits"] + v["misses"]) if v["hits"] + v["misses"] else None
            assert v["hit_rate"] == pytest.approx(want) if want is not None else v["hit_rate"] is None, t
        # Every landed load came from some tier: the loads' bytes are the bytes loaded on demand and prefetched.
        assert sum(tiers[t]["loaded_bytes"] for t in lower) == e["demand_bytes"] + e["prefetched_bytes"] > 0
        # The experts live on NVMe: loads read it.
        assert tiers["nvme"]["loads"] > 0 and tiers["nvme"]["hit_rate"] == 1.0
        # bytes_read is the run's reads, the start-up check's apart; the loads are among the run's reads.
        assert tiers["nvme"]["bytes_read"] >= tiers["nvme"]["loaded_bytes"]
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith("experts store:"))
        assert "no reads" not in line, line
        assert "nvme 100.0%" in line and f"{tiers['nvme']['loads']} from nvme" in line, line
    # A new store has nothing to check at start-up; the second run reads back every stored expert
    # once (an identical block already there is kept), and those reads are not loads.
    assert all(v["startup_check_reads"] == 0 and v["startup_check_bytes_read"] == 0
               for v in first["summary"]["tiers"]["experts"].values())
    nvme2 = second["summary"]["tiers"]["experts"]["nvme"]
    assert nvme2["startup_check_bytes_read"] == second["summary"]["experts"]["total_expert_bytes"]
    assert nvme2["startup_check_reads"] > 0
    line = next(x for x in r2.stdout.splitlines() if x.strip().startswith("experts store:"))
    assert f"start-up check of the stored experts read {nvme2['startup_check_reads']} blocks" in line, line
    assert "start-up" not in next(x for x in r1.stdout.splitlines() if x.strip().startswith("experts store:"))


def test_the_demo_figures_match_an_independent_recompute(terrace, two_runs, tmp_path):
    d, (_, first), (_, second) = two_runs
    for i, j in enumerate((first, second)):
        for k, t in enumerate(j["turns"]):
            generated, digest = recompute(terrace, d / "model", t["prompt"], len(t["generated"]),
                                          tmp_path / f"oracle-{i}-{k}")
            assert t["generated"] == generated, t
            assert t["final_logits_xxh3_64"] == digest, t


def test_the_demo_check_catches_a_perturbed_restore(terrace, tmp_path):
    d = tmp_path / "data"
    r, j = run_demo(terrace, d, "--inject-fault", "state", "--json", expect=1)
    assert json.loads(r.stdout) == j  # --json: stdout holds only the figures (progress on stderr)
    assert j["verified"] is False
    bad = [t for t in j["turns"] if not t["equal"]]
    assert bad and all(t["restored_tokens"] > 0 for t in bad)
    assert "differ from the full recompute" in r.stderr


# The quickest run: one short turn, small pools.
QUICK = ["--preset", "k3-toy", "--conversations", "1", "--turns", "1", "--system-tokens", "8", "--user-tokens", "4",
         "--new-tokens", "1", "--kv-nvme-size", "4MiB", "--state-nvme-size", "4MiB"]


def test_the_demo_neither_replaces_nor_removes_a_report_or_figures_it_did_not_write(terrace, tmp_path):
    """DIR/report.html and DIR/demo-run.json are the demo's only when they carry Terrace's mark (the HTML
    report's generator meta; "generator": "terrace" as the JSON's first member). A file of either name
    without it - a user's, or a demo-run.json of a Terrace from before the mark - makes a run and --fresh
    exit 2 naming it, and nothing is written or removed (both were taken by name: the run replaced them,
    --fresh deleted them). The demo's own files are replaced by the next run and removed by --fresh."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True)
    own = {n: (d / n).read_bytes() for n in ("demo-run.json", "report.html")}
    assert own["demo-run.json"].startswith(b'{\n "generator": "terrace",\n')
    older = json.loads(own["demo-run.json"])
    del older["generator"]
    for name, foreign in (("report.html", "<!DOCTYPE html>\n<html>my notes</html>\n"),
                          ("demo-run.json", '{"my": "own data"}\n'), ("demo-run.json", json.dumps(older, indent=1))):
        (d / name).write_text(foreign)
        assert_demo_refuses(terrace, d, QUICK, f"'{name} (it ", "generator", "move it out")
        (d / name).write_bytes(own[name])
    r = terrace("demo", "--dir", d, *QUICK, "--json", timeout=300, check=True)
    assert r.stdout.startswith('{"generator":"terrace",') and json.loads(r.stdout) == json.loads((d / "demo-run.json").read_text())
    r = terrace("demo", "--fresh", "--dir", d, *QUICK, timeout=300, check=True)
    assert "removed the demo's data" in r.stderr


def test_demo_flags_are_checked(terrace, tmp_path):
    for args, word in ((["--turns", "0"], "--turns"), (["--preset", "kimi-k3"], "--preset"),
                       (["--expert-cache", "lots"], "--expert-cache")):
        r = terrace("demo", "--dir", tmp_path / "d", *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert word in r.stderr, (args, r.stderr)


def test_a_kept_model_or_pool_of_other_settings_is_refused(terrace, two_runs):
    """--seed names the model's weights: the model kept in DIR was built with seed 1, so --seed 2 exits 2
    naming both (it was reused and reported as seed 2); and an NVMe size given for an existing pool of
    another size exits 2 naming the flag and the pool's size (it was ignored)."""
    d, _, _ = two_runs
    before = (d / "demo-run.json").read_bytes()
    r = terrace("demo", "--dir", d, *SMALL, "--seed", "2", "--json", timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "built with seed 1" in r.stderr and "--seed 1" in r.stderr and "--fresh" in r.stderr, r.stderr
    # SMALL's pools are 8 MiB (kv) and 16 MiB (state).
    for flag, size, have in (("--kv-nvme-size", "16MiB", "8.0 MiB"), ("--state-nvme-size", "8MiB", "16.0 MiB")):
        args = list(SMALL)
        args[args.index(flag) + 1] = size
        r = terrace("demo", "--dir", d, *args, timeout=300)
        assert r.returncode == 2, (flag, r.stdout + r.stderr)
        assert flag in r.stderr and have in r.stderr, (flag, r.stderr)
    assert (d / "demo-run.json").read_bytes() == before  # nothing was run


def test_sigint_stops_the_demo_after_its_turn_and_keeps_its_stores(terrace, tmp_path):
    """SIGINT once the first turn printed: the demo stops before the next turn, exits 130 saying how many
    turns ran, writes no summary, and its stores verify (store check --checksums-only)."""
    d = tmp_path / "data"
    args = [a if a != "2" else "3" for a in SMALL]  # 3 conversations x 3 turns
    p = terrace.popen("demo", "--dir", d, *args)
    for line in p.stderr:  # the turns are progress, on stderr
        if "conversation 1 turn 1:" in line:
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=300)
    assert p.returncode == 128 + signal.SIGINT, out + err
    assert re.search(r"terrace demo: stopped by SIGINT in step 3 after \d of 9 turns; what is in .* is kept", err), err
    assert not (d / "demo-run.json").exists()
    for pool in ("kv", "state", "experts"):
        r = terrace("store", "check", "--checksums-only", "--dir", d / pool)
        assert r.returncode == 0, (pool, r.stdout, r.stderr)


def test_a_full_pool_is_reported_as_such_and_does_not_fail_the_check(terrace, tmp_path):
    """A 1 MiB state pool fills up: write-backs fail, so later turns restore less, but every turn still
    equals the recompute. The demo says verified and exits 0, and names the full pool, its flag and
    --fresh (a pool's size is fixed when it is created); it never claims the outputs differ."""
    d = tmp_path / "data"
    r = terrace("demo", "--dir", d, "--preset", "k3-toy", "--conversations", "2", "--turns", "2",
                "--system-tokens", "128", "--new-tokens", "1", "--kv-nvme-size", "4MiB", "--state-nvme-size", "1MiB",
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads((d / "demo-run.json").read_text())
    s = j["summary"]
    assert j["verified"] is True and all(t["equal"] for t in j["turns"])
    assert s["prefix_write_failures"] > 0
    assert [p["pool"] for p in s["prefix_pools_full"]] == ["state"]
    full = s["prefix_pools_full"][0]
    assert full["flag"] == "--state-nvme-size" and full["nvme_capacity_bytes"] == 1 << 20
    assert full["nvme_free_bytes"] < full["block_bytes_max"]
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("write-backs:"))
    assert f"{s['prefix_write_failures']} prefix-cache write-back(s) failed" in line, line
    # The command to run names this run's --dir and --preset, not the defaults' data and model.
    assert "the state pool's NVMe file is full" in line, line
    assert f"'terrace demo --dir {d} --preset k3-toy --fresh --state-nvme-size SIZE'" in line, line
    assert "the kv pool" not in line
    assert "differ" not in r.stdout + r.stderr and "NOT verified" not in r.stdout


def test_a_store_left_half_created_or_half_removed_is_the_demos_own(terrace, tmp_path):
    """A store folder holding only the demo's marker and an index that a stopped creation left (no data
    file) is the demo's: the next run clears it and creates the store (saying so), and --fresh removes
    it. A marked folder whose terrace.data is not Terrace's is still refused, naming that file."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True)

    def half_created(store, with_index=True):
        for f in (d / store).iterdir():
            if f.name != "terrace-demo.marker":
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        if with_index:
            (d / store / "index").mkdir()
            (d / store / "index" / "TERRACE-INDEX-CREATING").write_text("")

    for store, with_index, fresh in (("experts", True, []), ("state", False, []), ("kv", True, ["--fresh"])):
        half_created(store, with_index)
        r = terrace("demo", "--dir", d, *QUICK, *fresh, timeout=300)
        assert r.returncode == 0, (store, fresh, r.stdout, r.stderr)
        if not fresh:
            assert f"removing what a stopped run left in '{d / store}'" in r.stderr, r.stderr
        assert (d / store / "terrace.data").is_file() and (d / store / "terrace-demo.marker").is_file()
    (d / "state" / "terrace.data").write_bytes(b"not a store" * 1000)
    assert_demo_refuses(terrace, d, QUICK, "'state/terrace.data (not a Terrace data file)'")


def test_a_pool_that_does_not_open_is_named_in_the_demos_flags(terrace, tmp_path):
    """The demo has --dir and --fresh, not --store: a pool whose index was removed is reported in those."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True)
    shutil.rmtree(d / "state" / "index")
    r = terrace("demo", "--dir", d, *QUICK, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "--store" not in err, err
    assert f"terrace demo --dir {d} --preset k3-toy --fresh" in err, err


def test_figures_the_run_did_not_measure_are_null_and_na_not_zero(terrace, tmp_path):
    """With --new-tokens 1 no turn makes a decode step, and a fresh 2-turn run whose prompt is shorter
    than a block restores nothing: the decode rate, the stalls per decode step, the TTFT of the turns
    that restored and the restore's split by tier are null in the JSON, "n/a" in the text and "not
    recorded" on the page, not a measured 0."""
    d = tmp_path / "data"
    r = terrace("demo", "--dir", d, "--preset", "k3-toy", "--conversations", "1", "--turns", "2", "--system-tokens",
                "8", "--user-tokens", "4", "--new-tokens", "1", "--kv-nvme-size", "4MiB", "--state-nvme-size", "4MiB",
                timeout=300, check=True)
    j = json.loads((d / "demo-run.json").read_text())
    s = j["summary"]
    assert s["restored_turns"] == 0 and s["restored_tokens"] == 0
    assert all(len(t["generated"]) == 1 for t in j["turns"])
    for key in ("decode_tokens_per_s", "ttft_restored_turns_mean_s", "ttft_restored_turns_recompute_mean_s"):
        assert s[key] is None, key
    assert s["experts"]["stall_s_per_decode_token"] is None
    assert all(t["experts"]["stall_s_per_decode_token"] is None for t in j["turns"])
    assert set(s["prefix_restore_share_by_tier"].values()) == {None}
    assert isinstance(s["tokens_per_s"], float) and s["tokens_per_s"] > 0
    assert "decode n/a tokens/s" in r.stdout
    assert "of the 0 turns that restored: n/a s vs n/a s" in r.stdout
    assert "n/a ms per decode step" in r.stdout
    assert "restored bytes came n/a from hbm (emulated in host memory: no GPU), n/a from host, n/a from nvme" in r.stdout
    page = (d / "report.html").read_text()
    assert "(decode not recorded)" in page and "not recorded per decode step" in page
    assert not re.search(r"decode 0\.0 tokens/s|\b0 ms per decode step", page)
