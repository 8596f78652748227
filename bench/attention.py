"""Decode attention over a paged KV pool, one Llama-3-8B layer (32 q heads, 8 kv heads, d 128): peers
side by side in one process (H200; not a test).

    python bench/attention.py [--json out.json]

Peers: our CUDA kernel (``paged_attention(backend="kernel")``, bf16 and FP8 pages; ``kernel`` the
tensor-core ("mma") kernel the engine runs for bf16 compute, ``kernel_staged`` the cp.async-staged
CUDA-core kernel that serves float32 compute), the XLA path the
engine runs without it (``backend="xla"``: gather the rows' pages, two einsums), and jax's Pallas GPU
``paged_attention`` (Triton; pages [kv_heads, pages, page, d], k_splits 1/4/16). Pages are shuffled
over the pool, as a running engine leaves them. Reported: microseconds per call (median, timing.py:
distinct pools per call so nothing stays in L2), and the bandwidth of the KV bytes actually used.

    python bench/attention.py --prefill [--json out.json]

Prompt steps instead: the prefill kernel (GPU time alone, CUPTI) beside the XLA path it replaced
(wall per call), on the engine's step shapes -- 2048 packed tokens as whole prompts of (a) and (b)
and as a chunk after a cached prefix -- in TFLOP/s of the causal work done (4 d per query-key pair
at or before the query).
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
from timing import kernel_times, time_jax  # noqa: E402

from modelopt_jax.ops import attention  # noqa: E402
from modelopt_jax.ops.attention import paged_attention  # noqa: E402

HEADS, KV, D, PAGE = 32, 8, 128, 16
SHAPES = [(1, 1024), (1, 4096), (64, 1024), (64, 4096), (256, 512), (256, 1024)]
POOL_BUDGET = 12e9  # bytes of distinct pools per timed program (3..10 of them: dispatch amortised)


def make(batch, context, dtype, seed):
    rng = np.random.default_rng(seed)
    pages = -(-context // PAGE)
    total = batch * pages + 1
    tables = (1 + rng.permutation(total - 1)).reshape(batch, pages).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, D)), jnp.bfloat16)
    return q, random_pools(total, dtype, seed), jnp.asarray(tables), jnp.full((batch,), context - 1, jnp.int32)


def random_pools(total_pages, dtype, seed):
    """(keys, values) pools of ``total_pages`` pages: as many distinct ones as POOL_BUDGET allows (3..10)."""
    count = int(max(3, min(10, POOL_BUDGET // (2 * total_pages * PAGE * KV * D * jnp.dtype(dtype).itemsize))))
    pools = []
    for i in range(count):
        k = jax.random.normal(jax.random.key(seed * 10 + i), (total_pages * PAGE, KV, D), jnp.float32)
        pools.append((k.astype(dtype), (k * 0.5).astype(dtype)))
    return pools


def ours(q, pool, tables, positions, backend, fp8, variant="mma", splits=None):
    k, v = pool
    scale = 0.02 if fp8 else None
    return paged_attention(q, k, v, k_scale=scale, v_scale=scale, page_size=PAGE,
                           token_rows=jnp.arange(q.shape[0], dtype=jnp.int32), positions=positions,
                           block_tables=tables, dtype=jnp.bfloat16, backend=backend, decode_variant=variant,
                           decode_splits=splits)


def kernel_seconds(fn, xs, ws, groups: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """GPU time per call (CUPTI, one traced run) of each group's kernels: those whose names contain
    one of the group's strings ("" matches every kernel of the program)."""
    program = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
    jax.block_until_ready(program(xs, ws))
    times = kernel_times(lambda: jax.block_until_ready(program(xs, ws)))
    return {group: sum(total for name, (_, total) in times.items() if any(k in name for k in kernels)) / 1e9 / len(ws)
            for group, kernels in groups.items()}


def kernel_only_seconds(fn, xs, ws, kernels=("PagedDecode", "MergeSplits")) -> float:
    """GPU time per call of our kernels alone (by default the decode kernel and its split merge;
    CUPTI), so the bandwidth is the kernel's and not the dispatch's."""
    return kernel_seconds(fn, xs, ws, {"kernels": kernels})["kernels"]


