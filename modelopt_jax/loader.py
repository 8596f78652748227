"""``load(path)``: a checked checkpoint directory in, a ready NNX model out.

The loader streams the checkpoint: each (fused) layer's tensors are read, checked, fused and put
on the device before the next layer is read, so peak host memory stays near one copy of the
weights. Anything the model did not consume is reported, never silently dropped.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.errors import CheckpointError, ConfigError, MissingTensorError
from modelopt_jax.layers import Embedding, RMSNorm
from modelopt_jax.ops.gemm import check_backend
from modelopt_jax.quant.schemes import FLOAT_DTYPES, SCHEMES, _read_checked, _read_scale, _to_device

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
KV_SCALE_NAMES = {  # where exporters put the FP8 KV-cache scales, in order of preference
    "k": ("k_proj.k_scale", "k_scale", "kv_scale", "k_proj.kv_scale"),
    "v": ("v_proj.v_scale", "v_scale", "kv_scale", "v_proj.kv_scale"),
}
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} not supported; choose one of {', '.join(DTYPES)}")
        return jnp.dtype(DTYPES[dtype])
    d = jnp.dtype(dtype)
    if d not in [jnp.dtype(v) for v in DTYPES.values()]:
        raise ConfigError(f"dtype {d} not supported; choose one of {', '.join(DTYPES)}")
    return d


class CheckpointWeights:
    """Implements the models' WeightSource over an opened :class:`Checkpoint`."""

    def __init__(self, ckpt: Checkpoint, *, dtype, backend: str):
        self.ckpt = ckpt
        self.dtype = dtype
        self.backend = backend
        self.quant = ckpt.quant_config

    def scheme_for(self, prefixes: Sequence[str]):
        if not self.quant.is_quantized:
            return SCHEMES[None]
        excluded = {p: self.quant.exclusion_rule(p) for p in prefixes}
        if len({rule is None for rule in excluded.values()}) > 1:
            detail = ", ".join(f"{p}: {'excluded by ' + r if r else 'quantized'}" for p, r in excluded.items())
            raise ConfigError(
                f"{' and '.join(self.quant.sources)}: the fused layer made of {', '.join(prefixes)} mixes "
                f"excluded and quantized shards ({detail}); they must be quantized (or excluded) together")
        return SCHEMES[None] if next(iter(excluded.values())) else SCHEMES[self.quant.quant_algo]

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None) -> nnx.Module:
        scheme = self.scheme_for(prefixes)
        shards = [scheme.read(self.ckpt, p, n, in_features, bias) for p, n in zip(prefixes, out_features)]
        return scheme.build(shards, dtype=self.dtype, backend=self.backend, out_dtype=out_dtype)

    def embedding(self, name, vocab, hidden) -> Embedding:
        table = _read_checked(self.ckpt, f"{name}.weight", FLOAT_DTYPES, [(vocab, hidden)], "embedding table")
        return Embedding(_to_device(table), dtype=self.dtype)

    def norm(self, name, size, eps) -> RMSNorm:
        weight = _read_checked(self.ckpt, f"{name}.weight", FLOAT_DTYPES, [(size,)], "RMSNorm weight")
        return RMSNorm(_to_device(weight), eps=eps, dtype=self.dtype)

    def kv_scales(self, attn_prefix) -> tuple[float, float] | None:
        if self.quant.kv_cache_quant_algo is None:
            return None
        scales = []
        for which, candidates in KV_SCALE_NAMES.items():
            name = next((f"{attn_prefix}.{c}" for c in candidates if self.ckpt.has(f"{attn_prefix}.{c}")), None)
            if name is None:
                raise MissingTensorError(
                    f"{self.ckpt.directory}: kv_cache_quant_algo is FP8 but {attn_prefix} has no {which}_scale "
                    f"(looked for {', '.join(attn_prefix + '.' + c for c in candidates)})")
            scales.append(float(_read_scale(self.ckpt, name, [(), (1,)], f"FP8 KV-cache {which} scale").reshape(())))
        return scales[0], scales[1]

    def tied_lm_head_ignored(self, name) -> None:
        if self.ckpt.has(name):
            self.ckpt.consumed.add(name)  # HF ignores lm_head.weight when embeddings are tied


