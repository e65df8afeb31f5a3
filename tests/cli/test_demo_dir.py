"""terrace demo's --dir against other runs and other Terrace commands: a second demo on a directory a
running demo uses is refused at once (its lock is taken before the model is built), and the index
folders `terrace store recover` sets aside in a demo's pool are Terrace's own (the demo runs with
them, --fresh removes them)."""
import json
import re
import subprocess
import time

from conftest import assert_demo_refuses

QUICK = ["--preset", "k3-toy", "--conversations", "1", "--turns", "1", "--system-tokens", "8", "--user-tokens", "4",
         "--new-tokens", "1", "--kv-nvme-size", "4MiB", "--state-nvme-size", "4MiB"]
# Long enough that the first run is still going when the second starts (k3-toy builds in seconds).
LONGER = ["--preset", "k3-toy", "--conversations", "2", "--turns", "3", "--system-tokens", "80", "--user-tokens", "16",
          "--new-tokens", "3", "--kv-nvme-size", "8MiB", "--state-nvme-size", "16MiB"]


def wait_until_building(d, p, seconds=120):
    """Waits until the demo `p` has begun writing its model into d/model.tmp."""
    end = time.time() + seconds
    while time.time() < end:
        tmp = d / "model.tmp"
        try:
            if tmp.is_dir() and any(tmp.iterdir()):
                return
        except FileNotFoundError:
            pass
        assert p.poll() is None, f"the first demo ended before it built its model: {p.communicate()}"
        time.sleep(0.005)
    raise AssertionError("the first demo did not start building its model")


def test_a_second_demo_on_a_dir_a_demo_is_building_in_is_refused_at_once(terrace, tmp_path):
    """While one demo builds its model in DIR/model.tmp (before any store exists), a second demo on the
    same --dir, with or without --fresh, exits 2 at once naming the first one's pid and removes
    nothing; the first one completes."""
    d = tmp_path / "data"
    first = terrace.popen("demo", "--dir", d, *LONGER)
    try:
        wait_until_building(d, first)
        for fresh in ([], ["--fresh"]):
            t0 = time.time()
            r = terrace("demo", "--dir", d, *LONGER, *fresh, timeout=60)
            took = time.time() - t0
            assert r.returncode == 2, (fresh, r.returncode, r.stdout, r.stderr)
            assert f"another process (pid {first.pid}) is using this --dir directory" in r.stderr, (fresh, r.stderr)
            assert took < 10, (fresh, took)  # refused at once, not after a build of its own
            assert "[1/4]" not in r.stdout + r.stderr  # it did not get to step 1
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, (out, err)
    assert "verified:" in out
    assert not (d / "model.tmp").exists() and (d / "model" / "model.safetensors").is_file()


