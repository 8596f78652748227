"""The grouped FP8 GEMM of a sparse layer's experts: our op's backends side by side, per token count.

    python bench/grouped_gemm.py [--shape qwen3-30b-a3b|mixtral-8x7b|small] [--tokens 1,8,64,512,2048]
                                 [--routing uniform|skewed] [--backends xla,ffi] [--repeats 5]

Rows are the tokens' top-k picks sorted by expert (what models/moe.py feeds the op); times are the
median of ``--repeats`` calls of the jitted op (bf16 output), after one warm-up call. On a GPU the
``ffi`` backend has no CUDA handler yet (the CUTLASS grouped GEMM is not built): run ``xla`` there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from modelopt_jax.ops.grouped_gemm import grouped_fp8_gemm  # noqa: E402

# experts, top-k, hidden, expert intermediate (gate/up N = 2 x intermediate, K = hidden)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "small": (64, 8, 512, 256)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    ap.add_argument("--backends", default="xla,ffi")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    experts, top_k, hidden, inter = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    w = rng.normal(0, 60, (experts, 2 * inter, hidden)).astype(ml_dtypes.float8_e4m3fn)  # gate/up of every expert
    col = np.full((experts, 2 * inter), 1e-3, np.float32)
    w_dev = jax.device_put(w)
    print(f"device {jax.devices()[0].device_kind}; shape {args.shape}: {experts} experts, top-{top_k}, "
          f"gate/up [{2 * inter}, {hidden}]; routing {args.routing}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        p = None if args.routing == "uniform" else np.arange(experts, 0, -1.0) ** 2 / np.sum(np.arange(experts, 0, -1.0) ** 2)
        picks = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)]).reshape(-1)
        sizes = np.bincount(picks, minlength=experts).astype(np.int32)
        x = jax.device_put(rng.normal(0, 60, (len(picks), hidden)).astype(ml_dtypes.float8_e4m3fn))
        line = [f"tokens {tokens:5d} (rows {len(picks)})"]
        for backend in args.backends.split(","):
            f = jax.jit(lambda x, w, g, c, b=backend: grouped_fp8_gemm(x, w, g, c, out_dtype=jnp.bfloat16, backend=b))
            f(x, w_dev, sizes, col).block_until_ready()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                f(x, w_dev, sizes, col).block_until_ready()
                times.append(time.perf_counter() - start)
            line.append(f"{backend} {statistics.median(times) * 1e3:9.2f} ms")
        print("  ".join(line))


if __name__ == "__main__":
    main()
