"""A process at its thread limit gets an error naming the limit, never std::terminate: the store's,
the tiers' and RocksDB's threads (the index's table files are opened on the calling thread).

Runs `model run --store` as user nobody under `prlimit --nproc N` for a range of N, so that each of
the threads the run starts is, for some N, the one refused. Needs root (to switch users), setpriv
and prlimit; skipped otherwise.
"""
import os
import shutil
import subprocess
import tempfile

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the built terrace binary", allow_module_level=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"),
                    reason="needs root, setpriv and prlimit to run as nobody under a process limit")
def test_model_run_store_at_a_thread_limit_fails_cleanly(make_model):
    # pytest's temporary folders are private to root: nobody works in a folder of its own under /tmp.
    with tempfile.TemporaryDirectory(prefix="terrace-nproc-") as top:
        os.chmod(top, 0o777)
        model = shutil.copytree(make_model("k3-toy", seed=1), os.path.join(top, "m"))
        for dirpath, _, files in os.walk(model):
            os.chmod(dirpath, 0o755)
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644)
        run_at_limits(model, top)


def run_at_limits(model, top):
    seen_refusal = False
    for n in range(6, 30):
        store = os.path.join(top, f"s{n}")
        p = subprocess.run(["prlimit", f"--nproc={n}", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            BIN, "model", "run", "--model", str(model), "--tokens", "1,2,3", "--store", str(store),
                            "--store-nvme-size", "16MiB", "--state-nvme-size", "16MiB"],
                           capture_output=True, text=True, timeout=120)
        assert "terminate" not in p.stderr, f"nproc {n}: {p.stderr}"
        assert p.returncode in (0, 1), f"nproc {n}: rc {p.returncode}: {p.stderr}"
        if p.returncode == 1:
            seen_refusal = True
            assert "Resource temporarily unavailable" in p.stderr, f"nproc {n}: {p.stderr}"
            assert "Options::" not in p.stderr, f"nproc {n}: a library option in a CLI error: {p.stderr}"
    assert seen_refusal, "no limit in the range refused a thread: the range no longer covers the run's threads"
