import json
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
import safetensors

# safetensors dtype name -> numpy dtype (BF16 through ml_dtypes; safetensors.numpy has no BF16).
NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
SPEC_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
               "U16": "uint16", "U8": "uint8", "BOOL": "bool"}


@pytest.fixture(scope="session")
def terrace():
    path = os.environ.get("TERRACE_BIN")
    if not path or not os.path.exists(path):
        pytest.skip("TERRACE_BIN is not set to the built terrace binary")

    def run(*args, check=True):
        r = subprocess.run([path, *map(str, args)], capture_output=True, text=True, timeout=240)
        if check and r.returncode != 0:
            raise AssertionError(f"terrace {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r
    return run


def read_safetensors(path):
    """Reads through the Rust parser (strict validation); returns {name: numpy array}."""
    with open(path, "rb") as f:
        data = f.read()
    out = {}
    for name, t in safetensors.deserialize(data):
        out[name] = np.frombuffer(bytes(t["data"]), dtype=NP_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


def write_safetensors(path, tensors, metadata=None):
    """Writes any numpy arrays, bfloat16 included, with Python's safetensors serializer."""
    keep = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    rev = {np.dtype(v): k for k, v in NP_DTYPES.items()}
    specs = {k: safetensors.TensorSpec(dtype=SPEC_DTYPES[rev[v.dtype]], shape=list(v.shape),
                                       data_ptr=v.ctypes.data, data_len=v.nbytes) for k, v in keep.items()}
    safetensors.serialize_file(specs, str(path), metadata=metadata)


def inspect_json(terrace, *args):
    return json.loads(terrace("model", "inspect", "--json", *args, check=False).stdout)
