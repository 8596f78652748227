"""Run NVIDIA ModelOpt FP8 checkpoints natively in JAX/Flax NNX.

    import modelopt_jax
    model = modelopt_jax.load("path/to/modelopt-fp8-checkpoint", dtype="bfloat16")
    logits = model(input_ids)  # int32 [B, T] -> float32 [B, T, vocab]
"""

from modelopt_jax import errors
from modelopt_jax.demo import demo_checkpoint_path
from modelopt_jax.loader import load
from modelopt_jax.ops import fp8_gemm

__version__ = "0.1.0"

__all__ = ["load", "errors", "fp8_gemm", "demo_checkpoint_path", "__version__"]
