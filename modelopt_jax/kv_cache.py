"""The KV cache: what it stores (:class:`KVCacheSpec`, decided once per model) and its buffers.

``kv_cache_dtype`` is resolved once, at load, into a :class:`KVCacheSpec` that the model keeps;
each attention layer keeps its :class:`LayerKVSpec`. The cached forward writes through
:meth:`KVBuffer.write` and reads through :meth:`KVBuffer.read`; the cache-less forward applies
:meth:`LayerKVSpec.round_trip`, which is the same quantize-then-dequantize, so the two paths see the
same key/value numbers whatever the spec says.

Layout per layer: [batch, max_len, kv_heads, head_dim]. A sequence's token at position p lives at
index p of its own row, so sequences of different lengths share one cache without padding masks:
attention reads keys 0..p (causal), and slots past a sequence's length hold nothing it will read.

FP8 caches store float8_e4m3fn codes with per-layer static scales (ModelOpt's k_scale/v_scale):
code = e4m3(RNE(clamp(k / k_scale))) and the attention reads code * k_scale.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from modelopt_jax.dtypes import COMPUTE_DTYPES, kv_cache_dtype_name
from modelopt_jax.ops.quantize import decode_stored, fake_quantize_static, quantize_static

FP8 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class LayerKVSpec:
    """One attention layer's cache: storage dtype and, for FP8, its static k/v scales."""

    dtype: str                     # storage dtype name
    k_scale: float | None = None   # FP8 only
    v_scale: float | None = None

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    def round_trip(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """k, v as the cache would give them back (the cache-less forward's view of the cache)."""
        if not self.is_fp8:
            return k, v
        return fake_quantize_static(k, self.k_scale), fake_quantize_static(v, self.v_scale)

    def buffers(self, shape, sharding=None) -> tuple["KVBuffer", "KVBuffer"]:
        zeros = lambda: jnp.zeros(shape, jnp.dtype(self.dtype), device=sharding)  # noqa: E731
        return KVBuffer(zeros(), self.k_scale), KVBuffer(zeros(), self.v_scale)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The model's KV cache, resolved once from ``kv_cache_dtype`` and the checkpoint's scales."""

    requested: str                                   # what was asked: "auto", "fp8", "bfloat16", ...
    layers: tuple[LayerKVSpec, ...]
    num_kv_heads: int = 0                            # KV heads per layer, over all devices
    head_dim: int = 0                                # per head

    def page_bytes(self, page_size: int) -> int:
        """Bytes one page of ``page_size`` tokens takes over all layers (keys and values, every KV
        head of every device): what the engine divides its memory budget by."""
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError("this KVCacheSpec was made without its geometry (num_kv_heads, head_dim)")
        return sum(2 * page_size * self.num_kv_heads * self.head_dim * jnp.dtype(s.dtype).itemsize
                   for s in self.layers)

    @property
    def dtype(self) -> str:
        return self.layers[0].dtype if self.layers else "float32"

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def scales(self) -> tuple[tuple[float, float], ...] | None:
        return tuple((s.k_scale, s.v_scale) for s in self.layers) if self.is_fp8 else None

    @staticmethod
    def resolve(kv_cache_dtype: str, checkpoint_scales: tuple[tuple[float, float], ...] | None, compute_dtype,
                num_layers: int, *, num_kv_heads: int = 0, head_dim: int = 0) -> "KVCacheSpec":
        """``"auto"``: FP8 when the checkpoint has an FP8 KV cache (its scales), else the compute dtype.

        ``"fp8"`` on a checkpoint without k/v scales uses scale 1.0 (as vLLM does) and warns, once,
        here; both forwards then round with scale 1.0.
        """
        name = kv_cache_dtype_name(kv_cache_dtype)
        if name == "auto":
            name = "fp8" if checkpoint_scales is not None else jnp.dtype(compute_dtype).name
        if name == "fp8":
            if checkpoint_scales is None:
                warnings.warn("kv_cache_dtype='fp8' but the checkpoint has no k_scale/v_scale: using scale 1.0, "
                              "which can clip or lose precision", stacklevel=3)
                checkpoint_scales = ((1.0, 1.0),) * num_layers
            layers = tuple(LayerKVSpec(FP8, float(k), float(v)) for k, v in checkpoint_scales)
        else:
            layers = (LayerKVSpec(jnp.dtype(COMPUTE_DTYPES[name]).name),) * num_layers
        return KVCacheSpec(str(kv_cache_dtype), layers, int(num_kv_heads), int(head_dim))


@dataclasses.dataclass
class KVBuffer:
    """One layer's keys (or values): the stored array plus the static scale to read FP8 codes with."""

    data: jax.Array               # [batch, max_len, kv_heads, head_dim]
    scale: float | None = None    # FP8 codes: value = code * scale

    def encode(self, x: jax.Array) -> jax.Array:
        """What is stored for values ``x``: FP8 codes (quantize on write) or the storage dtype."""
        return quantize_static(x, self.scale) if self.scale is not None else x.astype(self.data.dtype)

    def _decode(self, stored: jax.Array, dtype) -> jax.Array:
        """Values of stored entries in ``dtype`` (code * scale for FP8: dequantize on read)."""
        return decode_stored(stored, self.scale, dtype)

    def write(self, rows: jax.Array, positions: jax.Array, x: jax.Array) -> "KVBuffer":
        """``x`` [B, T, kv_heads, head_dim] stored at ``positions`` [B, T] of each row (quantized if FP8)."""
        return KVBuffer(self.data.at[rows, positions].set(self.encode(x)), self.scale)

    def read(self, dtype) -> jax.Array:
        return self._decode(self.data, dtype)

    # paged storage: ``data`` is [slots, kv_heads, head_dim], slot = page * page_size + offset;
    # a step's rows are written by modelopt_jax.ops.attention.paged_write_attention
    def with_data(self, data: jax.Array) -> "KVBuffer":
        """The same buffer (scale) over new stored ``data`` -- e.g. a pool an op wrote in place."""
        return KVBuffer(data, self.scale)

    # array-like views, for inspection
    @property
    def dtype(self):
        return self.data.dtype

    @property
    def shape(self):
        return self.data.shape

    @property
    def sharding(self):
        return self.data.sharding

    @property
    def addressable_shards(self):
        return self.data.addressable_shards

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


jax.tree_util.register_dataclass(KVBuffer, data_fields=["data"], meta_fields=["scale"])


@dataclasses.dataclass
class KVCache:
    """Per-layer key and value buffers; a pytree that jit can donate."""

    keys: list[KVBuffer]
    values: list[KVBuffer]

    @property
    def is_fp8(self) -> bool:
        return self.keys[0].scale is not None

    @property
    def scales(self) -> tuple[tuple[float, float], ...] | None:
        return tuple((k.scale, v.scale) for k, v in zip(self.keys, self.values)) if self.is_fp8 else None

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


jax.tree_util.register_dataclass(KVCache, data_fields=["keys", "values"], meta_fields=[])


@dataclasses.dataclass
class PagedKVCache:
    """Per-layer pools of fixed-size pages shared by all sequences (the generation engine's cache).

    Each layer's keys and values are one :class:`KVBuffer` of [num_pages * page_size, kv_heads,
    head_dim]: token position p of a sequence lives at slot ``block_table[p // page_size] *
    page_size + p % page_size``. Page 0 is the scratch page: padding tokens write there and no
    sequence ever owns it. Which pages a sequence owns is the engine's bookkeeping, not the cache's.
    """

    keys: list[KVBuffer]
    values: list[KVBuffer]
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[0] // self.page_size

    @property
    def is_fp8(self) -> bool:
        return self.keys[0].scale is not None

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["keys", "values"], meta_fields=["page_size"])


def init_cache(model, batch: int, max_len: int) -> KVCache:
    """A zeroed cache for ``batch`` sequences of up to ``max_len`` tokens: ``model.init_cache``.

    What it stores (bf16 or FP8 codes) was decided when the model was loaded
    (``load(..., kv_cache_dtype=...)``, ``LLM(..., kv_cache_dtype=...)``).
    """
    return model.init_cache(batch, max_len)
