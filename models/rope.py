"""Rotary position embeddings (default, linear and Llama-3 frequency scaling), as in HF transformers.

Inverse frequencies are computed once in numpy (they are static constants of the program); the
rotation runs in float32 and is cast back to the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.checkpoint import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies, with the configured scaling applied."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents, dtype=np.float32)).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope)
    return inv_freq.astype(np.float32)


def _llama3_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama-3.1's piecewise scaling: long wavelengths divided by ``factor``, short kept, smooth between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x`` [B, T, H, D] by ``positions`` [B, T] (HF's rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
