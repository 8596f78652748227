"""Lazy, validating reader for single-file and sharded safetensors checkpoints.

We parse the safetensors header ourselves (8-byte length, JSON, raw data) instead of going through
``safetensors.safe_open`` because (a) its numpy backend has no float8 type, and (b) we want every
malformed file -- a truncated shard, a header that lies about offsets, an unknown dtype -- to be
reported up front with the file and tensor named, before any weight is uploaded. Tensors are read
one at a time straight into a fresh, 64-byte aligned numpy buffer with ``readinto`` (no mmap), so a
load holds at most one host copy of one tensor beyond what has already been placed on the device
(on the CPU backend, none: ``jax.device_put`` adopts aligned buffers), and the page cache is never
counted as process memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from modelopt_jax.checkpoint import finite_scan
from modelopt_jax.checkpoint.files import open_regular
from modelopt_jax.errors import CheckpointError, DtypeMismatchError, MissingTensorError, NonFiniteTensorError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tag -> numpy dtype. Tags we do not map (e.g. F8_E8M0, F4) can still be listed
# and inspected; reading them raises DtypeMismatchError.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
# XLA:CPU adopts a host buffer aligned to this many bytes without copying it (jax.device_put on
# the CPU backend); numpy's own allocations are only 16-byte aligned, which forces a second copy.
HOST_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a ``HOST_ALIGNMENT`` boundary.

    Why: tensors read here are handed to ``jax.device_put``. On the CPU backend an aligned buffer
    becomes the device array itself (zero-copy), so a load holds one copy of the weights instead of
    two (the numpy array plus the device copy, the former freed only later). On GPU/TPU it changes
    nothing. The array is a view of a private over-allocated byte buffer, shared with nothing else.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it claims to be (from the header alone)."""

    name: str
    file: str  # absolute path
    dtype: str  # safetensors tag, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """``json`` object hook: a key given twice is an error, not "the last one wins"."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def raise_nonfinite(info: "TensorInfo", array: np.ndarray, first: int) -> None:
    """Raises NonFiniteTensorError for ``array`` (tensor ``info``), whose first NaN/inf is at flat index ``first``."""
    flat = array.reshape(-1)
    count = int(finite_scan.nonfinite_mask(flat, info.dtype).sum())  # the slow, exact pass: errors only
    index = [int(i) for i in np.unravel_index(first, info.shape)] if info.shape else []
    raw = int(flat[first:first + 1].view(finite_scan.NONFINITE_BITS[info.dtype][1])[0])
    raise NonFiniteTensorError(
        f"{info.file}: tensor {info.name!r} ({info.dtype}) holds {count} non-finite value(s) (NaN or inf), "
        f"e.g. {float(flat[first])} at index {index} (raw bits 0x{raw:x}); weights must be finite")


