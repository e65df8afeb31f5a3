"""bench/gpu/check.sh on a prebuilt bundle of stub binaries, with a stub nvidia-smi: every expected test
must report Passed for RESULT: PASS; a missing, skipped, failed or timed-out test fails the check; the
logs and the table land in $OUT. Also: bench/gpu/standalone lists every source of the libraries it
stands in for."""
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu" / "check.sh"


def expected_tests():
    out = subprocess.run(["bash", "-c", f"source {ROOT}/bench/gpu/targets.sh; echo ${{GPU_TESTS[@]}}; "
                          "echo ${GPU_TEST_BINARIES[@]}; echo ${GPU_BENCHES[@]}"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return out[0].split(), out[1].split(), out[2].split()


def stub(path, body):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def gpu_env(tmp_path):
    """A bundle of stub binaries that pass (each checks LD_LIBRARY_PATH starts with the bundle's lib), a
    stub nvidia-smi first on PATH, and an empty $OUT."""
    _, binaries, benches = expected_tests()
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    (bundle / "lib").mkdir()
    (bundle / "MANIFEST").write_text("commit stub\n")
    lib = bundle / "lib"
    for b in binaries:
        stub(bundle / "bin" / b, f'[[ $LD_LIBRARY_PATH == {lib}* ]] || {{ echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; exit 3; }}\n'
                                 f'echo "{b} $*: All tests passed"\n')
    for b in benches:
        stub(bundle / "bin" / b, 'echo "RESULT pinned h2d 1048576 50.0"\necho "RESULT x put pinned 1048576 12.5"\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    stub(tools / "nvidia-smi", 'echo "NVIDIA H100 80GB HBM3 (stub), 81559 MiB, 580.159.04"\n')
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}", OUT=str(out), TERRACE_GPU_BUNDLE=str(bundle),
               TERRACE_GPU_BUILD_DIR=str(tmp_path / "build"))
    env.pop("LD_LIBRARY_PATH", None)
    return bundle, out, env


def run_check(env, timeout=60):
    return subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, env=env, timeout=timeout)


def table(out):
    return dict(re.findall(r"^(test_\w+)\s+(.+?)\s*$", (out / "summary.txt").read_text(), re.M))


def test_all_passed_is_pass_and_everything_lands_in_out(gpu_env):
    bundle, out, env = gpu_env
    p = run_check(env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "RESULT: PASS" in p.stdout
    tests, _, _ = expected_tests()
    assert table(out) == {t: "Passed" for t in tests}
    assert "50.0 GB/s" in (out / "summary.txt").read_text()
    assert "test_codec_cuda [cuda-api]" in (out / "tests.log").read_text()  # test_codec_cuda_api's tag
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in out.iterdir()), files  # what the device tool returns
    assert {"check.log", "results.txt", "summary.txt", "tests.log", "bench.log"} <= set(files)


@pytest.mark.parametrize("case,body,want", [
    ("missing", None, "not built"),
    ("skipped", 'echo "SKIPPED: no CUDA device"\n', "Skipped (no CUDA device)"),
    ("failed", 'echo boom\nexit 42\n', "Failed (exit 42)"),
])
def test_a_test_not_passed_fails_the_check(gpu_env, case, body, want):
    bundle, out, env = gpu_env
    exe = bundle / "bin" / "test_hbm_store_cuda"
    if body is None:
        exe.unlink()
    else:
        stub(exe, body)
    p = run_check(env)
    assert p.returncode == 1, p.stdout
    assert "RESULT: FAIL" in p.stdout
    assert table(out)["test_hbm_store_cuda"] == want
    assert table(out)["test_hbm_cuda"] == "Passed"


def test_the_deadline_bounds_the_run_and_unrun_tests_fail(gpu_env):
    bundle, out, env = gpu_env
    stub(bundle / "bin" / "test_hbm_cuda", "sleep 100\n")  # a hang
    env["TERRACE_GPU_CHECK_DEADLINE"] = "27"  # 7 s for the tests and benchmarks, 20 s kept for the summary
    t0 = time.monotonic()
    p = run_check(env)
    assert time.monotonic() - t0 < 27, p.stdout
    assert p.returncode == 1 and "RESULT: FAIL" in p.stdout
    got = table(out)
    assert got["test_hbm_cuda"] == "Timeout"
    assert all(v in ("Passed", "Timeout") for v in got.values()), got
    assert "test_hbm_cuda" in (out / "results.txt").read_text()  # written as it finished


def cmake_sources(text, target):
    m = re.search(r"add_library\(" + target + r"\b(.*?)\)", text, re.S)
    assert m, target
    return {Path(w).name for w in m.group(1).split() if w.endswith(".cpp")}


def test_standalone_build_lists_every_source_of_the_tiers_it_builds():
    standalone = (ROOT / "bench/gpu/standalone/CMakeLists.txt").read_text()
    have = cmake_sources(standalone, "gpu_check_tiers")
    common = cmake_sources((ROOT / "CMakeLists.txt").read_text(), "terrace_common")
    host = cmake_sources((ROOT / "tiers/host/CMakeLists.txt").read_text(), "terrace_tier_host") | {"pinned_cuda.cpp"}
    hbm = cmake_sources((ROOT / "tiers/hbm/CMakeLists.txt").read_text(), "terrace_tier_hbm") | {"hbm_cuda.cpp"}
    missing = (common | host | hbm) - have
    assert not missing, f"bench/gpu/standalone/CMakeLists.txt lacks {sorted(missing)}"
