"""The KV cache: one preallocated key and value buffer per layer, a pytree that jit can donate.

Layout per layer: [batch, max_len, kv_heads, head_dim]. A sequence's token at position p lives at
index p of its own row, so sequences of different lengths share one cache without padding masks:
attention reads keys 0..p (causal), and slots past a sequence's length hold nothing it will read.

FP8 caches store float8_e4m3fn codes with per-layer static scales (ModelOpt's k_scale/v_scale):
code = e4m3(RNE(clamp(k / k_scale))) and the attention reads code * k_scale, bit-for-bit the
rounding the cache-less forward applies, so cached and uncached logits agree.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

FP8_NAMES = ("fp8", "fp8_e4m3", "float8_e4m3fn")
FLOAT_NAMES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


@dataclasses.dataclass
class KVCache:
    """Per-layer key/value buffers plus the static facts needed to read them."""

    keys: list[jax.Array]
    values: list[jax.Array]
    scales: tuple[tuple[float, float], ...] | None = None  # per layer (k_scale, v_scale) when FP8

    @property
    def is_fp8(self) -> bool:
        return self.scales is not None

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


jax.tree_util.register_dataclass(KVCache, data_fields=["keys", "values"], meta_fields=["scales"])


def resolve_cache_dtype(kv_cache_dtype: str, model) -> tuple[jnp.dtype, tuple[tuple[float, float], ...] | None]:
    """``"auto"`` is FP8 when the checkpoint has an FP8 KV cache (its scales), else the compute dtype.

    Forcing ``"fp8"`` on a checkpoint without k/v scales uses scale 1.0 (as vLLM does) and warns.
    """
    layers = model.layers
    checkpoint_scales = [layer.self_attn.kv_scales for layer in layers]
    has_scales = all(s is not None for s in checkpoint_scales)
    name = str(kv_cache_dtype).lower()
    if name == "auto":
        if has_scales:
            return jnp.dtype(jnp.float8_e4m3fn), tuple(checkpoint_scales)
        return jnp.dtype(model.dtype), None
    if name in FP8_NAMES:
        if not has_scales:
            warnings.warn("kv_cache_dtype='fp8' but the checkpoint has no k_scale/v_scale: using scale 1.0, "
                          "which can clip or lose precision", stacklevel=3)
            return jnp.dtype(jnp.float8_e4m3fn), tuple((1.0, 1.0) for _ in layers)
        return jnp.dtype(jnp.float8_e4m3fn), tuple(checkpoint_scales)
    if name in FLOAT_NAMES:
        return jnp.dtype(FLOAT_NAMES[name]), None
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} not supported; choose 'auto', 'fp8', "
                     f"{', '.join(map(repr, FLOAT_NAMES))}")


def init_cache(model, batch: int, max_len: int, kv_cache_dtype: str = "auto") -> KVCache:
    """A zeroed cache for ``batch`` sequences of up to ``max_len`` tokens (prompt + generated)."""
    cfg = model.config
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    dtype, scales = resolve_cache_dtype(kv_cache_dtype, model)
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    n = cfg.num_hidden_layers
    # A tensor-parallel model splits the cache by KV head, like its attention.
    sharding = model.cache_sharding() if hasattr(model, "cache_sharding") else None
    zeros = lambda: jnp.zeros(shape, dtype, device=sharding)  # noqa: E731
    return KVCache([zeros() for _ in range(n)], [zeros() for _ in range(n)], scales)
