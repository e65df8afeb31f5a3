"""terrace report as a browser draws it: Debian's chromium screenshots a plan page headless.

Its own ctest entry (python_cli_report_browser, tests/cli/CMakeLists.txt) names chromium in PROGRAMS:
where chromium is absent (CI does not install it, .ci/run) ctest reports that entry Skipped, never
Passed. python_cli_safety leaves this file out."""
import shutil
import subprocess

import pytest

from test_report import BLUE, RED, _colours


def _browser():
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        # Reached only outside ctest (plain `pytest`): under ctest the entry is skipped before pytest runs.
        pytest.skip("chromium is not installed (apt-get install chromium to render the report headless)")
    return browser


def _screenshot(browser, html, png, height):
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={png}",
                    f"--window-size=1000,{height}", html.as_uri()], check=True, capture_output=True, timeout=120)


def test_plan_report_renders_in_a_headless_browser(terrace, tmp_path):
    """The chart's series colours must appear on the screenshot (no blank or broken render)."""
    browser = _browser()
    plan = terrace("plan", "--json", check=True).stdout
    src, out, png = tmp_path / "plan.json", tmp_path / "plan.html", tmp_path / "plan.png"
    src.write_text(plan)
    terrace("report", src, "-o", out, check=True)
    _screenshot(browser, out, png, 1200)
    colours = _colours(png)
    # The memory-vs-context chart draws its first two series in the palette's blue and red.
    assert BLUE in colours and RED in colours
