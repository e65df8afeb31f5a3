"""Commands that keep their scratch stores in the temporary directory when --dir is not given: a
$TMPDIR that is not a directory is one clear error naming it and --dir (exit 1), never an
"internal error" from the throwing std::filesystem::temp_directory_path."""
import pytest


@pytest.fixture(params=["missing", "file"])
def bad_tmpdir(request, tmp_path, monkeypatch):
    p = tmp_path / "tmpdir"
    if request.param == "file":
        p.write_text("not a directory\n")
    monkeypatch.setenv("TMPDIR", str(p))
    return p


def check_refusal(r, tmpdir):
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "internal error" not in r.stderr
    assert f"TMPDIR={tmpdir}" in r.stderr
    assert "set TMPDIR to an existing directory, or pass --dir" in r.stderr
    assert r.stderr.startswith("terrace: error: no temporary directory"), r.stderr


def test_bench_store_without_a_usable_tmpdir(terrace, bad_tmpdir):
    r = terrace("bench", "store", "--total-bytes", "4MiB", "--block-size", "64KiB", "--repeat", "1")
    check_refusal(r, bad_tmpdir)


def test_bench_kv_without_a_usable_tmpdir(terrace, toy_model, bad_tmpdir):
    r = terrace("bench", "kv", "--model", toy_model, "--prefix-tokens", "64", "--chunk-tokens", "64", "--turns", "0")
    check_refusal(r, bad_tmpdir)
