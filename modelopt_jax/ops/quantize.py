"""FP8 (e4m3fn) activation quantization with ModelOpt's exact rounding rules.

All math is float32 whatever the compute dtype: ModelOpt's reference quantizes in float32, and a
bf16 multiply before rounding would move values across FP8 code boundaries. Values are clamped to
±448 first because XLA's float->e4m3fn conversion turns out-of-range values into NaN instead of
saturating; the conversion itself rounds to nearest, ties to even.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
# ModelOpt / vLLM floor for dynamic per-token scales, so an all-zero row does not divide by zero.
PER_TOKEN_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def reciprocal(scale: float) -> float:
    """1/scale rounded to float32, the multiplier ModelOpt applies for static scales."""
    return float(np.float32(1.0) / np.float32(scale))


def quantize_static(x: jnp.ndarray, scale: float) -> jnp.ndarray:
    """x_q = e4m3(RNE(clamp(x * (1/scale), -448, 448))) with a static per-tensor ``scale``."""
    x32 = x.astype(jnp.float32) * np.float32(reciprocal(scale))
    return jnp.clip(x32, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_per_token(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Dynamic per-row quantization over the last axis.

    Returns ``(x_q, s)`` with ``s = max(amax_row / 448, 1/(448*512))`` of shape ``x.shape[:-1]``
    (float32) and ``x_q = e4m3(clamp(x / s))``.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.maximum(amax / np.float32(FP8_MAX), np.float32(PER_TOKEN_MIN_SCALE))
    x_q = jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return x_q, scale[..., 0]


def dequantize_static(codes: jnp.ndarray, scale: float, dtype) -> jnp.ndarray:
    """``codes * scale`` in float32, cast to ``dtype`` (how an FP8 KV cache is read back)."""
    return (codes.astype(jnp.float32) * np.float32(scale)).astype(dtype)


def decode_stored(stored: jnp.ndarray, scale: float | None, dtype) -> jnp.ndarray:
    """Values of a KV cache's stored entries in ``dtype``: FP8 codes (``scale`` given) dequantized,
    anything else cast."""
    return dequantize_static(stored, scale, dtype) if scale is not None else stored.astype(dtype)


def fake_quantize_static(x: jnp.ndarray, scale: float) -> jnp.ndarray:
    """Round ``x`` to the FP8 grid of ``scale`` and back (used for FP8 KV cache values).

    Exactly :func:`quantize_static` then :func:`dequantize_static`, the pair the cached path uses,
    so cache-less and cached attention see the same key/value numbers.
    """
    return dequantize_static(quantize_static(x, scale), scale, x.dtype)


def dequantize_blockwise(w_q: jnp.ndarray, block_scales: np.ndarray, block: int = 128) -> jnp.ndarray:
    """float32 ``w_q * scale`` with one scale per ``block x block`` tile (edge tiles may be partial).

    The scale grid stays small ([N/block, K/block]) and is broadcast over a padded 4-D view, so the
    compiled program never carries an [N, K] constant.
    """
    n, k = w_q.shape
    scales = np.asarray(block_scales, np.float32)
    nb, kb = scales.shape
    w = jnp.pad(w_q.astype(jnp.float32), ((0, nb * block - n), (0, kb * block - k)))
    w = w.reshape(nb, block, kb, block) * scales[:, None, :, None]
    return w.reshape(nb * block, kb * block)[:n, :k]
