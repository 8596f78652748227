"""How far each compiled FP8 GEMM configuration's accumulation is from exact, on a CUDA GPU.

Run on the H200 (not a test):  python bench/gemm_accuracy.py [--ks 4096,14336] [--m 64] [--json out.json]

Every sm90 configuration is a CUTLASS "FP8 fast accumulation" kernel: the tensor cores add FP8
products into their own accumulator for the whole K loop, with no periodic promotion into a float32
register (what DeepGEMM and vLLM's block-scaled kernels do). That accumulator keeps fewer mantissa
bits than float32, so the error grows with K. This measures it per configuration, on the FP8 inputs
the model's layers see (activations and weights drawn as real ones are: roughly normal, scaled so
their largest values sit near the FP8 maximum), against a float64 GEMM of exactly the same FP8 codes,
beside two peers on the same inputs: a float32 GEMM (numpy's float32 accumulation) and XLA's FP8
dot on the GPU (float32 output). The CUDA kernels write bf16 or f16, so ours write float16 (the finer
of the two: its rounding alone gives the "f16 output floor" row), and the excess over that floor,
sqrt(err^2 - floor^2), is what the accumulation adds. Printed per (configuration, K): the relative
Frobenius error, the largest error over the output's RMS, and the excess over the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modelopt_jax.ops import native  # noqa: E402
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm  # noqa: E402

E4M3 = ml_dtypes.float8_e4m3fn


def fp8_inputs(m: int, n: int, k: int, seed: int = 0):
    """FP8 codes shaped like a quantized layer's: activations with a few outlier channels (as LLM
    activations have), weights near-normal; both scaled so the largest code is near 448."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.where(rng.random(k) < 0.01, 8.0, 1.0)
    w = rng.standard_normal((n, k))
    x_q = (x / np.abs(x).max() * 440).astype(np.float32).astype(E4M3)
    w_q = (w / np.abs(w).max() * 440).astype(np.float32).astype(E4M3)
    return x_q, w_q


def errors(got: np.ndarray, want: np.ndarray) -> dict:
    diff = got.astype(np.float64) - want
    rms = float(np.sqrt(np.mean(want ** 2)))
    return {"rel_frobenius": float(np.linalg.norm(diff) / np.linalg.norm(want)),
            "max_over_rms": float(np.abs(diff).max() / rms)}


def measure(m: int, k: int, n: int = 1024, seed: int = 0) -> list[dict]:
    x_q, w_q = fp8_inputs(m, n, k, seed)
    alpha = 1.0 / 440 ** 2
    want = (x_q.astype(np.float64) @ w_q.astype(np.float64).T) * alpha
    f32 = (x_q.astype(np.float32) @ w_q.astype(np.float32).T) * np.float32(alpha)
    rows = [{"path": "numpy float32", "k": k, "m": m, **errors(f32, want)},
            {"path": "f16 output floor", "k": k, "m": m, **errors(want.astype(np.float16), want)}]
    xj, wj = jnp.asarray(x_q), jnp.asarray(w_q)
    xla = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32) * alpha)(xj, wj)
    rows.append({"path": "XLA FP8 dot", "k": k, "m": m, **errors(np.asarray(xla), want)})
    for tile in range(native.config_count()):
        got = ffi_fp8_gemm(xj, wj, x_scale=alpha, w_scale=1.0, bias=None, out_dtype=jnp.float16, tile=tile)
        rows.append({"path": native.config_name(tile), "tile": tile, "k": k, "m": m,
                     **errors(np.asarray(got), want)})
    floor = rows[1]["rel_frobenius"]
    for row in rows:
        row["excess_over_f16_floor"] = float(np.sqrt(max(row["rel_frobenius"] ** 2 - floor ** 2, 0.0)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="4096,14336")
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not native.has_cuda_handler():
        sys.exit("the CUDA library is not built (or not of this package's handler contract)")
    print(f"device: {jax.devices()[0].device_kind}; M = {args.m}, N = 1024; errors against a float64 GEMM of "
          "the same FP8 codes")
    print(f"{'path':40s} {'K':>6s} {'rel. Frobenius':>15s} {'max / RMS':>10s} {'over floor':>10s}")
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        for row in measure(args.m, k):
            rows.append(row)
            print(f"{row['path']:40s} {k:6d} {row['rel_frobenius']:15.3e} {row['max_over_rms']:10.3e} "
                  f"{row['excess_over_f16_floor']:10.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
