"""The decoder of every supported family (Llama-2/3, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) as
Flax NNX modules.

The architecture declares its weights (:func:`weight_specs`: checkpoint names, sizes, fusing and
each dense layer's tensor-parallel role) and builds its skeleton from a plan (:func:`build`, run
under ``nnx.eval_shape``); it knows nothing about quantization, files or devices. q/k/v and
gate/up are fused into one layer each (one GEMM each). The families differ by options the config
carries, not by copies of this code: Qwen2's q/k/v bias, Qwen3's q/k RMSNorm (``qk_norm``),
Mistral's sliding window, and the mixture-of-experts block (:mod:`modelopt_jax.models.moe`) a
decoder layer holds instead of its MLP.

``model(input_ids)`` is the cache-less forward: logits for every position with a causal mask.
Keys and values pass through the model's KV-cache spec there too (for an FP8 cache: rounded to its
FP8 grid exactly as ModelOpt's reference does), so logits equal a cached run's.
``model.forward_cached(ids, positions, cache)`` is the cached forward used for generation: it
writes the new keys/values into the :class:`modelopt_jax.kv_cache.KVCache` made by
``model.init_cache`` and attends over everything cached up to each query's position. A model
loaded over a mesh runs both under ``shard_map``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from modelopt_jax import parallel
from modelopt_jax.checkpoint import ModelConfig
from modelopt_jax.kv_cache import KVCache, KVCacheSpec, LayerKVSpec, PagedKVCache
from modelopt_jax.layers import Embedding, RMSNorm, Router
from modelopt_jax.models.moe import SparseMoE
from modelopt_jax.models.rope import apply_rope, inverse_frequencies
from modelopt_jax.ops.attention import causal_attention, step_attention
from modelopt_jax.ops.paged_step import AttentionConfig, PagedStep, dense_rows_step
from modelopt_jax.quant.plan import COLUMN, REPLICATED, ROW, TP_AXIS, ModelPlan
from modelopt_jax.quant.schemes import SCHEMES, ExpertsSpec, LinearSpec


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A plain tensor the architecture reads as is (embedding table, norm weight)."""

    path: str                      # parameter path in the model state, e.g. "layers.0.input_layernorm.weight"
    name: str                      # checkpoint tensor name
    shape: tuple[int, ...]


