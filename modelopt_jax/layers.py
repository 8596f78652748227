"""Flax NNX dense layers: FP8 (per-tensor, per-channel/per-token, block weight-only) and plain.

Weights are NNX ``Param``s (device arrays, in the checkpoint's storage dtype). Scales are static
attributes -- Python floats or :class:`StaticArray` -- so ``nnx.split`` leaves them in the graph
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

from modelopt_jax.ops.gemm import fp8_gemm
from modelopt_jax.ops.quantize import dequantize_blockwise, quantize_per_token, quantize_static
from modelopt_jax.static_array import StaticArray


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

    Only used under tensor parallelism, where each device's slice of a column-parallel layer has
    different per-channel scales (a constant must be the same on every device).
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


class Linear(nnx.Module):
    """Unquantized dense layer (modules excluded from quantization keep the checkpoint dtype)."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None = None, *, dtype=jnp.bfloat16, out_dtype=None,
                 reduce_axis: str | None = None):
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(out_dtype or dtype)
        self.reduce_axis = reduce_axis  # tensor parallelism: psum partial outputs over this mesh axis

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        return _dense_layer(x, self.weight[...], self.bias, self.dtype, self.out_dtype, self.reduce_axis)


class Fp8Linear(nnx.Module):
    """FP8 weight [N, K] x FP8 activation, through :func:`modelopt_jax.ops.fp8_gemm`.

    ``input_scale`` is a float for static per-tensor activation scales (quant_algo ``FP8``) or
    ``None`` for dynamic per-token scales (``FP8_PER_CHANNEL_PER_TOKEN``). ``weight_scale`` is a
    float or a length-N ``StaticArray`` (per-channel weights, or a fused layer whose shards had
    different per-tensor scales). ``shard_sizes`` records the output widths of fused shards.
    ``logical_out`` < N means the weight rows were zero-padded at load time (GEMM kernels want N
    in multiples of 16); outputs are sliced back to the logical width. Under tensor parallelism
    ``weight_scale`` may be a :class:`ScaleVector` and ``reduce_axis`` names the mesh axis that
    row-parallel partial outputs are summed over.
    """

    def __init__(self, weight: jax.Array, *, weight_scale: float | StaticArray, input_scale: float | None,
                 bias: jax.Array | None = None, dtype=jnp.bfloat16, backend: str = "auto",
                 shard_sizes: Sequence[int] = (), out_dtype=None, logical_out: int | None = None,
                 reduce_axis: str | None = None):
        if weight.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"Fp8Linear needs a float8_e4m3fn weight, got {weight.dtype}")
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.weight_scale = weight_scale
        self.input_scale = input_scale
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(out_dtype or dtype)
        self.backend = backend
        self.logical_out = int(logical_out or weight.shape[0])
        self.shard_sizes = tuple(shard_sizes) or (self.logical_out,)
        self.reduce_axis = reduce_axis

    @property
    def out_features(self) -> int:
        return self.logical_out

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.input_scale is None:
            x_q, x_scale = quantize_per_token(x)
        else:
            x_q, x_scale = quantize_static(x, self.input_scale), self.input_scale
        w_scale = self.weight_scale[...] if isinstance(self.weight_scale, nnx.Variable) else self.weight_scale
        bias = None if self.bias is None else self.bias[...]
        y = fp8_gemm(x_q, self.weight[...], x_scale=x_scale, w_scale=w_scale,
                     bias=None if self.reduce_axis else bias, out_dtype=self.out_dtype, backend=self.backend)
        if self.reduce_axis:
            y = _reduce(y, bias, self.reduce_axis, self.out_dtype)
        return y if self.logical_out == y.shape[-1] else y[..., :self.logical_out]


class BlockFp8Linear(nnx.Module):
    """FP8 weight with one scale per 128x128 block, activations unquantized (``FP8_PB_WO``).

    The weight is dequantized inside the program (float32, then the compute dtype) right before
    the dot, so device memory holds FP8 codes only.
    """

    def __init__(self, weight: jax.Array, *, block_scales: StaticArray, bias: jax.Array | None = None,
                 dtype=jnp.bfloat16, block: int = 128, out_dtype=None, reduce_axis: str | None = None):
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.reduce_axis = reduce_axis
        self.block_scales = block_scales
        self.block = block
        self.dtype = jnp.dtype(dtype)
        self.out_dtype = jnp.dtype(out_dtype or dtype)

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
        self.parts = nnx.List(parts) if hasattr(nnx, "List") else list(parts)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([p(x) for p in self.parts], axis=-1)


class RMSNorm(nnx.Module):
    """RMSNorm as Hugging Face computes it: normalize in float32, cast, then scale by the weight."""

    def __init__(self, weight: jax.Array, *, eps: float, dtype=jnp.bfloat16):
        self.weight = nnx.Param(weight)
        self.eps = float(eps)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(self.eps))
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden] in the checkpoint dtype; can also act as a tied lm_head."""

    def __init__(self, table: jax.Array, *, dtype=jnp.bfloat16):
        self.table = nnx.Param(table)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding table (tied lm_head), float32."""
        return _dense(x, self.table[...], None, self.dtype, jnp.float32)
