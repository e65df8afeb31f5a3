"""Runs one pytest suite for ctest (terrace_add_pytest in tests/CMakeLists.txt).

    run_pytest.py NAME NEEDS PROGRAMS -- PYTEST_ARGS...

NEEDS is a comma-separated list of Python modules the suite imports (pytest is always needed).
PROGRAMS is a comma-separated list of executables the suite runs, each found on PATH; `a|b` is met by
either. When a module or a program is missing the suite is skipped: exit 77, which ctest reports as
"Skipped", with a line naming what is missing. Otherwise the exit code is pytest's.
"""
import importlib.util
import shutil
import sys

name, needs, programs, sep, *args = sys.argv[1:]
assert sep == "--", "usage: run_pytest.py NAME NEEDS PROGRAMS -- PYTEST_ARGS..."
modules = ["pytest"] + [m for m in needs.split(",") if m]
missing = [m for m in modules if importlib.util.find_spec(m) is None]
if missing:
    print(f"{name} skipped: missing Python module(s) {', '.join(missing)}; "
          f"install them with 'pip install {' '.join(missing)}' (scripts/deps.sh does)")
    sys.exit(77)
absent = [p for p in programs.split(",") if p and not any(shutil.which(a) for a in p.split("|"))]
if absent:
    print(f"{name} skipped: missing program(s) {', '.join(' or '.join(p.split('|')) for p in absent)} "
          f"(none on PATH)")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(args))
