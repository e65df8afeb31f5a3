"""Output that cannot be written is a failure that names what failed: standard output that cannot be
written (/dev/full fails every write with ENOSPC) is exit 1 with "cannot write standard output: <cause>",
never a silent 0 or an "internal error"; figures not measured are null; parser errors name the command
that was run; an output file's failure names the flag and the target."""
import json
import os
import re
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import write_safetensors

STDOUT_FULL = "terrace: error: cannot write standard output: No space left on device"


def run_to_dev_full(terrace, *args, **kwargs):
    """Runs terrace with its standard output on /dev/full; stdout is not captured."""
    import subprocess
    with open("/dev/full", "w") as full:
        return subprocess.run([terrace.path, *map(str, args)], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=kwargs.get("timeout", 120))


def assert_stdout_failure(r):
    assert r.returncode == 1, r.stderr
    assert STDOUT_FULL in r.stderr, r.stderr
    assert "internal error" not in r.stderr, r.stderr
    assert r.stderr.count("cannot write standard output") == 1, r.stderr


@pytest.mark.parametrize("args", [
    ("trace", "gen", "--requests", "3"),                  # small output: fails at the final flush
    ("plan", "--model", "k3-toy", "--json"),              # large output: fmt's print throws mid-way
    ("--version",),                                       # CLI11's std::cout, flushed as it prints
    ("store", "fill", "--help"),
])
def test_unwritable_stdout_is_exit_1_naming_standard_output(terrace, args):
    assert_stdout_failure(run_to_dev_full(terrace, *args))


STDOUT_PIPE = "terrace: error: cannot write standard output: Broken pipe"


