"""Numerical building blocks: FP8 quantization and the scaled FP8 GEMM."""

from modelopt_jax.ops.gemm import available_backends, check_backend, fp8_gemm, register_backend
from modelopt_jax.ops.quantize import (FP8_MAX, PER_TOKEN_MIN_SCALE, dequantize_blockwise, dequantize_static,
                                       fake_quantize_static,
                                       quantize_per_token, quantize_static)

__all__ = ["fp8_gemm", "register_backend", "available_backends", "check_backend", "quantize_static",
           "quantize_per_token", "fake_quantize_static", "dequantize_static", "dequantize_blockwise", "FP8_MAX",
           "PER_TOKEN_MIN_SCALE"]
