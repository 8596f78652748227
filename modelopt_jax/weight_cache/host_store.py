"""All processed arrays of a model in one POSIX shared-memory segment.

Each array starts on a 64-byte boundary because XLA:CPU adopts a 64-byte aligned host buffer as
the device buffer without copying (a DLPack import, see :class:`Mapping`), so an attached client's
weights *are* the daemon's pages.

Who may unlink what, and why we do not use ``multiprocessing.shared_memory``:

- The daemon creates its segment under an unguessable name (uid, device, 64 random bits: never
  the pid, which repeats across PID namespaces) with ``O_CREAT|O_EXCL`` and mode 0600, reserves
  every page with ``posix_fallocate`` (a full ``/dev/shm`` is an error now, not a SIGBUS later),
  and unlinks only the segment it created in this very process.
- A client maps a segment only after ``fstat`` shows it is owned by the client's own uid and not
  group/world accessible, and never registers it with ``multiprocessing.resource_tracker``: a
  tracker that outlives a SIGKILLed client would otherwise unlink the daemon's segment.
- A segment left by a SIGKILLed daemon is named in its lock file and removed by whoever next
  holds that lock (:func:`remove_stale`), the flock being the proof that its creator is gone.
- Unlinking a segment while clients map it is safe (POSIX keeps the pages until the last
  ``munmap``), so a stopping daemon frees its segment at once (``free_waits_for_clients`` is
  False). Clients still hold a lease (their attach connection) until the last array viewing the
  segment is gone, so ``status`` counts them as on a GPU.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat

import _posixshmem
import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.checkpoint.safetensors_index import HOST_ALIGNMENT
from modelopt_jax.errors import WeightCacheError, WeightCachePermissionError
from modelopt_jax.weight_cache import dlpack_view
from modelopt_jax.weight_cache.layout import pack


def new_name(device: int) -> str:
    """``mojwc_<uid>_<device>_<16 hex digits>``: readable owner and device, unguessable suffix."""
    return f"mojwc_{os.getuid()}_{int(device)}_{secrets.token_hex(8)}"


class Segment:
    """The daemon's segment: created here, filled once, unlinked only by the process that created it."""

    free_waits_for_clients = False  # attached clients keep their mapping after the unlink (see above)

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = int(size)
        self._creator = os.getpid()
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
        except FileExistsError as e:
            raise WeightCacheError(f"shared memory /dev/shm/{name} already exists; refusing to reuse a segment "
                                   f"this process did not create") from e
        except OSError as e:
            raise WeightCacheError(f"cannot create shared memory /dev/shm/{name}: {e}") from e
        try:
            os.ftruncate(fd, self.size)
            try:  # reserve the pages now: on a full tmpfs a write would otherwise die by SIGBUS
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                free = _free_bytes("/dev/shm")
                raise WeightCacheError(
                    f"/dev/shm has {free if free is not None else 'too few'} bytes free but the weight cache needs "
                    f"{self.size}; enlarge it (docker run --shm-size={-(-self.size // (1 << 20)) + 64}m, or remount "
                    f"/dev/shm with a larger size=)") from e
            self._mmap = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        self.buf = memoryview(self._mmap)

    @property
    def fields(self) -> dict:
        return {"store": "host", "shm_name": self.name}

    @property
    def where(self) -> str:
        return f"shared memory {self.name}"

    def free(self) -> None:
        """Unlink the name (attached clients keep their mapping) and unmap if possible."""
        if os.getpid() == self._creator:  # a forked child never unlinks its parent's segment
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:  # a view is still referenced somewhere; the mapping goes with the process
            pass


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create(arrays: dict, name: str) -> tuple[Segment, dict]:
    """Copies ``arrays`` into a new segment; returns it and the index {name: {offset, dtype, shape}}."""
    arrays = {k: np.asarray(jax.device_get(a)) for k, a in arrays.items()}
    index, size = pack(arrays, HOST_ALIGNMENT)
    shm = Segment(name, max(size, HOST_ALIGNMENT))
    for key, a in arrays.items():
        view = _view(shm.buf, index[key])
        np.copyto(view, a, casting="no")
        del view
    return shm, index


