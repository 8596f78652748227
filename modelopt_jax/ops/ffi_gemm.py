"""The ``modelopt_fp8_gemm`` XLA FFI custom call (CUTLASS on CUDA, C++ reference on CPU).

Operands: ``a`` [M, K] and ``b`` [N, K] float8_e4m3fn, then -- announced by boolean attributes --
``row_scale`` [M], ``col_scale`` [N] and ``bias`` [N], all float32. ``alpha`` is a float32
attribute, i.e. a constant compiled into the call. The op computes
``out = alpha * row[m] * col[n] * acc + bias[n]`` (missing vectors count as 1 / 0).

Scalars are folded on the host so that at most one of (alpha, vectors) carries them: per-tensor
layers pass only ``alpha = input_scale * weight_scale``; a static activation scale with a weight
scale vector is folded into ``col`` (a numpy constant); a dynamic per-token scale is ``row``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.ops import native


def ffi_fp8_gemm(x_q: jax.Array, w_q: jax.Array, *, x_scale, w_scale, bias, out_dtype, tile: int = -1,
                 swizzle: int = 1, raster: int = 0, out_init: jax.Array | None = None) -> jax.Array:
    """``x_q`` [M, K] (already 2-D), ``w_q`` [N, K]; scales as normalised by ``fp8_gemm``.

    The CUDA kernel choice, for tuning and benchmarks: ``tile`` forces a compiled tile configuration
    (-1 = by M bucket); ``swizzle`` (1, 2, 4 or 8) and ``raster`` (0 heuristic, 1 along M, 2 along N)
    set the persistent tile scheduler. The handlers reject other values.
    ``out_init`` [M, N] is aliased to the output (tests fill it with NaN to catch unwritten
    elements).
    """
    native.cpu_library()
    native.cuda_library()
    m, k = x_q.shape
    n = w_q.shape[0]
    operands = [x_q, w_q]
    alpha, row, col = np.float32(1.0), None, None
    if not isinstance(w_scale, float):  # a vector: numpy constant, or device data under TP
        col = w_scale.astype(np.float32) if isinstance(w_scale, np.ndarray) else w_scale.astype(jnp.float32)
        if isinstance(x_scale, float):
            col = col * np.float32(x_scale)
        else:
            row = x_scale
    elif isinstance(x_scale, float):
        alpha = np.float32(np.float32(x_scale) * np.float32(w_scale))
    else:
        row, alpha = x_scale, np.float32(w_scale)
    if row is not None:
        operands.append(jnp.asarray(row, jnp.float32).reshape(m))
    if col is not None:
        operands.append(jnp.asarray(col))
    if bias is not None:
        operands.append(bias.astype(jnp.float32).reshape(n))
    aliases = {}
    if out_init is not None:
        aliases = {len(operands): 0}
        operands.append(out_init)
    call = jax.ffi.ffi_call(native.TARGET, jax.ShapeDtypeStruct((m, n), out_dtype),
                            vmap_method="broadcast_all", input_output_aliases=aliases)
    return call(*operands, alpha=alpha, has_row_scale=row is not None, has_col_scale=col is not None,
                has_bias=bias is not None, has_out_init=out_init is not None, tile=np.int32(tile),
                swizzle=np.int32(swizzle), raster=np.int32(raster))
