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
