"""The one FP8 GEMM every quantized dense layer calls, with a pluggable backend.

    y = out_dtype( alpha * row[m] * col[n] * (x_q @ w_q.T) + bias[n] )

``x_q`` is the FP8 activation [..., K], ``w_q`` the FP8 weight exactly as stored in the checkpoint
[N, K] (K-major, never transposed; see :mod:`.alignment`), the product accumulated in float32.
The scales arrive as one :class:`~modelopt_jax.ops.epilogue.Fp8Epilogue`, the Python twin of the
FFI op's ``Fp8GemmProblem``: ``alpha`` a compile-time constant, ``col`` a per-output-channel
vector (a constant, or device data under tensor parallelism), ``row`` the dynamic per-token
activation scale. Every backend receives the same ``(alpha, row, col)`` and applies them in the
same order (alpha, then row, then col, then bias), so the backends cannot fold differently.

Backends register an implementation under a name:

- ``"xla"``: XLA's own FP8 dot with float32 accumulation and the epilogue as XLA ops (any platform).
- ``"cutlass"``: our ``modelopt_fp8_gemm`` XLA FFI custom call: the CUTLASS kernel on CUDA, the
  C++ handler on CPU (so CI exercises the real FFI plumbing).
- ``"auto"``: chosen per platform at lowering time (``jax.lax.platform_dependent``): ``"cutlass"``
  on CUDA when the CUDA library is built and the call qualifies (bf16/fp16 output and the
  alignment of :func:`~modelopt_jax.ops.alignment.cutlass_can_run`), unless the device's measured
  dispatch table (:mod:`.gemm_dispatch`) has XLA's path faster for this (M bucket, N, K); on CPU the C++ handler when
  the CPU library (a current build of it) is present and M <= :data:`CPU_HANDLER_MAX_ROWS` (decode steps: XLA:CPU converts
  the whole FP8 weight to float on every call, which the handler does not, so it is 1.1-3x faster
  there; for larger M XLA's dot wins, bench/RESULTS.md "FP8 GEMM on CPU"); ``"xla"`` everywhere else.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.errors import BackendUnavailableError
from modelopt_jax.ops.alignment import WEIGHT_LAYOUT, cutlass_can_run
from modelopt_jax.ops.epilogue import Fp8Epilogue, epilogue_of
from modelopt_jax.static_array import StaticArray

StaticScale = float | np.ndarray | StaticArray


class GemmImpl(Protocol):
    def __call__(self, x_q: jax.Array, w_q: jax.Array, *, alpha: np.float32, row: jax.Array | None,
                 col: np.ndarray | jax.Array | None, bias: jax.Array | None, out_dtype) -> jax.Array: ...


_BACKENDS: dict[str, GemmImpl] = {}
# Why a backend named by the user cannot run (e.g. "cutlass": native library not built).
_UNAVAILABLE: dict[str, str] = {}
# The processed-weight layout each backend consumes. The weight cache shares buffers only in
# WEIGHT_LAYOUT: a backend that wanted another (pre-transposed, swizzled) registers it here and the
# cache refuses it up front (and has it in the fingerprint) instead of handing over the wrong bytes.
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


def fp8_gemm(x_q: jax.Array, w_q: jax.Array, *, x_scale: StaticScale | jax.Array, w_scale: StaticScale | jax.Array,
             bias: jax.Array | None = None, out_dtype=jnp.bfloat16, backend: str = "auto") -> jax.Array:
    """Scaled FP8 GEMM from loose scales (see :func:`epilogue_of`), e.g. for tests and benchmarks."""
    epilogue, row, col = epilogue_of(x_scale, w_scale, w_q.shape[0])
    return scaled_fp8_gemm(x_q, w_q, epilogue, row=row, col=col, bias=bias, out_dtype=out_dtype, backend=backend)


def scaled_fp8_gemm(x_q: jax.Array, w_q: jax.Array, epilogue: Fp8Epilogue, *, row: jax.Array | None = None,
                    col: jax.Array | None = None, bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
                    backend: str = "auto") -> jax.Array:
    """The GEMM a planned layer runs; leading batch dims of ``x_q`` are reshaped (not copied) to M.

    ``row`` (per-token scales, shape ``x_q.shape[:-1]``) must be given exactly when
    ``epilogue.per_token``; ``col`` (a length-N device vector) exactly when ``epilogue.col_is_data``.
    """
    if x_q.dtype != jnp.float8_e4m3fn or w_q.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"fp8_gemm expects float8_e4m3fn operands, got {x_q.dtype} and {w_q.dtype}")
    n, k = w_q.shape
    if x_q.shape[-1] != k:
        raise ValueError(f"fp8_gemm: x has K={x_q.shape[-1]} but the weight [N={n}, K={k}] needs K={k}")
    lead = x_q.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64))
    if (row is not None) != epilogue.per_token:
        raise ValueError(f"fp8_gemm: per-token row scales {'missing' if row is None else 'given'} but the "
                         f"epilogue is {'' if epilogue.per_token else 'not '}per-token")
    if row is not None:
        if row.shape not in (lead, lead + (1,)):
            raise ValueError(f"fp8_gemm: dynamic x_scale has shape {row.shape}, expected {lead}")
        row = row.reshape(m).astype(jnp.float32)
    if (col is not None) != epilogue.col_is_data:
        raise ValueError("fp8_gemm: a data column scale must be given exactly when the epilogue says col_is_data")
    if col is None and epilogue.col is not None:
        col = epilogue.col.array
    if col is not None and col.shape != (n,):
        raise ValueError(f"fp8_gemm: column scale has shape {col.shape}, expected ({n},)")
    if col is not None and not isinstance(col, np.ndarray):
        col = col.astype(jnp.float32)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_gemm: bias has shape {bias.shape}, expected ({n},)")
    y = _resolve(backend)(x_q.reshape(m, k), w_q, alpha=np.float32(epilogue.alpha), row=row, col=col, bias=bias,
                          out_dtype=out_dtype)
    return y.reshape(*lead, n)


def _xla_fp8_gemm(x_q, w_q, *, alpha, row, col, bias, out_dtype):
    """Pure-XLA path: an FP8 dot with float32 accumulation, then the epilogue in the kernels' order.

    Runs on CPU and TPU (which upcast internally) and on CUDA (where XLA may call cuBLASLt FP8).
    """
    y = jax.lax.dot_general(x_q, w_q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if alpha != 1:
        y = y * alpha
    if row is not None:
        y = y * row[:, None]
    if col is not None:
        y = y * col[None, :]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    return y.astype(out_dtype)


register_backend("xla", _xla_fp8_gemm)


def _cutlass_qualifies(x_q, w_q, out_dtype) -> bool:
    n, k = w_q.shape
    return jnp.dtype(out_dtype) in (jnp.bfloat16, jnp.float16) and cutlass_can_run(n, k)


# "auto" runs our CPU handler up to this many rows (M); measured on a 2-core EPYC (bench/RESULTS.md):
# per call at N 5632 x K 2048, 2.9x faster than XLA at M = 1, 1.5x at 16, 1.1x at 32, 0.8x at 64, 0.4x at 256.
CPU_HANDLER_MAX_ROWS = 32


def _auto(x_q, w_q, **kwargs):
    """Per platform, chosen at lowering: our CUDA kernel for a qualifying call, our CPU handler for
    few rows, XLA otherwise (and wherever the library is not built)."""
    from modelopt_jax.ops import ffi_gemm, gemm_dispatch, native

    native.warn_if_gpu_without_kernels()
    branches = {}
    if native.has_cuda_handler() and _cutlass_qualifies(x_q, w_q, kwargs["out_dtype"]):
        (m, k), n = x_q.shape, w_q.shape[0]
        if gemm_dispatch.choose(gemm_dispatch.gpu_kind(), m, n, k) == gemm_dispatch.CUTLASS:
            branches["cuda"] = lambda x, w: ffi_gemm.ffi_scaled_gemm(x, w, **kwargs)
    if native.has_cpu_handler() and x_q.shape[0] <= CPU_HANDLER_MAX_ROWS:
        branches["cpu"] = lambda x, w: ffi_gemm.ffi_scaled_gemm(x, w, **kwargs)
    if not branches:
        return _xla_fp8_gemm(x_q, w_q, **kwargs)
    return jax.lax.platform_dependent(x_q, w_q, **branches, default=lambda x, w: _xla_fp8_gemm(x, w, **kwargs))


def _register_native() -> None:
    from modelopt_jax.ops import ffi_gemm, native

    if native.has_cpu_handler() or native.has_cuda_handler():
        register_backend("cutlass", ffi_gemm.ffi_scaled_gemm)
    else:
        _UNAVAILABLE["cutlass"] = ("the native FFI library was not found (reinstall with `pip install .`; "
                                   "see README: build)")


_register_native()
