"""Runs one pytest suite for ctest (terrace_add_pytest in tests/CMakeLists.txt).

    run_pytest.py NAME NEEDS -- PYTEST_ARGS...

NEEDS is a comma-separated list of Python modules the suite imports (pytest is always needed). When
one is missing the suite is skipped: exit 77, which ctest reports as "Skipped", with a line naming the
modules and the pip command that installs them. Otherwise the exit code is pytest's.
"""
import importlib.util
import sys

name, needs, sep, *args = sys.argv[1:]
assert sep == "--", "usage: run_pytest.py NAME NEEDS -- PYTEST_ARGS..."
modules = ["pytest"] + [m for m in needs.split(",") if m]
missing = [m for m in modules if importlib.util.find_spec(m) is None]
if missing:
    print(f"{name} skipped: missing Python module(s) {', '.join(missing)}; "
          f"install them with 'pip install {' '.join(missing)}' (scripts/deps.sh does)")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(args))
