"""``load(path)``: a checked checkpoint directory in, a ready NNX model out.

The stages are :mod:`modelopt_jax.pipeline`'s: open the checkpoint once, plan every layer from
headers and scales, get the processed arrays from a provider (the disk, or a weight-cache daemon
chosen up front with fallback to the disk in ``auto`` mode), build the model around them, and
report anything in the checkpoint the model did not consume.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from modelopt_jax import parallel, pipeline
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.dtypes import compute_dtype, kv_cache_dtype_name
from modelopt_jax.errors import CheckpointError, ConfigError, WeightCacheError
from modelopt_jax.kv_cache import KVCacheSpec
from modelopt_jax.ops.gemm import check_backend

log = logging.getLogger(__name__)

WEIGHT_CACHE_MODES = ("off", "auto", "require")


@dataclasses.dataclass(frozen=True)
class WeightCacheOptions:
    """How ``load`` uses a weight-cache daemon (see :mod:`modelopt_jax.weight_cache`)."""

    mode: str = "off"                  # "off", "auto" (attach or load from disk) or "require"
    socket_dir: str | None = None      # default: $MODELOPT_JAX_WEIGHT_CACHE_DIR or a per-user directory
    timeout: float | None = None       # how long "require" waits for a daemon still loading (default 60 s)
    device: int = 0                    # local device whose daemon serves a single-device model

    def __post_init__(self):
        if self.mode not in WEIGHT_CACHE_MODES:
            raise ConfigError(f"weight_cache={self.mode!r} not supported; use one of {', '.join(WEIGHT_CACHE_MODES)}")


def load(path: str | os.PathLike | Checkpoint, *, dtype="bfloat16", backend: str = "auto", mesh=None, kv_cache_dtype="auto",
         weight_cache: str | WeightCacheOptions = "off", weight_cache_dir: str | os.PathLike | None = None,
         weight_cache_timeout: float | None = None, weight_cache_device: int = 0):
    """Loads a ModelOpt FP8 (or unquantized) Llama/Qwen2 checkpoint as a Flax NNX model.

    ``dtype`` is the compute dtype ("bfloat16", "float32" or "float16"); FP8 weights stay FP8 and
    excluded layers keep the checkpoint's dtype in memory. ``backend`` selects the FP8 GEMM
    ("auto", "xla", "cutlass"). ``kv_cache_dtype`` ("auto", "fp8", "bfloat16", "float16",
    "float32") fixes what the model's KV cache stores; both the cached and the cache-less forward
    follow it. Returns a :class:`modelopt_jax.models.CausalLM`:
    ``model(input_ids) -> float32 logits [B, T, vocab]``. With ``mesh`` (a 1-D
    ``jax.sharding.Mesh`` with axis "tp", see :func:`modelopt_jax.parallel.make_mesh`) the weights
    are split Megatron-style over its devices and the model runs under ``shard_map``.

    ``weight_cache`` ("off", "auto", "require", or a :class:`WeightCacheOptions`) attaches to a
    weight-cache daemon's already processed buffers instead of reading the checkpoint;
    ``weight_cache_dir`` is its socket directory, ``weight_cache_timeout`` how long "require" waits
    for a daemon still loading. With ``mesh`` it attaches to one daemon per mesh device
    (``weight-cache serve --device i --tensor-parallel N``), each serving that device's shard.
    """
    dtype = compute_dtype(dtype)
    check_backend(backend)
    kv_cache_dtype_name(kv_cache_dtype)
    options = weight_cache if isinstance(weight_cache, WeightCacheOptions) else WeightCacheOptions(
        "off" if weight_cache in (None, False) else weight_cache,
        None if weight_cache_dir is None else os.fspath(weight_cache_dir), weight_cache_timeout,
        int(weight_cache_device))
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    tp = 1 if mesh is None else mesh.devices.size
    ranks = parallel.local_ranks(mesh)
    log.info("loading %s (%s, quant_algo=%s, kv=%s) as %s", ckpt.directory, ckpt.model_config.architecture,
             ckpt.quant_config.quant_algo, ckpt.quant_config.kv_cache_quant_algo, dtype)
    if options.mode != "off":
        from modelopt_jax.weight_cache.client import CacheWeights
        from modelopt_jax.weight_cache.layout import check_supported

        check_supported(backend)  # in every mode but off, before any socket work: falling back would hide it
        try:
            cache = CacheWeights.attach(ckpt, options, dtype=dtype, backend=backend, mesh=mesh)
            try:
                return _build(ckpt, cache.plan, cache.per_device, dtype, kv_cache_dtype, mesh, "daemon", cache.stores,
                              where=f"weight cache of {ckpt.directory}")
            except (CheckpointError, KeyError, TypeError, ValueError) as e:  # index and plan do not fit
                raise WeightCacheError(f"weight-cache daemon sent an inconsistent layout: {e!r}") from e
        except WeightCacheError as e:
            if options.mode == "require":
                raise
            log.warning("weight cache: %s; loading %s from disk", e, ckpt.directory)
    plan = pipeline.plan_model(ckpt, dtype=dtype, backend=backend, tensor_parallel=tp)
    per_device = pipeline.DiskWeights(ckpt).arrays(plan, ranks)
    pipeline.check_leftovers(ckpt)
    return _build(ckpt, plan, per_device, dtype, kv_cache_dtype, mesh, "disk", (), where=ckpt.directory)


def _build(ckpt, plan, per_device, dtype, kv_cache_dtype, mesh, source: str, stores, *, where: str):
    from modelopt_jax.models import LoadInfo

    config = ckpt.model_config
    kv_cache = KVCacheSpec.resolve(kv_cache_dtype, plan.kv_scales, dtype, config.num_hidden_layers,
                                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim)
    info = LoadInfo(ckpt.directory, source, tuple(stores), plan)
    return pipeline.build_model(ckpt.model_config, plan, per_device, kv_cache=kv_cache, mesh=mesh, info=info,
                                where=where)