def _check_leftovers(ckpt: Checkpoint) -> None:
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


def load(path: str | os.PathLike, *, dtype="bfloat16", backend: str = "auto", mesh=None,
         weight_cache: str = "off", weight_cache_dir: str | os.PathLike | None = None,
         weight_cache_timeout: float | None = None, weight_cache_device: int = 0):
    """Loads a ModelOpt FP8 (or unquantized) Llama/Qwen2 checkpoint as a Flax NNX model.

    ``dtype`` is the compute dtype ("bfloat16", "float32" or "float16"); FP8 weights stay FP8 and
    excluded layers keep the checkpoint's dtype in memory. ``backend`` selects the FP8 GEMM
    ("auto", "xla", "cutlass"). Returns a :class:`modelopt_jax.models.CausalLM`:
    ``model(input_ids) -> float32 logits [B, T, vocab]``. With ``mesh`` (a 1-D
    ``jax.sharding.Mesh`` with axis "tp", see :func:`modelopt_jax.parallel.make_mesh`) the model is
    split Megatron-style over its devices and returned as a
    :class:`modelopt_jax.parallel.TensorParallelModel` with the same interface.

    ``weight_cache`` ("off", "auto", "require") attaches to a weight-cache daemon's already
    processed buffers instead of reading the checkpoint (see :mod:`modelopt_jax.weight_cache`);
    ``weight_cache_dir`` is its socket directory (default: $MODELOPT_JAX_WEIGHT_CACHE_DIR or a
    per-user directory), ``weight_cache_timeout`` how long "require" waits for a daemon still loading.
    With ``mesh`` it attaches to one daemon per mesh device (``weight-cache serve --device i
    --tensor-parallel N``), each serving that device's shard.
    """
    from modelopt_jax.models import FAMILIES

    dtype = resolve_dtype(dtype)
    check_backend(backend)
    if weight_cache not in ("off", None, False):
        from modelopt_jax.weight_cache.client import load_with_cache

        return load_with_cache(path, dtype=dtype, backend=backend, mode=weight_cache, socket_dir=weight_cache_dir,
                               device=weight_cache_device, timeout=weight_cache_timeout, mesh=mesh,
                               ordinary_load=lambda: load(path, dtype=dtype, backend=backend, mesh=mesh))
    ckpt = Checkpoint.open(path)
    log.info("loading %s (%s, quant_algo=%s, kv=%s) as %s", ckpt.directory, ckpt.model_config.architecture,
             ckpt.quant_config.quant_algo, ckpt.quant_config.kv_cache_quant_algo, dtype)
    source = CheckpointWeights(ckpt, dtype=dtype, backend=backend)
    if mesh is not None:
        from modelopt_jax import parallel

        source = parallel.ShardedWeights(source, mesh)
    model = FAMILIES[ckpt.model_config.family](model_config_for(ckpt, mesh), source, dtype=dtype)
    _check_leftovers(ckpt)
    return finish_model(model, ckpt, mesh)


def model_config_for(ckpt: Checkpoint, mesh=None):
    """The architecture the builder is given: the checkpoint's, or one device's part of a TP split."""
    if mesh is None:
        return ckpt.model_config
    from modelopt_jax import parallel

    return parallel.local_config(ckpt, mesh.devices.size)


def finish_model(model, ckpt: Checkpoint, mesh=None):
    """Attaches what callers read off a loaded model; wraps a per-device model for its mesh."""
    model.quant_config = ckpt.quant_config
    model.checkpoint_dir = ckpt.directory
    if mesh is not None:
        from modelopt_jax import parallel

        model = parallel.TensorParallelModel(model, mesh, ckpt.model_config)
    return model
