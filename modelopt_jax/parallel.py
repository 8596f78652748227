"""Tensor parallelism: a Megatron-style split of the model over a 1-D device mesh (axis "tp").

- q/k/v and gate/up (fused) are column-parallel: device i holds rows [q_i; k_i; v_i] (its heads)
  and [gate_i; up_i]. o_proj and down_proj are row-parallel: device i holds columns i of K and the
  partial outputs are summed with ``psum`` before the bias. Embeddings, lm_head and norms are
  replicated (simple, and the lm_head is excluded from FP8 in ModelOpt exports anyway); the KV
  cache is split by KV head.
- The forward runs under ``shard_map``, so every FFI GEMM sees one device's local arrays.
- Each device's layer is built by the ordinary single-device code from its slice of the
  checkpoint tensors (so FP8 codes, scale folding and padding are exactly those of TP=1), placed
  directly on that device, and the per-device arrays are stitched into one global array with a
  NamedSharding: no device ever holds a full tensor.
- Static scales stay compile-time constants where they are the same on every device (per-tensor
  scales; fused-shard scale vectors, whose layout repeats per device). Per-channel scales of
  column-parallel layers differ per device and become sharded device data (``ScaleVector``).
- Multi-host: the same code under ``jax.distributed.initialize`` -- ``make_mesh`` takes the global
  device list and each process builds and places only the shards of its own devices.
- Numerics: dynamic per-token activation scales of a row-parallel layer are computed over each
  device's own K slice (vLLM's behaviour), so FP8_PER_CHANNEL_PER_TOKEN results differ slightly
  from TP=1; row-parallel partial sums are added in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from modelopt_jax.checkpoint import ModelConfig
from modelopt_jax.errors import ConfigError
from modelopt_jax.kv_cache import KVCache
from modelopt_jax.layers import ConcatLinear, Fp8Linear, ScaleVector
from modelopt_jax.quant.schemes import ShardTensors
from modelopt_jax.static_array import StaticArray

AXIS = "tp"
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")

try:  # jax >= 0.6 exports shard_map at top level
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover
    from jax.experimental.shard_map import shard_map as _shard_map


def shard_map(fn, mesh, in_specs, out_specs):
    try:
        return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # older spelling
        return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices) if devices is not None else jax.devices()
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but {len(devices)} devices are available "
                         f"({devices[0].platform})")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (AXIS,))


def local_config(ckpt, tp: int) -> ModelConfig:
    """The per-device view of ``ckpt``'s architecture; raises ConfigError naming what does not divide."""
    cfg, where = ckpt.model_config, os.path.join(ckpt.directory, "config.json")
    bad = [f"{name} {value}" for name, value in (("num_attention_heads", cfg.num_attention_heads),
                                                 ("num_key_value_heads", cfg.num_key_value_heads),
                                                 ("intermediate_size", cfg.intermediate_size)) if value % tp]
    if bad:
        raise ConfigError(f"{where}: tensor parallel size {tp} does not divide {', '.join(bad)} "
                          f"(each device needs whole heads and an equal MLP slice)")
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=cfg.num_key_value_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def _kind(prefixes: Sequence[str]) -> str:
    last = prefixes[0].rsplit(".", 1)[-1]
    return "column" if last in COLUMN else "row" if last in ROW else "replicated"


def _slice_shard(s: ShardTensors, i: int, tp: int, axis: int) -> ShardTensors:
    """Device i's part of one checkpoint Linear (rows for column-parallel, columns for row-parallel)."""
    if s.weight_scale is not None and s.weight_scale.ndim == 2:  # 128x128 blocks span the shards
        raise ConfigError("FP8_PB_WO under tensor parallelism is not supported (block scales span shards)")
    if axis == 0:
        n = s.out_features // tp
        rows = slice(i * n, (i + 1) * n)
        scale = s.weight_scale
        if scale is not None and scale.ndim == 1:
            scale = scale[rows]
        return ShardTensors(s.prefix, np.ascontiguousarray(s.weight[rows]),
                            None if s.bias is None else s.bias[rows], scale, s.input_scale)
    k = s.weight.shape[1] // tp
    return ShardTensors(s.prefix, np.ascontiguousarray(s.weight[:, i * k:(i + 1) * k]), s.bias, s.weight_scale,
                        s.input_scale)


def _linears(module) -> list:
    return list(module.parts) if isinstance(module, ConcatLinear) else [module]


def _read_full(inner, prefixes, in_features, out_features, bias, kind: str, tp: int):
    """The whole checkpoint tensors of a split layer (the builder asked with per-device sizes)."""
    scheme = inner.scheme_for(prefixes)
    if kind == "column":
        shards = [scheme.read(inner.ckpt, p, n * tp, in_features, bias) for p, n in zip(prefixes, out_features)]
    else:
        shards = [scheme.read(inner.ckpt, p, n, in_features * tp, bias) for p, n in zip(prefixes, out_features)]
    return scheme, shards


