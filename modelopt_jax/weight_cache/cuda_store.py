"""All processed arrays of a model in one daemon-owned CUDA allocation, shared over CUDA IPC.

Daemon side (:func:`create`): one ``cuMemAlloc`` holds every array at 256-byte aligned offsets,
filled device-to-device from the arrays the ordinary loader produced; one ``cuIpcGetMemHandle``
exports it. One allocation rather than one per array because opening an IPC handle costs about a
millisecond and a model has hundreds of arrays, and because XLA's own buffers live inside its
allocator's pool (an IPC handle names a whole allocation, not a pointer into one).

Client side (:func:`attach`): ``cuIpcOpenMemHandle`` maps the allocation once; every array is a
zero-copy DLPack view into it (:mod:`.dlpack_view`), so an attached client spends no device memory
on weights. The mapping is closed when the model and every view are gone.

Lifetime: CUDA does not document what an importer sees once the exporter frees an allocation it
has mapped, so the daemon never does that while a client may still read it. Each client keeps
its attach connection open as a lease (:mod:`.daemon`); the C DLPack deleter closes it when the
client's last view dies (or the process ends), and a stopping daemon frees the allocation only
after the last lease has closed (:attr:`Slab.free_waits_for_clients`).

Both sides use the device's primary context, which is the one XLA uses, through cuda-bindings.
"""

from __future__ import annotations

import ctypes
import logging
import os

import jax
import numpy as np

from modelopt_jax.errors import WeightCacheError

log = logging.getLogger(__name__)
GPU_ALIGNMENT = 256


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise WeightCacheError("the weight cache on a CUDA GPU needs cuda-bindings "
                               "(pip install 'modelopt_jax[cuda]' or pip install cuda-bindings)") from e
    return driver


def _call(what: str, result):
    """cuda-bindings returns (CUresult, *values); raise on failure, return the values."""
    driver = _driver()
    err, values = result[0], result[1:]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else name
        raise WeightCacheError(f"{what} failed: {name}")
    return values[0] if len(values) == 1 else values


def cuda_device(device: int):
    """The JAX GPU device with local index ``device`` (a clear error if there is none)."""
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        gpus = []
    if not 0 <= device < len(gpus):
        raise WeightCacheError(f"weight-cache device {device} does not exist ({len(gpus)} local CUDA devices)")
    return gpus[device]


