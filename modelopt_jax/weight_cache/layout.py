"""Record what the model builder received from the checkpoint, and replay it from shared buffers.

Why record at the WeightSource seam: every model family is built by ``build(config, source)``
calling ``embedding / linear / norm / kv_scales / tied_lm_head_ignored`` in a fixed order, and
each returned module is fully described by its arrays (already fused, padded, cast) plus a few
static attributes (scales as floats or StaticArray, shard sizes, logical output width, dtypes).
The daemon wraps the ordinary :class:`~modelopt_jax.loader.CheckpointWeights` in a
:class:`RecordingSource`; a client hands the same builder a :class:`ReplaySource` that returns
identical modules around views of the daemon's buffers. Nothing is reprocessed on the client:
constructors only store what they are given.
"""

from __future__ import annotations

import base64
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modelopt_jax.errors import UnsupportedForWeightCacheError, WeightCacheError
from modelopt_jax.layers import BlockFp8Linear, ConcatLinear, Embedding, Fp8Linear, Linear, RMSNorm, ScaleVector
from modelopt_jax.static_array import StaticArray

def check_supported(quant_config, backend: str = "auto") -> None:
    """Raises before any slow work when processed buffers of this scheme or backend cannot be shared.

    Each scheme declares it (``LinearScheme.weight_cache_ok``) and each GEMM backend the processed
    weight layout it consumes (:func:`modelopt_jax.ops.gemm.weight_layout`).
    """
    from modelopt_jax.ops.gemm import WEIGHT_LAYOUT, weight_layout
    from modelopt_jax.quant.schemes import SCHEMES

    scheme = SCHEMES.get(quant_config.quant_algo)
    if scheme is None or not scheme.weight_cache_ok:
        supported = ", ".join(str(k or "unquantized") for k, v in SCHEMES.items() if v.weight_cache_ok)
        raise UnsupportedForWeightCacheError(
            f"quant_algo {quant_config.quant_algo} cannot be served by the weight cache (supported: {supported}); "
            f"load it without weight_cache")
    if weight_layout(backend) != WEIGHT_LAYOUT:
        raise UnsupportedForWeightCacheError(
            f"GEMM backend {backend!r} consumes weights in layout {weight_layout(backend)!r}, not the weight "
            f"cache's {WEIGHT_LAYOUT!r}; load it without weight_cache")


def pack(arrays: dict, alignment: int) -> tuple[dict, int]:
    """Where each array goes in a store: ({name: {offset, dtype, shape, nbytes}}, total bytes),
    every offset a multiple of ``alignment`` (both stores lay arrays out this way)."""
    index, offset = {}, 0
    for key, a in arrays.items():
        nbytes = int(a.size) * a.dtype.itemsize
        index[key] = {"offset": offset, "dtype": a.dtype.name, "shape": list(a.shape), "nbytes": nbytes}
        offset += -(-nbytes // alignment) * alignment
    return index, offset


def _scale_to_json(value) -> Any:
    if value is None or isinstance(value, float):
        return value
    if isinstance(value, StaticArray):  # raw bytes, base64: a per-channel vector of a 70B model is
        # millions of floats, which as JSON numbers would dominate the attach time
        return {"static_array_b64": base64.b64encode(np.ascontiguousarray(value.array).tobytes()).decode("ascii"),
                "dtype": value.dtype.name, "shape": list(value.shape)}
    if isinstance(value, (int, np.floating)):
        return float(value)
    raise UnsupportedForWeightCacheError(f"weight scale of type {type(value).__name__} cannot be shared")


def _scale_from_json(value) -> Any:
    if isinstance(value, dict):
        raw = base64.b64decode(value["static_array_b64"], validate=True)
        return StaticArray(np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]))
    return value


def describe(module: nnx.Module, arrays: dict[str, jax.Array], key: str) -> dict:
    """JSON description of ``module``; its array leaves go into ``arrays`` under ``key``-derived names."""
    def put(name, param):
        if param is None:
            return None
        arrays[f"{key}.{name}"] = param[...]  # as processed, on its device; the store copies it
        return f"{key}.{name}"

    if isinstance(module, ConcatLinear):
        return {"cls": "ConcatLinear", "parts": [describe(p, arrays, f"{key}.parts.{i}")
                                                 for i, p in enumerate(module.parts)]}
    if isinstance(module, Fp8Linear):
        if isinstance(module.weight_scale, ScaleVector):  # a tensor-parallel rank's per-channel scales: data
            weight_scale = {"scale_vector": put("weight_scale", module.weight_scale)}
        else:
            weight_scale = _scale_to_json(module.weight_scale)
        return {"cls": "Fp8Linear", "weight": put("weight", module.weight), "bias": put("bias", module.bias),
                "weight_scale": weight_scale, "input_scale": _scale_to_json(module.input_scale),
                "dtype": module.dtype.name, "out_dtype": module.out_dtype.name, "backend": module.backend,
                "shard_sizes": list(module.shard_sizes), "logical_out": module.logical_out,
                "reduce_axis": module.reduce_axis}
    if isinstance(module, BlockFp8Linear):
        raise UnsupportedForWeightCacheError("FP8_PB_WO block layers cannot be shared by the weight cache")
    if isinstance(module, Linear):
        return {"cls": "Linear", "weight": put("weight", module.weight), "bias": put("bias", module.bias),
                "dtype": module.dtype.name, "out_dtype": module.out_dtype.name, "reduce_axis": module.reduce_axis}
    if isinstance(module, Embedding):
        return {"cls": "Embedding", "table": put("table", module.table), "dtype": module.dtype.name}
    if isinstance(module, RMSNorm):
        return {"cls": "RMSNorm", "weight": put("weight", module.weight), "eps": module.eps,
                "dtype": module.dtype.name}
    raise UnsupportedForWeightCacheError(f"module {type(module).__name__} cannot be shared by the weight cache")


