"""One class per quantization scheme, three verbs each: plan, process, module.

This is the seam between "what is in the checkpoint" and "what the GEMM wants" (the shape of
tpu-inference's fp8 layer):

- ``plan(ckpt, spec, tp)`` checks the headers of one layer's tensors and reads its (small) scale
  tensors into a frozen :class:`~modelopt_jax.quant.plan.LinearPlan`: fused shard sizes, padded
  width, the epilogue, the tensor-parallel role. No weight bytes are read.
- ``process(ckpt, plan, ranks, tp)`` reads the weight bytes and fuses, pads and slices them into
  the arrays of the layer's state, one dict per tensor-parallel rank asked for.
- ``module(plan, ...)`` builds the layer's skeleton (run under ``nnx.eval_shape``: no arrays).

Fusing never changes FP8 codes: shards with unequal per-tensor weight scales keep a per-output-
channel scale vector, and shards whose static activation scales differ keep separate GEMMs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from flax import nnx

from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.checkpoint.safetensors_index import NUMPY_DTYPES, TensorInfo, aligned_empty
from modelopt_jax.errors import (UnsupportedQuantizationError, CheckpointError, ConfigError, DtypeMismatchError, InvalidScaleError,
                                 MissingTensorError, ShapeMismatchError)
from modelopt_jax.layers import BlockFp8Linear, ConcatLinear, Fp8Linear, GroupedLinear, Linear
from modelopt_jax.ops.alignment import N_ALIGN, padded_rows
from modelopt_jax.quant.plan import COLUMN, REPLICATED, ROW, Fp8Epilogue, LinearPlan
from modelopt_jax.static_array import StaticArray

FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_WEIGHT_DTYPES = ("F8_E4M3",)
BLOCK = 128

__all__ = ["LinearSpec", "LinearScheme", "SCHEMES", "scheme_for", "N_ALIGN", "BLOCK", "FLOAT_DTYPES"]


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """A dense layer as the architecture declares it (global sizes, before any split)."""

    path: str                          # module path in the model, e.g. "layers.0.self_attn.qkv"
    prefixes: tuple[str, ...]          # checkpoint Linear prefixes fused into it, in output order
    in_features: int
    out_features: tuple[int, ...]      # N of each prefix
    bias: bool
    role: str = REPLICATED             # tensor-parallel split: COLUMN (N), ROW (K) or REPLICATED
    out_dtype: str | None = None       # None: the compute dtype


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """The experts of one sparse (MoE) layer, as one stacked layer: one LinearSpec per expert (its
    fused gate/up, or its down), all of one shape; planned together into a single [E, N, K] weight."""

    path: str                          # module path in the model, e.g. "layers.1.mlp.gate_up"
    parts: tuple[LinearSpec, ...]      # expert e's layer is parts[e]


# ---- checked reads ---------------------------------------------------------------------------------
def check_header(ckpt: Checkpoint, name: str, dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 role: str) -> TensorInfo:
    """The header of ``name`` if its dtype and shape are as expected; typed errors naming file and tensor."""
    if not ckpt.has(name):
        raise MissingTensorError(
            f"{ckpt.directory}: missing tensor {name!r} ({role}); expected {dtypes[0]}{list(shapes[0])}")
    info = ckpt.info(name)
    if info.dtype not in dtypes:
        raise DtypeMismatchError(
            f"{info.file}: tensor {name!r} ({role}) has dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if info.shape not in [tuple(s) for s in shapes]:
        raise ShapeMismatchError(
            f"{info.file}: tensor {name!r} ({role}) has shape {list(info.shape)}, expected "
            f"{' or '.join(str(list(s)) for s in shapes)} (from config.json)")
    return info


def read_checked(ckpt: Checkpoint, name: str, dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
                 role: str) -> np.ndarray:
    check_header(ckpt, name, dtypes, shapes, role)
    return ckpt.read(name)


def read_scale(ckpt: Checkpoint, name: str, shapes: Sequence[tuple[int, ...]], role: str) -> np.ndarray:
    """Reads a scale tensor as float32 and rejects NaN, inf, zero and negative values."""
    value = read_checked(ckpt, name, ("F32", "BF16", "F16"), shapes, role).astype(np.float32)
    bad = ~(np.isfinite(value) & (value > 0))
    if bad.any():
        # Plain Python numbers, so the message reads "found nan at index [5]" on every numpy version.
        idx = tuple(int(i) for i in np.argwhere(bad)[0]) if value.ndim else ()
        raise InvalidScaleError(
            f"{ckpt.info(name).file}: tensor {name!r} ({role}) must be finite and > 0; found "
            f"{float(value[idx])}" + (f" at index {list(idx)}" if value.ndim else "")
            + f" ({int(bad.sum())} bad of {value.size})")
    return value


def _storage_dtype(ckpt: Checkpoint, names: Sequence[str]) -> str:
    """The dtype fused tensors are stored in: theirs if they agree, else float32 (exact for all)."""
    dtypes = {ckpt.info(n).dtype for n in names}
    return NUMPY_DTYPES[dtypes.pop()].name if len(dtypes) == 1 else "float32"


# ---- assembling arrays -------------------------------------------------------------------------------
def _stack(parts: Sequence[np.ndarray], pad: int = 0, dtype=None, fill: float = 0.0) -> np.ndarray:
    """Rows of ``parts`` (then ``pad`` rows of ``fill``) in one new 64-byte aligned array.

    Aligned because XLA:CPU adopts an aligned host buffer as the device buffer without a copy
    (see ``SafetensorsIndex.read``); a single aligned, contiguous part is returned as is.
    """
    dtype = np.dtype(dtype or parts[0].dtype)
    if len(parts) == 1 and not pad and parts[0].dtype == dtype and parts[0].flags.c_contiguous \
            and parts[0].ctypes.data % 64 == 0:
        return parts[0]
    rows = sum(p.shape[0] for p in parts) + pad
    out = aligned_empty((rows,) + parts[0].shape[1:], dtype)
    start = 0
    for p in parts:
        out[start:start + p.shape[0]] = p
        start += p.shape[0]
    out[start:] = fill
    return out


def _rank_slice(a: np.ndarray, role: str, rank: int, tp: int) -> np.ndarray:
    """Rank ``rank``'s part of a checkpoint tensor: rows (column-parallel) or columns (row-parallel, 2-D)."""
    if tp == 1 or role == REPLICATED or (role == ROW and a.ndim < 2):
        return a
    axis = 0 if role == COLUMN else 1
    size = a.shape[axis] // tp
    return a[rank * size:(rank + 1) * size] if axis == 0 else a[:, rank * size:(rank + 1) * size]