def run_into_closed_pipe(terrace, *args):
    """Runs terrace with its standard output on a pipe nobody reads (the read end closed before the start): every
    write to it fails with EPIPE. SIGPIPE has its default action in the child (subprocess restores it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([terrace.path, *map(str, args)], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [
    ("trace", "gen", "--requests", "3"),
    ("trace", "gen", "--requests", "100000"),
    ("plan", "--model", "k3-toy", "--json"),
    ("--version",),
    ("store", "fill", "--help"),
])
def test_stdout_on_a_closed_pipe_is_exit_1_naming_standard_output(terrace, args):
    # Not killed by SIGPIPE (exit 141 in a shell, no word said): the write fails and is reported.
    r = run_into_closed_pipe(terrace, *args)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert STDOUT_PIPE in r.stderr, r.stderr
    assert "internal error" not in r.stderr, r.stderr
    assert r.stderr.count("cannot write standard output") == 1, r.stderr


def test_store_fill_into_a_pipe_closed_by_its_reader_says_how_many_blocks_are_durable(terrace, tmp_path):
    # `terrace store fill ... | head -1`: the reader goes away after one line.
    p = subprocess.Popen([terrace.path, "store", "fill", "--dir", str(tmp_path / "s"), "--count", "3000", "--capacity",
                          "64MiB", "--block-size", "4KiB", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert first.startswith(b"durable "), first
    assert rc == 1, (rc, err)
    assert STDOUT_PIPE in err, err
    m = re.search(r"the fill stopped: (\d+) blocks are durable in the store, (\d+) of them reported on 'durable' lines",
                  err)
    assert m, err
    durable, reported = int(m.group(1)), int(m.group(2))
    assert 1 <= reported <= durable < 3000, err
    # What it said is what the store holds.
    chk = terrace("store", "check", "--dir", tmp_path / "s")
    assert chk.returncode == 0, chk.stderr
    assert f"store check: {durable} blocks in the index: ok {durable} " in chk.stdout, chk.stdout


def test_model_run_json_to_full_stdout_fails(terrace, toy_model):
    assert_stdout_failure(run_to_dev_full(terrace, "model", "run", "--model", toy_model, "--tokens", "1,2,3", "--json"))


def test_store_fill_stops_when_a_durable_line_cannot_be_written(terrace, tmp_path):
    r = run_to_dev_full(terrace, "store", "fill", "--dir", tmp_path / "s", "--capacity", "16MiB", "--count", "50",
                        "--block-size", "4KiB", "--threads", "1")
    assert_stdout_failure(r)
    # The block whose line failed is durable, yet not reported: said so, and the fill stopped there.
    assert "blocks are durable in the store, 0 of them reported on 'durable' lines" in r.stderr, r.stderr
    assert "written and durable" not in r.stderr, r.stderr
    # The store itself is fine: a check of what was written reads it.
    chk = terrace("store", "check", "--dir", tmp_path / "s")
    assert chk.returncode == 0, chk.stderr


def test_parser_dependency_error_names_the_command_run(terrace, toy_model, tmp_path):
    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2", "--chunk-tokens", "64")
    assert r.returncode == 2, r.stderr
    assert "--chunk-tokens requires --store" in r.stderr, r.stderr
    assert "(run 'terrace model run --help')" in r.stderr, r.stderr
    assert "<command>" not in r.stderr, r.stderr


def test_bench_tiers_nvme_has_no_memcpy_figures(terrace, tmp_path):
    args = ("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "64KiB", "--total-bytes", "1MiB",
            "--dir", tmp_path / "b")
    r = terrace(*args, "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    # Never measured for the NVMe tier: null, not 0 (a 0 is drawn as a memcpy line at 0 MB/s).
    assert j["memcpy_mb_per_s"] is None and j["ratio_vs_memcpy"] is None and j["memcpy_baseline"] is None, j
    run_json = tmp_path / "run.json"
    run_json.write_text(r.stdout)
    rep = terrace("report", run_json, "-o", tmp_path / "r.html", "--svg")
    assert rep.returncode == 0, rep.stderr
    charts = [p.read_text() for p in tmp_path.glob("*.svg")] + [(tmp_path / "r.html").read_text()]
    assert len(charts) > 1
    assert not any("dotted: memcpy" in c for c in charts)
    assert any("no memcpy reference (not measured for this tier)" in c for c in charts)  # said, not left out
    text = terrace(*args)
    assert text.returncode == 0, text.stderr
    assert "memcpy" not in text.stdout, text.stdout


def test_bench_tiers_free_space_check_uses_the_capacity_the_tier_is_made_with(terrace, tmp_path):
    # 1 TiB of 4 KiB blocks: each takes an 8 KiB extent (one data unit, one descriptor unit), so the
    # file is 2 TiB + an eighth + 64 MiB = 2.3 TiB; the check must ask for that, not for 1.1 TiB.
    if shutil.disk_usage(tmp_path).free >= 2 << 40:
        pytest.skip("the file system of the temporary folder has room for the 2.3 TiB file")
    r = terrace("bench", "tiers", "--tier", "nvme", "--op", "write", "--block-size", "4KiB", "--total-bytes", "1TiB",
                "--dir", tmp_path / "b")
    assert r.returncode == 2, r.stderr
    assert "--total-bytes 1.0 TiB needs about 2.3 TiB on the file system of --dir" in r.stderr, r.stderr


def test_dump_logits_failure_names_the_flag_and_target(terrace, toy_model, tmp_path):
    target = tmp_path / "logits.safetensors"

    def small_files():  # every write past 64 bytes fails (EFBIG; SIGXFSZ is ignored by terrace)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    r = terrace("model", "run", "--model", toy_model, "--tokens", "1,2,3", "--dump-logits", target,
                preexec_fn=small_files)
    assert r.returncode == 1, r.stderr
    assert f"--dump-logits {target}: cannot write the logits: " in r.stderr, r.stderr
    assert not target.exists()


def unwritable_folder(tmp_path):
    """A folder where no file can be created, for this user (root: sysfs or procfs)."""
    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return d
    for d in ("/sys", "/proc"):
        probe = Path(d) / f".terrace-test-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
        except OSError:
            return Path(d)
        probe.unlink()
    pytest.skip("no folder refuses to create a file for root here")


def test_a_file_that_cannot_be_created_is_named_by_its_target_not_the_temporary(terrace, tmp_path):
    d = unwritable_folder(tmp_path)
    run = tmp_path / "run.json"
    run.write_text(terrace("plan", "--model", "k3-toy", "--json", check=True).stdout)
    for flag, target, argv in [
        ("--out", d / "x.jsonl", ["trace", "gen", "--requests", "5", "-o", d / "x.jsonl"]),
        ("-o", d / "r.html", ["report", run, "-o", d / "r.html"]),
    ]:
        r = terrace(*argv)
        assert r.returncode == 1, r.stderr
        # The flag and the target first, the temporary in parentheses after what failed.
        assert f"{flag} {target}: cannot create a temporary file next to it ({d}/.terrace-tmp-" in r.stderr, r.stderr
        assert not target.exists()


@pytest.mark.parametrize("mech", ["codec", "mxfp4"])
def test_ref_out_failure_names_the_flag_and_target(terrace, tmp_path, mech):
    import struct
    src = tmp_path / "in.safetensors"
    tensors = ({"x": ("F32", [2, 32], struct.pack("<64f", *range(64)))} if mech == "codec" else
               {"weight_packed": ("U8", [2, 16], bytes(range(32))), "weight_scale": ("U8", [2, 1], bytes([127, 127]))})
    write_safetensors(src, tensors)
    target = tmp_path / "out.safetensors"

    def small_files():  # every write past 64 bytes fails (EFBIG; SIGXFSZ is ignored by terrace)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    extra = ["--codec", "int8"] if mech == "codec" else []
    r = terrace("ref", mech, *extra, "--in", src, "--out", target, preexec_fn=small_files)
    assert r.returncode == 1, r.stderr
    assert f"ref {mech}: IOError: --out {target}: cannot write the output: " in r.stderr, r.stderr
    assert r.stdout == "", r.stdout  # no 'wrote' line for what was not written
    assert not target.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".terrace-tmp")]