def _read_header(path: str) -> dict[str, TensorInfo]:
    """Parses and checks one safetensors file's header; raises CheckpointError naming the file."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file: header claims {header_len} bytes "
                    f"but the file has {size} bytes")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e
    try:
        header = json.loads(header_bytes, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: duplicate tensor name {e.args[0]!r} in the safetensors header (a reader "
                              f"would silently keep one of them); the header is corrupt") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + header_len
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {entry!r}") from e
        if begin < 0 or end < begin or data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] run past the end of the file "
                f"({size - data_start} data bytes); the file is truncated or corrupt")
        np_dtype = NUMPY_DTYPES.get(dtype)
        if np_dtype is not None and any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: negative dimension in shape {list(shape)}")
        if np_dtype is not None and int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize != end - begin:
            raise CheckpointError(
                f"{path}: tensor {name!r}: {dtype}{list(shape)} needs "
                f"{int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize} bytes but the header gives it "
                f"{end - begin}")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, data_start + end)
    # Two entries sharing bytes means the header lies: one tensor would silently load another's data.
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(
                f"{path}: tensors {first!r} and {second!r} overlap in the data region (data_offsets must "
                f"not share bytes); the header is corrupt")
    return tensors


class SafetensorsIndex:
    """All tensors of a checkpoint directory, by name, read lazily.

    ``SafetensorsIndex(directory)`` reads ``model.safetensors.index.json`` when present (sharded),
    else ``model.safetensors``; every shard's header is checked at construction.
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        index_path = os.path.join(self.directory, INDEX_FILE)
        single_path = os.path.join(self.directory, SINGLE_FILE)
        self.tensors: dict[str, TensorInfo] = {}
        if os.path.exists(index_path):
            self.files = self._read_sharded(index_path)
        elif os.path.exists(single_path):
            self.files = [single_path]
            self.tensors = _read_header(single_path)
        else:
            raise CheckpointError(
                f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE} found (expected a Hugging Face "
                f"safetensors checkpoint directory)")

    def _read_sharded(self, index_path: str) -> list[str]:
        try:
            with open_regular(index_path, "r") as f:
                weight_map = json.load(f, object_pairs_hook=_unique_keys)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            bad = next(((n, f) for n, f in weight_map.items() if not isinstance(f, str)), None)
            if bad is not None:
                raise TypeError(f"weight_map maps {bad[0]!r} to {bad[1]!r}, expected a shard file name")
        except _DuplicateKey as e:
            raise CheckpointError(f"{index_path}: key {e.args[0]!r} appears twice; not a valid safetensors "
                                  f"index") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        headers = {}
        for file in files:
            rel = os.path.normpath(file) if file else ""
            if not rel or os.path.isabs(rel) or rel == os.curdir or rel == os.pardir or \
                    rel.startswith(os.pardir + os.sep):
                names = sorted(n for n, f in weight_map.items() if f == file)
                raise CheckpointError(
                    f"{index_path}: shard {file!r} (named for {len(names)} tensors, e.g. {names[0]!r}) is not a file "
                    f"name inside the checkpoint directory {self.directory}; every shard must be")
            path = os.path.join(self.directory, rel)
            if not os.path.exists(path):
                names = sorted(n for n, f in weight_map.items() if f == file)
                raise MissingTensorError(
                    f"{index_path}: shard {file!r} named for {len(names)} tensors (e.g. {names[0]!r}) "
                    f"does not exist in {self.directory}")
            headers[file] = _read_header(path)
        for name, file in weight_map.items():
            info = headers[file].get(name)
            if info is None:
                actual = [f for f in files if name in headers[f]]
                raise MissingTensorError(
                    f"{index_path}: tensor {name!r} is mapped to {file!r} but that shard does not contain it "
                    f"({'it is in ' + ', '.join(map(repr, actual)) if actual else 'no shard does'}); "
                    f"the index does not match its shards")
            self.tensors[name] = info
        # Tensors present in a shard but absent from the index are still usable.
        for header in headers.values():
            for name, info in header.items():
                self.tensors.setdefault(name, info)
        return [os.path.join(self.directory, os.path.normpath(f)) for f in files]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(f"{self.directory}: tensor {name!r} not found in {self._where()}") from None

    def _where(self) -> str:
        return ", ".join(os.path.basename(f) for f in self.files)

    def read(self, name: str, *, check_finite: bool = False) -> np.ndarray:
        """Reads one tensor into a new, 64-byte aligned numpy array (see :func:`aligned_empty`).

        The array owns its (private) buffer; it is never a view of a buffer shared with anything.
        """
        info = self.info(name)
        np_dtype = NUMPY_DTYPES.get(info.dtype)
        if np_dtype is None:
            raise DtypeMismatchError(
                f"{info.file}: tensor {name!r} has dtype {info.dtype}, which this package cannot read "
                f"(supported: {', '.join(NUMPY_DTYPES)})")
        out = aligned_empty(info.shape, np_dtype)
        try:
            with open_regular(info.file) as f:
                got, first = finite_scan.read_into(f, info.begin, out, info.dtype if check_finite else None)
        except OSError as e:
            raise CheckpointError(f"{info.file}: tensor {name!r}: read failed: {e}") from e
        if got != info.nbytes:
            raise CheckpointError(
                f"{info.file}: tensor {name!r}: expected {info.nbytes} bytes, read {got}; file truncated?")
        if first >= 0:
            raise_nonfinite(info, out, first)
        return out