def rebuild(desc: dict, arrays: dict[str, jax.Array]) -> nnx.Module:
    """Inverse of :func:`describe`: the same module around already-processed device arrays."""
    def get(name):
        if name is None:
            return None
        if name not in arrays:
            raise WeightCacheError(f"weight-cache layout names array {name!r} that the segment does not hold")
        return arrays[name]

    cls = desc.get("cls")
    if cls == "ConcatLinear":
        return ConcatLinear([rebuild(p, arrays) for p in desc["parts"]])
    if cls == "Fp8Linear":
        scale = desc["weight_scale"]
        vector = isinstance(scale, dict) and "scale_vector" in scale
        layer = Fp8Linear(get(desc["weight"]), weight_scale=1.0 if vector else _scale_from_json(scale),
                          input_scale=_scale_from_json(desc["input_scale"]), bias=get(desc["bias"]),
                          dtype=jnp.dtype(desc["dtype"]), backend=desc["backend"], shard_sizes=desc["shard_sizes"],
                          out_dtype=jnp.dtype(desc["out_dtype"]), logical_out=desc["logical_out"],
                          reduce_axis=desc.get("reduce_axis"))
        if vector:  # as parallel._build_rank sets it: device data, not a constant
            value = ScaleVector(get(scale["scale_vector"]))
            layer.weight_scale = nnx.data(value) if hasattr(nnx, "data") else value
        return layer
    if cls == "Linear":
        return Linear(get(desc["weight"]), get(desc["bias"]), dtype=jnp.dtype(desc["dtype"]),
                      out_dtype=jnp.dtype(desc["out_dtype"]), reduce_axis=desc.get("reduce_axis"))
    if cls == "Embedding":
        return Embedding(get(desc["table"]), dtype=jnp.dtype(desc["dtype"]))
    if cls == "RMSNorm":
        return RMSNorm(get(desc["weight"]), eps=desc["eps"], dtype=jnp.dtype(desc["dtype"]))
    raise WeightCacheError(f"weight-cache layout has an unknown module class {cls!r}")


class RecordingSource:
    """Wraps a WeightSource; records each call (in order) and the module or value it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[dict] = []
        self.arrays: dict[str, jax.Array] = {}

    def _key(self) -> str:
        return str(len(self.calls))

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None):
        module = self.inner.linear(prefixes, in_features, out_features, bias, out_dtype=out_dtype)
        self.calls.append({"op": "linear", "args": [list(prefixes), int(in_features),
                                                    [int(n) for n in out_features], bool(bias)],
                           "module": describe(module, self.arrays, self._key())})
        return module

    def embedding(self, name, vocab, hidden):
        module = self.inner.embedding(name, vocab, hidden)
        self.calls.append({"op": "embedding", "args": [name, int(vocab), int(hidden)],
                           "module": describe(module, self.arrays, self._key())})
        return module

    def norm(self, name, size, eps):
        module = self.inner.norm(name, size, eps)
        self.calls.append({"op": "norm", "args": [name, int(size), float(eps)],
                           "module": describe(module, self.arrays, self._key())})
        return module

    def kv_scales(self, attn_prefix):
        value = self.inner.kv_scales(attn_prefix)
        self.calls.append({"op": "kv_scales", "args": [attn_prefix],
                           "value": None if value is None else [float(v) for v in value]})
        return value

    def tied_lm_head_ignored(self, name):
        self.inner.tied_lm_head_ignored(name)
        self.calls.append({"op": "tied_lm_head_ignored", "args": [name]})


class ReplaySource:
    """The builder's WeightSource over a recorded layout and device arrays; reads no checkpoint tensor.

    Each call must match the recorded call at the same position (same op, names and sizes), so a
    layout can never be attached to a model built differently.
    """

    def __init__(self, calls: list[dict], arrays: dict[str, jax.Array]):
        self.calls = calls
        self.arrays = arrays
        self.position = 0

    def _next(self, op: str, args: list) -> dict:
        if self.position >= len(self.calls):
            raise WeightCacheError(f"weight-cache layout has {len(self.calls)} entries; the builder asked for more "
                                   f"({op} {args})")
        call = self.calls[self.position]
        self.position += 1
        if call.get("op") != op or call.get("args") != args:
            raise WeightCacheError(f"weight-cache layout entry {self.position - 1} is {call.get('op')} "
                                   f"{call.get('args')}, but the builder asked for {op} {args}")
        return call

    def finish(self) -> None:
        if self.position != len(self.calls):
            raise WeightCacheError(f"the builder used {self.position} of {len(self.calls)} weight-cache entries")

    def linear(self, prefixes, in_features, out_features, bias, *, out_dtype=None):
        call = self._next("linear", [list(prefixes), int(in_features), [int(n) for n in out_features], bool(bias)])
        return rebuild(call["module"], self.arrays)

    def embedding(self, name, vocab, hidden):
        return rebuild(self._next("embedding", [name, int(vocab), int(hidden)])["module"], self.arrays)

    def norm(self, name, size, eps):
        return rebuild(self._next("norm", [name, int(size), float(eps)])["module"], self.arrays)

    def kv_scales(self, attn_prefix):
        value = self._next("kv_scales", [attn_prefix]).get("value")
        return None if value is None else (float(value[0]), float(value[1]))

    def tied_lm_head_ignored(self, name):
        self._next("tied_lm_head_ignored", [name])
