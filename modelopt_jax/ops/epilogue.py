"""``Fp8Epilogue``: how a GEMM's float32 accumulator becomes the output, as one value.

It mirrors the FFI op's ``Fp8GemmProblem`` (``ffi/fp8_gemm_problem.h``: alpha, row scale, column
scale, bias), so a reader of the Python sees the same quantities the kernel sees. A quantization
scheme computes it once, at plan time (:mod:`modelopt_jax.quant.schemes`), and both GEMM
backends read it as is (:mod:`.gemm`).
"""

from __future__ import annotations

import dataclasses

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
