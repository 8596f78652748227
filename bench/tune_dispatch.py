"""Measures, per (N, K) and M, whether our CUTLASS kernel or XLA's FP8 dot is faster on this GPU, and
writes the table ``backend="auto"`` dispatches by (modelopt_jax/ops/gemm_dispatch_tables.py). Not a test.

    python bench/tune_dispatch.py [--shapes 8B.qkv,...|NxK] [--ms 1,16,...] [--margin 0.03] [--json out.json] [--write]

Both paths are timed by GPU kernel time (the profiler; no per-call thunk overhead) on the same
random FP8 operands with bf16 output and a per-tensor epilogue, ours at its own configuration
choice. XLA's path is chosen only where it is faster by more than ``--margin`` (noise between runs
is a few percent). Consecutive M with the same choice form one bucket; an M between two measured
ones takes the next measured one's choice. ``--write`` replaces this device kind's table in the
package and keeps the other kinds'.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pprint
import sys

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import _inputs  # noqa: E402
from timing import device_time_jax, repetitions  # noqa: E402
from tune_gemm import parse_shape  # noqa: E402

from modelopt_jax.ops import gemm_dispatch, native  # noqa: E402
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm  # noqa: E402
from modelopt_jax.ops.gemm import fp8_gemm  # noqa: E402

# Llama-3 8B/70B and Qwen3-30B-A3B's dense projections (fused qkv and gate_up), whole and at TP=2
DEFAULT_SHAPES = ("8B.qkv,8B.o,8B.gate_up,8B.down,70B.qkv,70B.o,70B.gate_up,70B.down,"
                  "3072x4096,4096x2048,14336x4096,4096x7168,5120x2048,2048x4096")
DEFAULT_MS = "1,8,16,32,64,128,256,512,1024,2048,4096,8192"
TABLE_FILE = os.path.join(ROOT, "modelopt_jax", "ops", "gemm_dispatch_tables.py")


def write_table(device_kind: str, shapes: dict, measured: str) -> None:
    from modelopt_jax.ops.gemm_dispatch_tables import TABLES

    tables = dict(TABLES)
    tables[device_kind] = {"measured": measured, "shapes": shapes}
    gemm_dispatch.parse_table(device_kind, shapes)  # refuse to write what "auto" would refuse to read
    with open(TABLE_FILE) as f:
        head = f.read().split("TABLES", 1)[0]
    with open(TABLE_FILE, "w") as f:
        f.write(head + "TABLES: dict = " + pprint.pformat(tables, width=110, sort_dicts=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--ms", default=DEFAULT_MS)
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--json")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if not native.has_cuda_handler():
        sys.exit("the CUDA library is not built (or not of this package's handler contract)")
    kind = jax.devices()[0].device_kind
    ms = [int(v) for v in args.ms.split(",")]
    rows, shapes = [], {}
    print(f"device: {kind}; TFLOP/s by GPU kernel time, bf16 output, per-tensor scales")
    for shape in args.shapes.split(","):
        n, k = parse_shape(shape)
        choices = []
        for m in ms:
            reps = repetitions(n * k + m * k + 2 * m * n, 40 if 2.0 * m * n * k < 1e11 else 8)
            xs, ws = _inputs(m, n, k, reps)
            ours = device_time_jax(lambda x, w: ffi_fp8_gemm(x, w, x_scale=0.01, w_scale=0.001, bias=None,
                                                             out_dtype=jnp.bfloat16), xs, ws)
            xla = device_time_jax(lambda x, w: fp8_gemm(x, w, x_scale=0.01, w_scale=0.001, out_dtype=jnp.bfloat16,
                                                        backend="xla"), xs, ws)
            path = gemm_dispatch.XLA if xla < ours * (1 - args.margin) else gemm_dispatch.CUTLASS
            choices.append((m, path))
            flops = 2.0 * m * n * k
            rows.append({"shape": shape, "n": n, "k": k, "m": m, "ours_us": ours * 1e6, "xla_us": xla * 1e6,
                         "path": path})
            print(f"{shape:12s} M={m:5d}  ours {flops / ours / 1e12:7.1f}  xla {flops / xla / 1e12:7.1f}  "
                  f"xla/ours time {xla / ours:5.2f}  -> {path}", flush=True)
            del xs, ws
        if any(path != gemm_dispatch.CUTLASS for _, path in choices):
            shapes[(n, k)] = gemm_dispatch.merge_buckets(choices)
    print("table:", pprint.pformat(shapes, width=110))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": kind, "rows": rows,
                       "shapes": {f"{n}x{k}": b for (n, k), b in shapes.items()}}, f, indent=1)
    if args.write:
        when = datetime.date.today().isoformat()
        write_table(kind, shapes, f"{when}, python bench/tune_dispatch.py --ms {args.ms} --margin {args.margin}")
        print(f"wrote {TABLE_FILE}")


if __name__ == "__main__":
    main()
