"""The engine's schedule for a workload, without a model or a device: steps, their composition and
the programs they compile (``step_shape``), for tuning the scheduler and the bucketing on a CPU.

    python bench/schedule_sim.py [--workload b] [--pages 53469] [--max-num-seqs N] [--max-num-batched-tokens 8192]
                                 [--reserve-tokens 1024] [--pow2-prompt-buckets] [--one-program]

``--pages`` defaults to the pool ``LLM`` gives the synthetic 8B FP8 checkpoint on the H200 (bf16
pages, kv_cache_memory_fraction 0.9). Every sampled token is a fixed id and no request stops
early (``ignore_eos``), as in bench/serve.py.

The estimated seconds use a step-time model fitted to the H200 runs of 2026-12-01 (8B FP8, bf16
pages; bench/RESULTS.md): a decode step costs 4.6 ms plus its KV bytes at the kernel's 2.34 TB/s,
a prompt step 17.2 ms plus 12.1 us per token (through (a)'s 2048-token steps at 42 ms and (b)'s
~940-token steps at 28.6 ms). A guide for comparing policies, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from modelopt_jax.engine.engine import default_max_num_seqs  # noqa: E402
from modelopt_jax.engine.pages import PagePool  # noqa: E402
from modelopt_jax.engine.request import Request  # noqa: E402
from modelopt_jax.engine.buckets import MAX_PROMPT_SEQS, MIN_DECODE_ROWS, bucket, token_bucket  # noqa: E402
from modelopt_jax.engine.step_programs import (kernel_prompt_section, program_parts, shared_prefixes,  # noqa: E402
                                               step_shape)
from modelopt_jax.ops.paged_step import AttentionConfig, cascade_lines  # noqa: E402
from modelopt_jax.engine.scheduler import Scheduler  # noqa: E402
from modelopt_jax.sampling import SamplingParams  # noqa: E402


def workload(name: str) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, shaped as bench/serve.py draws them (distinct ids
    per request where serve.py's prompts are distinct, a shared prefix where they share one)."""
    rng = np.random.default_rng(0)
    if name == "a":
        return [([10 + i] * 1024, 128) for i in range(64)]
    if name == "d":
        return [([10 + i] * 1000, 1000) for i in range(1000)]
    if name == "e":  # a 1500-token system prompt shared by all, 50-200 distinct tokens each, 128 out
        return [([3] * 1500 + [10 + i] * int(rng.integers(50, 201)), 128) for i in range(1000)]
    if name == "f":  # 256 prompts of 512 tokens, 8 samples each, 256 out
        return [([10 + i] * 512, 256) for i in range(256) for _ in range(8)]
    out = []
    for i in range(1000):
        n = int(rng.integers(64, 1025))
        out.append(([10 + i] * n, int(rng.integers(32, 513))))
    return out


KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B: 32 layers x 8 kv heads x 128 x (k, v) x 2 bytes


def step_seconds(batch) -> float:
    """The fitted H200 cost of one step (see the module docstring)."""
    if all(n == 1 for _, n in batch):
        return 4.6e-3 + sum(r.computed + 1 for r, _ in batch) * KV_BYTES_PER_TOKEN / 2.34e12
    return 17.2e-3 + 12.1e-6 * sum(n for _, n in batch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="b", choices=["a", "b", "d", "e", "f"])
    ap.add_argument("--runs", type=int, default=1, help="run the workload this many times over one pool "
                                                         "(later runs find earlier prompts in the prefix cache)")
    ap.add_argument("--pages", type=int, default=53469)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: what the engine picks for the pool")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--reserve-tokens", type=int, default=1024)
    ap.add_argument("--layout", default="packed", choices=["packed", "split", "one"],
                    help="mixed steps as one packed program per token bucket (EngineConfig.packed_steps, the "
                         "default), as a decode and a prompt program (packed_steps=False), or as one program per "
                         "decode bucket x prompt bucket (also split_steps=False)")
    ap.add_argument("--pow2-prompt-buckets", action="store_true",
                    help="prompt tokens pad to powers of two only (EngineConfig.fine_prompt_buckets=False)")
    ap.add_argument("--cascade-group", type=int, default=16,
                    help="AttentionConfig.cascade_group (Llama-3-8B on the GPU: 16; 0: no cascade attention)")
    ap.add_argument("--verbose", action="store_true", help="print every program's shape and step count")
    args = ap.parse_args()
    if args.max_num_seqs is None:
        args.max_num_seqs = default_max_num_seqs(args.pages, args.page_size)
    pool = PagePool(args.pages, args.page_size)
    args.split = args.layout == "split"
    args.packed_rows = bucket(args.max_num_seqs, MIN_DECODE_ROWS) if args.layout == "packed" else None
    args.fine = fine = not args.pow2_prompt_buckets
    args.cap = cap = min(MAX_PROMPT_SEQS, args.max_num_seqs)
    scheduler = Scheduler(pool, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          reserve_tokens=args.reserve_tokens, split_steps=args.split,
                          packed_steps=args.layout == "packed", fine_prompt_buckets=fine,
                          prompt_seqs_limit=lambda tokens: kernel_prompt_section(token_bucket(tokens, fine=fine),
                                                                                 cap)[2])
    attention = AttentionConfig(args.page_size, decode="fused_kernel", prefill="kernel",  # the H200's paths
                                cascade_group=args.cascade_group)
    seen = set()
    for run in range(args.runs):
        requests = [Request(i, None, list(ids), SamplingParams(max_tokens=m, ignore_eos=True), frozenset(), m,
                            np.zeros(2, np.uint32)) for i, (ids, m) in enumerate(workload(args.workload))]
        shapes = simulate(args, scheduler, attention, requests, run)
        new = set(shapes) - seen
        seen |= set(shapes)
        print(f"run {run + 1}: {len(shapes)} programs, {len(new)} not compiled by an earlier run; "
              f"prefix-cache hit tokens {sum(r.cached_tokens for r in requests):,}")


