"""What the NaN/inf scan of checkpoint tensors costs a load (issue: hardening; target < 5%).

    python bench/finite_scan.py [--dir DIR] [--repeats 5] [--json out.json]

Writes (or reuses) the 1.4 GB synthetic Llama-shaped FP8 checkpoint that bench/load_memory.py uses
(hidden 4096, intermediate 14336, 4 layers, vocab 32000, unequal shard scales), then, in one
process with the files in the page cache, times ``modelopt_jax.load(dir)`` alternately with the scan
(the product) and without it (``Checkpoint.read`` passing ``check_finite=False``), and prints the
median wall times and their ratio. Warm loads are the worst case for the scan's share: a cold load
waits on the disk, which the scan overlaps with nothing but is small next to.
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

    def unchecked(self, name):
        self.consumed.add(name)
        return self.tensors.read(name, check_finite=False)

    def load_once(scan: bool) -> float:
        checkpoint_module.Checkpoint.read = original if scan else unchecked
        try:
            t = time.perf_counter()
            model = modelopt_jax.load(args.dir)
            jax.block_until_ready(jax.tree_util.tree_leaves(model))
            return time.perf_counter() - t
        finally:
            checkpoint_module.Checkpoint.read = original

    load_once(True), load_once(False)  # warm the page cache and the import paths
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for scan in (True, False):
            times[scan].append(load_once(scan))
    with_scan, without = statistics.median(times[True]), statistics.median(times[False])
    report = {"checkpoint_bytes": size, "device": jax.devices()[0].device_kind, "with_scan_s": with_scan,
              "without_scan_s": without, "overhead": with_scan / without - 1, "samples": {
                  "with_scan": times[True], "without_scan": times[False]}}
    print(f"# {report['device']}; checkpoint {size / 1e9:.2f} GB; median of {args.repeats} warm loads each")
    print(f"load with the scan {with_scan:.3f} s, without {without:.3f} s: scan costs {100 * report['overhead']:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
