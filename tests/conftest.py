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