class _Context:
    """Makes ``ordinal``'s primary context current for the duration of a ``with`` block."""

    def __init__(self, ordinal: int):
        driver = _driver()
        _call("cuInit", driver.cuInit(0))
        self.device = _call("cuDeviceGet", driver.cuDeviceGet(int(ordinal)))
        self.ctx = _call("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(self.device))

    def __enter__(self):
        _call("cuCtxPushCurrent", _driver().cuCtxPushCurrent(self.ctx))
        return self

    def __exit__(self, *exc):
        _call("cuCtxPopCurrent", _driver().cuCtxPopCurrent())


def device_uuid(ordinal: int) -> str:
    """The GPU's UUID (part of the fingerprint: a cache only serves the GPU that holds it)."""
    driver = _driver()
    _call("cuInit", driver.cuInit(0))
    dev = _call("cuDeviceGet", driver.cuDeviceGet(int(ordinal)))
    uuid = _call("cuDeviceGetUuid", driver.cuDeviceGetUuid(dev))
    raw = bytes(uuid.bytes) if not isinstance(uuid.bytes, str) else uuid.bytes.encode("latin-1")
    return "GPU-" + raw.hex()


def _handle_bytes(handle) -> bytes:
    return ctypes.string_at(handle.getPtr(), 64)


def _handle_from_bytes(raw: bytes):
    handle = _driver().CUipcMemHandle()
    if len(raw) != 64:
        raise WeightCacheError(f"CUDA IPC handle has {len(raw)} bytes, expected 64")
    ctypes.memmove(handle.getPtr(), raw, 64)
    return handle


class Slab:
    """The daemon's allocation: freed by :meth:`free` (clean shutdown) or with the process."""

    free_waits_for_clients = True  # see the module docstring: no cuMemFree under a client's mapping

    def __init__(self, ordinal: int, nbytes: int):
        self.ordinal, self.nbytes = int(ordinal), int(nbytes)
        self.context = _Context(ordinal)
        with self.context:
            self.ptr = int(_call(f"cuMemAlloc({nbytes})", _driver().cuMemAlloc(max(self.nbytes, GPU_ALIGNMENT))))
            self.handle = _handle_bytes(_call("cuIpcGetMemHandle", _driver().cuIpcGetMemHandle(self.ptr)))

    @property
    def fields(self) -> dict:
        """What a client needs to map it."""
        return {"store": "cuda", "ipc_handle": self.handle.hex(), "alloc_bytes": self.nbytes, "ordinal": self.ordinal}

    @property
    def where(self) -> str:
        return f"CUDA allocation on device ordinal {self.ordinal}"

    def free(self) -> None:
        if self.ptr:
            with self.context:
                _call("cuMemFree", _driver().cuMemFree(self.ptr))
            self.ptr = 0


def create(arrays: dict, ordinal: int) -> tuple[Slab, dict]:
    """Copies ``arrays`` (device or host) into a new :class:`Slab`; returns it and the index."""
    from modelopt_jax.weight_cache.layout import pack

    driver = _driver()
    index, offset = pack(arrays, GPU_ALIGNMENT)
    device = _device_of(ordinal)
    slab = Slab(ordinal, offset)
    try:
        with slab.context:
            for key, a in arrays.items():
                dst, n = slab.ptr + index[key]["offset"], index[key]["nbytes"]
                if n == 0:
                    continue
                if isinstance(a, jax.Array) and a.devices() == {device}:
                    a.block_until_ready()
                    _call(f"copy of {key}", driver.cuMemcpyDtoD(dst, a.unsafe_buffer_pointer(), n))
                else:
                    host = np.ascontiguousarray(np.asarray(jax.device_get(a)))
                    _call(f"upload of {key}", driver.cuMemcpyHtoD(dst, host.ctypes.data, n))
            _call("cuCtxSynchronize", driver.cuCtxSynchronize())
    except BaseException:
        slab.free()
        raise
    return slab, index


def _device_of(ordinal: int):
    for d in jax.local_devices(backend="gpu"):
        if d.local_hardware_id == ordinal:
            return d
    return None


class Mapping:
    """A client's view of the daemon's allocation; closes the IPC mapping once no array views it.

    Takes over ``lease_fd`` (the attach connection): closed when the last view dies, when the
    mapping closes, or right away if mapping fails.
    """

    def __init__(self, handle: bytes, nbytes: int, ordinal: int, lease_fd: int = -1):
        from modelopt_jax.weight_cache.dlpack_view import Views

        self.base = 0
        try:
            self.ordinal = int(ordinal)
            self.context = _Context(ordinal)
            with self.context:
                self.base = int(_call("cuIpcOpenMemHandle", _driver().cuIpcOpenMemHandle(
                    _handle_from_bytes(handle), _driver().CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)))
            self.views = Views(self.base, nbytes, device_id=self.ordinal, lease_fd=lease_fd)
        except BaseException:
            if lease_fd >= 0:
                os.close(lease_fd)
            if self.base:
                with self.context:
                    _driver().cuIpcCloseMemHandle(self.base)
            raise

    def span(self) -> tuple[int, int]:
        """(address, bytes) of the mapping in this process."""
        return self.base, self.views.nbytes

    def close_if_unused(self) -> bool:
        if self.base and self.views.alive == 0:
            with self.context:
                _call("cuIpcCloseMemHandle", _driver().cuIpcCloseMemHandle(self.base))
            self.base = 0
            self.views.close_lease()  # an attachment without arrays never had a view to end it
        return self.base == 0

    def __del__(self):
        try:
            self.close_if_unused()
        except Exception:  # at interpreter exit the driver may already be gone; the OS unmaps
            pass


def attach(handle_hex: str, nbytes: int, index: dict, ordinal: int,
           lease_fd: int = -1) -> tuple[Mapping, dict[str, jax.Array]]:
    """Maps the daemon's allocation and returns zero-copy arrays for every index entry (taking over
    ``lease_fd``, see :class:`Mapping`)."""
    try:
        handle = bytes.fromhex(handle_hex)
    except (TypeError, ValueError) as e:
        if lease_fd >= 0:
            os.close(lease_fd)
        raise WeightCacheError(f"weight-cache daemon sent a malformed CUDA IPC handle: {e}") from e
    mapping = Mapping(handle, nbytes, ordinal, lease_fd)
    arrays = {}
    for key, entry in index.items():
        arrays[key] = mapping.views.array(int(entry["offset"]), entry["dtype"], entry["shape"])
    return mapping, arrays