def window_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | None) -> jax.Array:
    """True where a key is inside the query's sliding window (``q - k < window``; all True without one).
    Broadcasts: ``query_positions`` [..., Tq, 1] against ``key_positions`` [..., S]."""
    if window is None:
        return jnp.ones(jnp.broadcast_shapes(query_positions.shape, key_positions.shape), bool)
    return query_positions - key_positions < window


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, qkv: nnx.Module, o_proj: nnx.Module, kv: LayerKVSpec, *, dtype,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        self.qkv = qkv
        self.o_proj = o_proj
        self.q_norm = q_norm  # Qwen3: RMSNorm over head_dim of every q head (None: none)
        self.k_norm = k_norm
        self.sliding_window = config.sliding_window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(config.rope, config.head_dim))
        self.kv = kv  # what this layer's KV cache stores (dtype, FP8 scales)
        self.dtype = jnp.dtype(dtype)

    def project_qkv(self, x: jax.Array, positions: jax.Array):
        """q, k, v [B,T,heads,D] with RoPE applied (k/v as computed, before any cache rounding)."""
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].reshape(b, t, self.num_heads, self.head_dim)
        k = qkv[..., q_size:q_size + kv_size].reshape(b, t, self.num_kv_heads, self.head_dim)
        v = qkv[..., q_size + kv_size:].reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = np.asarray(self.inv_freq, np.float32)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        q, k, v = self.project_qkv(x, positions)
        k, v = self.kv.round_trip(k, v)  # what the cache would hand back, so cached == cache-less
        return self.o_proj(causal_attention(q, k, v, mask))

    def init_cache(self, batch: int, max_len: int, *, shards: int = 1, sharding=None):
        """This layer's (keys, values) buffers; ``shards`` devices each hold this layer's KV heads."""
        return self.kv.buffers((batch, max_len, self.num_kv_heads * shards, self.head_dim), sharding)

    def init_paged_cache(self, slots: int, *, shards: int = 1, sharding=None):
        """This layer's (keys, values) page pools of ``slots`` token slots (pages x page size)."""
        return self.kv.buffers((slots, self.num_kv_heads * shards, self.head_dim), sharding)

    def cached(self, x, positions, keys, values):
        """Writes this step's k/v at ``positions`` [B,T] and attends over the cache up to each position."""
        q, k, v = self.project_qkv(x, positions)
        rows = jnp.arange(x.shape[0])[:, None]
        keys, values = keys.write(rows, positions, k), values.write(rows, positions, v)
        max_len = keys.shape[1]
        key_pos = jnp.arange(max_len)[None, None, :]
        mask = ((key_pos <= positions[:, :, None]) & window_mask(positions[:, :, None], key_pos,
                                                                 self.sliding_window))[:, None]  # [B,1,T,S]
        out = causal_attention(q, keys.read(self.dtype), values.read(self.dtype), mask)
        return self.o_proj(out), keys, values


    def step(self, x, keys, values, step: PagedStep):
        """One engine step over the page pool: x [1, T, hidden] of tokens from many sequences.

        Stores each token's k/v at ``step.slots`` and lets it attend over its own sequence's pages up
        to its position (decode rows and prompt chunks alike, see :func:`step_attention`); only the
        pages in the block tables are read.
        """
        q, k, v = self.project_qkv(x, step.positions[None])
        out, k_pool, v_pool = step_attention(q[0], keys.encode(k[0]), values.encode(v[0]), keys.data, values.data,
                                             k_scale=keys.scale, v_scale=values.scale, step=step, dtype=self.dtype)
        return self.o_proj(out[None]), keys.with_data(k_pool), values.with_data(v_pool)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate/up fused into one layer."""

    def __init__(self, gate_up: nnx.Module, down: nnx.Module, intermediate_size: int, *, dtype):
        self.gate_up = gate_up
        self.down = down
        self.intermediate_size = intermediate_size
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """``real``: which tokens of an engine step are real (:class:`SparseMoE` skips the others); a
        dense block computes every row anyway, its GEMMs being shaped by the padded rows."""
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., :self.intermediate_size], gate_up[..., self.intermediate_size:]
        return self.down((jax.nn.silu(gate.astype(jnp.float32)).astype(self.dtype) * up).astype(self.dtype))


class DecoderLayer(nnx.Module):
    def __init__(self, input_norm: RMSNorm, attn: Attention, post_attn_norm: RMSNorm, mlp: MLP | SparseMoE):
        self.input_layernorm = input_norm
        self.self_attn = attn
        self.post_attention_layernorm = post_attn_norm
        self.mlp = mlp

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cached(self, x, positions, keys, values):
        attn, keys, values = self.self_attn.cached(self.input_layernorm(x), positions, keys, values)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values

    def step(self, x, keys, values, step: PagedStep):
        attn, keys, values = self.self_attn.step(self.input_layernorm(x), keys, values, step)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), real=step.real_tokens), keys, values


@dataclasses.dataclass(frozen=True, eq=False)
class LoadInfo:
    """Where a loaded model's weights came from; ``stores`` keeps weight-cache mappings alive."""

    directory: str                 # the checkpoint directory
    weights: str = "disk"          # "disk" or "daemon" (the weight cache)
    stores: tuple[Any, ...] = ()   # weight cache: one mapping per attached daemon, rank order (span())
    plan: ModelPlan | None = None  # what every layer is (see modelopt_jax.quant.plan)


