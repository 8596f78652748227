"""Where daemons put their socket and lock file.

Per user, never shared: the directory is created 0700 and must be owned by the caller, so
another user can neither connect to nor replace a socket (SO_PEERCRED checks the peer too).
"""

from __future__ import annotations

import os
import stat
import tempfile

from modelopt_jax.errors import WeightCacheError

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


def ensure_private_dir(directory: str) -> str:
    """Creates ``directory`` 0700 (or checks an existing one is ours and not group/world accessible)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise WeightCacheError(f"{directory}: weight-cache directory is owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)
    return directory


def socket_path(directory: str, device: int) -> str:
    return os.path.join(directory, f"device-{int(device)}.sock")


def lock_path(directory: str, device: int) -> str:
    return os.path.join(directory, f"device-{int(device)}.lock")


def daemon_pid(directory: str, device: int) -> int | None:
    """The pid written in the lock file if that process is alive (a daemon loading or serving)."""
    try:
        with open(lock_path(directory, device)) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid
