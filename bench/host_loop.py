"""The engine's host work per step, apart from the device (any machine; not a test).

Why: on the H200, a decode step of 256 rows of the 8B model took 12.99 ms of wall time for
10.24 ms of GPU work (bench/RESULTS.md, 2026-12-02): the host's cycle per step -- record the
sampled tokens, schedule, build the step's arrays, dispatch -- is longer than the step, and the
GPU waits. This times each part of that cycle inside ``LLM.generate`` on a small checkpoint (the
package's demo model by default; its device time is irrelevant here: the wait for the device is
timed separately and left out).

    python bench/host_loop.py [--rows 256] [--prompt 100] [--new 48] [--checkpoint DIR] [--json out.json]

A checkpoint with the 8B's 32 layers and tiny widths shows the per-layer host costs (the weights'
pytree) without the 8B's device time: ``modelopt_jax.synthetic.write_checkpoint(DIR, hidden_size=128,
intermediate_size=256, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
vocab_size=512)``.

Reported per step (milliseconds, mean over the measured run; decode and prompt steps together):
``schedule`` (the scheduler's decisions, both the speculative one and any in line), ``launch``
(building the step's host arrays; dispatch not included), ``dispatch`` (the jit call, which
returns before the device is done), ``collect`` (recording the tokens, excluding the device wait),
``wait`` (the device-to-host copy, which is where the device time shows).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import modelopt_jax  # noqa: E402
from modelopt_jax import LLM, SamplingParams  # noqa: E402
from modelopt_jax.engine import runner as runner_module  # noqa: E402


def _timed(acc: collections.Counter, label: str, fn):
    """``fn``, adding its seconds to ``acc[label]``."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] += time.perf_counter() - t
    return timed


class _TimedPrograms(dict):
    """The runner's compiled-ahead programs, each call timed as dispatch (``Runner._compiled``)."""

    def __init__(self, programs: dict, acc: collections.Counter):
        super().__init__(programs)
        self.acc = acc

    def get(self, key, default=None):
        program = super().get(key, default)
        return None if program is None else _timed(self.acc, "dispatch", program)


def measure(llm: LLM, prompts: list[list[int]], params) -> dict:
    """Host seconds per step by part while ``llm.generate(prompts, params)`` runs (see the module
    docstring). Dispatch covers programs compiled ahead (``Runner._compiled``) and jit's alike."""
    engine, runner = llm.engine, llm.engine.runner
    acc = collections.Counter()
    saved = (engine._scheduler.schedule, runner.launch, runner._step, engine._collect, runner_module.jax.device_get,
             runner._compiled)
    try:
        engine._scheduler.schedule = _timed(acc, "schedule", saved[0])
        runner.launch = _timed(acc, "launch+dispatch", saved[1])
        runner._step = _timed(acc, "dispatch", saved[2])
        engine._collect = _timed(acc, "collect+wait", saved[3])
        runner_module.jax.device_get = _timed(acc, "wait", saved[4])
        runner._compiled = _TimedPrograms(saved[5], acc)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t
    finally:
        compiled_meanwhile = {k: v for k, v in runner._compiled.items() if k not in saved[5]}
        (engine._scheduler.schedule, runner.launch, runner._step, engine._collect,
         runner_module.jax.device_get, runner._compiled) = saved
        runner._compiled.update(compiled_meanwhile)  # background compiles that finished during the run
    stats = llm.last_stats
    steps = stats["steps"]
    parts = {"schedule": acc["schedule"], "launch": acc["launch+dispatch"] - acc["dispatch"],
             "dispatch": acc["dispatch"], "collect": acc["collect+wait"] - acc["wait"], "wait": acc["wait"]}
    per_step = {k: 1e3 * v / steps for k, v in parts.items()}
    host = sum(v for k, v in per_step.items() if k != "wait")
    return {"steps": steps, "decode_steps": stats["decode_steps"], "total_s": total, "ms_per_step": per_step,
            "host_ms_per_step": host}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=os.path.join(os.path.dirname(modelopt_jax.__file__), "demo",
                                                         "qwen2-bytes-fp8"))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="the pool (default: 256 MiB on the CPU, where the default pool holds only 8 sequences; "
                         "the memory fraction elsewhere)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import jax

    pool = args.kv_cache_bytes or (256 << 20 if jax.default_backend() == "cpu" else None)
    llm = LLM(args.checkpoint, max_model_len=args.prompt + args.new + 16, kv_cache_bytes=pool,
              max_num_seqs=args.rows)
    rng = np.random.default_rng(0)
    vocab = llm.model.config.vocab_size
    prompts = [rng.integers(10, vocab, args.prompt).tolist() for _ in range(args.rows)]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    runs = [measure(llm, prompts, params) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["host_ms_per_step"])
    cells = ", ".join(f"{k} {v:.2f}" for k, v in best["ms_per_step"].items())
    print(f"{args.rows} rows x {args.prompt} prompt + {args.new} new, {best['steps']} steps "
          f"({best['decode_steps']} decode): host {best['host_ms_per_step']:.2f} ms/step ({cells}; best of "
          f"{args.repeats})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
