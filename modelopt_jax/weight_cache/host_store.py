"""All processed arrays of a model in one POSIX shared-memory segment.

Each array starts on a 64-byte boundary because XLA:CPU adopts a 64-byte aligned host buffer as
the device buffer without copying (``jax.device_put``), so an attached client's weights *are*
the daemon's pages. The segment is created by the daemon, which alone unlinks it; clients must
unregister it from multiprocessing's resource_tracker, which would otherwise unlink the daemon's
segment when the client exits, and must keep the ``SharedMemory`` object alive as long as the
arrays (the model holds it).
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.checkpoint.safetensors_index import HOST_ALIGNMENT
from modelopt_jax.errors import WeightCacheError
from modelopt_jax.weight_cache.layout import pack


class Segment(shared_memory.SharedMemory):
    """The daemon's segment: what clients are told (:attr:`fields`) and how it is freed."""

    @property
    def fields(self) -> dict:
        return {"store": "host", "shm_name": self.name}

    @property
    def where(self) -> str:
        return f"shared memory {self.name}"

    def free(self) -> None:
        """Unlink the name (attached clients keep their mapping) and unmap if possible."""
        try:
            self.unlink()
        except FileNotFoundError:
            pass
        try:
            self.close()
        except BufferError:  # a view is still referenced somewhere; the mapping goes with the process
            pass


def create(arrays: dict, name: str) -> tuple[Segment, dict]:
    """Copies ``arrays`` into a new segment; returns it and the index {name: {offset, dtype, shape}}."""
    arrays = {k: np.asarray(jax.device_get(a)) for k, a in arrays.items()}
    index, size = pack(arrays, HOST_ALIGNMENT)
    try:
        shm = Segment(name=name, create=True, size=max(size, HOST_ALIGNMENT))
    except FileExistsError:  # a stale segment of a killed daemon with our pid: replace it
        old = shared_memory.SharedMemory(name=name)
        old.close()
        old.unlink()
        shm = Segment(name=name, create=True, size=max(size, HOST_ALIGNMENT))
    for key, a in arrays.items():
        view = _view(shm, index[key])
        np.copyto(view, a, casting="no")
        del view
    return shm, index


def _view(shm: shared_memory.SharedMemory, entry: dict) -> np.ndarray:
    dtype = jnp.dtype(entry["dtype"])
    shape = tuple(int(d) for d in entry["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(shm.buf, dtype=dtype, count=count, offset=int(entry["offset"])).reshape(shape)


class _Mapping(shared_memory.SharedMemory):
    """A client's mapping: never unlinks, and stays mapped while device arrays still view it."""

    def span(self) -> tuple[int, int]:
        """(address, bytes) of the mapping in this process."""
        return np.frombuffer(self.buf, np.uint8).ctypes.data, self.size

    def __del__(self):
        try:
            self.close()
        except (BufferError, OSError):  # arrays still alive at interpreter exit: the OS unmaps
            pass


def attach(name: str, index: dict) -> tuple[shared_memory.SharedMemory, dict[str, np.ndarray]]:
    """Maps the daemon's segment (read side) and returns views of every array, without copying."""
    try:
        shm = _Mapping(name=name)
    except (FileNotFoundError, OSError) as e:
        raise WeightCacheError(f"cannot map weight-cache shared memory {name!r}: {e}") from e
    try:  # the daemon owns the segment; our tracker must not unlink it when we exit
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # pragma: no cover - tracker internals differ between versions
        pass
    views = {}
    for key, entry in index.items():
        end = int(entry["offset"]) + int(entry["nbytes"])
        if end > shm.size:
            raise WeightCacheError(f"weight-cache segment {name!r} is smaller ({shm.size}) than its index says")
        views[key] = _view(shm, entry)
    return shm, views
