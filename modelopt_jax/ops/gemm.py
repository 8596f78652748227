"""The one FP8 GEMM every quantized dense layer calls, with a pluggable backend.

    y = out_dtype( x_scale * (w_scale * (x_q @ w_q.T)) + bias )

``x_q`` is the FP8 activation [..., K], ``w_q`` the FP8 weight exactly as stored in the checkpoint
[N, K] (K-major, never transposed), the product accumulated in float32. ``w_scale`` is static
(a Python float, or a length-N vector for per-channel weights and fused layers with unequal shard
scales); ``x_scale`` is static (float) or dynamic (one float32 per row, per-token quantization).
When both scales are scalars they are multiplied once at trace time into a single constant alpha,
which is what a GEMM epilogue applies.

Backends register an implementation under a name:

- ``"xla"``: XLA's own FP8 dot with float32 accumulation and the epilogue as XLA ops (any platform).
- ``"cutlass"``: our ``modelopt_fp8_gemm`` XLA FFI custom call: the CUTLASS kernel on CUDA, the
  C++ reference handler on CPU (so CI exercises the real FFI plumbing). Scalars travel as a
  compile-time attribute; per-channel / per-token vectors and the bias as buffers.
- ``"auto"``: chosen per platform at lowering time (``jax.lax.platform_dependent``): ``"cutlass"``
  on CUDA when the CUDA library is built and the call qualifies (bf16/fp16 output, K % 16 == 0,
  N % 8 == 0), ``"xla"`` everywhere else.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.errors import BackendUnavailableError
from modelopt_jax.static_array import StaticArray

StaticScale = float | np.ndarray | StaticArray


class GemmImpl(Protocol):
    def __call__(self, x_q: jax.Array, w_q: jax.Array, *, x_scale: float | jax.Array,
                 w_scale: float | np.ndarray, bias: jax.Array | None, out_dtype) -> jax.Array: ...


_BACKENDS: dict[str, GemmImpl] = {}
# Why a backend named by the user cannot run (e.g. "cutlass": native library not built).
_UNAVAILABLE: dict[str, str] = {}


# The processed FP8 weight every backend consumes: float8_e4m3fn [N, K] as stored in the checkpoint,
# rows zero-padded to a multiple of 16. The weight cache shares buffers in exactly this layout, so a
# backend that wanted another one (e.g. pre-transposed or swizzled) would register it here and the
# cache would refuse it (and put it in the fingerprint) instead of handing over the wrong bytes.
WEIGHT_LAYOUT = "fp8-e4m3fn-NK-pad16"
_WEIGHT_LAYOUTS: dict[str, str] = {}


def register_backend(name: str, impl: GemmImpl, *, weight_layout: str = WEIGHT_LAYOUT) -> None:
    _BACKENDS[name] = impl
    _WEIGHT_LAYOUTS[name] = weight_layout
    _UNAVAILABLE.pop(name, None)


def weight_layout(backend: str) -> str:
    """The processed-weight layout ``backend`` consumes ("auto" picks among same-layout backends)."""
    if backend == "auto":
        layouts = set(_WEIGHT_LAYOUTS.values()) or {WEIGHT_LAYOUT}
        return layouts.pop() if len(layouts) == 1 else "mixed"
    return _WEIGHT_LAYOUTS.get(backend, WEIGHT_LAYOUT)


def available_backends() -> tuple[str, ...]:
    return ("auto",) + tuple(_BACKENDS)


def _resolve(backend: str) -> GemmImpl:
    if backend == "auto":
        return _auto
    impl = _BACKENDS.get(backend)
    if impl is None:
        reason = _UNAVAILABLE.get(backend, "unknown backend")
        raise BackendUnavailableError(
            f"GEMM backend {backend!r} is unavailable: {reason}; available: {', '.join(available_backends())}")
    return impl


def check_backend(backend: str) -> None:
    """Raises BackendUnavailableError early (at load time) for a backend that cannot run."""
    _resolve(backend)


def _static(value: StaticScale, name: str) -> float | np.ndarray | jax.Array:
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        # A device vector (tensor-parallel per-channel scales differ per device); scalars must be static.
        if name == "w_scale" and value.ndim == 1:
            return value.astype(jnp.float32)
        raise TypeError(f"{name} must be static (a float or numpy array), not a traced value")
    if isinstance(value, StaticArray):
        value = value.array
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = float(value)
    return np.asarray(value, np.float32) if isinstance(value, np.ndarray) else float(np.float32(value))


def fp8_gemm(x_q: jax.Array, w_q: jax.Array, *, x_scale: StaticScale | jax.Array, w_scale: StaticScale,
             bias: jax.Array | None = None, out_dtype=jnp.bfloat16, backend: str = "auto") -> jax.Array:
    """Scaled FP8 GEMM; leading batch dims of ``x_q`` are reshaped (not copied) to one M axis."""
    if x_q.dtype != jnp.float8_e4m3fn or w_q.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"fp8_gemm expects float8_e4m3fn operands, got {x_q.dtype} and {w_q.dtype}")
    n, k = w_q.shape
    if x_q.shape[-1] != k:
        raise ValueError(f"fp8_gemm: x has K={x_q.shape[-1]} but the weight [N={n}, K={k}] needs K={k}")
    lead = x_q.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))
    w_scale = _static(w_scale, "w_scale")
    if not isinstance(w_scale, float) and w_scale.shape != (n,):
        raise ValueError(f"fp8_gemm: w_scale vector has shape {w_scale.shape}, expected ({n},)")
    if isinstance(x_scale, (jax.Array, jax.core.Tracer)):
        if x_scale.shape not in (lead, lead + (1,)):
            raise ValueError(f"fp8_gemm: dynamic x_scale has shape {x_scale.shape}, expected {lead}")
        x_scale = x_scale.reshape(m).astype(jnp.float32)
    else:
        x_scale = _static(x_scale, "x_scale")
        if isinstance(x_scale, np.ndarray):
            raise ValueError("fp8_gemm: a static x_scale must be a scalar")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_gemm: bias has shape {bias.shape}, expected ({n},)")
    y = _resolve(backend)(x_q.reshape(m, k), w_q, x_scale=x_scale, w_scale=w_scale, bias=bias,
                          out_dtype=out_dtype)
    return y.reshape(*lead, n)


def _xla_fp8_gemm(x_q, w_q, *, x_scale, w_scale, bias, out_dtype):
    """Pure-XLA path: an FP8 dot with float32 accumulation, then the scale/bias epilogue.

    Runs on CPU and TPU (which upcast internally) and on CUDA (where XLA may call cuBLASLt FP8).
    """
    acc = jax.lax.dot_general(x_q, w_q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if isinstance(x_scale, float) and isinstance(w_scale, float):
        y = acc * np.float32(np.float32(x_scale) * np.float32(w_scale))
    else:
        y = acc * (w_scale if isinstance(w_scale, float) else w_scale[None, :])
        y = y * (x_scale if isinstance(x_scale, float) else x_scale[:, None])
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


register_backend("xla", _xla_fp8_gemm)


def _cutlass_qualifies(x_q, w_q, out_dtype) -> bool:
    n, k = w_q.shape
    return jnp.dtype(out_dtype) in (jnp.bfloat16, jnp.float16) and k % 16 == 0 and n % 8 == 0


def _auto(x_q, w_q, *, x_scale, w_scale, bias, out_dtype):
    """XLA everywhere, except CUDA with our kernel built and a qualifying call: chosen at lowering."""
    from modelopt_jax.ops import ffi_gemm, native

    kwargs = dict(x_scale=x_scale, w_scale=w_scale, bias=bias, out_dtype=out_dtype)
    native.warn_if_gpu_without_kernels()
    if not (native.has_cuda_handler() and _cutlass_qualifies(x_q, w_q, out_dtype)):
        return _xla_fp8_gemm(x_q, w_q, **kwargs)
    return jax.lax.platform_dependent(
        x_q, w_q, cuda=lambda x, w: ffi_gemm.ffi_fp8_gemm(x, w, **kwargs),
        default=lambda x, w: _xla_fp8_gemm(x, w, **kwargs))


def _register_native() -> None:
    from modelopt_jax.ops import ffi_gemm, native

    if native.has_cpu_handler() or native.has_cuda_handler():
        register_backend("cutlass", ffi_gemm.ffi_fp8_gemm)
    else:
        _UNAVAILABLE["cutlass"] = ("the native FFI library was not found (reinstall with `pip install .`; "
                                   "see README: build)")


_register_native()
