"""FP8 GEMM benchmark on a CUDA GPU: our CUTLASS FFI kernel against its peers, side by side.

Run on the H200 (not a test):  python bench/gemm.py [--shapes 8B,70B] [--ms 1,16,1024] [--json out.json]
Peers on the same shapes and FP8 inputs, in the same process: ours per-tensor and per-token x
per-channel; XLA's FP8 ``dot_general(f8, f8) * scale``; XLA's dequantize-then-dot (which XLA may
rewrite into cuBLASLt FP8); XLA bf16; torch ``_scaled_mm`` per-tensor and row-wise when torch is
importable. Every output is bf16 and every dtype is printed. Prints TFLOP/s, effective weight
bandwidth of ours, and ours / best peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import device_time_jax, device_time_torch, repetitions, time_jax, time_torch  # noqa: E402

from modelopt_jax.ops import native  # noqa: E402
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm  # noqa: E402
from modelopt_jax.ops.gemm import fp8_gemm  # noqa: E402

SHAPES = {  # name: (N, K) of Llama-3 linear layers (fused qkv and gate_up)
    "8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096), "8B.down": (4096, 14336),
    "70B.qkv": (10240, 8192), "70B.o": (8192, 8192), "70B.gate_up": (57344, 8192), "70B.down": (8192, 28672),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SX, SW = 0.0123, 0.00071


def _inputs(m, n, k, copies, seed=0):
    """``copies`` distinct random FP8 activations [M, K] and weights [N, K] (never zeros)."""
    key = jax.random.PRNGKey(seed)
    kx, kw = jax.random.split(key)
    gen = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 60).clip(-448, 448)
                  .astype(jnp.float8_e4m3fn), static_argnums=1)
    xs = [gen(jax.random.fold_in(kx, i), (m, k)) for i in range(copies)]
    ws = [gen(jax.random.fold_in(kw, i), (n, k)) for i in range(copies)]
    return xs, ws


def jax_peers(n):
    col = np.random.default_rng(0).uniform(1e-4, 1e-3, n).astype(np.float32)

    def ours_tensor(x, w):
        return ffi_fp8_gemm(x, w, x_scale=SX, w_scale=SW, bias=None, out_dtype=jnp.bfloat16)

    def ours_token(x, w):
        row = jnp.asarray(np.full((x.shape[0],), SX, np.float32))  # a per-token [M] buffer (a constant here)
        return ffi_fp8_gemm(x, w, x_scale=row, w_scale=col, bias=None, out_dtype=jnp.bfloat16)

    def xla_fp8_dot(x, w):
        return fp8_gemm(x, w, x_scale=SX, w_scale=SW, out_dtype=jnp.bfloat16, backend="xla")

    def xla_dequant_dot(x, w):
        a = x.astype(jnp.bfloat16) * jnp.bfloat16(SX)
        b = w.astype(jnp.bfloat16) * jnp.bfloat16(SW)
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

    return {"ours_tensor": ours_tensor, "ours_token": ours_token, "xla_fp8_dot": xla_fp8_dot,
            "xla_dequant_dot": xla_dequant_dot}


def torch_peers(xs, ws):
    try:
        import torch
    except ImportError:
        return {}, None, None
    txs = [torch.from_dlpack(x) for x in xs]
    tws = [torch.from_dlpack(w) for w in ws]
    m, n = xs[0].shape[0], ws[0].shape[0]
    sa, sb = torch.tensor(SX, device="cuda"), torch.tensor(SW, device="cuda")  # made once, not per call
    ra, rb = torch.full((m, 1), SX, device="cuda"), torch.full((1, n), SW, device="cuda")

    def tensor(x, w):
        return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def rowwise(x, w):
        return torch._scaled_mm(x, w.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16)

    return {"torch_tensor": tensor, "torch_rowwise": rowwise}, txs, tws


def bench_shape(name, n, k, ms, reps_small=50, reps_large=10, device_timing=False):
    """Times every peer at each M; with ``device_timing`` by summed GPU kernel time (profiler)."""
    tj, tt = (device_time_jax, device_time_torch) if device_timing else (time_jax, time_torch)
    rows = []
    for m in ms:
        flops = 2.0 * m * n * k
        reps = repetitions(n * k + m * k + 2 * m * n, reps_small if flops < 1e11 else reps_large)
        xs, ws = _inputs(m, n, k, reps)
        times = {}
        for peer, fn in jax_peers(n).items():
            times[peer] = tj(fn, xs, ws)
        bf_reps = max(3, reps // 2)  # bf16 operands are twice the bytes
        xs_bf = [x.astype(jnp.bfloat16) for x in xs[:bf_reps]]
        ws_bf = [w.astype(jnp.bfloat16) for w in ws[:bf_reps]]
        times["xla_bf16"] = tj(lambda x, w: jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16), xs_bf, ws_bf)
        del xs_bf, ws_bf
        tpeers, txs, tws = torch_peers(xs, ws)
        for peer, fn in tpeers.items():
            try:
                times[peer] = tt(fn, txs, tws)
            except RuntimeError as e:  # e.g. rowwise unsupported for a shape
                print(f"  {peer} failed at M={m}: {e}", file=sys.stderr)
        peers = {p: t for p, t in times.items() if not p.startswith("ours")}
        best_peer = min(peers, key=peers.get)
        row = {"timing": "device kernel time" if device_timing else "wall time / call", "shape": name, "m": m, "n": n, "k": k, "tflops": {p: flops / t / 1e12 for p, t in times.items()},
               "us": {p: t * 1e6 for p, t in times.items()}, "best_peer": best_peer,
               "weight_tb_s": n * k / times["ours_tensor"] / 1e12,
               "ratio_tensor": peers[best_peer] / times["ours_tensor"],
               "ratio_token": peers[best_peer] / times["ours_token"],
               "ratio_vs_torch": times.get("torch_tensor", np.nan) / times["ours_tensor"],
               "token_overhead": times["ours_token"] / times["ours_tensor"] - 1}
        rows.append(row)
        print(f"{name:12s} M={m:5d}  ours {row['tflops']['ours_tensor']:7.1f} TF/s ({row['us']['ours_tensor']:8.1f} us,"
              f" {row['weight_tb_s']:.2f} TB/s w)  token {row['tflops']['ours_token']:7.1f}  "
              f"xla_fp8 {row['tflops']['xla_fp8_dot']:7.1f}  xla_deq {row['tflops']['xla_dequant_dot']:7.1f}  "
              f"bf16 {row['tflops']['xla_bf16']:7.1f}  torch {row['tflops'].get('torch_tensor', float('nan')):7.1f}"
              f"/{row['tflops'].get('torch_rowwise', float('nan')):7.1f}  best={best_peer} "
              f"ratio {row['ratio_tensor']:.2f}x (token {row['ratio_token']:.2f}x)", flush=True)
        del xs, ws
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8B,70B", help="comma list of prefixes or full names")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--json")
    ap.add_argument("--device-timing", action="store_true",
                    help="sum of GPU kernel durations from the profiler instead of wall time (no launch gaps)")
    args = ap.parse_args()
    if not native.has_cuda_handler():
        raise SystemExit("CUDA FFI library not found (build with nvcc, or set MODELOPT_JAX_NATIVE_DIR)")
    dev = jax.devices()[0]
    timing = "GPU kernel time (profiler)" if args.device_timing else "wall time per call in one program"
    print(f"# {dev.device_kind}, jax {jax.__version__}; all outputs bf16, inputs float8_e4m3fn; {timing}", flush=True)
    wanted = args.shapes.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    rows = []
    for name, (n, k) in SHAPES.items():
        if any(name == w or name.startswith(w + ".") for w in wanted):
            rows += bench_shape(name, n, k, ms, device_timing=args.device_timing)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