def test_the_lock_ends_with_the_run(terrace, tmp_path):
    """The lock lives as long as the run: after a demo ended the next one on the same --dir runs (also
    with --fresh), and the lock leaves no file of its own in DIR."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True, timeout=300)
    terrace("demo", "--dir", d, *QUICK, "--fresh", check=True, timeout=300)
    assert {p.name for p in d.iterdir()} == {"terrace-demo.marker", "model", "kv", "state", "experts", "demo-run.json",
                                            "report.html"}


def recover(terrace, pool):
    r = terrace("store", "recover", "--dir", pool, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"the old index was moved to '([^']+)'", r.stdout)
    assert m, r.stdout
    return m.group(1)


def test_index_folders_store_recover_set_aside_are_the_demos_own(terrace, tmp_path):
    """`store recover --dir DIR/kv` moves the pool's old index to kv/index.damaged-<time>: the demo runs
    with it there (reusing the pool), --fresh removes it with the rest; a foreign file inside such a
    folder is still refused, naming it, and nothing is removed."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True, timeout=300)
    aside = recover(terrace, d / "kv")
    assert (d / "kv").joinpath(aside.split("/")[-1]).is_dir() and "index.damaged-" in aside
    r = terrace("demo", "--dir", d, *QUICK, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "did not create" not in r.stderr

    # A foreign file in the set-aside folder makes it not Terrace's.
    name = aside.split("/")[-1]
    (d / "kv" / name / "notes.txt").write_text("mine\n")
    assert_demo_refuses(terrace, d, QUICK, f"kv/{name}/notes.txt")
    (d / "kv" / name / "notes.txt").unlink()

    # A user's folder named like one but not by recover (or holding no index database of Terrace's),
    # with files whose names an index could hold: never taken for Terrace's, never removed.
    for mine, files in (("index.damaged-my-notes", ("notes.log", "thesis.tmp", "LOGBOOK.txt")),
                        ("index.damaged-20261207T060550-x", ("notes.log",)),
                        ("index.reformatted-20261207T060550", ("draft.log",))):
        (d / "kv" / mine).mkdir()
        for f in files:
            (d / "kv" / mine / f).write_text("my precious notes\n")
        assert_demo_refuses(terrace, d, QUICK, f"kv/{mine}")
        for f in files:
            (d / "kv" / mine / f).unlink()
        (d / "kv" / mine).rmdir()

    # Two recovers on the state pool too; then --fresh removes every set-aside folder.
    recover(terrace, d / "state")
    recover(terrace, d / "state")
    r = terrace("demo", "--dir", d, *QUICK, "--fresh", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "removed the demo's data" in r.stdout + r.stderr
    for pool in ("kv", "state"):
        left = sorted(p.name for p in (d / pool).iterdir())
        assert not [n for n in left if n.startswith("index.")], (pool, left)


def test_fresh_removes_a_store_or_model_file_only_when_it_is_terraces(terrace, tmp_path):
    """Inside the demo's marked DIR, a store folder without its marker (a run stopped between the
    store's creation and its marker) counted as the demo's by file name alone, and the model folder's
    files too: --fresh deleted a user's terrace.data or model.safetensors. Now the data file must be a
    Terrace data file and model.safetensors a checkpoint Terrace wrote (with config.json beside it)."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True, timeout=300)
    (d / "state" / "terrace-demo.marker").unlink()
    (d / "state" / "terrace.data").write_text("".join(f"{i}\n" for i in range(1, 1001)))
    assert_demo_refuses(terrace, d, QUICK, "'state (a store without terrace-demo.marker)'")

    d = tmp_path / "model"
    terrace("demo", "--dir", d, *QUICK, check=True, timeout=300)
    (d / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    assert_demo_refuses(terrace, d, QUICK, "'model/config.json (not beside a checkpoint Terrace wrote)'",
                        "'model/model.safetensors (not a checkpoint Terrace wrote; if it is the demo's, damaged, "
                        "delete the folder model yourself and run again)'")


def test_a_run_that_reused_nothing_does_not_say_it_reused_the_last_runs_data(terrace, tmp_path):
    """A --fresh stopped after removing the stores and the model leaves demo-run.json: the next run
    built everything anew, yet said "reused the last run's data: 0 KV + 0 state blocks"."""
    d = tmp_path / "data"
    terrace("demo", "--dir", d, *QUICK, check=True, timeout=300)
    for pool in ("kv", "state", "experts"):
        for f in sorted((d / pool).rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        (d / pool).rmdir()
    for f in (d / "model").iterdir():
        f.unlink()
    (d / "model").rmdir()
    r = terrace("demo", "--dir", d, *QUICK, "--json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    j = json.loads((d / "demo-run.json").read_text())
    assert j["reused_previous_run"] is False and j["model"]["reused"] is False
    r = terrace("demo", "--dir", d, *QUICK, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reused the last run's data: the model, the experts" in r.stdout, r.stdout


def test_the_rerun_command_the_demo_prints_parses_back_to_its_dir_and_model(terrace, tmp_path):
    """The command printed to run again names --dir (quoted as a shell reads it), --preset and --seed
    where they are not the defaults: it said 'terrace demo', which reruns on ./terrace-data."""
    d = tmp_path / 'my "data" $HOME'
    r = terrace("demo", "--dir", d, *QUICK, "--seed", "7", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^run '(.*)' again to reuse this data", r.stdout, re.M)
    assert m, r.stdout
    words = subprocess.run(["bash", "-c", f'set -- {m.group(1)}; printf "%s\\0" "$@"'], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split("\0")[:-1]  # as a shell reads it
    assert words == ["terrace", "demo", "--dir", str(d), "--preset", "k3-toy", "--seed", "7"]
