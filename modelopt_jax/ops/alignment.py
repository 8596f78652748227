"""The alignment rules of the FP8 GEMM kernels and the processed-weight layout, in one place.

CUTLASS's FP8 kernels (``ffi/cuda/fp8_gemm_cuda.cu``, which states the same K % 16 / N % 8 rule in
its error message) need K in multiples of 16 and N in multiples of 8. Weights are stored with N
zero-padded to a multiple of ``N_ALIGN`` once, at load time, and the layer slices its output
back, so no call ever pads. ``WEIGHT_LAYOUT`` names exactly that processed form; the weight cache
shares buffers only in it (and puts it in its fingerprint).
"""

from __future__ import annotations

N_ALIGN = 16             # weight rows (N) are zero-padded to a multiple of this at load time
CUTLASS_K_MULTIPLE = 16  # the CUTLASS kernels' K alignment (FP8 elements)
CUTLASS_N_MULTIPLE = 8   # the CUTLASS kernels' N alignment
# float8_e4m3fn [N, K] as stored in the checkpoint (K-major, never transposed), N padded to N_ALIGN.
WEIGHT_LAYOUT = "fp8-e4m3fn-NK-pad16"


def padded_rows(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`N_ALIGN`."""
    return -(-n // N_ALIGN) * N_ALIGN


def cutlass_can_run(n: int, k: int) -> bool:
    """Whether a [*, K] x [N, K] problem meets the CUTLASS kernels' alignment."""
    return k % CUTLASS_K_MULTIPLE == 0 and n % CUTLASS_N_MULTIPLE == 0
