"""What every layer of a model *is*, decided once from headers and scales, before any weight bytes.

A :class:`LinearPlan` is frozen and JSON-serialisable: the scheme, the shard sizes, the padded
width, the epilogue (:class:`Fp8Epilogue`), block scales and the tensor-parallel role. A
:class:`ModelPlan` holds one per dense layer plus the plain tensors (embedding, norms) and the
checkpoint's FP8 KV-cache scales. The same plan drives three things, so they cannot disagree:
``process`` (which bytes go where), the module skeleton (built under ``nnx.eval_shape``), and the
weight cache (a daemon ships the plan with its buffers; a client rebuilds the skeleton from it).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np

from modelopt_jax.errors import WeightCacheError
from modelopt_jax.ops.epilogue import Fp8Epilogue
from modelopt_jax.static_array import StaticArray

# Tensor-parallel roles: which axis of the weight [N, K] is split over the mesh.
COLUMN, ROW, REPLICATED = "column", "row", "replicated"
ROLES = (COLUMN, ROW, REPLICATED)
# The mesh axis tensor parallelism splits over (jax.sharding.Mesh axis name).
TP_AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """One dense layer (a single checkpoint Linear or fused shards) as this process will build it.

    Sizes are per device: under tensor parallelism ``shard_sizes``/``in_features`` are one rank's.
    """

    scheme: str                        # SCHEMES key: "unquantized", "fp8", "fp8_pc_pt", "fp8_pb_wo", "concat"
    prefixes: tuple[str, ...]          # checkpoint Linear prefixes fused into this layer
    in_features: int                   # K of this device's weight
    shard_sizes: tuple[int, ...]       # N of each fused shard on this device
    padded_out: int                    # rows of the stored weight (N zero-padded for the GEMM kernels)
    weight_dtype: str                  # storage dtype of the weight
    bias_dtype: str | None = None      # None: no bias
    role: str = REPLICATED             # COLUMN, ROW or REPLICATED (tensor parallelism)
    out_dtype: str | None = None       # None: the compute dtype
    input_scale: float | None = None   # static activation scale (FP8 per-tensor)
    epilogue: Fp8Epilogue | None = None
    block_scales: StaticArray | None = None  # FP8_PB_WO: [N/128, K/128]
    parts: tuple["LinearPlan", ...] = ()     # scheme "concat": separate GEMMs on the same input

    @property
    def out_features(self) -> int:
        return sum(self.shard_sizes)


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """A plain tensor read as is (embedding table, norm weight); replicated under TP."""

    name: str                          # checkpoint tensor name
    shape: tuple[int, ...]
    dtype: str                         # storage dtype


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """Everything the skeleton and ``process`` need: state path -> plan, plus KV-cache scales."""

    family: str
    dtype: str                                        # compute dtype
    backend: str                                      # FP8 GEMM backend
    tensor_parallel: int
    linears: tuple[tuple[str, LinearPlan], ...]       # (module path, plan), in checkpoint order
    tensors: tuple[tuple[str, TensorPlan], ...]       # (parameter path, plan)
    kv_scales: tuple[tuple[float, float], ...] | None  # per layer (k_scale, v_scale); None: no FP8 KV

    def linear(self, path: str) -> LinearPlan:
        return dict(self.linears)[path]

    def tensor(self, path: str) -> TensorPlan:
        return dict(self.tensors)[path]

    def to_json(self) -> str:
        return json.dumps(_encode(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> "ModelPlan":
        try:
            plan = _decode(json.loads(text), ModelPlan)
        except (KeyError, TypeError, ValueError) as e:
            raise WeightCacheError(f"not a valid model plan: {e!r}") from e
        if not isinstance(plan, ModelPlan):
            raise WeightCacheError(f"not a valid model plan: a JSON {type(plan).__name__}, not a ModelPlan object")
        return plan


_CLASSES = {c.__name__: c for c in (Fp8Epilogue, LinearPlan, TensorPlan, ModelPlan)}


def _encode(value) -> Any:
    if isinstance(value, StaticArray):  # raw bytes, base64: a 70B per-channel vector has millions of floats
        a = np.ascontiguousarray(value.array)
        return {"__array__": base64.b64encode(a.tobytes()).decode("ascii"), "dtype": a.dtype.name,
                "shape": list(a.shape)}
    if dataclasses.is_dataclass(value):
        return {"__class__": type(value).__name__,
                **{f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(value, expected=None) -> Any:
    if isinstance(value, dict) and "__array__" in value:
        raw = base64.b64decode(value["__array__"], validate=True)
        return StaticArray(np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]))
    if isinstance(value, dict) and "__class__" in value:
        cls = _CLASSES[value["__class__"]]
        if expected is not None and cls is not expected:
            raise TypeError(f"expected {expected.__name__}, found {cls.__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(value) - {"__class__"} != names:
            raise KeyError(f"{cls.__name__} fields {sorted(set(value) - {'__class__'})}, expected {sorted(names)}")
        return cls(**{k: _decode(v) for k, v in value.items() if k != "__class__"})
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value
