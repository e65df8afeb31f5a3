"""Writes safetensors files without numpy or the safetensors package (shared by the pytest suite and
the CLI fuzz run, which may run under a bare python3)."""
import json
import pathlib
import struct


def write_safetensors(path, tensors):
    """A safetensors file at `path` (str or Path) from {name: (dtype, shape, raw bytes)}."""
    header, offset, data = {}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)