def _build_rank(inner, scheme, shards, kind: str, rank: int, tp: int, device, out_dtype):
    """Device ``rank``'s part of a split layer, built by the single-device code and placed on ``device``."""
    axis = 0 if kind == "column" else 1
    # Per-channel scales of a column-parallel layer differ per device: they cannot be one
    # compile-time constant and become sharded device data. Decided from the scheme, not from
    # the values, so every host of a multi-host mesh builds the same program.
    vector_scales = kind == "column" and any(s.weight_scale is not None and s.weight_scale.ndim == 1 for s in shards)
    with jax.default_device(device):
        module = scheme.build([_slice_shard(s, rank, tp, axis) for s in shards], dtype=inner.dtype,
                              backend=inner.backend, out_dtype=out_dtype)
        for layer in _linears(module):
            if kind == "row":
                layer.reduce_axis = AXIS
            if vector_scales and isinstance(layer, Fp8Linear) and isinstance(layer.weight_scale, StaticArray):
                vector = ScaleVector(jax.device_put(layer.weight_scale.array, device))
                # the attribute started out static (a constant); mark it as data now
                layer.weight_scale = nnx.data(vector) if hasattr(nnx, "data") else vector
    return module


def stitch(modules: Sequence[nnx.Module], kind: str, mesh: Mesh) -> nnx.Module:
    """Per-device modules (one per local mesh device, in mesh order) -> one module of global arrays.

    ``kind`` "column"/"row" shards weights along N/K; "replicated" makes every leaf a replicated
    global array. No data moves: each device's arrays become that device's shard.
    """
    tp = mesh.devices.size
    split = [nnx.split(m) for m in modules]
    graphdef = split[0][0]
    if any(g != graphdef for g, _ in split[1:]):
        raise ConfigError("tensor-parallel shards of a layer differ in static structure (scales); "
                          "this checkpoint cannot be split evenly")
    leaves = [jax.tree_util.tree_leaves(s) for _, s in split]
    treedef = jax.tree_util.tree_structure(split[0][1])
    out = []
    for per_device in zip(*leaves):
        local = per_device[0]
        if kind != "replicated" and (kind == "column" or local.ndim == 2):
            axis = 0 if kind == "column" else 1
            spec = [None] * local.ndim
            spec[axis] = AXIS
            shape = list(local.shape)
            shape[axis] *= tp
            out.append(jax.make_array_from_single_device_arrays(
                tuple(shape), NamedSharding(mesh, P(*spec)), list(per_device)))
        else:  # replicated modules, row-parallel bias / output-channel scales: identical on every device
            out.append(jax.make_array_from_single_device_arrays(
                local.shape, NamedSharding(mesh, P()), list(per_device)))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))


class ShardedWeights:
    """A model WeightSource (see models/llama.py) that builds each layer split over ``mesh``.

    Wraps the single-device ``CheckpointWeights``; the builder asks with per-device sizes (it is
    given the local config), which are scaled back up to read the checkpoint tensors.
    """

    def __init__(self, inner, mesh: Mesh):
        self.inner, self.mesh = inner, mesh
        self.devices = list(mesh.devices.flat)
        self.tp = len(self.devices)
        # (mesh index, device) of the devices this process owns: on a multi-host mesh each process
        # builds and places only its own shards (jax.make_array_from_single_device_arrays).
        self.local_devices = [(i, d) for i, d in enumerate(self.devices) if d.process_index == jax.process_index()]

    def _replicate(self, module):
        graphdef, state = nnx.split(module)
        state = jax.tree_util.tree_map(lambda a: jax.device_put(a, NamedSharding(self.mesh, P())), state)
        return nnx.merge(graphdef, state)

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None):
        kind = _kind(prefixes)
        if kind == "replicated":
            return self._replicate(self.inner.linear(prefixes, in_features, out_features, bias, out_dtype=out_dtype))
        scheme, shards = _read_full(self.inner, prefixes, in_features, out_features, bias, kind, self.tp)
        modules = [_build_rank(self.inner, scheme, shards, kind, i, self.tp, device, out_dtype)
                   for i, device in self.local_devices]
        return stitch(modules, kind, self.mesh)

    def embedding(self, name, vocab, hidden):
        return self._replicate(self.inner.embedding(name, vocab, hidden))

    def norm(self, name, size, eps):
        return self._replicate(self.inner.norm(name, size, eps))

    def kv_scales(self, attn_prefix):
        return self.inner.kv_scales(attn_prefix)

    def tied_lm_head_ignored(self, name):
        return self.inner.tied_lm_head_ignored(name)


