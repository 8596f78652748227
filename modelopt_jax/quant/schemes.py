"""One class per quantization scheme: read a checkpoint Linear, fuse shards, build the layer.

This is the seam between "what is in the checkpoint" and "what the GEMM wants" (the shape of
tpu-inference's fp8 layer): ``read`` checks and loads one checkpoint ``nn.Linear`` (weight, bias,
scales) to host memory, ``build`` turns the shards of one fused layer (q/k/v, gate/up, or a single
projection) into one NNX module on the device.

Fusing never changes FP8 codes: shards with unequal per-tensor weight scales keep a per-output-
channel scale vector, and shards whose static activation scales differ keep separate GEMMs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.checkpoint.safetensors_index import aligned_empty
from modelopt_jax.errors import (CheckpointError, DtypeMismatchError, InvalidScaleError, MissingTensorError,
                                 ShapeMismatchError)
from modelopt_jax.layers import BlockFp8Linear, ConcatLinear, Fp8Linear, Linear
from modelopt_jax.static_array import StaticArray

FLOAT_DTYPES = ("BF16", "F16", "F32")
# FP8 GEMM kernels want N (weight rows) in multiples of this; other widths are zero-padded once at
# load time and the layer slices its output back (never a per-call pad).
N_ALIGN = 16
FP8_WEIGHT_DTYPES = ("F8_E4M3",)
BLOCK = 128


@dataclasses.dataclass
class ShardTensors:
    """One checkpoint Linear, read and checked, on the host."""

    prefix: str
    weight: np.ndarray  # [N, K]
    bias: np.ndarray | None = None
    weight_scale: np.ndarray | None = None  # float32: [] | [N] | [N/128, K/128]
    input_scale: float | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def _read_checked(ckpt: Checkpoint, name: str, dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
                  role: str) -> np.ndarray:
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
    return ckpt.read(name)


def _read_scale(ckpt: Checkpoint, name: str, shapes: Sequence[tuple[int, ...]], role: str) -> np.ndarray:
    """Reads a scale tensor as float32 and rejects NaN, inf, zero and negative values."""
    value = _read_checked(ckpt, name, ("F32", "BF16", "F16"), shapes, role).astype(np.float32)
    bad = ~(np.isfinite(value) & (value > 0))
    if bad.any():
        # Plain Python numbers, so the message reads "found nan at index [5]" on every numpy version.
        idx = tuple(int(i) for i in np.argwhere(bad)[0]) if value.ndim else ()
        raise InvalidScaleError(
            f"{ckpt.info(name).file}: tensor {name!r} ({role}) must be finite and > 0; found "
            f"{float(value[idx])}" + (f" at index {list(idx)}" if value.ndim else "")
            + f" ({int(bad.sum())} bad of {value.size})")
    return value


def _read_bias(ckpt: Checkpoint, prefix: str, n: int, has_bias: bool) -> np.ndarray | None:
    if not has_bias:
        return None
    return _read_checked(ckpt, f"{prefix}.bias", FLOAT_DTYPES, [(n,)], "bias")


def _to_device(array: np.ndarray):
    """Host array -> device array, without an extra host copy.

    ``jax.device_put`` rather than ``jnp.asarray``: on the CPU backend ``jnp.asarray`` makes a host
    copy before the transfer (measured: three live copies of a bf16/fp8 table for a moment), while
    ``device_put`` adopts a 64-byte aligned numpy buffer as the device buffer (zero-copy), which is
    why the reader and :func:`_concat` allocate aligned arrays. Peak memory of a CPU load is then
    about one copy of the weights (bench/load_memory.py).
    """
    return jax.device_put(array)


def _concat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Stacks fused shards along the output axis into a new aligned array (see :func:`_to_device`)."""
    if len(arrays) == 1:
        return arrays[0]
    shape = (sum(a.shape[0] for a in arrays),) + arrays[0].shape[1:]
    return np.concatenate(arrays, axis=0, out=aligned_empty(shape, np.result_type(*arrays)))


def _fused_bias(shards: Sequence[ShardTensors], pad: int = 0):
    if shards[0].bias is None:
        return None
    dtypes = {s.bias.dtype for s in shards}
    biases = [s.bias if len(dtypes) == 1 else s.bias.astype(np.float32) for s in shards]
    if pad:
        biases.append(np.zeros(pad, biases[0].dtype))
    return _to_device(_concat(biases))


