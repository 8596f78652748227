"""Where daemons put their socket and lock file, and how either end checks them.

Per user, never shared: the directory is created 0700 and must be owned by the caller, so
another user can neither connect to nor replace a socket (SO_PEERCRED checks the peer too). The
client checks the same before connecting (:func:`check_private_dir`): the default directory may
be a predictable ``/tmp`` path that another user created first.

The lock file holds ``{"pid": ..., "segment": ...}`` as JSON. Whether a daemon is alive is asked
of the kernel (``flock``), never of the pid, which means nothing across PID namespaces.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile

from modelopt_jax.errors import WeightCacheError, WeightCachePermissionError

ENV_DIR = "MODELOPT_JAX_WEIGHT_CACHE_DIR"


def default_socket_dir() -> str:
    """$MODELOPT_JAX_WEIGHT_CACHE_DIR, else $XDG_RUNTIME_DIR/modelopt_jax-weight-cache, else /tmp/...-<uid>."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "modelopt_jax-weight-cache")
    return os.path.join(tempfile.gettempdir(), f"modelopt_jax-weight-cache-{os.getuid()}")


def resolve_dir(directory: str | os.PathLike | None) -> str:
    return os.path.abspath(os.fspath(directory) if directory is not None else default_socket_dir())


def os_error(e: OSError, what: str) -> WeightCacheError:
    """A typed error for a failed file-system step, with the usual causes spelled out."""
    hint = {errno.ENOSPC: " (no space or no free inodes on that file system)",
            errno.EDQUOT: " (disk quota exceeded)", errno.EROFS: " (read-only file system)",
            errno.EACCES: " (permission denied)", errno.ENAMETOOLONG: " (path too long for a Unix socket)"}
    return WeightCacheError(f"{what}: {e.strerror or e}{hint.get(e.errno, '')}")


def _check_stat(directory: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise WeightCachePermissionError(f"{directory}: weight-cache directory is not a directory (a symlink or "
                                         f"a file); refusing to use it")
    if st.st_uid != os.getuid():
        raise WeightCachePermissionError(
            f"{directory}: weight-cache directory is owned by uid {st.st_uid}, not {os.getuid()}; another user may "
            f"have created it first -- remove it or set {ENV_DIR} to a directory of your own")


def ensure_private_dir(directory: str) -> str:
    """Creates ``directory`` 0700 (or checks an existing one is ours, then makes it 0700)."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except OSError as e:
        raise os_error(e, f"cannot create the weight-cache directory {directory}") from e
    _check_stat(directory, st)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)
    return directory


def check_private_dir(directory: str) -> bool:
    """Client side: False if ``directory`` does not exist; raises unless it is ours and 0700."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise os_error(e, f"cannot inspect the weight-cache directory {directory}") from e
    _check_stat(directory, st)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise WeightCachePermissionError(
            f"{directory}: weight-cache directory has mode {stat.S_IMODE(st.st_mode):04o}, expected 0700 (others "
            f"could replace the socket); refusing to connect")
    return True


def socket_path(directory: str, device: int) -> str:
    return os.path.join(directory, f"device-{int(device)}.sock")


def lock_path(directory: str, device: int) -> str:
    return os.path.join(directory, f"device-{int(device)}.lock")


def read_lock_info(fd: int) -> dict:
    """The JSON a daemon wrote into its lock file ({} if empty or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode()) if data.strip() else {}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def write_lock_info(fd: int, info: dict) -> None:
    data = json.dumps(info).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def lock_holder(directory: str, device: int) -> dict | None:
    """The lock file's info while a daemon holds the lock (loading or serving), else None."""
    try:
        fd = os.open(lock_path(directory, device), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_lock_info(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def daemon_pid(directory: str, device: int) -> int | None:
    """The pid (in the daemon's PID namespace) of a daemon holding the lock, if any holds it."""
    info = lock_holder(directory, device)
    if info is None:
        return None
    pid = info.get("pid")
    return pid if isinstance(pid, int) else -1


@contextlib.contextmanager
def take_stale_lock(directory: str, device: int):
    """Yields the lock's info if no daemon holds the lock (we hold it meanwhile), else None."""
    try:
        fd = os.open(lock_path(directory, device), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        if os.fstat(fd).st_uid != os.getuid():
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield read_lock_info(fd)
    finally:
        os.close(fd)
