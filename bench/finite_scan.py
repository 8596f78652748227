"""What the NaN/inf scan of checkpoint tensors costs a load (issue: hardening; target < 5%).

    python bench/finite_scan.py [--dir DIR] [--repeats 5] [--json out.json]

Writes (or reuses) the 1.4 GB synthetic Llama-shaped FP8 checkpoint that bench/load_memory.py uses
(hidden 4096, intermediate 14336, 4 layers, vocab 32000, unequal shard scales), then, in one
process with the files in the page cache, times ``modelopt_jax.load(dir)`` round-robin in four
ways: each read path of :mod:`modelopt_jax.checkpoint.finite_scan` (``native``: the CPU library's
read-and-scan; ``numpy``: the fallback without it) with the scan (the product) and without it
(``Checkpoint.read`` passing ``check_finite=False``). It prints the median wall times, each path's
scan overhead, and the product's time against the fastest scan-less load. Warm loads are the worst
case for the scan's share: a cold load waits on the disk, next to which the scan is small.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import modelopt_jax  # noqa: E402
from modelopt_jax.checkpoint import checkpoint as checkpoint_module  # noqa: E402
from modelopt_jax.checkpoint import finite_scan  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/modelopt_jax_scan_ckpt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        from modelopt_jax.synthetic import write_checkpoint

        write_checkpoint(args.dir, family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_shard_bytes=500 << 20)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir) if f.endswith(".safetensors"))

    original = checkpoint_module.Checkpoint.read
    native_scan = finite_scan._native

    def unchecked(self, name):
        self.consumed.add(name)
        return self.tensors.read(name, check_finite=False)

    def load_once(path: str, scan: bool) -> float:
        checkpoint_module.Checkpoint.read = original if scan else unchecked
        finite_scan._native = native_scan if path == "native" else (lambda: None)
        try:
            t = time.perf_counter()
            model = modelopt_jax.load(args.dir)
            jax.block_until_ready(jax.tree_util.tree_leaves(model))
            return time.perf_counter() - t
        finally:
            checkpoint_module.Checkpoint.read = original
            finite_scan._native = native_scan

    paths = ["native", "numpy"] if finite_scan.native_available() else ["numpy"]
    ways = [(p, scan) for p in paths for scan in (True, False)]
    for way in ways:  # warm the page cache and the import paths
        load_once(*way)
    times = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way in ways:
            times[way].append(load_once(*way))
    median = {way: statistics.median(t) for way, t in times.items()}
    fastest_bare = min(median[(p, False)] for p in paths)
    report = {"checkpoint_bytes": size, "device": jax.devices()[0].device_kind, "cpus": len(os.sched_getaffinity(0)),
              "repeats": args.repeats, "paths": {}}
    print(f"# {report['device']}, {report['cpus']} CPUs; checkpoint {size / 1e9:.2f} GB; median of {args.repeats} "
          f"warm loads each")
    for p in paths:
        with_scan, without = median[(p, True)], median[(p, False)]
        report["paths"][p] = {"with_scan_s": with_scan, "without_scan_s": without,
                              "overhead": with_scan / without - 1, "over_fastest_bare": with_scan / fastest_bare - 1,
                              "samples": {"with_scan": times[(p, True)], "without_scan": times[(p, False)]}}
        print(f"{p:6s}: load with the scan {with_scan:.3f} s, without {without:.3f} s: scan costs "
              f"{100 * (with_scan / without - 1):.1f}%; {100 * (with_scan / fastest_bare - 1):.1f}% over the "
              f"fastest load without a scan ({fastest_bare:.3f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