def _row_padding(shards: Sequence[ShardTensors]) -> int:
    """Rows of zeros that bring the fused output width to a multiple of N_ALIGN."""
    return -sum(s.out_features for s in shards) % N_ALIGN


def _fp8_linear(shards: Sequence[ShardTensors], pad: int, weight_scale, input_scale, *, dtype, backend,
                out_dtype) -> Fp8Linear:
    """One Fp8Linear over the fused, ``pad``-row padded shards (the scale already covers the pad)."""
    sizes = [s.out_features for s in shards]
    return Fp8Linear(_padded_weight(shards, pad), weight_scale=weight_scale, input_scale=input_scale,
                     bias=_fused_bias(shards, pad), dtype=dtype, backend=backend, shard_sizes=sizes,
                     out_dtype=out_dtype, logical_out=sum(sizes))


def _padded_weight(shards: Sequence[ShardTensors], pad: int):
    weights = [s.weight for s in shards]
    if pad:
        weights.append(np.zeros((pad, weights[0].shape[1]), weights[0].dtype))
    return _to_device(_concat(weights))


class LinearScheme:
    """Base: subclasses set ``name`` and implement ``read`` and ``build``.

    ``weight_cache_ok`` declares whether the modules ``build`` returns are fully described by
    their arrays plus static attributes (scales, shard sizes, logical width), which is what the
    weight-cache daemon records and a client replays; a scheme that is not stays off the cache.
    """

    name = "?"
    weight_cache_ok = True

    def read(self, ckpt: Checkpoint, prefix: str, out_features: int, in_features: int,
             has_bias: bool) -> ShardTensors:
        raise NotImplementedError

    def build(self, shards: Sequence[ShardTensors], *, dtype, backend: str, out_dtype=None) -> nnx.Module:
        raise NotImplementedError


class Unquantized(LinearScheme):
    """Excluded modules (or an unquantized checkpoint): weight in the checkpoint's float dtype."""

    name = "unquantized"

    def read(self, ckpt, prefix, out_features, in_features, has_bias):
        role = "weight of a module that is not quantized"
        if ckpt.quant_config.is_quantized:
            rule = ckpt.quant_config.exclusion_rule(prefix)
            role = f"weight of a module excluded from quantization by {rule}" if rule else role
        weight = _read_checked(ckpt, f"{prefix}.weight", FLOAT_DTYPES, [(out_features, in_features)], role)
        for suffix in ("weight_scale", "input_scale"):
            if ckpt.has(f"{prefix}.{suffix}"):
                raise CheckpointError(
                    f"{ckpt.info(f'{prefix}.{suffix}').file}: {prefix}.{suffix} exists but {prefix} is "
                    f"{'excluded from quantization' if ckpt.quant_config.is_quantized else 'not quantized'}; "
                    f"the checkpoint and its quantization config disagree")
        return ShardTensors(prefix, weight, _read_bias(ckpt, prefix, out_features, has_bias))

    def build(self, shards, *, dtype, backend, out_dtype=None):
        weights = [s.weight for s in shards]
        if len({w.dtype for w in weights}) > 1:
            weights = [w.astype(np.float32) for w in weights]
        return Linear(_to_device(_concat(weights)), _fused_bias(shards), dtype=dtype, out_dtype=out_dtype)


