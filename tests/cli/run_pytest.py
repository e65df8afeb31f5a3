"""Runs the CLI safety tests; exits 77 (ctest: skipped) when pytest is missing."""
import importlib.util
import sys

if importlib.util.find_spec("pytest") is None:
    print("python_cli_safety skipped: pytest is missing; install it with 'pip install pytest'")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
