"""Reading a tensor's bytes and finding NaN/inf among them in the same pass (issue 13, item 14).

A NaN or infinity in a weight (an FP8 byte 0x7F/0xFF, ``inf`` in a bf16 norm weight) turns every
logit into NaN without an error, so every float tensor a model consumes is scanned as it is read.
The scan must cost a warm load under 5% (``bench/finite_scan.py``), which numpy cannot do: it needs
two integer max-reductions per chunk and a Python call per chunk. So:

- native (``ModeloptJaxReadScan`` in ``ffi/finite_scan.cc``, our always-built CPU library): one
  call per tensor reads it with ``pread`` and scans each piece in one vectorised pass, on a helper
  thread one piece behind the reads when the tensor is large and a second CPU exists;
- fallback (the library is absent or predates the scan): ``readinto`` in 1 MiB chunks, each scanned
  by numpy while it is still in cache.

Both find the same values: a value is non-finite when its bits without the sign are >= the
all-ones exponent E (:data:`NONFINITE_BITS`). Which path ran is :func:`native_available`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import numpy as np

# safetensors dtype tag -> (signed view, unsigned view, E), E being the exponent bits (e4m3fn: exponent
# and mantissa, its only NaN codes being S.1111.111). A non-finite value's |bits| >= E: a positive one
# is >= E as a signed integer, a negative one >= sign|E as an unsigned one (what numpy's fallback uses).
NONFINITE_BITS = {
    "F8_E4M3": (np.int8, np.uint8, 0x7F),
    "F8_E5M2": (np.int8, np.uint8, 0x7C),
    "BF16": (np.int16, np.uint16, 0x7F80),
    "F16": (np.int16, np.uint16, 0x7C00),
    "F32": (np.int32, np.uint32, 0x7F800000),
    "F64": (np.int64, np.uint64, 0x7FF0000000000000),
}
CHUNK_BYTES = 1 << 20  # fallback: the second reduction of a chunk reads it from cache


@functools.cache
def _native():
    """The library's (read-and-scan, find) functions with their C signatures, or None."""
    from modelopt_jax.ops import native

    lib = native.cpu_library()
    if lib is None or not hasattr(lib, "ModeloptJaxReadScan"):
        return None
    read_scan, find = lib.ModeloptJaxReadScan, lib.ModeloptJaxFindNonFinite
    read_scan.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                          ctypes.c_uint64, ctypes.POINTER(ctypes.c_int64)]
    read_scan.restype = ctypes.c_int64
    find.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64]
    find.restype = ctypes.c_int64
    for tag, (_, unsigned, exp) in NONFINITE_BITS.items():  # the library must agree with this table
        probe = np.zeros(64, unsigned)
        probe[37] = exp
        if find(probe.ctypes.data, probe.size, probe.itemsize, exp) != 37:
            warnings.warn(f"{lib._name}: ModeloptJaxFindNonFinite misses a {tag} NaN/inf; the loader scans with "
                          f"numpy instead (rebuild modelopt_jax)", stacklevel=2)
            return None
    return read_scan, find


def native_available() -> bool:
    return _native() is not None


def _has_nonfinite(flat: np.ndarray, spec) -> bool:
    signed, unsigned, exp = spec
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    return int(flat.view(signed).max()) >= exp or int(flat.view(unsigned).max()) >= (sign | exp)


def nonfinite_mask(flat: np.ndarray, tag: str) -> np.ndarray:
    """Element-wise: which of ``flat`` (a 1-D array of dtype ``tag``) are NaN or inf (a slow, exact pass)."""
    _, unsigned, exp = NONFINITE_BITS[tag]
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    return (flat.view(unsigned) & unsigned(sign - 1)) >= exp


def read_into(f, begin: int, out: np.ndarray, tag: str | None) -> tuple[int, int]:
    """Fills the C-contiguous ``out`` from the open file ``f`` at byte ``begin``; with ``tag`` (a float
    safetensors dtype) scans it too. Returns (bytes read, flat index of the first NaN/inf or -1).

    Fewer bytes than ``out`` holds means the file ended; a failed read raises OSError.
    """
    flat = out.reshape(-1)
    nbytes = flat.size * flat.itemsize
    spec = NONFINITE_BITS.get(tag) if tag is not None else None
    native = _native()
    if native is not None and nbytes:
        first = ctypes.c_int64(-1)
        width, exp = (flat.itemsize, spec[2]) if spec is not None else (0, 0)
        got = native[0](f.fileno(), begin, flat.ctypes.data, nbytes, width, exp, ctypes.byref(first))
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return int(got), int(first.value)
    view = memoryview(flat.view(np.uint8))
    step = CHUNK_BYTES if spec is not None else max(nbytes, 1)  # with the scan: cache-sized chunks
    got, bad = 0, False
    f.seek(begin)
    while got < nbytes:
        n = f.readinto(view[got:got + step])
        if not n:
            break
        if spec is not None and not bad:
            bad = _has_nonfinite(flat[got // flat.itemsize:(got + n) // flat.itemsize], spec)
        got += n
    if not bad:
        return got, -1
    return got, int(np.argmax(nonfinite_mask(flat[:got // flat.itemsize], tag)))
