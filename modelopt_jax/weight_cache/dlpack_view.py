"""Zero-copy ``jax.Array`` views of device memory this process does not own, through DLPack.

The weight-cache client maps the daemon's CUDA allocation with ``cuIpcOpenMemHandle`` and must
turn each processed tensor inside it into a ``jax.Array`` without copying. JAX's own entry for
that is ``jax.dlpack.from_dlpack(..., copy=False)``, which adopts the pointer as the buffer and
calls the DLPack deleter when the buffer dies. We build the (legacy, ``"dltensor"``) DLPack
capsule ourselves because no installed producer speaks float8_e4m3fn (CuPy does not).

Lifetime, and why it is built this way: the deleter is the C function ``ModeloptJaxDlpackRelease``
from our always-built CPU library, not a Python callback, because XLA frees buffers that outlive
the interpreter after Python has finalized and a Python callback there crashes the process. It
decrements a live-view count; :class:`Views` closes the IPC mapping only when the count is zero.
When the count drops to zero the deleter also closes the client's lease on the daemon (the attach
connection, whose end tells a stopping daemon that this client no longer views its allocation).
The structs and the count are kept alive for the whole process (a few hundred bytes per attach),
since XLA may read them after every Python reference is gone.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.errors import WeightCacheError

DL_CPU, DL_CUDA = 1, 2
# DLPack (1.1) type codes: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6, kDLFloat8_e4m3fn 10.
_DL_TYPES = {
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
    "bfloat16": (4, 16), "bool": (6, 8), "float8_e4m3fn": (10, 8),
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _ViewLease(ctypes.Structure):
    """manager_ctx of every view: ``ViewLease`` in ffi/dlpack_release.cc."""

    _fields_ = [("live", ctypes.c_int64), ("fd", ctypes.c_int32)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


# A private prototype: ctypes.pythonapi.PyCapsule_New is shared, and other libraries set its argtypes.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))

_KEEP_FOREVER: list = []  # see the module docstring: XLA may touch these after Python is gone
_KEEP_LOCK = threading.Lock()
ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", ctypes.pythonapi))(_KEEP_FOREVER)  # survives the clearing of module globals at exit


def keep_forever(obj) -> None:
    """Keeps ``obj`` (e.g. a mapping that views still read) alive until the process ends."""
    with _KEEP_LOCK:
        _KEEP_FOREVER.append(obj)


def _native_lib() -> ctypes.CDLL:
    from modelopt_jax.ops import native

    lib = native.cpu_library()
    if lib is None or not hasattr(lib, "ModeloptJaxDlpackRelease"):
        raise WeightCacheError(f"{native.CPU_LIB} with ModeloptJaxDlpackRelease was not found (rebuild/reinstall "
                               f"modelopt_jax); it is needed to view the weight cache's device memory")
    if not hasattr(lib, "ModeloptJaxLeaseClose"):
        raise WeightCacheError(f"{lib._name} predates weight-cache leases (no ModeloptJaxLeaseClose); rebuild/reinstall "
                               f"modelopt_jax")
    lib.ModeloptJaxCounterAdd.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.ModeloptJaxCounterAdd.restype = None
    lib.ModeloptJaxLeaseClose.argtypes = [ctypes.c_void_p]
    lib.ModeloptJaxLeaseClose.restype = None
    return lib


class _Producer:
    """The two methods ``jax.dlpack.from_dlpack`` asks of an external array."""

    def __init__(self, capsule, device_type: int, device_id: int):
        self.capsule, self.device = capsule, (device_type, device_id)

    def __dlpack__(self, stream=None, **_):  # the data is complete before we hand it out: no stream to wait on
        return self.capsule

    def __dlpack_device__(self):
        return self.device


class Views:
    """Zero-copy arrays over ``[base, base + nbytes)`` on one device; counts the arrays still alive.

    ``lease_fd``: a file descriptor this object takes over (the client's attach connection), closed
    by the C deleter as soon as no view is alive any more, or by :meth:`close_lease`.
    """

    def __init__(self, base: int, nbytes: int, *, device_type: int = DL_CUDA, device_id: int = 0,
                 lease_fd: int = -1):
        self.base, self.nbytes = int(base), int(nbytes)
        self.device_type, self.device_id = device_type, int(device_id)
        self._lib = _native_lib()
        self.lease = _ViewLease(0, int(lease_fd))
        self._leased = lease_fd >= 0
        with _KEEP_LOCK:
            _KEEP_FOREVER.append(self.lease)
        self._release = ctypes.cast(self._lib.ModeloptJaxDlpackRelease, ctypes.c_void_p).value

    @property
    def alive(self) -> int:
        return self.lease.live

    @property
    def lease_open(self) -> bool:
        return self.lease.fd >= 0

    def close_lease(self, _addressof=ctypes.addressof) -> None:
        """Ends the lease now (idempotent; atomic with respect to the deleter's close). ``addressof`` is
        bound at definition: a mapping finalised at interpreter exit runs after module globals are
        cleared (``ctypes`` is then None)."""
        self._lib.ModeloptJaxLeaseClose(_addressof(self.lease))

    def array(self, offset: int, dtype, shape) -> jax.Array:
        name = jnp.dtype(dtype).name
        if self._leased and not self.lease_open:  # the daemon may have freed the memory since
            raise WeightCacheError("this weight-cache attachment was released (every view of it died); attach again")
        if name not in _DL_TYPES:
            raise WeightCacheError(f"dtype {name} cannot be viewed through DLPack")
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            raise WeightCacheError(f"a {name}{list(shape)} view at offset {offset} does not fit the "
                                   f"{self.nbytes}-byte weight-cache allocation")
        code, bits = _DL_TYPES[name]
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self.base + int(offset)
        managed.dl_tensor.device = _DLDevice(self.device_type, self.device_id)
        managed.dl_tensor.ndim = len(shape)
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
        managed.manager_ctx = ctypes.addressof(self.lease)
        managed.deleter = self._release
        with _KEEP_LOCK:
            _KEEP_FOREVER.append((managed, dims))
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        counter = ctypes.addressof(self.lease)
        self._lib.ModeloptJaxCounterAdd(counter, 1)  # before the import: the buffer may die at any time after it
        try:
            out = jax.dlpack.from_dlpack(_Producer(capsule, self.device_type, self.device_id), copy=False)
        except Exception as e:
            self._lib.ModeloptJaxCounterAdd(counter, -1)
            raise WeightCacheError(f"JAX refused a zero-copy view of the weight cache ({name}{list(shape)}): {e}") from e
        if out.dtype != jnp.dtype(dtype) or out.shape != shape:
            raise WeightCacheError(f"DLPack view came back as {out.dtype}{list(out.shape)}, expected {name}{list(shape)}")
        return out
