"""Runs the Python interop tests; exits 77 (ctest: skipped) when a required module is missing."""
import importlib.util
import sys

MISSING = [m for m in ("numpy", "safetensors", "ml_dtypes", "pytest") if importlib.util.find_spec(m) is None]
if MISSING:
    print(f"python_model_io skipped: missing Python module(s) {', '.join(MISSING)}; "
          "install them with 'pip install numpy safetensors ml_dtypes pytest'")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
