"""Which FP8 GEMM backend "auto" should run on CPU: LLM.generate with each, side by side.

    python bench/cpu_backend.py [--dir DIR] [--batches 1,8] [--new 16] [--prompt 32] [--long-prompt 256]
                                [--backends xla,cutlass,auto] [--repeats 3] [--gemm-rows 1,8,16,32,64,256]
                                [--json out.json]

Writes (or reuses) a small synthetic Llama-shaped FP8 checkpoint (hidden 2048, intermediate 5632,
8 layers, 32/8 heads, vocab 32000: 0.36 GB of FP8 weights, small enough for a 2-core machine),
then per backend loads it with ``LLM(..., backend=B, dtype="bfloat16")`` and reports medians of
``--repeats`` runs, each shape run once untimed first (compilation excluded):

- decode: ``batch`` greedy sequences after a ``--prompt``-token prompt: ``batch x new`` tokens over
  the time of generating ``new + 1`` tokens minus that of generating 1 (the prompt step), in
  tokens/s. The engine pads a step's tokens to at least 16, so every decode step here has M = 16;
- prefill: one ``--long-prompt``-token prompt, one new token, in prompt tokens/s.

First, the GEMM alone (``--gemm-rows``): one jitted ``fp8_gemm`` of each M against the model's
largest weight (N 5632 x K 2048, per-tensor scales, bf16 out) with ``backend="xla"`` and
``"cutlass"`` (our CPU handler), median of 20 calls each; the ratio says where "auto"'s row limit
(``CPU_HANDLER_MAX_ROWS``) belongs.

Every dtype is printed; all backends read the same FP8 weights, with bf16 activations out.
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
import numpy as np  # noqa: E402

from modelopt_jax import LLM, SamplingParams  # noqa: E402
from modelopt_jax.ops import native  # noqa: E402


def timed(llm, prompts, new: int, repeats: int) -> float:
    """Median seconds of ``llm.generate(prompts)`` for ``new`` greedy tokens, after one untimed run."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles this shape's programs
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_sweep(rows: list[int], n: int = 5632, k: int = 2048, calls: int = 20) -> dict:
    """Median seconds per call of XLA's FP8 dot and of our CPU handler, per M, with their ratio."""
    import jax.numpy as jnp

    from modelopt_jax.ops.gemm import fp8_gemm

    rng = np.random.default_rng(1)
    w_q = jnp.asarray(rng.normal(0, 1, (n, k)).astype(jnp.float8_e4m3fn))
    out = {}
    for m in rows:
        x_q = jnp.asarray(rng.normal(0, 1, (m, k)).astype(jnp.float8_e4m3fn))
        row = {}
        for backend in ("xla", "cutlass"):
            fn = jax.jit(lambda x, w, b=backend: fp8_gemm(x, w, x_scale=0.05, w_scale=0.02, out_dtype=jnp.bfloat16,
                                                             backend=b))
            fn(x_q, w_q).block_until_ready()
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                fn(x_q, w_q).block_until_ready()
                times.append(time.perf_counter() - t)
            row[f"{backend}_ms"] = 1e3 * statistics.median(times)
        row["xla_over_handler"] = row["xla_ms"] / row["cutlass_ms"]
        out[m] = row
        print(f"gemm M={m:4d} N={n} K={k}: xla {row['xla_ms']:.2f} ms, our handler {row['cutlass_ms']:.2f} ms, "
              f"xla/handler {row['xla_over_handler']:.2f}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/modelopt_jax_cpu_backend_ckpt")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=256)
    ap.add_argument("--backends", default="xla,cutlass,auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemm-rows", default="1,8,16,32,64,256", help="M values of the GEMM sweep ('' skips it)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        from modelopt_jax.synthetic import write_checkpoint

        write_checkpoint(args.dir, family="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
    rng = np.random.default_rng(0)
    report = {"device": jax.devices()[0].device_kind, "cpus": len(os.sched_getaffinity(0)),
              "fast_cpu_handler": native.has_cpu_handler(), "weights": "float8_e4m3fn",
              "activations": "bfloat16", "results": {}}
    print(f"# {report['device']}, {report['cpus']} CPUs; FP8 weights, bf16 activations; fast CPU handler: "
          f"{report['fast_cpu_handler']}")
    if args.gemm_rows:
        report["gemm"] = gemm_sweep([int(m) for m in args.gemm_rows.split(",")])
    for backend in filter(None, args.backends.split(",")):  # "" runs only the GEMM sweep
        llm = LLM(args.dir, dtype="bfloat16", backend=backend, max_model_len=512, compilation_cache_dir=None)
        row = {}
        for b in (int(x) for x in args.batches.split(",")):
            prompts = [rng.integers(1, 32000, args.prompt).tolist() for _ in range(b)]
            decode = timed(llm, prompts, args.new + 1, args.repeats) - timed(llm, prompts, 1, args.repeats)
            row[f"decode_b{b}_tok_s"] = b * args.new / decode
        long = [rng.integers(1, 32000, args.long_prompt).tolist()]
        row["prefill_tok_s"] = args.long_prompt / timed(llm, long, 1, args.repeats)
        report["results"][backend] = row
        print(f"{backend:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
