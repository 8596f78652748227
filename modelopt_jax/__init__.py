"""Run NVIDIA ModelOpt FP8 checkpoints natively in JAX/Flax NNX.

    import modelopt_jax
    model = modelopt_jax.load("path/to/modelopt-fp8-checkpoint", dtype="bfloat16")
    logits = model(input_ids)  # int32 [B, T] -> float32 [B, T, vocab]
"""

import os as _os

# In an installed wheel, `models/` is the subpackage modelopt_jax/models (pyproject.toml maps it).
# In a source checkout run in place (PYTHONPATH=., Bazel runfiles, the GPU test machine), it sits
# beside this package at the repository root: make that same directory importable under the same
# name, so `import modelopt_jax.models` works both ways and nothing else changes.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "models")) and _os.path.isfile(
        _os.path.join(_root, "models", "__init__.py")):
    __path__.append(_root)

from modelopt_jax import errors  # noqa: E402
from modelopt_jax.demo import demo_checkpoint_path  # noqa: E402
from modelopt_jax.generation import make_cached_forward  # noqa: E402
from modelopt_jax.kv_cache import KVCache, init_cache  # noqa: E402
from modelopt_jax.llm import LLM, RequestOutput  # noqa: E402
from modelopt_jax.loader import WeightCacheOptions, load  # noqa: E402
from modelopt_jax import parallel  # noqa: E402,F401  (make_mesh after a plain `import modelopt_jax`)
from modelopt_jax.ops import fp8_gemm  # noqa: E402
from modelopt_jax.sampling import SamplingParams  # noqa: E402

from modelopt_jax._version import __version__  # noqa: E402

__all__ = ["load", "WeightCacheOptions", "LLM", "SamplingParams", "RequestOutput", "make_cached_forward", "init_cache", "KVCache",
           "errors", "fp8_gemm", "demo_checkpoint_path", "__version__"]
