"""bench kv, bench experts and bench store stopped by SIGINT/SIGTERM: each exits with 128 + the signal
and removes the pools it created; after SIGKILL (no chance to clean up) the next run recognises its own
marked leftover and removes it, while a folder holding anything else is still refused untouched."""
import os
import shutil
import signal
import time

import pytest

from conftest import snapshot, wait_for


def kill_once_marked(terrace, argv, marker):
    """Starts the bench and SIGKILLs it once it has marked its store (no chance to clean up)."""
    p = terrace.popen(*argv)
    try:
        assert wait_for(marker), f"the bench did not mark its store: {argv}"
    finally:
        p.kill()
        p.communicate()
    assert marker.exists()


# Each workload runs for far longer than the test waits (minutes), so the signal always lands mid-run;
# the marker file says the bench has created its store and is at work.
def kv_bench(toy, d):
    return ["bench", "kv", "--model", toy, "--dir", d, "--prefix-tokens", "8192,16384,32768", "--chunk-tokens", "64",
            "--repeat", "20"], d / "kv" / "terrace-bench-kv.marker"


def experts_bench(toy, d):
    return ["bench", "experts", "--model", toy, "--dir", d, "--prompt", "4", "--decode", "1500", "--budgets", "50%",
            "--configs", "on-demand,oracle"], \
        d / "terrace-bench-experts.marker"


def store_bench(toy, d):
    return ["bench", "store", "--dir", d, "--block-size", "64KiB", "--total-bytes", "256MiB", "--batch", "1",
            "--repeat", "100"], d / "nvme" / "terrace-bench-store.marker"


BENCHES = {"kv": kv_bench, "experts": experts_bench, "store": store_bench}


@pytest.mark.parametrize("bench", sorted(BENCHES))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_stops_and_cleans_up_on_signal(terrace, toy_model, tmp_path, bench, sig):
    d = tmp_path / "pools"
    argv, marker = BENCHES[bench](toy_model, d)
    p = terrace.popen(*argv)
    try:
        assert wait_for(marker), f"bench {bench} did not mark its store"
        time.sleep(0.3)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert f"stopped by {signal.Signals(sig).name}" in err, err
    assert "terrace: error" not in err, err  # the stop is not reported as a failure
    # Everything the bench created is gone: kv and store made --dir and remove it; experts removes its store.
    assert not d.exists() or os.listdir(d) == [], os.listdir(d)


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_removes_its_own_leftover_after_sigkill(terrace, toy_model, tmp_path, bench):
    d = tmp_path / "pools"
    argv, marker = BENCHES[bench](toy_model, d)
    kill_once_marked(terrace, argv, marker)
    # A short run on the same --dir recognises the leftover as its own and removes it first.
    r = terrace(*short_run(toy_model, d)[bench], timeout=300)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()


def short_run(toy, d):
    return {"kv": ["bench", "kv", "--model", toy, "--dir", d, "--prefix-tokens", "64", "--chunk-tokens", "32"],
            "experts": ["bench", "experts", "--model", toy, "--dir", d, "--prompt", "2", "--decode", "2",
                        "--budgets", "50%", "--configs", "on-demand"],
            "store": ["bench", "store", "--dir", d, "--total-bytes", "4MiB", "--repeat", "1"]}


# A second Ctrl-C while the bench removes its store stops the removal part-way. The data file goes
# first and the marker last, so what is left is the marker with the index (or alone): the next run
# removes each as its own. A store sub-folder goes together with its marker (signals held off), so
# an empty sub-folder in a --dir is never the bench's: it may be the user's, and is refused untouched.
@pytest.mark.parametrize("bench", sorted(BENCHES))
@pytest.mark.parametrize("left", ["marker+index", "marker", "empty-folder"])
def test_bench_removes_what_a_stopped_cleanup_left(terrace, toy_model, tmp_path, bench, left):
    d = tmp_path / "pools"
    argv, marker = BENCHES[bench](toy_model, d)
    kill_once_marked(terrace, argv, marker)
    for store in {marker.parent} | ({d / "state"} if bench == "kv" else set()):
        (store / "terrace.data").unlink(missing_ok=True)
        if left != "marker+index":
            shutil.rmtree(store / "index", ignore_errors=True)
        if left == "empty-folder":
            (store / marker.name).unlink()
    before = snapshot(d)
    r = terrace(*short_run(toy_model, d)[bench], timeout=300)
    if left == "empty-folder" and marker.parent != d:  # kv/, state/ or nvme/ left empty in --dir
        assert r.returncode == 2 and f"--dir {d} is not empty" in r.stderr, r.stderr
        assert snapshot(d) == before
        return
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    assert not d.exists() or os.listdir(d) == [], os.listdir(d)


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_refuses_a_folder_with_anything_else(terrace, toy_model, tmp_path, bench):
    d = tmp_path / "pools"
    argv, marker = BENCHES[bench](toy_model, d)
    kill_once_marked(terrace, argv, marker)
    (d / "notes.txt").write_text("mine")  # the user's file beside the leftover: nothing may be removed
    before = snapshot(d)
    r = terrace(*argv, timeout=60)
    assert r.returncode == 2 and ("not empty" in r.stderr or "notes.txt" in r.stderr), r.stderr
    assert snapshot(d) == before


def tiers_bench(toy, d):
    return ["bench", "tiers", "--tier", "nvme", "--op", "randread", "--block-size", "4KiB", "--total-bytes", "256MiB",
            "--repeat", "50", "--json", "--dir", d], d / "terrace-bench.marker"


# The reason a killed run's leftover is not removed is the entry that is not the bench's: the refusal
# names it (beside the leftover in --dir, or inside its store folder), and nothing is removed.
@pytest.mark.parametrize("bench,where", [("tiers", ""), ("kv", ""), ("kv", "kv"), ("store", ""), ("store", "nvme")])
def test_a_leftover_beside_a_user_file_is_refused_naming_that_file(terrace, toy_model, tmp_path, bench, where):
    d = tmp_path / "pools"
    argv, marker = {"tiers": tiers_bench, **BENCHES}[bench](toy_model, d)
    kill_once_marked(terrace, argv, marker)
    (d / where / "notes.txt").write_text("mine")
    before = snapshot(d)
    short = {"tiers": ["bench", "tiers", "--tier", "nvme", "--op", "randread", "--block-size", "4KiB",
                       "--total-bytes", "8MiB", "--repeat", "1", "--json", "--dir", d],
             **short_run(toy_model, d)}[bench]
    r = terrace(*short, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "'notes.txt'" in r.stderr and str(d / where).rstrip("/") in r.stderr, r.stderr
    assert "nothing was removed" in r.stderr, r.stderr
    assert snapshot(d) == before
