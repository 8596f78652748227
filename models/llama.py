"""Llama-family decoder (Llama-2/3, Qwen2) as Flax NNX modules.

Modules receive their already-built dense layers (FP8 or not) instead of creating parameters, so
the architecture knows nothing about quantization and the loader can stream weights in one at a
time. q/k/v and gate/up are fused into one layer each (one GEMM each); Qwen2 differs from Llama
only by its q/k/v bias, which the config carries.

``model(input_ids)`` is the cache-less forward: logits for every position with a causal mask.
With an FP8 KV cache in the checkpoint, keys (after RoPE) and values are rounded to the cache's
FP8 grid exactly as ModelOpt's reference does, so logits equal a cached run's.
``model.forward_cached(ids, positions, cache)`` is the cached forward used for generation: it
writes the new keys/values into a :class:`modelopt_jax.kv_cache.KVCache` at their positions and
attends over everything cached up to each query's position.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modelopt_jax.checkpoint import ModelConfig
from modelopt_jax.kv_cache import KVCache
from modelopt_jax.layers import Embedding, RMSNorm
from modelopt_jax.ops.quantize import dequantize_static, fake_quantize_static, quantize_static
from modelopt_jax.models.rope import apply_rope, inverse_frequencies


class WeightSource(Protocol):
    """What the builder needs from a checkpoint (implemented by modelopt_jax.loader)."""

    def linear(self, prefixes: Sequence[str], in_features: int, out_features: Sequence[int],
               bias: bool, *, out_dtype=None) -> nnx.Module: ...

    def embedding(self, name: str, vocab: int, hidden: int) -> Embedding: ...

    def norm(self, name: str, size: int, eps: float) -> RMSNorm: ...

    def kv_scales(self, attn_prefix: str) -> tuple[float, float] | None: ...

    def tied_lm_head_ignored(self, name: str) -> None: ...


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA. q [B,T,H,D], k/v [B,S,KV,D], mask [B,1,T,S] (True = attend)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * np.float32(d ** -0.5)
    # A finite floor (not -inf) keeps fully masked rows (left padding) finite instead of NaN.
    scores = jnp.where(mask[:, :, None], scores, np.float32(np.finfo(np.float32).min))
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h * d).astype(v.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, qkv: nnx.Module, o_proj: nnx.Module,
                 kv_scales: tuple[float, float] | None, *, dtype):
        self.qkv = qkv
        self.o_proj = o_proj
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(config.rope, config.head_dim))
        self.kv_scales = kv_scales  # (k_scale, v_scale) for an FP8 KV cache, else None
        self.dtype = jnp.dtype(dtype)

    def project_qkv(self, x: jax.Array, positions: jax.Array, fake_quant_kv: bool = True):
        """q, k, v [B,T,heads,D] with RoPE applied and k/v rounded to the FP8 cache grid if any."""
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].reshape(b, t, self.num_heads, self.head_dim)
        k = qkv[..., q_size:q_size + kv_size].reshape(b, t, self.num_kv_heads, self.head_dim)
        v = qkv[..., q_size + kv_size:].reshape(b, t, self.num_kv_heads, self.head_dim)
        inv_freq = np.asarray(self.inv_freq, np.float32)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if fake_quant_kv and self.kv_scales is not None:
            k = fake_quantize_static(k, self.kv_scales[0])
            v = fake_quantize_static(v, self.kv_scales[1])
        return q, k, v

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        q, k, v = self.project_qkv(x, positions)
        return self.o_proj(causal_attention(q, k, v, mask))

    def cached(self, x, positions, k_cache, v_cache, scales):
        """Writes this step's k/v at ``positions`` [B,T] and attends over the cache up to each position."""
        q, k, v = self.project_qkv(x, positions, fake_quant_kv=False)
        if scales is not None:  # FP8 cache: store codes, read code * scale (the fake-quant rounding)
            k, v = quantize_static(k, scales[0]), quantize_static(v, scales[1])
        rows = jnp.arange(x.shape[0])[:, None]
        k_cache = k_cache.at[rows, positions].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[rows, positions].set(v.astype(v_cache.dtype))
        if scales is not None:
            keys = dequantize_static(k_cache, scales[0], self.dtype)
            values = dequantize_static(v_cache, scales[1], self.dtype)
        else:
            keys, values = k_cache.astype(self.dtype), v_cache.astype(self.dtype)
        mask = (jnp.arange(k_cache.shape[1])[None, None, :] <= positions[:, :, None])[:, None]  # [B,1,T,S]
        return self.o_proj(causal_attention(q, keys, values, mask)), k_cache, v_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate/up fused into one layer."""

    def __init__(self, gate_up: nnx.Module, down: nnx.Module, intermediate_size: int, *, dtype):
        self.gate_up = gate_up
        self.down = down
        self.intermediate_size = intermediate_size
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., :self.intermediate_size], gate_up[..., self.intermediate_size:]
        return self.down((jax.nn.silu(gate.astype(jnp.float32)).astype(self.dtype) * up).astype(self.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, input_norm: RMSNorm, attn: Attention, post_attn_norm: RMSNorm, mlp: MLP):
        self.input_layernorm = input_norm
        self.self_attn = attn
        self.post_attention_layernorm = post_attn_norm
        self.mlp = mlp

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cached(self, x, positions, k_cache, v_cache, scales):
        attn, k_cache, v_cache = self.self_attn.cached(self.input_layernorm(x), positions, k_cache, v_cache, scales)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class CausalLM(nnx.Module):
    """Decoder-only language model: ``model(input_ids) -> logits`` (float32 [B, T, vocab])."""

    def __init__(self, config: ModelConfig, embed: Embedding, layers: Sequence[DecoderLayer], norm: RMSNorm,
                 lm_head: nnx.Module | None, *, dtype):
        self.config = config
        self.embed_tokens = embed
        self.layers = nnx.List(layers)
        self.norm = norm
        self.lm_head = lm_head  # None: tied to the embedding table
        self.dtype = jnp.dtype(dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits for every position. ``attention_mask`` [B, T] (1 = real token) masks left padding."""
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
        if attention_mask is not None:
            mask = mask & jnp.asarray(attention_mask, bool)[:, None, None, :]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.logits(self.norm(x))

    def forward_cached(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
                       logit_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Cached forward: ``(ids [B,T], positions [B,T], cache) -> (logits, cache)``.

        Token ``t`` of row ``b`` is at absolute position ``positions[b, t]`` (< cache.max_len); its
        key/value are written there. ``logit_positions`` [B] (indices into T) computes logits only
        for one token per row ([B, 1, vocab]) -- the last prompt token at prefill -- instead of all
        T ([B, T, vocab]). Pure and jit-compatible; donate ``cache`` to update it in place.
        """
        scales = cache.scales
        x = self.embed_tokens(jnp.asarray(input_ids))
        keys, values = list(cache.keys), list(cache.values)
        for i, layer in enumerate(self.layers):
            x, keys[i], values[i] = layer.cached(x, positions, keys[i], values[i],
                                                 None if scales is None else scales[i])
        if logit_positions is not None:
            x = jnp.take_along_axis(x, logit_positions[:, None, None], axis=1)
        return self.logits(self.norm(x)), KVCache(keys, values, scales)


def build(config: ModelConfig, source: WeightSource, *, dtype) -> CausalLM:
    """Builds the model layer by layer, pulling each weight from ``source`` exactly once."""
    h, kv = config.hidden_size, config.kv_size
    embed = source.embedding("model.embed_tokens", config.vocab_size, h)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn_p = f"{p}.self_attn"
        qkv = source.linear([f"{attn_p}.q_proj", f"{attn_p}.k_proj", f"{attn_p}.v_proj"], h,
                            [config.q_size, kv, kv], config.attention_bias)
        o_proj = source.linear([f"{attn_p}.o_proj"], config.q_size, [h], config.o_proj_bias)
        attn = Attention(config, qkv, o_proj, source.kv_scales(attn_p), dtype=dtype)
        gate_up = source.linear([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], h,
                                [config.intermediate_size] * 2, config.mlp_bias)
        down = source.linear([f"{p}.mlp.down_proj"], config.intermediate_size, [h], config.mlp_bias)
        layers.append(DecoderLayer(
            source.norm(f"{p}.input_layernorm", h, config.rms_norm_eps), attn,
            source.norm(f"{p}.post_attention_layernorm", h, config.rms_norm_eps),
            MLP(gate_up, down, config.intermediate_size, dtype=dtype)))
    norm = source.norm("model.norm", h, config.rms_norm_eps)
    if config.tie_word_embeddings:
        source.tied_lm_head_ignored("lm_head.weight")
        lm_head = None
    else:
        lm_head = source.linear(["lm_head"], h, [config.vocab_size], False, out_dtype=jnp.float32)
    return CausalLM(config, embed, layers, norm, lm_head, dtype=dtype)