def _view(buf, entry: dict) -> np.ndarray:
    dtype = jnp.dtype(entry["dtype"])
    shape = tuple(int(d) for d in entry["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buf, dtype=dtype, count=count, offset=int(entry["offset"])).reshape(shape)


def _open_checked(name: str) -> tuple[int, os.stat_result]:
    """Opens a segment for reading and writing after checking, on the open descriptor, that it is ours."""
    if not isinstance(name, str) or not name or "/" in name:
        raise WeightCacheError(f"weight-cache daemon named an invalid shared-memory segment {name!r}")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except OSError as e:
        raise WeightCacheError(f"cannot open weight-cache shared memory /dev/shm/{name}: {e}") from e
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular shared-memory object"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this process's uid {os.getuid()}"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}; a weight-cache segment must be 0600"
    if problem is not None:
        os.close(fd)
        raise WeightCachePermissionError(f"refusing to map /dev/shm/{name}: it {problem} (another user may have "
                                         f"planted it)")
    return fd, st


class Mapping:
    """A client's mapping of the daemon's segment, whose arrays are zero-copy DLPack views.

    DLPack, as on a GPU (:mod:`.dlpack_view`), rather than numpy views adopted by ``device_put``:
    its C deleter runs when XLA frees the last buffer viewing the segment, which is when the
    client's lease (``lease_fd``, the attach connection, taken over here) is closed; no Python
    object's lifetime says that reliably (JAX's caches keep models' static metadata, and stitching
    makes new array objects over the same buffers). The segment stays mapped while a view is alive,
    for the rest of the process if this object goes first.
    """

    def __init__(self, name: str, device_id: int, lease_fd: int = -1):
        try:
            fd, st = _open_checked(name)
            try:
                if st.st_size == 0:
                    raise WeightCacheError(f"weight-cache shared memory /dev/shm/{name} is empty")
                self._mmap = mmap.mmap(fd, st.st_size)
            finally:
                os.close(fd)
            self.name, self.size = name, st.st_size
            self.base = np.frombuffer(self._mmap, np.uint8).ctypes.data  # the temporary export ends here
            self.views = dlpack_view.Views(self.base, self.size, device_type=dlpack_view.DL_CPU, device_id=device_id,
                                           lease_fd=lease_fd)
        except BaseException:
            if lease_fd >= 0:
                os.close(lease_fd)
            raise

    def span(self) -> tuple[int, int]:
        """(address, bytes) of the mapping in this process."""
        return self.base, self.size

    def __del__(self):
        views = getattr(self, "views", None)
        if views is None:
            return
        if views.alive:  # XLA may still read it: never unmapped in this process
            dlpack_view.keep_forever(self._mmap)
            return
        views.close_lease()  # an attachment without arrays never had a view to end it
        self._mmap.close()


def attach(name: str, index: dict, device_id: int, lease_fd: int = -1) -> tuple[Mapping, dict[str, jax.Array]]:
    """Maps the daemon's segment and returns a zero-copy array on CPU device ``device_id`` (its
    ``local_hardware_id``) for every index entry, taking over ``lease_fd`` (see :class:`Mapping`)."""
    shm = Mapping(name, device_id, lease_fd)
    arrays = {}
    for key, entry in index.items():
        end = int(entry["offset"]) + int(entry["nbytes"])
        if int(entry["offset"]) < 0 or end > shm.size:
            raise WeightCacheError(f"weight-cache segment {name!r} is smaller ({shm.size}) than its index says")
        arrays[key] = shm.views.array(int(entry["offset"]), entry["dtype"], entry["shape"])
    return shm, arrays


def remove_stale(name: str) -> bool:
    """Unlinks the segment a dead daemon named in the lock file we now hold, if it is ours; True if removed."""
    try:
        fd, _ = _open_checked(name)
    except WeightCacheError:
        return False
    os.close(fd)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True
