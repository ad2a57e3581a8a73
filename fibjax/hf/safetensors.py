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


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor(path: Path, name: str, info, base: int) -> tuple[TensorRef, int, int]:
    """(the tensor, begin, end) of one header entry, its fields checked as the reference reader does."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise SafetensorsError(f"{where}: its entry {info!r} lacks dtype, shape or data_offsets")
    if info["dtype"] not in DTYPES:
        raise SafetensorsError(f"{where}: dtype {info['dtype']!r} is not one fibjax reads ({', '.join(DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_int(n) for n in shape):
        raise SafetensorsError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(n) for n in offsets):
        raise SafetensorsError(f"{where}: data_offsets {offsets!r} are not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"{where}: data_offsets {offsets} end before they begin")
    ref = TensorRef(path, DTYPES[info["dtype"]], tuple(shape), base + begin)
    if end - begin != ref.nbytes:
        raise SafetensorsError(f"{where} takes {end - begin} bytes; its shape {tuple(shape)} {info['dtype']} needs {ref.nbytes}")
    return ref, begin, end


def read_header(path: Path) -> dict[str, TensorRef]:
    """Every tensor of ``path``, checked as strictly as the ``safetensors`` library checks a file:
    the header a JSON object of known dtypes and integer shapes and offsets, each tensor's byte
    count its shape's, the tensors laid end to end from the first data byte to the last (no
    overlap, no gap, no byte outside the file), ``__metadata__`` a map of strings. A failure is
    one SafetensorsError naming the file and the tensor."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or not 0 < length <= min(MAX_HEADER, size - 8):
                raise SafetensorsError(f"{path} is not a safetensors file (bad header length; truncated?)")
            header = json.loads(f.read(length).decode("utf-8"))
    except FileNotFoundError:
        raise SafetensorsError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise SafetensorsError(f"{path} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is a JSON {type(header).__name__}, not the object of tensors a safetensors file holds")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ {metadata!r} is not a map of strings")
    base = 8 + length
    placed = sorted((_tensor(path, name, info, base) + (name,) for name, info in header.items()), key=lambda t: (t[1], t[2]))
    reached, last = 0, None
    for _, begin, end, name in placed:
        if begin != reached:
            if begin < reached:
                how = f"overlaps {last!r}"
            else:
                how = f"leaves bytes {reached:,}..{begin:,} unclaimed after {last!r}" if last else f"begins at {begin:,}, not 0"
            raise SafetensorsError(f"{path}: tensor {name!r} (data_offsets [{begin}, {end}]) {how}: the tensors must lie end to end")
        reached, last = end, name
    if base + reached != size:
        which = f"after tensor {last!r}" if last else "with no tensors"
        state = "is truncated" if base + reached > size else f"has {size - base - reached:,} bytes no tensor claims"
        raise SafetensorsError(f"{path} {state}: the data ends at byte {base + reached:,} {which}, the file has {size:,}")
    return {name: ref for ref, _, _, name in placed}


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
