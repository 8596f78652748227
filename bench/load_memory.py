"""Peak host memory of ``modelopt_jax.load`` on a GB-sized synthetic ModelOpt FP8 checkpoint.

Why: the loader promises to stream (one layer's host tensors at a time, then onto the device), so
on a CPU backend -- where "device" arrays live in process memory too -- the peak RSS of a load
should be about one copy of the weights. This measures it:

1. writes (or reuses, with ``--dir``) a Llama-shaped per-tensor FP8 checkpoint with
   :func:`modelopt_jax.synthetic.write_checkpoint` (default: hidden 4096, intermediate 14336,
   4 layers, vocab 32000, ~1.4 GB of tensor data, sharded at 500 MB);
2. in a fresh Python process, imports ``jax`` and ``modelopt_jax``, runs a tiny jnp op, records the
   RSS baseline, then runs ``modelopt_jax.load(dir, dtype=...)`` and records the peak RSS
   (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), so the delta is attributable to the load;
3. prints a table (and writes JSON with ``--json PATH``): checkpoint tensor bytes, baseline RSS,
   peak RSS, peak delta, peak delta / checkpoint bytes, RSS after the load, load wall time.

    python bench/load_memory.py [--dir DIR] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

MiB = 1024 * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(directory: str, dtype: str) -> None:
    """Runs in the fresh process: baseline, load, peak. Prints one JSON line."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import modelopt_jax
    from modelopt_jax.checkpoint import SafetensorsIndex

    jnp.ones((8,), jnp.float32).sum().block_until_ready()  # backend initialised, allocator warm
    checkpoint_bytes = sum(info.nbytes for info in SafetensorsIndex(directory).tensors.values())
    baseline, baseline_peak = _current_rss(), _peak_rss()
    t0 = time.perf_counter()
    model = modelopt_jax.load(directory, dtype=dtype)
    leaves = jax.tree_util.tree_leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    wall = time.perf_counter() - t0
    peak = _peak_rss()
    after = _current_rss()
    print(json.dumps({
        "checkpoint_bytes": checkpoint_bytes, "model_array_bytes": int(sum(x.nbytes for x in leaves)),
        "baseline_rss": baseline, "baseline_peak_rss": baseline_peak, "peak_rss": peak, "rss_after_load": after,
        "peak_delta": peak - baseline, "peak_delta_ratio": (peak - baseline) / checkpoint_bytes,
        "load_seconds": wall, "dtype": dtype, "jax_version": jax.__version__,
        "backend": jax.default_backend(), "directory": directory}))


def measure(directory: str, dtype: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", directory, "--dtype", dtype],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"child load failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="checkpoint directory (generated there if it has no config.json); "
                                  "default: a temporary directory, removed afterwards")
    ap.add_argument("--regenerate", action="store_true", help="rewrite the checkpoint even if --dir has one")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--quant-algo", default="FP8")
    ap.add_argument("--shard-mb", type=float, default=500.0, help="max shard size in MB (1e6 bytes)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=1, help="fresh-process loads to run (reports each)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.dtype)
        return 0

    from modelopt_jax.synthetic import write_checkpoint

    tmp = None
    directory = args.dir
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="modelopt-jax-bench-")
    gen_seconds = None
    try:
        if args.regenerate or not os.path.exists(os.path.join(directory, "config.json")):
            t0 = time.perf_counter()
            info = write_checkpoint(
                directory, family="llama", hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                vocab_size=args.vocab, quant_algo=args.quant_algo, max_shard_bytes=int(args.shard_mb * 1e6))
            gen_seconds = time.perf_counter() - t0
            print(f"wrote {info.tensor_bytes / 1e9:.3f} GB in {len(info.files)} file(s) to {directory} "
                  f"in {gen_seconds:.1f} s; writer process peak RSS {_peak_rss() / MiB:,.0f} MiB "
                  f"(streams one chunk at a time)", flush=True)
        runs = [measure(directory, args.dtype) for _ in range(args.repeat)]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    r = runs[0]
    rows = [("checkpoint tensor bytes", f"{r['checkpoint_bytes'] / MiB:,.1f} MiB"),
            ("model array bytes (after load)", f"{r['model_array_bytes'] / MiB:,.1f} MiB"),
            ("RSS baseline (import jax, modelopt_jax; tiny op)", f"{r['baseline_rss'] / MiB:,.1f} MiB")]
    for i, run in enumerate(runs):
        tag = f" [run {i + 1}]" if len(runs) > 1 else ""
        rows += [(f"peak RSS (ru_maxrss){tag}", f"{run['peak_rss'] / MiB:,.1f} MiB"),
                 (f"peak delta = peak - baseline{tag}", f"{run['peak_delta'] / MiB:,.1f} MiB"),
                 (f"peak delta / checkpoint bytes{tag}", f"{run['peak_delta_ratio']:.3f}"),
                 (f"RSS after load - baseline{tag}", f"{(run['rss_after_load'] - run['baseline_rss']) / MiB:,.1f} MiB"),
                 (f"load wall time ({run['dtype']}){tag}", f"{run['load_seconds']:.2f} s")]
    width = max(len(k) for k, _ in rows)
    print(f"modelopt_jax.load memory  (jax {r['jax_version']}, backend {r['backend']}, {os.cpu_count()} CPUs)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
                       "generate_seconds": gen_seconds,
                       "writer_peak_rss": _peak_rss() if gen_seconds is not None else None, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
