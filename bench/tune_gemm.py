"""Tile-configuration tuning for the CUTLASS FP8 GEMM (H200; not a test).

Times every compiled tile configuration (the ``tile`` attribute forces one), under each given
scheduler ``swizzle`` and ``raster``, on Llama-3 shapes for each M, prints the best per M bucket and
writes JSON. The chosen table goes into ffi/cuda/sm90_configs.cu (ChooseSm90Config) and the
measurements into bench/RESULTS.md.

    python bench/tune_gemm.py [--shapes 8B.qkv,8B.down,8192x2048] [--ms 1,16,128] [--json tune.json]

A shape is a name of ``gemm.SHAPES`` or ``NxK`` (e.g. 8192x2048: the grid and per-CTA work that an
explicit split-K of 2 would give 8B.o_proj, 4096x4096, measured before building one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm import SHAPES, _inputs  # noqa: E402
from timing import device_time_jax, repetitions, time_jax  # noqa: E402

from modelopt_jax.ops import native  # noqa: E402
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm  # noqa: E402

DEFAULT_SHAPES = "8B.qkv,8B.gate_up,8B.down,70B.gate_up,70B.down"
DEFAULT_MS = "1,8,16,32,64,128,256,512,1024,2048,4096,8192"


def _label(tile: int, swizzle: int, raster: int) -> str:
    """Short name of one kernel choice, e.g. "5", "5s8", "5s8r2"."""
    return f"{tile}" + (f"s{swizzle}" if swizzle > 1 else "") + (f"r{raster}" if raster else "")


def parse_shape(shape: str) -> tuple[int, int]:
    """(N, K) of a ``gemm.SHAPES`` name or of ``NxK``."""
    if shape in SHAPES:
        return SHAPES[shape]
    n, sep, k = shape.partition("x")
    if not (sep and n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0):
        raise SystemExit(f"--shapes: {shape!r} is neither one of {sorted(SHAPES)} nor NxK (e.g. 8192x2048)")
    return int(n), int(k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--ms", default=DEFAULT_MS)
    ap.add_argument("--tiles", default="all", help="tile configuration indices, or 'all'")
    ap.add_argument("--swizzles", default="1", help="scheduler swizzle sizes to try, e.g. 1,4,8")
    ap.add_argument("--rasters", default="0", help="raster orders to try: 0 heuristic, 1 along M, 2 along N")
    ap.add_argument("--json")
    ap.add_argument("--device-timing", action="store_true",
                    help="GPU kernel time from the profiler instead of wall time per call (no per-call thunk "
                         "overhead: at mid M, tens of us, the wall time's ~15 us of it blurs the ranking)")
    args = ap.parse_args()
    timer = device_time_jax if args.device_timing else time_jax
    count = native.config_count()
    tiles = range(count) if args.tiles == "all" else [int(t) for t in args.tiles.split(",")]
    configs, names = {}, {}  # short label -> (tile, swizzle, raster), and -> description
    for tile in tiles:
        for sw in [int(v) for v in args.swizzles.split(",")]:
            for r in [int(v) for v in args.rasters.split(",")]:
                c = _label(tile, sw, r)
                configs[c] = (tile, sw, r)
                names[c] = native.config_name(tile) + (f" swz{sw}" if sw > 1 else "") + (f" r{r}" if r else "")
    print("# configs:", names, flush=True)
    results = []
    for shape in args.shapes.split(","):
        n, k = parse_shape(shape)
        for m in [int(v) for v in args.ms.split(",")]:
            flops = 2.0 * m * n * k
            reps = repetitions(n * k + m * k + 2 * m * n, 40 if flops < 1e11 else 8)
            xs, ws = _inputs(m, n, k, reps)
            times = {}
            for c, (tile, sw, r) in configs.items():
                try:
                    times[c] = timer(lambda x, w, tile=tile, sw=sw, r=r: ffi_fp8_gemm(
                        x, w, x_scale=0.01, w_scale=0.001, bias=None, out_dtype=jnp.bfloat16, tile=tile,
                        swizzle=sw, raster=r), xs, ws)
                except Exception as e:  # a config that cannot implement this shape
                    print(f"  config {c} failed for {shape} M={m}: {str(e)[:120]}", flush=True)
            best = min(times, key=times.get)
            tile, sw, r = configs[best]
            results.append({"shape": shape, "m": m, "n": n, "k": k, "us": {names[c]: t * 1e6 for c, t in times.items()},
                            "best": names[best], "best_tile": tile, "best_swizzle": sw, "best_raster": r,
                            "best_tflops": flops / times[best] / 1e12})
            line = "  ".join(f"{c}:{flops / t / 1e12:6.0f}" for c, t in times.items())
            print(f"{shape:12s} M={m:5d} best={best} ({flops / times[best] / 1e12:6.1f} TF/s, "
                  f"{n * k / times[best] / 1e12:.2f} TB/s)  [{line}]", flush=True)
            del xs, ws
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "configs": names, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