class Fp8PerTensor(LinearScheme):
    """quant_algo FP8: scalar weight_scale and static scalar input_scale per checkpoint Linear."""

    name = "fp8 per-tensor (static activations)"

    def read(self, ckpt, prefix, out_features, in_features, has_bias):
        weight = _read_checked(ckpt, f"{prefix}.weight", FP8_WEIGHT_DTYPES, [(out_features, in_features)],
                               "FP8 weight")
        weight_scale = _read_scale(ckpt, f"{prefix}.weight_scale", [(), (1,)], "per-tensor weight scale")
        input_scale = _read_scale(ckpt, f"{prefix}.input_scale", [(), (1,)], "static activation scale")
        return ShardTensors(prefix, weight, _read_bias(ckpt, prefix, out_features, has_bias),
                            weight_scale.reshape(()), float(input_scale.reshape(())))

    def build(self, shards, *, dtype, backend, out_dtype=None):
        if len({s.input_scale for s in shards}) > 1:
            # Different activation scales: one GEMM would change the activation FP8 codes.
            return ConcatLinear([self.build([s], dtype=dtype, backend=backend, out_dtype=out_dtype) for s in shards])
        scales = [float(s.weight_scale) for s in shards]
        pad = _row_padding(shards)
        if len(set(scales)) == 1:
            weight_scale = scales[0]
        else:
            sizes = [s.out_features for s in shards] + [pad]
            weight_scale = StaticArray(np.repeat(np.asarray(scales + [1.0], np.float32), sizes))
        return _fp8_linear(shards, pad, weight_scale, shards[0].input_scale, dtype=dtype, backend=backend,
                           out_dtype=out_dtype)


class Fp8PerChannelPerToken(LinearScheme):
    """quant_algo FP8_PER_CHANNEL_PER_TOKEN: weight_scale [N], dynamic per-token activation scales."""

    name = "fp8 per-channel weights, per-token activations"

    def read(self, ckpt, prefix, out_features, in_features, has_bias):
        weight = _read_checked(ckpt, f"{prefix}.weight", FP8_WEIGHT_DTYPES, [(out_features, in_features)],
                               "FP8 weight")
        weight_scale = _read_scale(ckpt, f"{prefix}.weight_scale", [(out_features,), (out_features, 1)],
                                   "per-channel weight scale")
        if ckpt.has(f"{prefix}.input_scale"):
            raise CheckpointError(
                f"{ckpt.info(prefix + '.input_scale').file}: {prefix}.input_scale is present but quant_algo "
                f"FP8_PER_CHANNEL_PER_TOKEN computes activation scales per token; refusing to guess which applies")
        return ShardTensors(prefix, weight, _read_bias(ckpt, prefix, out_features, has_bias),
                            weight_scale.reshape(out_features))

    def build(self, shards, *, dtype, backend, out_dtype=None):
        pad = _row_padding(shards)
        scales = [s.weight_scale for s in shards] + ([np.ones(pad, np.float32)] if pad else [])
        return _fp8_linear(shards, pad, StaticArray(_concat(scales)), None, dtype=dtype, backend=backend,
                           out_dtype=out_dtype)


class Fp8BlockWeightOnly(LinearScheme):
    """quant_algo FP8_PB_WO: one weight scale per 128x128 block, activations stay in compute dtype."""

    name = "fp8 128x128 block weights, unquantized activations"
    weight_cache_ok = False  # its block-scale layer is not in the weight cache's recorded layout

    def read(self, ckpt, prefix, out_features, in_features, has_bias):
        weight = _read_checked(ckpt, f"{prefix}.weight", FP8_WEIGHT_DTYPES, [(out_features, in_features)],
                               "FP8 weight")
        nb, kb = math.ceil(out_features / BLOCK), math.ceil(in_features / BLOCK)
        scales = _read_scale(ckpt, f"{prefix}.weight_scale", [(nb, 1, kb, 1), (nb, kb)],
                             f"{BLOCK}x{BLOCK} block weight scale")
        return ShardTensors(prefix, weight, _read_bias(ckpt, prefix, out_features, has_bias), scales.reshape(nb, kb))

    def build(self, shards, *, dtype, backend, out_dtype=None):
        if len(shards) > 1 and any(s.out_features % BLOCK for s in shards[:-1]):
            # A shard boundary inside a block: the scale grids cannot simply be stacked.
            return ConcatLinear([self.build([s], dtype=dtype, backend=backend, out_dtype=out_dtype) for s in shards])
        return BlockFp8Linear(_to_device(_concat([s.weight for s in shards])),
                              block_scales=StaticArray(_concat([s.weight_scale for s in shards])),
                              bias=_fused_bias(shards), dtype=dtype, block=BLOCK, out_dtype=out_dtype)


SCHEMES: dict[str | None, LinearScheme] = {
    None: Unquantized(),
    "FP8": Fp8PerTensor(),
    "FP8_PER_CHANNEL_PER_TOKEN": Fp8PerChannelPerToken(),
    "FP8_PB_WO": Fp8BlockWeightOnly(),
}
