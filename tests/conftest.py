"""Shared test settings: where the ModelOpt fixtures live, and GPU-test skipping.

Fixtures are test data only (the package never reads them). ``MODELOPT_JAX_FIXTURES`` overrides
the default location ``../shared/fixtures`` relative to the repository root.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = pathlib.Path(os.environ.get("MODELOPT_JAX_FIXTURES", REPO.parent / "shared" / "fixtures"))
MODELOPT = FIXTURES / "modelopt"
TRAINED = FIXTURES / "modelopt-trained"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # test helpers (numpy_reference)


def fixture_dir(name: str) -> pathlib.Path:
    """A fixture checkpoint directory by name (modelopt/ or modelopt-trained/)."""
    for base in (MODELOPT, TRAINED):
        if (base / name).is_dir():
            return base / name
    pytest.skip(f"fixture {name} not found under {FIXTURES}")


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
