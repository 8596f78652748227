"""Where the ModelOpt fixtures live (test data only; the package never reads them).

``MODELOPT_JAX_FIXTURES`` overrides the default ``../shared/fixtures`` relative to the repository.
"""

from __future__ import annotations

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = pathlib.Path(os.environ.get("MODELOPT_JAX_FIXTURES", REPO.parent / "shared" / "fixtures"))
MODELOPT = FIXTURES / "modelopt"
TRAINED = FIXTURES / "modelopt-trained"
FP8_FIXTURES = ["llama-tiny-fp8", "llama-tiny-fp8-kv", "llama-tiny-fp8-pc-pt", "qwen2-tiny-fp8",
                "qwen2-tiny-fp8-kv", "qwen2-tiny-fp8-pb-wo", "qwen2-tiny-fp8-pc-pt", "qwen2-bytes-fp8",
                "qwen2-bytes-fp8-kv", "qwen2-bytes-fp8-pc-pt"]


def fixture_dir(name: str) -> pathlib.Path:
    """A fixture checkpoint directory by name (from modelopt/ or modelopt-trained/); skips if absent."""
    for base in (MODELOPT, TRAINED):
        if (base / name).is_dir():
            return base / name
    pytest.skip(f"fixture {name} not found under {FIXTURES}")