class RankWeights:
    """The WeightSource of one tensor-parallel rank: exactly the modules :class:`ShardedWeights`
    builds for device ``rank`` (split layers sliced, replicated ones whole), on ``device``, not
    stitched. A weight-cache daemon serving one GPU of a TP mesh builds its cache with this.
    """

    def __init__(self, inner, tp: int, rank: int, device):
        if not 0 <= rank < tp:
            raise ConfigError(f"rank {rank} is not in a tensor-parallel group of size {tp}")
        self.inner, self.tp, self.rank, self.device = inner, tp, rank, device

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None):
        kind = _kind(prefixes)
        if kind == "replicated":
            with jax.default_device(self.device):
                return self.inner.linear(prefixes, in_features, out_features, bias, out_dtype=out_dtype)
        scheme, shards = _read_full(self.inner, prefixes, in_features, out_features, bias, kind, self.tp)
        return _build_rank(self.inner, scheme, shards, kind, self.rank, self.tp, self.device, out_dtype)

    def embedding(self, name, vocab, hidden):
        with jax.default_device(self.device):
            return self.inner.embedding(name, vocab, hidden)

    def norm(self, name, size, eps):
        with jax.default_device(self.device):
            return self.inner.norm(name, size, eps)

    def kv_scales(self, attn_prefix):
        return self.inner.kv_scales(attn_prefix)

    def tied_lm_head_ignored(self, name):
        return self.inner.tied_lm_head_ignored(name)


class StitchingSource:
    """The builder's WeightSource over one source per local mesh device (e.g. weight-cache replays):
    every call asks each device's source for its module and stitches them like ShardedWeights.
    """

    def __init__(self, sources: Sequence, mesh: Mesh):
        self.sources, self.mesh = list(sources), mesh

    def _all(self, method: str, *args, **kwargs):
        return [getattr(src, method)(*args, **kwargs) for src in self.sources]

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None):
        modules = self._all("linear", prefixes, in_features, out_features, bias, out_dtype=out_dtype)
        return stitch(modules, _kind(prefixes), self.mesh)

    def embedding(self, name, vocab, hidden):
        return stitch(self._all("embedding", name, vocab, hidden), "replicated", self.mesh)

    def norm(self, name, size, eps):
        return stitch(self._all("norm", name, size, eps), "replicated", self.mesh)

    def kv_scales(self, attn_prefix):
        values = self._all("kv_scales", attn_prefix)
        if any(v != values[0] for v in values[1:]):
            raise ConfigError(f"{attn_prefix}: the ranks disagree on the FP8 KV-cache scales ({values})")
        return values[0]

    def tied_lm_head_ignored(self, name):
        self._all("tied_lm_head_ignored", name)


class TensorParallelModel:
    """A model split over a mesh; calls run its per-device module under ``shard_map``.

    Same interface as :class:`modelopt_jax.models.CausalLM` for callers: ``model(ids)``,
    ``forward_cached``, ``config`` (the global architecture), ``layers``, ``dtype``.
    """

    def __init__(self, local_model, mesh: Mesh, config: ModelConfig):
        self.mesh, self.config = mesh, config
        self.local_config = local_model.config
        self.graphdef, self.state = nnx.split(local_model)
        self.state_specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, self.state)
        self.layers = local_model.layers
        self.dtype = local_model.dtype
        self.quant_config = getattr(local_model, "quant_config", None)
        self.tensor_parallel_size = mesh.devices.size
        fn = shard_map(lambda state, ids, pos, am: nnx.merge(self.graphdef, state)(ids, pos, am), mesh,
                       in_specs=(self.state_specs, P(), P(), P()), out_specs=P())
        self._call = jax.jit(fn)

    def cache_spec(self, cache: KVCache) -> KVCache:
        spec = P(None, None, AXIS, None)
        return KVCache([spec] * len(cache.keys), [spec] * len(cache.values), cache.scales)

    def __call__(self, input_ids, positions=None, attention_mask=None):
        input_ids = jnp.asarray(input_ids)
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask)
        return self._call(self.state, input_ids, positions, mask)

    def cached_forward_fn(self):
        """``forward(state, ids, positions, cache, logit_positions=None) -> (logits, cache)`` over the mesh."""
        graphdef, specs, mesh = self.graphdef, self.state_specs, self.mesh

        def forward(state, ids, positions, cache, logit_positions=None):
            cache_specs = self.cache_spec(cache)
            if logit_positions is None:
                body = lambda st, i, p, c: nnx.merge(graphdef, st).forward_cached(i, p, c)  # noqa: E731
                args, in_specs = (state, ids, positions, cache), (specs, P(), P(), cache_specs)
            else:
                body = lambda st, i, p, c, lp: nnx.merge(graphdef, st).forward_cached(i, p, c, lp)  # noqa: E731
                args, in_specs = (state, ids, positions, cache, logit_positions), (specs, P(), P(), cache_specs, P())
            return shard_map(body, mesh, in_specs=in_specs, out_specs=(P(), cache_specs))(*args)

        return forward, self.state

    def cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, None, AXIS, None))
