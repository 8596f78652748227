"""The staged load pipeline: open -> plan -> provide weights -> build -> check leftovers.

``load``, the weight-cache daemon and the weight-cache client all run these stages; they differ
only in who provides the processed arrays (:class:`DiskWeights` reads and processes the checkpoint;
the weight cache hands over views of a daemon's buffers). The checkpoint is opened once and
passed down.

- :func:`plan_model` reads headers and the small scale tensors into a
  :class:`~modelopt_jax.quant.plan.ModelPlan` (no weight bytes).
- a provider returns, for each local device, ``{state path: array on that device}``.
- :func:`build_model` builds the skeleton from the plan under ``nnx.eval_shape``, checks that every
  state leaf got an array of its shape and dtype (nothing missing, nothing extra), stitches
  per-device arrays into global ones under tensor parallelism, and fills the state (``nnx.merge``).
- :func:`check_leftovers` reports checkpoint tensors nothing consumed.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from modelopt_jax import parallel
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.checkpoint.safetensors_index import NUMPY_DTYPES
from modelopt_jax.errors import CheckpointError, ConfigError, MissingTensorError
from modelopt_jax.kv_cache import KVCacheSpec
from modelopt_jax.quant.plan import ModelPlan, TensorPlan
from modelopt_jax.quant.schemes import (FLOAT_DTYPES, SCHEMES, check_header, plan_linear, read_checked, read_scale,
                                        scheme_for)

log = logging.getLogger(__name__)

KV_SCALE_NAMES = {  # where exporters put the FP8 KV-cache scales, in order of preference
    "k": ("k_proj.k_scale", "k_scale", "kv_scale", "k_proj.kv_scale"),
    "v": ("v_proj.v_scale", "v_scale", "kv_scale", "v_proj.kv_scale"),
}
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def family_of(ckpt: Checkpoint):
    from modelopt_jax.models import FAMILIES

    return FAMILIES[ckpt.model_config.family]


def _kv_scales(ckpt: Checkpoint, attention_prefixes: Sequence[str]) -> tuple[tuple[float, float], ...] | None:
    if ckpt.quant_config.kv_cache_quant_algo is None:
        return None
    out = []
    for attn in attention_prefixes:
        pair = []
        for which, candidates in KV_SCALE_NAMES.items():
            name = next((f"{attn}.{c}" for c in candidates if ckpt.has(f"{attn}.{c}")), None)
            if name is None:
                raise MissingTensorError(
                    f"{ckpt.directory}: kv_cache_quant_algo is FP8 but {attn} has no {which}_scale "
                    f"(looked for {', '.join(attn + '.' + c for c in candidates)})")
            pair.append(float(read_scale(ckpt, name, [(), (1,)], f"FP8 KV-cache {which} scale").reshape(())))
        out.append((pair[0], pair[1]))
    return tuple(out)


def plan_model(ckpt: Checkpoint, *, dtype, backend: str, tensor_parallel: int = 1) -> ModelPlan:
    """What every layer is, from headers and scales: the plan both providers and the builder follow."""
    config = ckpt.model_config
    if tensor_parallel > 1:
        parallel.check_divisible(config, tensor_parallel, os.path.join(ckpt.directory, "config.json"))
    ckpt.check_counts()
    linear_specs, tensor_specs, attention = family_of(ckpt).weight_specs(config)
    tensors = []  # headers first: the embedding is the first thing a wrong hidden size shows in
    for t in tensor_specs:
        info = check_header(ckpt, t.name, FLOAT_DTYPES, [t.shape],
                            "embedding table" if "embed" in t.name else "RMSNorm weight")
        tensors.append((t.path, TensorPlan(t.name, tuple(t.shape), NUMPY_DTYPES[info.dtype].name)))
    linears = tuple((s.path, plan_linear(ckpt, s, tensor_parallel)) for s in linear_specs)
    if config.tie_word_embeddings and ckpt.has("lm_head.weight"):
        ckpt.consumed.add("lm_head.weight")  # HF ignores lm_head.weight when embeddings are tied
    return ModelPlan(config.family, jnp.dtype(dtype).name, backend, int(tensor_parallel), linears, tuple(tensors),
                     _kv_scales(ckpt, attention))


class DiskWeights:
    """Reads and processes the checkpoint, one layer at a time, straight onto each local device.

    Streaming keeps peak host memory near one layer (on the CPU backend ``device_put`` adopts the
    64-byte aligned host arrays as the device buffers, so a load holds one copy of the weights).
    """

    source = "disk"

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def arrays(self, plan: ModelPlan, ranks: Sequence[tuple[int, object]]) -> list[dict[str, jax.Array]]:
        out: list[dict[str, jax.Array]] = [{} for _ in ranks]
        rank_ids = [r for r, _ in ranks]
        tp = plan.tensor_parallel
        for path, lp in plan.linears:
            per_rank = SCHEMES[lp.scheme].process(self.ckpt, lp, rank_ids, tp)
            for arrays, leaves, (_, device) in zip(out, per_rank, ranks):
                for name, host in leaves.items():
                    arrays[f"{path}.{name}"] = jax.device_put(host, device)
        for path, tplan in plan.tensors:
            host = read_checked(self.ckpt, tplan.name, FLOAT_DTYPES, [tplan.shape], "tensor")
            for arrays, (_, device) in zip(out, ranks):
                arrays[path] = jax.device_put(host, device)
        return out


def state_path(path: tuple) -> str:
    """``("layers", 0, "self_attn", "qkv", "weight")`` -> ``"layers.0.self_attn.qkv.weight"``."""
    return ".".join(str(p) for p in path)


def materialize(factory, per_device: Sequence[dict[str, jax.Array]], *, mesh=None, where: str = "the weights"):
    """``factory()``'s module with its state filled from one ``{state path: array}`` per local device.

    The skeleton is built under ``nnx.eval_shape`` (no memory); every state leaf must get an array
    of exactly its shape and dtype, and no array may be left over. Under tensor parallelism the
    per-device arrays are stitched into global arrays split as each parameter's ``tp_axis`` says.
    """
    graphdef, state = nnx.split(nnx.eval_shape(factory))
    filled, seen = [], set()
    for path, variable in nnx.to_flat_state(state):
        key = state_path(path)
        seen.add(key)
        arrays = []
        for rank_arrays in per_device:
            if key not in rank_arrays:
                raise CheckpointError(f"{where}: no array for {key} ({variable.dtype}{list(variable.shape)})")
            a = rank_arrays[key]
            if tuple(a.shape) != tuple(variable.shape) or a.dtype != variable.dtype:
                raise CheckpointError(f"{where}: {key} is {a.dtype}{list(a.shape)}, the plan says "
                                      f"{variable.dtype}{list(variable.shape)}")
            arrays.append(a)
        value = arrays[0] if mesh is None else parallel.stitch(arrays, parallel.spec_of(variable), mesh)
        filled.append((path, variable.replace(value)))
    extra = sorted(set().union(*[set(d) for d in per_device]) - seen)
    if extra:
        raise CheckpointError(f"{where}: arrays the model does not have: {', '.join(extra[:5])}")
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def build_model(config, plan: ModelPlan, per_device: Sequence[dict[str, jax.Array]], *, kv_cache: KVCacheSpec,
                mesh=None, info=None, where: str = "the weights"):
    """The model from its plan and one ``{state path: array}`` per local device (mesh order)."""
    from modelopt_jax.models import FAMILIES

    family = FAMILIES[plan.family]
    return materialize(lambda: family.build(config, plan, kv_cache=kv_cache, mesh=mesh, info=info), per_device,
                       mesh=mesh, where=where)


def load_linear(ckpt: Checkpoint, spec, *, dtype, backend: str = "auto"):
    """One dense layer of ``ckpt`` planned, processed and built on the default device (tests, benchmarks)."""
    lp = scheme_for(ckpt, spec.prefixes).plan(ckpt, spec)
    scheme = SCHEMES[lp.scheme]
    (host,) = scheme.process(ckpt, lp, [0])
    return materialize(lambda: scheme.module(lp, dtype=jnp.dtype(dtype), backend=backend, reduce_axis=None),
                       [{k: jax.device_put(v) for k, v in host.items()}], where=ckpt.directory)


def check_leftovers(ckpt: Checkpoint) -> None:
    """Raises CheckpointError for tensors nothing consumed (a checkpoint that does not match its config)."""
    left = [n for n in ckpt.unconsumed() if not n.endswith(IGNORABLE_SUFFIXES)]
    kv_only = [n for n in left if n.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "kv_scale")]
    if kv_only and ckpt.quant_config.kv_cache_quant_algo is None:
        warnings.warn(f"{ckpt.directory}: {len(kv_only)} FP8 KV-cache scales (e.g. {kv_only[0]}) are present but "
                      f"kv_cache_quant_algo is null; the KV cache is not quantized", stacklevel=3)
        left = [n for n in left if n not in kv_only]
    if left:
        shown = ", ".join(left[:8]) + (f", ... ({len(left)} in all)" if len(left) > 8 else "")
        raise CheckpointError(
            f"{ckpt.directory}: tensors not used by {ckpt.model_config.architecture} as configured in config.json: "
            f"{shown}; the checkpoint does not match its config")


def check_plan_matches(plan: ModelPlan, config, *, dtype, backend: str, tensor_parallel: int, where: str) -> None:
    """A plan received from elsewhere (the weight cache) must describe the model this process wants."""
    want = {"family": config.family, "dtype": jnp.dtype(dtype).name, "backend": backend,
            "tensor_parallel": int(tensor_parallel)}
    got = {k: getattr(plan, k) for k in want}
    if got != want:
        raise ConfigError(f"{where}: plan is for {got}, this process needs {want}")
