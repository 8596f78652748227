"""Flax NNX dense layers: FP8 (per-tensor, per-channel/per-token, block weight-only) and plain.

Every layer is built from its plan (:mod:`modelopt_jax.quant.plan`) with zero-filled parameters,
under ``nnx.eval_shape`` so no memory is touched; the loader then fills the state. Weights are NNX
``Param``s in the checkpoint's storage dtype, each tagged with the axis tensor parallelism splits
(``tp_axis``). Scales are static attributes (the plan's epilogue: Python floats or
:class:`~modelopt_jax.static_array.StaticArray`), so ``nnx.split`` leaves them in the graph
definition and ``jax.jit`` compiles them in as constants; they are never jit arguments.
``dtype`` is the compute dtype and, unless ``out_dtype`` says otherwise, the output dtype (the lm_head
writes float32 logits: rounding logits of magnitude ~20 to bf16 would cost ~0.1). Storage dtypes
are whatever the checkpoint holds.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from modelopt_jax.ops.gemm import scaled_fp8_gemm
from modelopt_jax.ops.grouped_gemm import grouped_fp8_gemm
from modelopt_jax.ops.quantize import dequantize_blockwise, quantize_per_token, quantize_static
from modelopt_jax.quant.plan import COLUMN, ROW, LinearPlan, TensorPlan


def _precision(dtype) -> jax.lax.Precision:
    # float32 compute must mean float32 math on GPU/TPU too (no TF32 / bf16 passes).
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _reduce(y: jax.Array, bias: jax.Array | None, axis: str, out_dtype) -> jax.Array:
    """Row-parallel epilogue: sum the partial products of all shards, then add the bias once."""
    y = jax.lax.psum(y, axis)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(out_dtype)
    return y


class ScaleVector(nnx.Variable):
    """A per-output-channel weight scale held as device data instead of a compile-time constant.

    Only used under tensor parallelism (the plan's ``epilogue.col_is_data``), where each device's
    slice of a column-parallel layer has different per-channel scales (a constant must be the same
    on every device).
    """


def _dense(x: jax.Array, w: jax.Array, bias: jax.Array | None, dtype, out_dtype=None) -> jax.Array:
    """x @ w.T (+ bias) with w stored [N, K]; float32 accumulation, result in ``out_dtype``."""
    y = jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            precision=_precision(dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or dtype)


def _dense_layer(x, w, bias_param, dtype, out_dtype, reduce_axis: str | None) -> jax.Array:
    """An unquantized layer's output; under row parallelism the bias is added after the all-reduce."""
    bias = None if bias_param is None else bias_param[...]
    if reduce_axis:
        return _reduce(_dense(x, w, None, dtype, out_dtype), bias, reduce_axis, out_dtype)
    return _dense(x, w, bias, dtype, out_dtype)


def _param(shape, dtype, tp_axis: int | None, variable=nnx.Param) -> nnx.Variable:
    """A zero-filled parameter (the loader fills it; modules are built under ``nnx.eval_shape``).

    ``tp_axis`` is the array axis split over the tensor-parallel mesh axis (None: replicated): the
    one piece of sharding information, read by :func:`modelopt_jax.parallel.state_specs`.
    """
    return variable(jnp.zeros(tuple(shape), jnp.dtype(dtype)), tp_axis=tp_axis)


def _split_axes(role: str) -> tuple[int | None, int | None]:
    """(weight axis, bias axis) split over the mesh for a tensor-parallel role."""
    return {COLUMN: (0, 0), ROW: (1, None)}.get(role, (None, None))


class Linear(nnx.Module):
    """Unquantized dense layer (modules excluded from quantization keep the checkpoint dtype)."""

    def __init__(self, plan: LinearPlan, *, dtype=jnp.bfloat16, reduce_axis: str | None = None):
        w_axis, b_axis = _split_axes(plan.role)
        self.weight = _param((plan.padded_out, plan.in_features), plan.weight_dtype, w_axis)
        self.bias = _param((plan.padded_out,), plan.bias_dtype, b_axis) if plan.bias_dtype else None
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(plan.out_dtype or dtype)
        self.reduce_axis = reduce_axis  # tensor parallelism: psum partial outputs over this mesh axis

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dense_layer(x, self.weight[...], self.bias, self.dtype, self.out_dtype, self.reduce_axis)


class Fp8Linear(nnx.Module):
    """FP8 weight [N, K] x FP8 activation, through :func:`modelopt_jax.ops.gemm.scaled_fp8_gemm`.

    Static facts come from the plan: ``input_scale`` (a float for static per-tensor activation
    scales, quant_algo ``FP8``; None for dynamic per-token scales) and ``epilogue`` (alpha, the
    per-channel vector as a constant, or ``col_scale`` as a state leaf under tensor parallelism).
    ``logical_out`` < N means the weight rows were zero-padded at load time; outputs are sliced
    back to the logical width. ``reduce_axis`` names the mesh axis that row-parallel partial
    outputs are summed over.
    """

    def __init__(self, plan: LinearPlan, *, dtype=jnp.bfloat16, backend: str = "auto",
                 reduce_axis: str | None = None):
        if plan.weight_dtype != "float8_e4m3fn":
            raise TypeError(f"Fp8Linear needs a float8_e4m3fn weight, got {plan.weight_dtype}")
        w_axis, b_axis = _split_axes(plan.role)
        self.weight = _param((plan.padded_out, plan.in_features), plan.weight_dtype, w_axis)
        self.bias = _param((plan.padded_out,), plan.bias_dtype, b_axis) if plan.bias_dtype else None
        self.col_scale = (_param((plan.padded_out,), jnp.float32, w_axis, ScaleVector)
                          if plan.epilogue.col_is_data else None)
        self.epilogue = plan.epilogue
        self.input_scale = plan.input_scale
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(plan.out_dtype or dtype)
        self.backend = backend
        self.logical_out = plan.out_features
        self.shard_sizes = tuple(plan.shard_sizes)
        self.reduce_axis = reduce_axis

    @property
    def out_features(self) -> int:
        return self.logical_out

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.epilogue.per_token:
            x_q, row = quantize_per_token(x)
        else:
            x_q, row = quantize_static(x, self.input_scale), None
        bias = None if self.bias is None else self.bias[...]
        col = None if self.col_scale is None else self.col_scale[...]
        y = scaled_fp8_gemm(x_q, self.weight[...], self.epilogue, row=row, col=col,
                            bias=None if self.reduce_axis else bias, out_dtype=self.out_dtype, backend=self.backend)
        if self.reduce_axis:
            y = _reduce(y, bias, self.reduce_axis, self.out_dtype)
        return y if self.logical_out == y.shape[-1] else y[..., :self.logical_out]


class BlockFp8Linear(nnx.Module):
    """FP8 weight with one scale per 128x128 block, activations unquantized (``FP8_PB_WO``).

    The weight is dequantized inside the program (float32, then the compute dtype) right before
    the dot, so device memory holds FP8 codes only.
    """

    def __init__(self, plan: LinearPlan, *, dtype=jnp.bfloat16, block: int = 128, reduce_axis: str | None = None):
        w_axis, b_axis = _split_axes(plan.role)
        self.weight = _param((plan.padded_out, plan.in_features), plan.weight_dtype, w_axis)
        self.bias = _param((plan.padded_out,), plan.bias_dtype, b_axis) if plan.bias_dtype else None
        self.reduce_axis = reduce_axis
        self.block_scales = plan.block_scales
        self.block = block
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(plan.out_dtype or dtype)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        w = dequantize_blockwise(self.weight[...], self.block_scales.array, self.block)
        return _dense_layer(x, w, self.bias, self.dtype, self.out_dtype, self.reduce_axis)


class ConcatLinear(nnx.Module):
    """Several dense layers on the same input with outputs concatenated.

    Used for a fused q/k/v or gate/up layer whose shards cannot share one GEMM exactly (their
    static activation scales differ, so the same input quantizes to different FP8 codes).
    """

    def __init__(self, parts: Sequence[nnx.Module]):
        self.parts = nnx.List(parts)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([p(x) for p in self.parts], axis=-1)


class RMSNorm(nnx.Module):
    """RMSNorm as Hugging Face computes it: normalize in float32, cast, then scale by the weight."""

    def __init__(self, plan: TensorPlan, *, eps: float, dtype=jnp.bfloat16):
        self.weight = _param(plan.shape, plan.dtype, None)
        self.eps = float(eps)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(self.eps))
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Router(nnx.Module):
    """An MoE layer's router: its weight [num_experts, hidden] in the checkpoint's dtype (replicated under TP)."""

    def __init__(self, plan: TensorPlan):
        self.weight = _param(plan.shape, plan.dtype, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 router logits [..., num_experts] (neither input nor weight is quantized)."""
        return jax.lax.dot_general(x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
                                   (((x.ndim - 1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden] in the checkpoint dtype; can also act as a tied lm_head."""

    def __init__(self, plan: TensorPlan, *, dtype=jnp.bfloat16):
        self.table = _param(plan.shape, plan.dtype, None)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied lm_head), float32."""
        return _dense(x, self.table[...], None, self.dtype, jnp.float32)


class GroupedLinear(nnx.Module):
    """A sparse layer's experts as one stacked weight [E, N, K]: ``(x [M, K] sorted by expert,
    group_sizes [E]) -> [M, N]``, each expert's rows through its weight only.

    FP8 experts run :func:`modelopt_jax.ops.grouped_gemm.grouped_fp8_gemm` on the input quantized
    once (the layer's one static input scale, or per-token scales), each row then scaled by its
    expert's output-channel factors (``epilogue.col`` [E, N], input and weight scales folded in; a
    state leaf ``col_scale`` under tensor parallelism). Unquantized experts run ``ragged_dot`` in
    the compute dtype.
    """

    def __init__(self, plan: LinearPlan, *, dtype=jnp.bfloat16, backend: str = "auto",
                 reduce_axis: str | None = None):
        experts = len(plan.parts)
        w_axis = {COLUMN: 1, ROW: 2}.get(plan.role)
        self.weight = _param((experts, plan.padded_out, plan.in_features), plan.weight_dtype, w_axis)
        self.epilogue = plan.epilogue  # None: unquantized experts
        self.col_scale = (_param((experts, plan.padded_out), jnp.float32, 1 if plan.role == COLUMN else None,
                                 ScaleVector) if plan.epilogue is not None and plan.epilogue.col_is_data else None)
        self.input_scale = plan.input_scale
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(plan.out_dtype or dtype)
        self.backend = backend if backend in ("xla", "ffi") else "auto"  # dense-GEMM backends map to "auto"
        self.logical_out = plan.out_features
        self.reduce_axis = reduce_axis

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        if self.epilogue is None:
            y = jax.lax.ragged_dot(x.astype(self.dtype), jnp.swapaxes(self.weight[...], 1, 2).astype(self.dtype),
                                   group_sizes, precision=_precision(self.dtype), preferred_element_type=jnp.float32)
            y = y.astype(self.out_dtype)
        else:
            if self.epilogue.per_token:
                x_q, row = quantize_per_token(x)
            else:
                x_q, row = quantize_static(x, self.input_scale), None
            col = self.col_scale[...] if self.col_scale is not None else self.epilogue.col.array
            y = grouped_fp8_gemm(x_q, self.weight[...], group_sizes, col, row=row, out_dtype=self.out_dtype,
                                 backend=self.backend)
        if self.reduce_axis:
            y = jax.lax.psum(y, self.reduce_axis)
        return y if self.logical_out == y.shape[-1] else y[..., :self.logical_out]