class CausalLM(nnx.Module):
    """Decoder-only language model: ``model(input_ids) -> logits`` (float32 [B, T, vocab]).

    ``config`` is the checkpoint's architecture; with a ``mesh`` the layers hold one device's part
    (heads / tp) and both forwards run under ``shard_map`` over the mesh's "tp" axis.
    """

    def __init__(self, config: ModelConfig, embed: Embedding, layers, norm: RMSNorm, lm_head: nnx.Module | None,
                 *, dtype, kv_cache: KVCacheSpec, mesh=None, info: LoadInfo | None = None):
        self.config = config
        self.embed_tokens = embed
        self.layers = nnx.List(layers)
        self.norm = norm
        self.lm_head = lm_head  # None: tied to the embedding table
        self.dtype = jnp.dtype(dtype)
        self.kv_cache = kv_cache
        self.mesh = mesh
        self.info = info

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.devices.size

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
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        args = (input_ids, jnp.asarray(positions), jnp.asarray(attention_mask))
        if self.mesh is None:
            return self._forward(*args)
        return parallel.run_sharded(self, CausalLM._forward, self.mesh, args, (P(), P(), P()), P())

    def _forward(self, input_ids, positions, attention_mask):
        t = input_ids.shape[1]
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None] & attention_mask.astype(bool)[:, None, None, :]
        if self.config.sliding_window is not None:
            mask = mask & window_mask(positions[:, :, None], positions[:, None, :], self.config.sliding_window)[:, None]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.logits(self.norm(x))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """A zeroed cache for ``batch`` sequences of up to ``max_len`` tokens (prompt + generated)."""
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        shards = self.tensor_parallel_size
        sharding = None if self.mesh is None else parallel.cache_sharding(self.mesh)
        pairs = [layer.self_attn.init_cache(batch, max_len, shards=shards, sharding=sharding) for layer in self.layers]
        return KVCache([k for k, _ in pairs], [v for _, v in pairs])

    def forward_cached(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache,
                       logit_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Cached forward: ``(ids [B,T], positions [B,T], cache) -> (logits, cache)``.

        Token ``t`` of row ``b`` is at absolute position ``positions[b, t]`` (< cache.max_len); its
        key/value are written there. ``logit_positions`` [B] (indices into T) computes logits only
        for one token per row ([B, 1, vocab]) -- the last prompt token at prefill -- instead of all
        T ([B, T, vocab]). Pure and jit-compatible; donate ``cache`` to update it in place.
        """
        args = (jnp.asarray(input_ids), jnp.asarray(positions), cache)
        if logit_positions is not None:
            args += (jnp.asarray(logit_positions),)
        if self.mesh is None:
            return self._forward_cached(*args)
        cache_specs = jax.tree.map(lambda _: parallel.CACHE_SPEC, cache)
        specs = (P(), P(), cache_specs) + ((P(),) if logit_positions is not None else ())
        return parallel.run_sharded(self, CausalLM._forward_cached, self.mesh, args, specs, (P(), cache_specs))

    def _forward_cached(self, input_ids, positions, cache: KVCache, logit_positions=None):
        x = self.embed_tokens(input_ids)
        keys, values = list(cache.keys), list(cache.values)
        for i, layer in enumerate(self.layers):
            x, keys[i], values[i] = layer.cached(x, positions, keys[i], values[i])
        if logit_positions is not None:
            x = jnp.take_along_axis(x, logit_positions[:, None, None], axis=1)
        return self.logits(self.norm(x)), KVCache(keys, values)


    def init_paged_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        """A zeroed page pool: ``num_pages`` pages (page 0 is scratch) of ``page_size`` tokens per layer."""
        shards = self.tensor_parallel_size
        sharding = None if self.mesh is None else parallel.paged_cache_sharding(self.mesh)
        pairs = [layer.self_attn.init_paged_cache(num_pages * page_size, shards=shards, sharding=sharding)
                 for layer in self.layers]
        return PagedKVCache([k for k, _ in pairs], [v for _, v in pairs], page_size)

    def attention_config(self, page_size: int, **overrides) -> AttentionConfig:
        """The attention paths this model's paged steps take on its devices (see :class:`AttentionConfig`;
        ``overrides``, e.g. ``prefill="xla"``, for A/B runs)."""
        device = self.mesh.devices.flat[0] if self.mesh is not None else jax.local_devices()[0]
        kv = self.kv_cache
        local_heads = self.config.num_attention_heads // self.tensor_parallel_size
        local_kv = self.config.num_key_value_heads // self.tensor_parallel_size
        return AttentionConfig.resolve(num_heads=local_heads, num_kv_heads=local_kv, head_dim=self.config.head_dim,
                                       pool_dtype=kv.dtype, compute_dtype=self.dtype, page_size=page_size,
                                       platform=device.platform, sliding_window=self.config.sliding_window,
                                       **overrides)

    def forward_step(self, cache: PagedKVCache, step: PagedStep, *, all_logits: bool = False):
        """The engine's forward: one :class:`PagedStep` over the page pool -> ``(logits, cache)``.

        Logits are float32 [R, vocab] at each row's ``step.logit_index`` token, or [T, vocab] for every
        token with ``all_logits`` (prompt log-probs). Pure and jit-compatible; donate ``cache``.
        Within a step no token may read a slot another token of the step writes; pages shared by
        several sequences (prefix caching) are full and only read.
        """
        method = CausalLM._forward_step_all if all_logits else CausalLM._forward_step
        if self.mesh is None:
            return method(self, cache, step)
        cache_specs = jax.tree.map(lambda _: parallel.PAGED_CACHE_SPEC, cache)
        step_specs = jax.tree.map(lambda _: P(), step)
        return parallel.run_sharded(self, method, self.mesh, (cache, step), (cache_specs, step_specs),
                                    (P(), cache_specs))

    def _forward_step_all(self, cache: PagedKVCache, step: PagedStep):
        return self._forward_step(cache, step, all_logits=True)

    def _forward_step(self, cache: PagedKVCache, step: PagedStep, all_logits: bool = False):
        x = self.embed_tokens(step.input_ids[None])
        keys, values = list(cache.keys), list(cache.values)
        for i, layer in enumerate(self.layers):
            x, keys[i], values[i] = layer.step(x, keys[i], values[i], step)
        x = x[0]
        if not all_logits:
            x = x[step.logit_index]
        return self.logits(self.norm(x)), PagedKVCache(keys, values, cache.page_size)

    def forward_paged(self, input_ids: jax.Array, positions: jax.Array, cache: PagedKVCache, slots: jax.Array,
                      block_tables: jax.Array, logit_positions: jax.Array | None = None):
        """:meth:`forward_step` for a [B, T] batch (row b is sequence b): ``(logits, cache)``.

        ``input_ids``, ``positions``, ``slots`` [B, T], ``block_tables`` [B, W]. Logits [B, T, vocab],
        or [B, 1, vocab] at ``logit_positions`` [B] (indices into T).
        """
        input_ids = jnp.asarray(input_ids)
        b, t = input_ids.shape
        step = dense_rows_step(input_ids, positions, slots, block_tables, self.attention_config(cache.page_size),
                               logit_positions)
        logits, cache = self.forward_step(cache, step, all_logits=logit_positions is None)
        return logits.reshape(b, -1, logits.shape[-1]), cache


def weight_specs(config: ModelConfig) -> tuple[list[LinearSpec | ExpertsSpec], list[TensorSpec], list[str]]:
    """Every weight the architecture reads: (dense layers, plain tensors, attention prefixes).

    Sizes are the checkpoint's; each dense layer says how tensor parallelism splits it.
    """
    h, kv = config.hidden_size, config.kv_size
    linears = []
    tensors = [TensorSpec("embed_tokens.table", "model.embed_tokens.weight", (config.vocab_size, h))]
    attention = []
    for i in range(config.num_hidden_layers):
        p, m = f"model.layers.{i}", f"layers.{i}"
        attn = f"{p}.self_attn"
        attention.append(attn)
        linears += [
            LinearSpec(f"{m}.self_attn.qkv", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), h,
                       (config.q_size, kv, kv), config.attention_bias, COLUMN),
            LinearSpec(f"{m}.self_attn.o_proj", (f"{attn}.o_proj",), config.q_size, (h,), config.o_proj_bias, ROW),
        ]
        if config.qk_norm:
            tensors += [TensorSpec(f"{m}.self_attn.{n}.weight", f"{attn}.{n}.weight", (config.head_dim,))
                        for n in ("q_norm", "k_norm")]
        if config.moe is not None and config.moe.is_sparse(i):
            lin, ten = moe_specs(config, i)
            linears += lin
            tensors += ten
        else:
            linears += [
                LinearSpec(f"{m}.mlp.gate_up", (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"), h,
                           (config.intermediate_size,) * 2, config.mlp_bias, COLUMN),
                LinearSpec(f"{m}.mlp.down", (f"{p}.mlp.down_proj",), config.intermediate_size, (h,), config.mlp_bias,
                           ROW),
            ]
        tensors += [TensorSpec(f"{m}.input_layernorm.weight", f"{p}.input_layernorm.weight", (h,)),
                    TensorSpec(f"{m}.post_attention_layernorm.weight", f"{p}.post_attention_layernorm.weight", (h,))]
    tensors.append(TensorSpec("norm.weight", "model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        linears.append(LinearSpec("lm_head", ("lm_head",), h, (config.vocab_size,), False, REPLICATED, "float32"))
    return linears, tensors, attention


def moe_specs(config: ModelConfig, layer: int) -> tuple[list[ExpertsSpec], list[TensorSpec]]:
    """A sparse layer's experts, stacked: one layer of every expert's fused gate/up and one of their
    downs (tensor parallelism splits each expert's intermediate width like a dense MLP's), and its
    router (read as is, replicated)."""
    from modelopt_jax.checkpoint.hf_config import MOE_LAYOUTS

    moe, h = config.moe, config.hidden_size
    block, router, (gate, up, down) = MOE_LAYOUTS[moe.layout]
    p, m = f"model.layers.{layer}.{block}", f"layers.{layer}.mlp"
    experts = [f"{p}.experts.{e}" for e in range(moe.num_experts)]
    f = moe.intermediate_size
    linears = [ExpertsSpec(f"{m}.gate_up", tuple(LinearSpec(f"{m}.gate_up", (f"{x}.{gate}", f"{x}.{up}"), h, (f, f),
                                                            False, COLUMN) for x in experts)),
               ExpertsSpec(f"{m}.down", tuple(LinearSpec(f"{m}.down", (f"{x}.{down}",), f, (h,), False, ROW)
                                              for x in experts))]
    return linears, [TensorSpec(f"{m}.router.weight", f"{p}.{router}.weight", (moe.num_experts, h))]


def build(config: ModelConfig, plan: ModelPlan, *, kv_cache: KVCacheSpec, mesh=None,
          info: LoadInfo | None = None) -> CausalLM:
    """The model's skeleton from its plan (call under ``nnx.eval_shape``: parameters are zeros).

    ``config`` is the checkpoint's architecture; the layers get one device's part of it under
    tensor parallelism (``plan.tensor_parallel``).
    """
    tp = plan.tensor_parallel
    local = parallel.local_config(config, tp)
    dtype = jnp.dtype(plan.dtype)
    reduce_axis = TP_AXIS if tp > 1 else None

    def linear(path: str) -> nnx.Module:
        lp = plan.linear(path)
        return SCHEMES[lp.scheme].module(lp, dtype=dtype, backend=plan.backend,
                                         reduce_axis=reduce_axis if lp.role == ROW else None)

    def norm(path: str) -> RMSNorm:
        return RMSNorm(plan.tensor(path), eps=config.rms_norm_eps, dtype=dtype)

    layers = []
    for i in range(config.num_hidden_layers):
        m = f"layers.{i}"
        qk = ({"q_norm": norm(f"{m}.self_attn.q_norm.weight"), "k_norm": norm(f"{m}.self_attn.k_norm.weight")}
              if config.qk_norm else {})
        attn = Attention(local, linear(f"{m}.self_attn.qkv"), linear(f"{m}.self_attn.o_proj"), kv_cache.layers[i],
                         dtype=dtype, **qk)
        if config.moe is not None and config.moe.is_sparse(i):
            moe = local.moe
            mlp = SparseMoE(Router(plan.tensor(f"{m}.mlp.router.weight")), linear(f"{m}.mlp.gate_up"),
                            linear(f"{m}.mlp.down"), moe.intermediate_size, top_k=moe.top_k,
                            normalize=moe.normalize_top_k, dtype=dtype)
        else:
            mlp = MLP(linear(f"{m}.mlp.gate_up"), linear(f"{m}.mlp.down"), local.intermediate_size, dtype=dtype)
        layers.append(DecoderLayer(norm(f"{m}.input_layernorm.weight"), attn,
                                   norm(f"{m}.post_attention_layernorm.weight"), mlp))
    embed = Embedding(plan.tensor("embed_tokens.table"), dtype=dtype)
    lm_head = None if config.tie_word_embeddings else linear("lm_head")
    return CausalLM(config, embed, layers, norm("norm.weight"), lm_head, dtype=dtype, kv_cache=kv_cache, mesh=mesh,
                    info=info)
