"""The grouped FP8 GEMM a sparse layer's stacked experts run (:class:`~modelopt_jax.layers.GroupedLinear`).

``out[m] = row[m] * col[g(m)] * (x_q[m] @ w_q[g(m)].T)`` for rows sorted by group: rows
``[offset_g, offset_g + group_sizes[g])`` go through group g's weight, ``offset_g`` the sizes before
it; rows past the sizes' sum are zeros. Group sizes are device data, so any routing runs without
recompiling. Backends:

- ``"xla"``: ``jax.lax.ragged_dot`` over the FP8 codes widened to float32 (float32 output) or bf16
  (exact either way: every e4m3 value is a bf16 value, and their products fit float32), float32
  accumulation, then the scales. XLA:CPU lowers ragged_dot to one masked product per group, G times
  the work of the rows themselves.
- ``"ffi"``: the ``modelopt_fp8_grouped_gemm`` custom call. On CUDA, CUTLASS's sm90a grouped
  (pointer-array) GEMM (ffi/cuda/fp8_grouped_gemm_kernel.cuh): a setup kernel turns the device group
  sizes into the per-group problem table, so routing never reaches the host. On CPU the C++ handler
  (ffi/fp8_gemm_cpu.cc) multiplies each group's rows by that group's weight only. Invalid sizes
  (negative, or summing past M) are a typed error on CPU; on CUDA they cannot be reported from the
  device, and the output is all NaN instead.
- ``"auto"``: chosen per platform at lowering: the CUDA handler where the library has it and the call
  qualifies (bfloat16/float16 output, K % 16 == 0, N % 8 == 0), the CPU handler where built, XLA
  elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.errors import BackendUnavailableError
from modelopt_jax.ops import native
from modelopt_jax.ops.alignment import cutlass_can_run

BACKENDS = ("auto", "xla", "ffi")


def grouped_fp8_gemm(x_q: jax.Array, w_q: jax.Array, group_sizes: jax.Array, col, *, row: jax.Array | None = None,
                     out_dtype=jnp.bfloat16, backend: str = "auto", tile: int = -1) -> jax.Array:
    """``x_q`` [M, K] and ``w_q`` [G, N, K] float8_e4m3fn, ``group_sizes`` [G] int32, ``col`` [G, N]
    float32 (a constant numpy array or a device array), ``row`` [M] float32 or None -> [M, N].
    ``tile`` names a compiled CUDA configuration (:func:`native.grouped_config_names`; benchmarks),
    -1 lets the handler choose by rows per group."""
    if x_q.dtype != jnp.float8_e4m3fn or w_q.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"grouped_fp8_gemm expects float8_e4m3fn operands, got {x_q.dtype} and {w_q.dtype}")
    if x_q.ndim != 2 or w_q.ndim != 3 or x_q.shape[1] != w_q.shape[2]:
        raise ValueError(f"grouped_fp8_gemm: x [M, K] and w [G, N, K] expected, got {x_q.shape} and {w_q.shape}")
    groups, n, _ = w_q.shape
    if group_sizes.shape != (groups,):
        raise ValueError(f"grouped_fp8_gemm: group_sizes has shape {group_sizes.shape}, expected ({groups},)")
    if tuple(col.shape) != (groups, n):
        raise ValueError(f"grouped_fp8_gemm: col has shape {tuple(col.shape)}, expected ({groups}, {n})")
    if row is not None and row.shape != (x_q.shape[0],):
        raise ValueError(f"grouped_fp8_gemm: row has shape {row.shape}, expected ({x_q.shape[0]},)")
    if backend not in BACKENDS:
        raise ValueError(f"grouped_fp8_gemm: backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    args = (x_q, w_q, group_sizes.astype(jnp.int32), jnp.asarray(col, jnp.float32),
            None if row is None else row.astype(jnp.float32))
    if backend == "xla":
        return _xla(*args, out_dtype=out_dtype)
    ffi = lambda *a: _ffi(*_unpack(a, row), out_dtype=out_dtype, tile=tile)  # noqa: E731
    ffi_cuda = lambda *a: _ffi(*_unpack(a, row), out_dtype=out_dtype, tile=tile, cuda=True)  # noqa: E731
    xla = lambda *a: _xla(*_unpack(a, row), out_dtype=out_dtype)  # noqa: E731
    operands = [a for a in args if a is not None]
    if backend == "ffi":
        on_gpu = jax.default_backend() == "gpu"
        if not (native.has_cuda_handler() if on_gpu else native.has_cpu_handler()):
            where = "CUDA library with ModeloptFp8GroupedGemmCuda" if on_gpu else \
                "CPU library with ModeloptFp8GroupedGemmCpu"
            raise BackendUnavailableError(f"grouped GEMM backend 'ffi': the native {where} was not found "
                                          "(reinstall with `pip install .`)")
        if on_gpu and not _cuda_qualifies(w_q, out_dtype):
            raise ValueError(f"grouped_fp8_gemm backend 'ffi' on CUDA needs bfloat16/float16 output, K % 16 == 0 "
                             f"and N % 8 == 0; got out {jnp.dtype(out_dtype)}, w {w_q.shape}")
        return (ffi_cuda if on_gpu else ffi)(*operands)
    branches = {}
    if native.has_cuda_handler() and _cuda_qualifies(w_q, out_dtype):
        branches["cuda"] = ffi_cuda
    if native.has_cpu_handler():
        branches["cpu"] = ffi
    if not branches:
        return xla(*operands)
    return jax.lax.platform_dependent(*operands, **branches, default=xla)


def _cuda_qualifies(w_q, out_dtype) -> bool:
    _, n, k = w_q.shape
    return jnp.dtype(out_dtype) in (jnp.bfloat16, jnp.float16) and cutlass_can_run(n, k)


def _unpack(operands, row):
    return tuple(operands) if row is not None else tuple(operands) + (None,)


def _xla(x_q, w_q, group_sizes, col, row, *, out_dtype):
    wide = jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if wide == jnp.float32 else jax.lax.Precision.DEFAULT
    acc = jax.lax.ragged_dot(x_q.astype(wide), jnp.swapaxes(w_q, 1, 2).astype(wide), group_sizes,
                             precision=precision, preferred_element_type=jnp.float32)
    m = x_q.shape[0]
    group_of_row = jnp.repeat(jnp.arange(w_q.shape[0], dtype=jnp.int32), group_sizes, total_repeat_length=m)
    y = acc * col[group_of_row]  # rows past the sum: acc is zero there
    if row is not None:
        y = y * row[:, None]
    return y.astype(out_dtype)


def _ffi(x_q, w_q, group_sizes, col, row, *, out_dtype, tile=-1, cuda=False):
    """The custom call. On CUDA it has a second result, the kernels' workspace (the per-group problem
    table and CUTLASS's own), sized here for the current device and discarded."""
    operands = [x_q, w_q, group_sizes, col] + ([] if row is None else [row])
    out = jax.ShapeDtypeStruct((x_q.shape[0], w_q.shape[1]), out_dtype)
    if not cuda:
        call = jax.ffi.ffi_call(native.GROUPED_TARGET, out, vmap_method="broadcast_all")
        return call(*operands, has_row_scale=row is not None, tile=np.int32(tile))
    (m, k), (groups, n, _) = x_q.shape, w_q.shape
    size = native.grouped_workspace_bytes(m, n, k, groups, jnp.dtype(out_dtype) == jnp.bfloat16)
    call = jax.ffi.ffi_call(native.GROUPED_TARGET, (out, jax.ShapeDtypeStruct((size,), jnp.uint8)),
                            vmap_method="broadcast_all")
    return call(*operands, has_row_scale=row is not None, tile=np.int32(tile))[0]


def reference(x_q: np.ndarray, w_q: np.ndarray, group_sizes: np.ndarray, col: np.ndarray,
              row: np.ndarray | None = None) -> np.ndarray:
    """float64 numpy reference of the op (tests)."""
    x, w = np.asarray(x_q, np.float64), np.asarray(w_q, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start:start + size] = x[start:start + size] @ w[g].T * np.asarray(col, np.float64)[g]
        start += size
    if row is not None:
        out *= np.asarray(row, np.float64)[:, None]
    return out
