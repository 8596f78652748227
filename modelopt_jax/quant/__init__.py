"""Quantization schemes: how each ModelOpt format is read, fused and run."""

from modelopt_jax.quant.schemes import SCHEMES, LinearScheme, ShardTensors

__all__ = ["SCHEMES", "LinearScheme", "ShardTensors"]
