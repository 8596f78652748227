"""pytest hooks: make test helpers importable and skip GPU tests where there is no CUDA device."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# Tensor-parallel tests need several devices; on CPU, XLA can split the host into virtual ones.
# This must happen before jax initialises its backends (i.e. before any test module runs).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # fixture_paths, numpy_reference


def _has_cuda() -> bool:
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["native", "numpy"])
def scan_path(request, monkeypatch):
    """Runs a test once through the loader's native NaN/inf scan and once through its numpy fallback
    (what a machine without the CPU library runs); the native run fails on a stale library."""
    from modelopt_jax.checkpoint import finite_scan
    from modelopt_jax.ops import native

    if request.param == "native":
        if native.cpu_library() is None:
            pytest.skip(f"{native.CPU_LIB} is not built here")
        assert finite_scan.native_available(), f"{native.CPU_LIB} lacks ModeloptJaxReadScan: rebuild it"
    else:
        monkeypatch.setattr(finite_scan, "_native", lambda: None)
    return request.param


def _weight_cache_leaks(started_before: int) -> list[str]:
    """Removes and returns the /dev/shm segments of weight-cache daemons started since
    ``started_before`` that have exited and left their segment behind."""
    import weight_cache_helpers

    leaked = []
    for daemon in weight_cache_helpers.STARTED[started_before:]:
        for name in daemon.leftovers():
            leaked.append(name)
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
    return leaked


@pytest.fixture(autouse=True, scope="module")
def _no_weight_cache_segment_outlives_its_module():
    import weight_cache_helpers

    before = len(weight_cache_helpers.STARTED)
    yield
    leaked = _weight_cache_leaks(before)
    assert not leaked, f"weight-cache daemons of this module left shared memory behind: {leaked}"


@pytest.fixture(autouse=True)
def _no_weight_cache_segment_outlives_its_test():
    """A test that starts a weight-cache daemon and ends it (stop, SIGTERM, or SIGKILL followed by
    ``weight-cache stop``, as a user would clean up) leaves no /dev/shm segment behind; one that
    does fails, and the segment is removed."""
    import weight_cache_helpers

    before = len(weight_cache_helpers.STARTED)
    yield
    leaked = _weight_cache_leaks(before)
    assert not leaked, f"this test left weight-cache shared memory behind: {leaked}"
