"""Reading and writing the safetensors format, one tensor at a time.

A file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets: [begin, end]}}, offsets relative to the data that follows), then the raw
little-endian bytes. Reading maps each tensor's bytes (``np.memmap``) so that only the slices a
device asks for are read, and bfloat16 is read through ``ml_dtypes`` (numpy has no bfloat16,
which is why the ``safetensors`` package's numpy reader cannot serve here). Nothing is unpickled.
Writing streams one tensor after another, so a model is never held twice in host memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from fibjax.errors import FibjaxError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class SafetensorsError(FibjaxError, ValueError):
    """A safetensors file is missing, truncated or not in the format; the message names it."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def map(self) -> np.ndarray:
        """The tensor as a read-only memory map (no bytes read until they are indexed)."""
        if self.nbytes == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def read_header(path: Path) -> dict[str, TensorRef]:
    """Every tensor of ``path``, checked against the file's size (a truncated file is an error)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or not 0 < length <= min(MAX_HEADER, size - 8):
                raise SafetensorsError(f"{path} is not a safetensors file (bad header length; truncated?)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise SafetensorsError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise SafetensorsError(f"{path} is not a readable safetensors file ({e})") from None
    base = 8 + length
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[info["dtype"]], tuple(int(n) for n in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has an unsupported or malformed entry {info}") from None
        ref = TensorRef(path, dtype, shape, base + int(begin))
        if int(end) - int(begin) != ref.nbytes:
            raise SafetensorsError(f"{path}: tensor {name!r} takes {int(end) - int(begin)} bytes, its shape {shape} {info['dtype']} needs {ref.nbytes}")
        if base + int(end) > size:
            raise SafetensorsError(f"{path} is truncated: tensor {name!r} ends at byte {base + int(end):,}, the file has {size:,}")
        refs[name] = ref
    return refs


def write(path: Path, tensors: Iterable[tuple[str, np.dtype, tuple[int, ...], Callable[[], np.ndarray]]], metadata: dict[str, str] | None = None) -> None:
    """Write ``(name, dtype, shape, fetch)`` tensors to ``path`` (atomically: a ``.tmp`` renamed),
    calling each ``fetch()`` only when its bytes are written."""
    tensors = list(tensors)
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the reference writer does
    tmp = Path(f"{path}.tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, dtype, shape, fetch in tensors:
            array = np.ascontiguousarray(fetch(), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"tensor {name!r}: shape {array.shape}, declared {tuple(shape)}")
            f.write(array.tobytes())
    os.replace(tmp, path)
