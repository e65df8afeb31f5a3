import json
import os
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

from safetensors_file import write_safetensors  # noqa: F401 (re-exported to the tests)


class Terrace:
    """Runs the built binary; every run has a timeout so that a hang fails the test, not the suite."""

    def __init__(self, path):
        self.path = path

    def __call__(self, *args, cwd=None, timeout=120, check=False, preexec_fn=None):
        try:
            r = subprocess.run([self.path, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                               preexec_fn=preexec_fn)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"terrace {' '.join(map(str, args))} hung (no exit within {timeout} s)")
        if check and r.returncode != 0:
            raise AssertionError(f"terrace {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def popen(self, *args, cwd=None):
        return subprocess.Popen([self.path, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd)


@pytest.fixture(scope="session")
def terrace():
    path = os.environ.get("TERRACE_BIN")
    if not path or not os.path.exists(path):
        pytest.skip("TERRACE_BIN is not set to the built terrace binary")
    return Terrace(path)


@pytest.fixture(scope="session")
def toy_model(terrace, tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "toy"
    terrace("model", "init", "--preset", "k3-toy", "--out", d, "--routing-tokens", "0", check=True)
    return d


def snapshot(root):
    """{relative path: (kind, bytes or link target)} of everything under root (symlinks not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", None)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
            else:
                out[rel] = ("other", os.stat(p, follow_symlinks=False).st_mode)
    return out


def assert_demo_refuses(terrace, d, args, *needles):
    """`terrace demo --dir d ARGS`, with and without --fresh, exits 2 with every needle in its stderr
    and changes nothing under d."""
    before = snapshot(d)
    for fresh in ([], ["--fresh"]):
        r = terrace("demo", "--dir", d, *args, *fresh, timeout=300)
        assert r.returncode == 2, (fresh, r.stdout, r.stderr)
        for needle in needles:
            assert needle in r.stderr, (needle, r.stderr)
        assert snapshot(d) == before, fresh


def user_folder(path):
    """A folder of someone's files that Terrace must never touch."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.txt").write_text("years of work\n")
    (path / "photos").mkdir(exist_ok=True)
    (path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return path


def wait_for(path, seconds=60):
    """True once `path` exists (polled every 50 ms), False after `seconds`."""
    end = time.time() + seconds
    while time.time() < end:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


SVG_NS = "{http://www.w3.org/2000/svg}"


def render_report(terrace, tmp_path, data, name):
    """`terrace report --svg` of `data` (written as tmp_path/NAME.json): (the page's HTML, {chart name: its
    parsed SVG}). The page must be self-contained (no link, script or URL but the SVG namespace) and
    inline each chart exactly as written beside it; each SVG must be well-formed XML."""
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(data))
    out = tmp_path / f"{name}.html"
    terrace("report", src, "-o", out, "--svg", check=True)
    html = out.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html and "<script" not in html and "href=" not in html and "src=" not in html
    charts = {}
    for p in tmp_path.glob(f"{name}-*.svg"):
        text = p.read_text()
        assert text in html  # the same SVG is inlined in the page
        charts[p.stem[len(name) + 1:]] = ET.fromstring(text)
    return html, charts