def sweep_splits(splits: list[int], shapes=SHAPES) -> list[dict]:
    """The decode kernel's GPU time (CUPTI) per shape, pool dtype and CTAs per (token, kv head), the
    heuristic's choice beside: what kernel_splits should pick."""
    rows = []
    print("# decode kernel (mma / staged for fp32) GPU us per call by splits; * = kernel_splits' choice")
    for batch, context in shapes:
        for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            q, pools, tables, positions = make(batch, context, dtype, batch + context)
            auto = attention.kernel_splits(batch, KV, tables.shape[1], attention._sm_count(),
                                          jnp.dtype(dtype).itemsize)
            line = {"batch": batch, "context": context, "pages": name, "auto": auto}
            for n in splits:
                fn = lambda x, w: ours(x, w, tables, positions, "kernel", name == "fp8", splits=n)  # noqa: E731
                line[n] = kernel_only_seconds(fn, [q] * len(pools), pools) * 1e6
            rows.append(line)
            cells = " ".join(f"{n}{'*' if n == auto else ''}:{line[n]:.0f}" for n in splits)
            print(f"batch {batch:4d} x {context:5d} {name}: {cells}", flush=True)
            del pools
    return rows


PREFILL_STEPS = [  # (name, [(cached prefix, new tokens) per row]): 2048-token prompt steps of the engine
    ("2 x 1024 (a)", [(0, 1024)] * 2),
    ("3 x 683 (b)", [(0, 683)] * 3),
    ("16 x 128", [(0, 128)] * 16),
    ("1 x 2048 after 2048", [(2048, 2048)]),
    ("8 x 1024 (a), 8192", [(0, 1024)] * 8),    # the default 8192-token budget
    ("1 x 600 after 1500", [(1500, 600)]),      # a server's mixed step: one tail after a cached system prompt
]


