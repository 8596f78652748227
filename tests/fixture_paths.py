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


# The package ships the checkpoint of this fixture (its demo); the fixture adds ModelOpt's reference
# logits and greedy references next to it.
PACKAGED = {"qwen2-bytes-fp8"}


class _PackagedFixture(type(pathlib.Path())):
    """The packaged copy of a fixture: a file only the full fixture has skips the test that asks for it."""

    def __truediv__(self, key):
        path = super().__truediv__(key)
        if not path.exists():
            pytest.skip(f"{key} is only in the full fixture (not found under {FIXTURES})")
        return path


def fixture_dir(name: str) -> pathlib.Path:
    """A fixture checkpoint directory by name (from modelopt/ or modelopt-trained/); skips if absent.

    Without ../shared, the fixture the package ships (``qwen2-bytes-fp8``, the demo) comes from the
    package, so the tests of that checkpoint still run on a fresh machine.
    """
    for base in (MODELOPT, TRAINED):
        if (base / name).is_dir():
            return base / name
    if name in PACKAGED:
        from modelopt_jax.demo import demo_checkpoint_path

        return _PackagedFixture(demo_checkpoint_path())
    pytest.skip(f"fixture {name} not found under {FIXTURES}")
