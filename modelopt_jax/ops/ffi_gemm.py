"""The ``modelopt_fp8_gemm`` XLA FFI custom call (CUTLASS on CUDA, C++ reference on CPU).

Operands: ``a`` [M, K] and ``b`` [N, K] float8_e4m3fn, then -- announced by boolean attributes --
``row_scale`` [M], ``col_scale`` [N] and ``bias`` [N], all float32. ``alpha`` is a float32
attribute, i.e. a constant compiled into the call. The op computes
``out = alpha * row[m] * col[n] * acc + bias[n]`` (missing vectors count as 1 / 0): exactly the
:class:`~modelopt_jax.ops.epilogue.Fp8Epilogue` the layer's plan holds, so nothing is folded here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.ops import native
from modelopt_jax.ops.epilogue import epilogue_of


def ffi_scaled_gemm(x_q: jax.Array, w_q: jax.Array, *, alpha, row, col, bias, out_dtype, tile: int = -1,
                    swizzle: int = 1, raster: int = 0, out_init: jax.Array | None = None) -> jax.Array:
    """``x_q`` [M, K] (already 2-D), ``w_q`` [N, K]; ``alpha``/``row``/``col`` as ``scaled_fp8_gemm`` passes them.

    ``alpha`` is passed as ``np.float32`` (a static attribute: a jax value here would be traced and
    could not be compiled into the call). The CUDA kernel choice, for tuning and benchmarks: ``tile``
    forces a compiled tile configuration (-1 = by M bucket); ``swizzle`` (1, 2, 4 or 8) and ``raster``
    (0 heuristic, 1 along M, 2 along N) set the persistent tile scheduler; the handlers reject other
    values. ``out_init`` [M, N] is aliased to the output (tests fill it with NaN to catch unwritten
    elements).
    """
    native.cpu_library()
    native.cuda_library()
    m, _ = x_q.shape
    n = w_q.shape[0]
    operands = [x_q, w_q]
    if row is not None:
        operands.append(jnp.asarray(row, jnp.float32).reshape(m))
    if col is not None:
        operands.append(jnp.asarray(col, jnp.float32).reshape(n))
    if bias is not None:
        operands.append(bias.astype(jnp.float32).reshape(n))
    aliases = {}
    if out_init is not None:
        aliases = {len(operands): 0}
        operands.append(out_init)
    call = jax.ffi.ffi_call(native.TARGET, jax.ShapeDtypeStruct((m, n), out_dtype),
                            vmap_method="broadcast_all", input_output_aliases=aliases)
    return call(*operands, alpha=np.float32(alpha), has_row_scale=row is not None, has_col_scale=col is not None,
                has_bias=bias is not None, has_out_init=out_init is not None, tile=np.int32(tile),
                swizzle=np.int32(swizzle), raster=np.int32(raster))


def ffi_fp8_gemm(x_q: jax.Array, w_q: jax.Array, *, x_scale, w_scale, bias, out_dtype, tile: int = -1,
                 swizzle: int = 1, raster: int = 0, out_init: jax.Array | None = None) -> jax.Array:
    """The FFI call from loose scales (tests, benchmarks): folded by :func:`~modelopt_jax.ops.epilogue.epilogue_of`."""
    epilogue, row, col = epilogue_of(x_scale, w_scale, w_q.shape[0])
    if row is not None:
        row = row.reshape(x_q.shape[0])
    if col is None and epilogue.col is not None:
        col = epilogue.col.array
    return ffi_scaled_gemm(x_q, w_q, alpha=epilogue.alpha, row=row, col=col, bias=bias, out_dtype=out_dtype,
                           tile=tile, swizzle=swizzle, raster=raster, out_init=out_init)