def simulate(args, scheduler, attention, requests, run):
    for r in requests:
        scheduler.add(r)
    table_width = -(-args.max_model_len // args.page_size)
    shapes, rows_hist, steps = collections.Counter(), collections.Counter(), collections.Counter()
    real = padded = 0
    prompt_tokens = collections.Counter()  # tokens of programs with prompt chunks: "run" (padded), "fed" (real)
    cascade = collections.Counter()  # decode rows, rows reading a shared prefix, prefix tokens read (whole / cascade)
    # mixed steps: their count, tokens as the programs run them, and as one program per token bucket would
    # (decode and prompt tokens together in token_bucket(D + P): the next design's cost, see RESULTS 2026-12-07)
    mixed = collections.Counter()
    seconds = {"prompt": 0.0, "decode": 0.0}
    while not scheduler.done:
        batch = scheduler.schedule()
        seconds["decode" if all(n == 1 for _, n in batch) else "prompt"] += step_seconds(batch)
        step_tokens = 0  # as the step's programs run them (padded)
        for part in program_parts(batch, args.split):
            key = step_shape(part, attention, table_width, max_prompt_seqs=args.cap, fine_prompt_buckets=args.fine,
                             packed_decode_rows=args.packed_rows)
            shapes[key] += 1
            step_tokens += key.tokens
            if key.prompt_tokens:  # a program with prompt chunks: its prompt tokens as run (padded), and as fed
                prompt_tokens["run"] += key.prompt_tokens  # (packed: the whole step's, decodes included)
                prompt_tokens["fed"] += sum(n for _, n in part if key.packed or n > 1)
        padded += step_tokens
        decode = [r for r, n in batch if n == 1]
        fed_prompt = sum(n for _, n in batch if n > 1)
        if decode and fed_prompt:
            mixed["steps"] += 1
            mixed["run"] += step_tokens
            mixed["one_program"] += token_bucket(len(decode) + fed_prompt, fine=args.fine)
            mixed["real"] += len(decode) + fed_prompt
        if decode and attention.cascade_group:
            nd = bucket(len(decode), MIN_DECODE_ROWS)
            plan = shared_prefixes(decode, attention.cascade_group, args.page_size, table_width,
                                   cascade_lines(nd, attention.cascade_group), pad=nd)
            cascade["rows"] += len(decode)
            cascade["sharing"] += plan.rows_sharing
            cascade["tokens_read"] += sum(r.computed + 1 for r in decode) - int(plan.lengths.sum()) + \
                args.page_size * int(np.count_nonzero(plan.tables))
            cascade["tokens_plain"] += sum(r.computed + 1 for r in decode)
        prompt = any(n > 1 for _, n in batch)
        steps["prompt" if prompt else "decode"] += 1
        rows_hist["prompt" if prompt else "decode"] += len(batch)
        real += sum(n for _, n in batch)
        for r, n in batch:
            r.computed += n
            scheduler.register_pages(r)
            if r.pending == 0:
                r.accept(7, 0.0, [], [])
                if r.finish_reason:
                    scheduler.finish(r)
    prompt_steps, decode_steps = steps["prompt"], steps["decode"]
    print(f"workload {args.workload}: {len(requests)} requests, {prompt_steps} prompt steps "
          f"({rows_hist['prompt'] / max(prompt_steps, 1):.1f} rows each), {decode_steps} decode steps "
          f"({rows_hist['decode'] / max(decode_steps, 1):.1f} rows each), preemptions {scheduler.preemptions}; "
          f"{len(shapes)} programs; tokens padded by {padded / real - 1:.1%} (programs with prompt chunks: "
          f"{prompt_tokens['run'] / max(prompt_tokens['fed'], 1) - 1:.1%} of {prompt_tokens['fed']:,} tokens)")
    if cascade["rows"]:
        print(f"cascade attention (group {attention.cascade_group}): {cascade['sharing'] / cascade['rows']:.1%} of "
              f"decode rows read a shared prefix; decode steps read {cascade['tokens_read'] / cascade['tokens_plain']:.1%} "
              f"of the KV tokens they would without it")
    if mixed["steps"]:
        print(f"mixed steps {mixed['steps']}: {mixed['real']:,} real tokens, run as {mixed['run']:,} by their programs "
              f"(+{mixed['run'] / mixed['real'] - 1:.1%}); one program per token_bucket(decode + prompt tokens) "
              f"would run {mixed['one_program']:,} (+{mixed['one_program'] / mixed['real'] - 1:.1%}) in "
              f"{mixed['steps']} programs")
    generated = sum(r.budget for r in requests)
    total = seconds["prompt"] + seconds["decode"]
    print(f"estimated H200 time: prompt steps {seconds['prompt']:.1f} s, decode steps {seconds['decode']:.1f} s; "
          f"{generated / total:,.0f} generated tok/s")
    if args.verbose:
        print("decode-rows prompt-tokens prompt-rows prompt-width table-width prompt-seqs cascade: steps")
        for k, v in sorted(shapes.items()):
            print(*dataclasses.astuple(k), ":", v)
    return shapes


if __name__ == "__main__":
    main()