def _local_sizes(spec: LinearSpec, tp: int) -> tuple[tuple[int, ...], int]:
    """(shard sizes, K) of one device's part of ``spec``'s layer."""
    if tp > 1 and spec.role == COLUMN:
        bad = [n for n in spec.out_features if n % tp]
        if bad:
            raise ConfigError(f"{spec.prefixes[0]}: output size {bad[0]} does not divide by tensor parallel size {tp}")
        return tuple(n // tp for n in spec.out_features), spec.in_features
    if tp > 1 and spec.role == ROW:
        if spec.in_features % tp:
            raise ConfigError(f"{spec.prefixes[0]}: input size {spec.in_features} does not divide by tensor "
                              f"parallel size {tp}")
        return tuple(spec.out_features), spec.in_features // tp
    return tuple(spec.out_features), spec.in_features


def _global_shapes(plan: LinearPlan, tp: int) -> list[tuple[int, int]]:
    """Checkpoint shapes [N, K] of the plan's shards (its sizes are one device's)."""
    if tp > 1 and plan.role == COLUMN:
        return [(n * tp, plan.in_features) for n in plan.shard_sizes]
    if tp > 1 and plan.role == ROW:
        return [(n, plan.in_features * tp) for n in plan.shard_sizes]
    return [(n, plan.in_features) for n in plan.shard_sizes]


class LinearScheme:
    """Base: subclasses set ``name`` and implement ``plan``, ``process`` and ``module``."""

    name = "?"
    description = "?"
    weight_dtypes: tuple[str, ...] = FLOAT_DTYPES  # what the checkpoint's weight may be stored as
    weight_role = "weight"                         # how error messages call it

    def plan(self, ckpt: Checkpoint, spec: LinearSpec, tp: int = 1) -> LinearPlan:
        raise NotImplementedError

    def process(self, ckpt: Checkpoint, plan: LinearPlan, ranks: Sequence[int], tp: int = 1) -> list[dict]:
        """One ``{state leaf name: host array}`` per rank in ``ranks``: the fused, padded, sliced
        weight and bias (each checkpoint tensor read once, whatever the number of ranks)."""
        pad = plan.padded_out - plan.out_features
        weights = self._weights(ckpt, plan, ranks, tp, self.weight_dtypes, self.weight_role, pad)
        biases = self._bias(ckpt, plan, ranks, tp, pad)
        return [_leaves(weight=w, bias=b) for w, b in zip(weights, biases)]

    def module(self, plan: LinearPlan, *, dtype, backend: str, reduce_axis: str | None) -> nnx.Module:
        raise NotImplementedError

    # shared pieces -------------------------------------------------------------------------------
    def _bias(self, ckpt, plan: LinearPlan, ranks, tp, pad: int) -> list[np.ndarray | None]:
        if plan.bias_dtype is None:
            return [None] * len(ranks)
        full = [read_checked(ckpt, f"{p}.bias", FLOAT_DTYPES, [(n,)], "bias")
                for p, (n, _) in zip(plan.prefixes, _global_shapes(plan, tp))]
        return [_stack([_rank_slice(b, plan.role, r, tp) for b in full], pad, plan.bias_dtype) for r in ranks]

    def _bias_dtype(self, ckpt, spec: LinearSpec) -> str | None:
        if not spec.bias:
            return None
        for p, n in zip(spec.prefixes, spec.out_features):
            check_header(ckpt, f"{p}.bias", FLOAT_DTYPES, [(n,)], "bias")
        return _storage_dtype(ckpt, [f"{p}.bias" for p in spec.prefixes])

    def _weights(self, ckpt, plan: LinearPlan, ranks, tp, dtypes, role: str, pad: int) -> list[np.ndarray]:
        full = [read_checked(ckpt, f"{p}.weight", dtypes, [shape], role)
                for p, shape in zip(plan.prefixes, _global_shapes(plan, tp))]
        return [_stack([_rank_slice(w, plan.role, r, tp) for w in full], pad, plan.weight_dtype) for r in ranks]

    def _concat(self, ckpt, spec: LinearSpec, tp: int) -> LinearPlan:
        """Separate GEMMs on the same input, one per shard (when one GEMM would not be exact)."""
        parts = tuple(self.plan(ckpt, dataclasses.replace(spec, prefixes=(p,), out_features=(n,)), tp)
                      for p, n in zip(spec.prefixes, spec.out_features))
        sizes, k = _local_sizes(spec, tp)
        return LinearPlan("concat", spec.prefixes, k, sizes, sum(p.padded_out for p in parts), "mixed",
                          role=spec.role, out_dtype=spec.out_dtype, parts=parts)


class Unquantized(LinearScheme):
    """Excluded modules (or an unquantized checkpoint): weight in the checkpoint's float dtype."""

    name = "unquantized"
    description = "unquantized"

    def plan(self, ckpt, spec, tp=1):
        role = "weight of a module that is not quantized"
        if ckpt.quant_config.is_quantized:
            rule = ckpt.quant_config.exclusion_rule(spec.prefixes[0])
            role = f"weight of a module excluded from quantization by {rule}" if rule else role
        for p, n in zip(spec.prefixes, spec.out_features):
            check_header(ckpt, f"{p}.weight", FLOAT_DTYPES, [(n, spec.in_features)], role)
            for suffix in ("weight_scale", "input_scale"):
                if ckpt.has(f"{p}.{suffix}"):
                    raise CheckpointError(
                        f"{ckpt.info(f'{p}.{suffix}').file}: {p}.{suffix} exists but {p} is "
                        f"{'excluded from quantization' if ckpt.quant_config.is_quantized else 'not quantized'}; "
                        f"the checkpoint and its quantization config disagree")
        sizes, k = _local_sizes(spec, tp)
        return LinearPlan(self.name, spec.prefixes, k, sizes, sum(sizes),
                          _storage_dtype(ckpt, [f"{p}.weight" for p in spec.prefixes]),
                          self._bias_dtype(ckpt, spec), spec.role, spec.out_dtype)

    def module(self, plan, *, dtype, backend, reduce_axis):
        return Linear(plan, dtype=dtype, reduce_axis=reduce_axis)


class Fp8PerTensor(LinearScheme):
    """quant_algo FP8: scalar weight_scale and static scalar input_scale per checkpoint Linear."""

    name = "fp8"
    description = "fp8 per-tensor (static activations)"
    weight_dtypes = FP8_WEIGHT_DTYPES
    weight_role = "FP8 weight"

    def plan(self, ckpt, spec, tp=1):
        w_scales, x_scales = [], []
        for p, n in zip(spec.prefixes, spec.out_features):
            check_header(ckpt, f"{p}.weight", FP8_WEIGHT_DTYPES, [(n, spec.in_features)], "FP8 weight")
            w_scales.append(float(read_scale(ckpt, f"{p}.weight_scale", [(), (1,)], "per-tensor weight scale")
                                  .reshape(())))
            x_scales.append(float(read_scale(ckpt, f"{p}.input_scale", [(), (1,)], "static activation scale")
                                  .reshape(())))
        if len(set(x_scales)) > 1:
            # Different activation scales: one GEMM would change the activation FP8 codes.
            return self._concat(ckpt, spec, tp)
        sizes, k = _local_sizes(spec, tp)
        padded = padded_rows(sum(sizes))
        if len(set(w_scales)) == 1:
            w_scale = w_scales[0]
        else:  # unequal shard scales: one per output channel; a device's layout repeats on every device
            w_scale = np.repeat(np.asarray(w_scales + [1.0], np.float32), list(sizes) + [padded - sum(sizes)])
        return LinearPlan(self.name, spec.prefixes, k, sizes, padded, "float8_e4m3fn", self._bias_dtype(ckpt, spec),
                          spec.role, spec.out_dtype, input_scale=x_scales[0],
                          epilogue=Fp8Epilogue.fold(x_scales[0], w_scale))

    def module(self, plan, *, dtype, backend, reduce_axis):
        return Fp8Linear(plan, dtype=dtype, backend=backend, reduce_axis=reduce_axis)


class Fp8PerChannelPerToken(Fp8PerTensor):
    """quant_algo FP8_PER_CHANNEL_PER_TOKEN: weight_scale [N], dynamic per-token activation scales.

    Under tensor parallelism a column-parallel layer's per-channel scales differ per device, so
    they cannot be one compile-time constant: the plan says so (``col_is_data``) and the scales
    become a sharded state leaf. Decided from the scheme and role, never from the values, so every
    host of a multi-host mesh builds the same program.
    """

    name = "fp8_pc_pt"
    description = "fp8 per-channel weights, per-token activations"

    def plan(self, ckpt, spec, tp=1):
        scales = [self._scale(ckpt, p, n, spec.in_features) for p, n in zip(spec.prefixes, spec.out_features)]
        sizes, k = _local_sizes(spec, tp)
        padded = padded_rows(sum(sizes))
        if tp > 1 and spec.role == COLUMN:
            epilogue = Fp8Epilogue.fold(None, None, col_is_data=True)
        else:
            epilogue = Fp8Epilogue.fold(None, _stack(scales, padded - sum(sizes), np.float32, fill=1.0))
        return LinearPlan(self.name, spec.prefixes, k, sizes, padded, "float8_e4m3fn", self._bias_dtype(ckpt, spec),
                          spec.role, spec.out_dtype, epilogue=epilogue)

    @staticmethod
    def _scale(ckpt, prefix, n, k) -> np.ndarray:
        check_header(ckpt, f"{prefix}.weight", FP8_WEIGHT_DTYPES, [(n, k)], "FP8 weight")
        if ckpt.has(f"{prefix}.input_scale"):
            raise CheckpointError(
                f"{ckpt.info(prefix + '.input_scale').file}: {prefix}.input_scale is present but quant_algo "
                f"FP8_PER_CHANNEL_PER_TOKEN computes activation scales per token; refusing to guess which applies")
        return read_scale(ckpt, f"{prefix}.weight_scale", [(n,), (n, 1)], "per-channel weight scale").reshape(n)

    def process(self, ckpt, plan, ranks, tp=1):
        out = super().process(ckpt, plan, ranks, tp)
        if plan.epilogue.col_is_data:
            pad = plan.padded_out - plan.out_features
            full = [self._scale(ckpt, p, n, k) for p, (n, k) in zip(plan.prefixes, _global_shapes(plan, tp))]
            for leaves, r in zip(out, ranks):
                leaves["col_scale"] = _stack([_rank_slice(s, plan.role, r, tp) for s in full], pad, np.float32, 1.0)
        return out


class Fp8BlockWeightOnly(LinearScheme):
    """quant_algo FP8_PB_WO: one weight scale per 128x128 block, activations stay in compute dtype."""

    name = "fp8_pb_wo"
    description = "fp8 128x128 block weights, unquantized activations"
    weight_dtypes = FP8_WEIGHT_DTYPES
    weight_role = "FP8 weight"

    def plan(self, ckpt, spec, tp=1):
        if tp > 1 and spec.role != REPLICATED:
            raise ConfigError(f"{spec.prefixes[0]}: FP8_PB_WO under tensor parallelism is not supported "
                              f"(its 128x128 block scales span the shards)")
        if len(spec.prefixes) > 1 and any(n % BLOCK for n in spec.out_features[:-1]):
            # A shard boundary inside a block: the scale grids cannot simply be stacked.
            return self._concat(ckpt, spec, tp)
        grids = []
        for p, n in zip(spec.prefixes, spec.out_features):
            check_header(ckpt, f"{p}.weight", FP8_WEIGHT_DTYPES, [(n, spec.in_features)], "FP8 weight")
            nb, kb = math.ceil(n / BLOCK), math.ceil(spec.in_features / BLOCK)
            grids.append(read_scale(ckpt, f"{p}.weight_scale", [(nb, 1, kb, 1), (nb, kb)],
                                    f"{BLOCK}x{BLOCK} block weight scale").reshape(nb, kb))
        sizes = tuple(spec.out_features)
        return LinearPlan(self.name, spec.prefixes, spec.in_features, sizes, sum(sizes), "float8_e4m3fn",
                          self._bias_dtype(ckpt, spec), spec.role, spec.out_dtype,
                          block_scales=StaticArray(np.concatenate(grids, axis=0)))

    def module(self, plan, *, dtype, backend, reduce_axis):
        return BlockFp8Linear(plan, dtype=dtype, reduce_axis=reduce_axis)


class Concat(LinearScheme):
    """Several layers on the same input, outputs concatenated (planned by the schemes above)."""

    name = "concat"
    description = "separate GEMMs per shard"

    def process(self, ckpt, plan, ranks, tp=1):
        out = [{} for _ in ranks]
        for i, part in enumerate(plan.parts):
            for leaves, part_leaves in zip(out, SCHEMES[part.scheme].process(ckpt, part, ranks, tp)):
                leaves.update({f"parts.{i}.{k}": v for k, v in part_leaves.items()})
        return out

    def module(self, plan, *, dtype, backend, reduce_axis):
        return ConcatLinear([SCHEMES[p.scheme].module(p, dtype=dtype, backend=backend, reduce_axis=reduce_axis)
                             for p in plan.parts])


class Experts(LinearScheme):
    """A sparse layer's experts stacked into one weight [E, N, K] (one buffer, one op per layer).

    Each expert is first planned by its own scheme (so headers, scales and tensor-parallel slices
    are checked exactly as for a dense layer); this scheme then requires what one grouped GEMM
    needs -- the same scheme, shape and input scale for every expert (ModelOpt calibrates one input
    quantizer per layer) -- and folds each expert's epilogue into a row of per-expert output-channel
    factors ``epilogue.col`` [E, N] (alpha folded in), or a state leaf under tensor parallelism
    (``col_is_data``: per-channel scales differ per device).
    """

    name = "experts"
    description = "experts stacked [E, N, K]"
    STACKABLE = ("fp8", "fp8_pc_pt", "unquantized")

    def stack(self, ckpt, path: str, parts: Sequence[LinearPlan]) -> LinearPlan:
        first = parts[0]
        for part in parts:
            if part.scheme == "concat":
                raise CheckpointError(f"{ckpt.directory}: {' and '.join(part.prefixes)} have different input scales; "
                                      f"an expert's gate and up read the same input and ModelOpt gives them one")
            if part.scheme not in self.STACKABLE:
                raise UnsupportedQuantizationError(f"{ckpt.directory}: {part.prefixes[0]} is {part.scheme}; experts "
                                                   f"support {', '.join(self.STACKABLE)}")
            same = ("scheme", "in_features", "shard_sizes", "padded_out", "weight_dtype", "bias_dtype")
            differs = [f for f in same if getattr(part, f) != getattr(first, f)]
            if differs:
                raise CheckpointError(f"{ckpt.directory}: experts {first.prefixes[0]} and {part.prefixes[0]} differ in "
                                      f"{', '.join(differs)}; every expert of a layer must be alike")
            if part.input_scale != first.input_scale:
                raise CheckpointError(
                    f"{ckpt.directory}: {path}: the experts have different input scales "
                    f"({first.prefixes[0]}.input_scale = {first.input_scale!r}, {part.prefixes[0]}.input_scale = "
                    f"{part.input_scale!r}); ModelOpt writes one per layer, shared by all experts")
        epilogue = None
        if first.epilogue is not None:
            if first.epilogue.col_is_data:
                epilogue = first.epilogue
            else:
                rows = [p.epilogue.col.array if p.epilogue.col is not None
                        else np.full(p.padded_out, p.epilogue.alpha, np.float32) for p in parts]
                epilogue = Fp8Epilogue(col=StaticArray(np.stack(rows).astype(np.float32)),
                                       per_token=first.epilogue.per_token)
        return LinearPlan(self.name, tuple(p for part in parts for p in part.prefixes), first.in_features,
                          first.shard_sizes, first.padded_out, first.weight_dtype, None, first.role, first.out_dtype,
                          input_scale=first.input_scale, epilogue=epilogue, parts=tuple(parts))

    def process(self, ckpt, plan, ranks, tp=1):
        per_expert = [SCHEMES[p.scheme].process(ckpt, p, ranks, tp) for p in plan.parts]
        out = []
        for r in range(len(ranks)):
            leaves = {}
            for key in per_expert[0][r]:
                arrays = [expert[r][key] for expert in per_expert]
                stacked = aligned_empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
                for e, a in enumerate(arrays):
                    stacked[e] = a
                leaves[key] = stacked
            out.append(leaves)
        return out

    def module(self, plan, *, dtype, backend, reduce_axis):
        return GroupedLinear(plan, dtype=dtype, backend=backend, reduce_axis=reduce_axis)


def plan_linear(ckpt: Checkpoint, spec: "LinearSpec | ExpertsSpec", tp: int = 1) -> LinearPlan:
    """The plan of a dense layer, or of a sparse layer's stacked experts."""
    if isinstance(spec, ExpertsSpec):
        return SCHEMES["experts"].stack(ckpt, spec.path, [scheme_for(ckpt, p.prefixes).plan(ckpt, p, tp)
                                                          for p in spec.parts])
    return scheme_for(ckpt, spec.prefixes).plan(ckpt, spec, tp)


def _leaves(**arrays) -> dict:
    return {k: v for k, v in arrays.items() if v is not None}


SCHEMES: dict[str, LinearScheme] = {s.name: s for s in (Unquantized(), Fp8PerTensor(), Fp8PerChannelPerToken(),
                                                         Fp8BlockWeightOnly(), Concat(), Experts())}
# quant_algo in the checkpoint's config -> scheme
BY_QUANT_ALGO = {None: "unquantized", "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8_pc_pt", "FP8_PB_WO": "fp8_pb_wo"}


def scheme_for(ckpt: Checkpoint, prefixes: Sequence[str]) -> LinearScheme:
    """The scheme of a (fused) layer; every shard must be quantized, or excluded, alike."""
    quant = ckpt.quant_config
    if not quant.is_quantized:
        return SCHEMES["unquantized"]
    excluded = {p: quant.exclusion_rule(p) for p in prefixes}
    if len({rule is None for rule in excluded.values()}) > 1:
        detail = ", ".join(f"{p}: {'excluded by ' + r if r else 'quantized'}" for p, r in excluded.items())
        raise ConfigError(
            f"{' and '.join(quant.sources)}: the fused layer made of {', '.join(prefixes)} mixes "
            f"excluded and quantized shards ({detail}); they must be quantized (or excluded) together")
    return SCHEMES["unquantized" if next(iter(excluded.values())) else BY_QUANT_ALGO[quant.quant_algo]]
