"""Zero-copy DLPack views of memory the process does not own (the weight cache's client side).

On a CPU the same code path that views a CUDA IPC mapping views aligned host memory, so the
capsule layout, dtype codes, bounds checks, live-view counting and -- the reason the deleter is
C -- a clean interpreter exit with views still alive are all checked in CI.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from modelopt_jax.errors import WeightCacheError
from modelopt_jax.weight_cache.dlpack_view import DL_CPU, Views


def _aligned(nbytes: int) -> tuple[np.ndarray, int]:
    raw = np.empty(nbytes + 256, np.uint8)
    skip = (-raw.ctypes.data) % 256
    return raw[skip:skip + nbytes], raw.ctypes.data + skip


def _host_device_id() -> int:
    return jax.local_devices(backend="cpu")[0].local_hardware_id or 0


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16", "float32", "int32"])
def test_views_are_zero_copy_and_exact(dtype):
    rng = np.random.default_rng(abs(hash(dtype)) % 2**32)
    buf, base = _aligned(1 << 16)
    views = Views(base, buf.nbytes, device_type=DL_CPU, device_id=_host_device_id())
    want = rng.standard_normal((48, 40)).astype(np.float32) * 8
    want = want.astype(np.int32) if dtype == "int32" else want.astype(jax.numpy.dtype(dtype))
    offset = 4096
    buf[offset:offset + want.nbytes] = want.view(np.uint8).ravel()
    got = views.array(offset, dtype, want.shape)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.unsafe_buffer_pointer() == base + offset  # the view, not a copy
    assert np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    assert views.alive == 1
    del got
    gc.collect()
    assert views.alive == 0


def test_out_of_bounds_and_unsupported_dtypes_are_refused():
    buf, base = _aligned(4096)
    views = Views(base, buf.nbytes, device_type=DL_CPU, device_id=_host_device_id())
    with pytest.raises(WeightCacheError, match="does not fit the 4096-byte"):
        views.array(4000, "float32", (32,))
    with pytest.raises(WeightCacheError, match="does not fit"):
        views.array(-256, "uint8", (4,))
    with pytest.raises(WeightCacheError, match="cannot be viewed"):
        views.array(0, "complex64", (4,))
    assert views.alive == 0


def test_interpreter_exit_with_live_views_is_clean():
    # a Python DLPack deleter would run after finalization here and crash the process (SIGSEGV)
    code = textwrap.dedent("""
        import numpy as np
        from modelopt_jax.weight_cache.dlpack_view import DL_CPU, Views
        raw = np.zeros(1 << 14, np.uint8)
        base = raw.ctypes.data + (-raw.ctypes.data) % 256
        views = Views(base, 1 << 13, device_type=DL_CPU, device_id=0)
        kept = [views.array(i * 256, "float8_e4m3fn", (16, 16)) for i in range(8)]
        print("alive", views.alive)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "alive 8" in out.stdout


def _peer_closed(sock, wait: float = 0.0) -> bool:
    """Whether the other end of ``sock`` has been closed (EOF), waiting up to ``wait`` seconds."""
    sock.settimeout(wait)  # 0: non-blocking
    try:
        return sock.recv(1) == b""
    except (BlockingIOError, TimeoutError):
        return False


def test_lease_closes_when_the_last_view_dies():
    """The weight-cache client's lease on the daemon (its attach connection) is handed to Views and
    closed by the C deleter when no view is left, which tells a stopping daemon it may free its store."""
    import socket

    ours, daemons_end = socket.socketpair()
    buf, base = _aligned(1 << 14)
    views = Views(base, buf.nbytes, device_type=DL_CPU, device_id=_host_device_id(), lease_fd=ours.detach())
    kept = [views.array(i * 256, "bfloat16", (8, 8)) for i in range(3)]
    assert views.alive == 3 and views.lease_open
    del kept[:2]
    gc.collect()
    assert views.alive == 1 and views.lease_open and not _peer_closed(daemons_end)
    del kept
    gc.collect()
    assert views.alive == 0 and not views.lease_open
    assert _peer_closed(daemons_end, wait=5)
    views.close_lease()  # idempotent: the descriptor is not closed twice (it may be someone else's by now)
    with pytest.raises(WeightCacheError, match="attachment was released"):
        views.array(0, "bfloat16", (8, 8))  # the daemon may have freed the memory by now
    daemons_end.close()


def test_lease_closed_when_the_attachment_ends_without_views():
    import socket

    ours, daemons_end = socket.socketpair()
    buf, base = _aligned(4096)
    views = Views(base, buf.nbytes, device_type=DL_CPU, device_id=_host_device_id(), lease_fd=ours.detach())
    with pytest.raises(WeightCacheError, match="does not fit"):
        views.array(4000, "float32", (32,))
    assert views.lease_open  # a refused view never counted
    views.close_lease()
    assert not views.lease_open and _peer_closed(daemons_end, wait=5)
    daemons_end.close()