def make_prefill(rows, dtype, seed):
    """A prompt step's operands: queries packed row after row, each row's pages shuffled over the pool,
    row_tokens [R, widest row] (padding T), and the causal query-key pairs it scores."""
    rng = np.random.default_rng(seed)
    pages = [-(-(pre + new) // PAGE) for pre, new in rows]
    total = sum(pages) + 1
    order = 1 + rng.permutation(total - 1)
    width = max(pages)
    tables = np.zeros((len(rows), width), np.int32)
    start = 0
    for r, n in enumerate(pages):
        tables[r, :n] = order[start:start + n]
        start += n
    tokens = sum(new for _, new in rows)
    row_width = max(new for _, new in rows)
    row_tokens = np.full((len(rows), row_width), tokens, np.int32)
    token_rows, positions, offset, pairs = [], [], 0, 0
    for r, (pre, new) in enumerate(rows):
        row_tokens[r, :new] = np.arange(offset, offset + new)
        token_rows += [r] * new
        positions += range(pre, pre + new)
        pairs += sum(p + 1 for p in range(pre, pre + new))
        offset += new
    q = jnp.asarray(rng.standard_normal((tokens, HEADS, D)), jnp.bfloat16)
    ints = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    return (q, random_pools(total, dtype, seed),
            (ints(token_rows), ints(positions), jnp.asarray(tables), jnp.asarray(row_tokens)), pairs)


def prefill_steps() -> list[dict]:
    """The prefill kernel's GPU time (CUPTI), the op's (every kernel of its program: q's conversion,
    the output's zeroing and conversion too), and XLA's wall time per call on the engine's prompt steps."""
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; prompt steps of one layer: {HEADS} heads, {KV} kv "
          f"heads, d {D}, page {PAGE}; us per call (TFLOP/s of causal attention)")
    rows = []
    for name, step in PREFILL_STEPS:
        for pages, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            q, pools, (token_rows, positions, tables, row_tokens), pairs = make_prefill(step, dtype, len(step))
            flops = 4 * D * HEADS * pairs
            scale = 0.02 if pages == "fp8" else None

            def run(backend):
                return lambda x, w: paged_attention(x, w[0], w[1], k_scale=scale, v_scale=scale, page_size=PAGE,
                                                    token_rows=token_rows, positions=positions, block_tables=tables,
                                                    dtype=jnp.bfloat16, row_tokens=row_tokens, backend=backend)
            line = {"step": name, "pages": pages, "pairs": pairs}
            try:
                s = kernel_seconds(run("prefill_kernel"), [q] * len(pools), pools,
                                   {"kernel": ("PagedPrefill",), "op": ("",)})
                line["kernel_gpu_us"], line["kernel_tflops"] = s["kernel"] * 1e6, flops / s["kernel"] / 1e12
                line["op_gpu_us"] = s["op"] * 1e6
            except Exception as e:  # reported, not fatal
                line["kernel_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            try:
                s = time_jax(run("xla"), [q] * len(pools), pools)
                line["xla_us"], line["xla_tflops"] = s * 1e6, flops / s / 1e12
            except Exception as e:
                line["xla_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            rows.append(line)
            cells = "; ".join(f"{k[:-3] if k.endswith('_us') else k} {v:.0f}" for k, v in line.items()
                              if k.endswith("_us"))
            tf = "; ".join(f"{k} {v:.0f}" for k, v in line.items() if k.endswith("_tflops"))
            print(f"{name:22s} {pages}: {cells} ({tf})", flush=True)
            for k, v in line.items():
                if k.endswith("_error"):
                    print(f"    {k}: {v}")
            del pools
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--splits", help="comma-separated splits to sweep (only the sweep runs)")
    ap.add_argument("--shapes", help="with --splits: comma-separated BATCHxCONTEXT (default: all of SHAPES)")
    ap.add_argument("--prefill", action="store_true", help="prompt steps: the prefill kernel vs XLA (only they run)")
    args = ap.parse_args()
    if args.prefill or args.splits:  # a mode of its own: only it runs
        if args.prefill:
            rows = prefill_steps()
        else:
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
            rows = sweep_splits([int(x) for x in args.splits.split(",")], shapes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; one layer: {HEADS} heads, {KV} kv heads, d {D}, "
          f"page {PAGE}; us per call (TB/s of the KV bytes in use)")
    rows = []
    for batch, context in SHAPES:
        line = {"batch": batch, "context": context}
        for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            q, pools, tables, positions = make(batch, context, dtype, batch + context)
            kv_bytes = 2 * batch * context * KV * D * jnp.dtype(dtype).itemsize
            peers = {"kernel": lambda x, w: ours(x, w, tables, positions, "kernel", name == "fp8"),
                     "kernel_staged": lambda x, w: ours(x, w, tables, positions, "kernel", name == "fp8", "staged"),
                     "xla": lambda x, w: ours(x, w, tables, positions, "xla", name == "fp8")}
            if name == "bf16":
                # pallas pages are [KV, pages, page, D]: transposed outside the timed program
                ppools = [tuple(x.reshape(-1, PAGE, KV, D).transpose(2, 0, 1, 3) for x in p) for p in pools]
                for ks in (1, 4, 16):
                    peers[f"pallas_k{ks}"] = (lambda ks: lambda x, w: _pallas_pretransposed(x, w, tables, positions,
                                                                                            ks))(ks), ppools
            for peer, fn in peers.items():
                fn, ws = (fn if isinstance(fn, tuple) else (fn, pools))
                try:
                    s = time_jax(fn, [q] * len(ws), ws)
                    line[f"{name}_{peer}_us"] = s * 1e6
                    line[f"{name}_{peer}_tbs"] = kv_bytes / s / 1e12
                    if peer.startswith("kernel"):
                        gpu = kernel_only_seconds(fn, [q] * len(ws), ws)
                        line[f"{name}_{peer}_gpu_us"] = gpu * 1e6
                        line[f"{name}_{peer}_gpu_tbs"] = kv_bytes / gpu / 1e12
                except Exception as e:  # a peer that cannot run this shape is reported, not fatal
                    line[f"{name}_{peer}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            del pools
        rows.append(line)
        cells = [f"{k[:-3]} {v:.0f} ({line[k[:-3] + '_tbs']:.2f})" for k, v in line.items() if k.endswith("_us")]
        # (the *_gpu cells: kernel time alone, CUPTI)
        print(f"batch {batch:4d} x {context:5d}: " + "; ".join(cells), flush=True)
        for k, v in line.items():
            if k.endswith("_error"):
                print(f"    {k}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _pallas_pretransposed(q, pages, tables, positions, k_splits):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_paged

    k, v = pages
    return pallas_paged(q, k, v, tables, positions + 1, k_splits=k_splits, pages_per_compute_block=8)


if __name__ == "__main__":
    main()
