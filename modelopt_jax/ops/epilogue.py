"""``Fp8Epilogue``: how a GEMM's float32 accumulator becomes the output, as one value.

It mirrors the FFI op's ``Fp8GemmProblem`` (``ffi/fp8_gemm_problem.h``: alpha, row scale, column
scale, bias), so a reader of the Python sees the same quantities the kernel sees. A quantization
scheme computes it once, at plan time (:mod:`modelopt_jax.quant.schemes`), and both GEMM
backends read it as is (:mod:`.gemm`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from modelopt_jax.static_array import StaticArray


@dataclasses.dataclass(frozen=True)
class Fp8Epilogue:
    """``y = alpha * row[m] * col[n] * acc + bias[n]``, the Python twin of ``Fp8GemmProblem``.

    Built once by the scheme's ``plan`` (a static activation scale is folded in there) and read
    as is by both GEMM backends, so the folding exists once. A missing factor counts as 1.
    """

    alpha: float = 1.0                 # float32 scalar, a constant in the program
    col: StaticArray | None = None     # static per-output-channel factor [N] (a constant)
    col_is_data: bool = False          # the per-channel factor is a state leaf instead (per-device under TP)
    per_token: bool = False            # row = the dynamic per-token activation scale

    @staticmethod
    def fold(x_scale: float | None, w_scale: float | np.ndarray | None, *, col_is_data: bool = False) -> "Fp8Epilogue":
        """The epilogue of a static (float) or dynamic (None) activation scale times a weight scale.

        ``w_scale`` is a float, a length-N vector, or None with ``col_is_data`` (a data vector).
        """
        per_token = x_scale is None
        if col_is_data:
            return Fp8Epilogue(alpha=1.0 if per_token else float(np.float32(x_scale)), col_is_data=True,
                               per_token=per_token)
        if isinstance(w_scale, np.ndarray) and w_scale.ndim == 1:
            col = w_scale.astype(np.float32)
            if not per_token:
                col = col * np.float32(x_scale)
            return Fp8Epilogue(col=StaticArray(col), per_token=per_token)
        w = np.float32(w_scale)
        alpha = w if per_token else np.float32(np.float32(x_scale) * w)
        return Fp8Epilogue(alpha=float(alpha), per_token=per_token)


def _is_traced(value) -> bool:
    return isinstance(value, (jax.Array, jax.core.Tracer))


def epilogue_of(x_scale, w_scale, n: int) -> tuple[Fp8Epilogue, jax.Array | None, jax.Array | None]:
    """``(epilogue, row, col)`` for loose scales: ``x_scale`` a static float or per-row data,
    ``w_scale`` a static float / length-N vector or (tensor parallelism) a length-N device vector.

    The folding itself is :meth:`Fp8Epilogue.fold`, the same one the schemes' plans use.
    """
    row = x_scale if _is_traced(x_scale) else None
    if row is None:
        if isinstance(x_scale, StaticArray):
            x_scale = x_scale.array
        if np.ndim(x_scale) != 0:
            raise ValueError("fp8_gemm: a static x_scale must be a scalar")
        x_scale = float(np.float32(x_scale))
    if _is_traced(w_scale):
        if w_scale.ndim != 1:
            raise TypeError("fp8_gemm: w_scale must be static (a float or numpy array) or a length-N device "
                            "vector, not a traced scalar")
        if w_scale.shape != (n,):
            raise ValueError(f"fp8_gemm: w_scale vector has shape {w_scale.shape}, expected ({n},)")
        return Fp8Epilogue.fold(None if row is not None else x_scale, None, col_is_data=True), row, w_scale
    w = np.asarray(w_scale.array if isinstance(w_scale, StaticArray) else w_scale, np.float32)
    if w.ndim == 0:
        w = float(w)
    elif w.shape != (n,):
        raise ValueError(f"fp8_gemm: w_scale vector has shape {w.shape}, expected ({n},)")
    return Fp8Epilogue.fold(None if row is not None else x_scale, w), row, None
