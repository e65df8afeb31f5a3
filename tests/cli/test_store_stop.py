"""store recover and store drill stopped by SIGINT/SIGTERM: each stops at its next checkpoint, says
`stopped by SIG...` and how far it got, exits 128 + the signal number, and leaves what the next run
(and `store check`) takes up. The recover's checkpoints are reached through a test gate
(TERRACE_TEST_RECOVER_GATE), so the signal lands at a known point instead of racing the scan."""
import os
import signal
import subprocess
import time

import pytest

from conftest import wait_for


def make_store(terrace, d):
    """A store of 64 blocks; returns the file of their `durable` lines, for `store check --expect`."""
    r = terrace("store", "fill", "--dir", d, "--count", "64", "--block-size", "16KiB", "--capacity", "64MiB",
                check=True, timeout=120)
    acked = d.parent / "acked.txt"
    acked.write_text(r.stdout)
    return acked


def recover_at_gate(terrace, tmp_path, d, sig, at=None):
    """Starts `store recover --dir d`, waits at the gate `at` (the first scan chunk by default), sends
    `sig`, opens the gate; returns (returncode, stdout, stderr)."""
    gate = tmp_path / "gate"
    env = dict(os.environ, TERRACE_TEST_RECOVER_GATE=str(gate))
    if at:
        env["TERRACE_TEST_RECOVER_GATE_AT"] = at
    p = subprocess.Popen([terrace.path, "store", "recover", "--dir", str(d)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert wait_for(tmp_path / "gate.waiting", seconds=30), "the recover did not reach the gate"
        p.send_signal(sig)
        time.sleep(0.1)
        gate.write_text("")
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_recover_stopped_while_scanning_changes_nothing(terrace, tmp_path, sig):
    d = tmp_path / "s"
    acked = make_store(terrace, d)
    before = sorted(os.listdir(d))
    rc, out, err = recover_at_gate(terrace, tmp_path, d, sig)
    name = signal.Signals(sig).name
    assert rc == 128 + sig, (rc, out, err)
    assert f"store recover: stopped by {name} while scanning the data file" in err, err
    assert "as the scan found them (it writes nothing)" in err and f"'terrace store recover --dir {d}'" in err, err
    assert "terrace: error" not in err
    assert sorted(os.listdir(d)) == before  # no index.rebuilding, no index moved aside
    r = terrace("store", "check", "--dir", d, "--expect", acked, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = terrace("store", "recover", "--dir", d, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_recover_stopped_while_writing_leaves_what_the_next_recover_takes_up(terrace, tmp_path):
    """Stopped after a step of writing the new index: the old index stays in place (the store checks
    clean), the unfinished index.rebuilding is named in the message, and the next recover removes it
    and rebuilds."""
    d = tmp_path / "s"
    acked = make_store(terrace, d)
    rc, out, err = recover_at_gate(terrace, tmp_path, d, signal.SIGINT, at="manifest")
    assert rc == 130, (rc, out, err)
    assert "store recover: stopped by SIGINT while writing the new index" in err, err
    assert f"'{d / 'index.rebuilding'}'" in err and "the next 'terrace store recover" in err, err
    assert (d / "index.rebuilding").is_dir() and (d / "index").is_dir()
    r = terrace("store", "check", "--dir", d, "--expect", acked, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = terrace("store", "recover", "--dir", d, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "64 blocks indexed" in r.stdout, r.stdout
    assert not (d / "index.rebuilding").exists()
    r = terrace("store", "check", "--dir", d, "--expect", acked, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_drill_stops_after_its_round_and_the_next_drill_takes_the_dir(terrace, tmp_path, sig):
    d = tmp_path / "drill"
    p = terrace.popen("store", "drill", "--dir", d, "--kills", "1000", "--faults", "eio", "--capacity", "16MiB",
                      "--max-acks", "8")
    try:
        assert wait_for(d / "eio" / "terrace.data", seconds=60), "the drill did not start its first round"
        time.sleep(0.5)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    name = signal.Signals(sig).name
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert f"store drill: stopped by {name} after " in err and "the stores and logs in" in err, err
    assert "terrace: error" not in err, err
    assert "eio" in out and "stopped before all its rounds ran" in out, out
    r = terrace("store", "drill", "--dir", d, "--kills", "1", "--faults", "eio", "--capacity", "16MiB", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
