"""`terrace store drill`: the per-round progress lines count the faults the round injected, the drill's own
bit flips included, so they add up to the JSON's faults_injected."""
import json
import os
import re
import subprocess

import pytest

BIN = os.environ.get("TERRACE_BIN")
if not BIN or not os.path.exists(BIN):
    pytest.skip("TERRACE_BIN is not set to the built terrace binary", allow_module_level=True)


def test_bitflip_rounds_count_their_flips_in_the_progress_line(tmp_path):
    p = subprocess.run([BIN, "store", "drill", "--dir", str(tmp_path / "d"), "--kills", "2", "--faults", "bitflip",
                        "--capacity", "16MiB", "--block-size", "4KiB", "--max-acks", "20", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    injected = json.loads(p.stdout)["faults"][0]["faults_injected"]
    per_round = [int(m) for m in re.findall(r"^drill bitflip round \d+/\d+: .*?, (\d+) faults", p.stderr, re.M)]
    assert len(per_round) == 2, p.stderr
    assert injected > 0 and sum(per_round) == injected, p.stderr
