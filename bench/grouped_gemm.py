"""The grouped FP8 GEMM of a sparse layer's experts: our op beside XLA's paths and torch, per token count.

    python bench/grouped_gemm.py [--shape qwen3-30b-a3b,mixtral-8x7b] [--proj gate_up,down]
                                 [--tokens 1,8,64,512,2048,8192] [--routing uniform,skewed]
                                 [--backends ffi,xla,xla-loop,torch] [--tile=-1[,T...]] [--repeats 5]
                                 [--device-timing]

Rows are the tokens' top-k picks sorted by expert (what models/moe.py feeds the op), bf16 output,
static scales (a per-expert column factor). Backends:
- ``ffi``: our ``modelopt_fp8_grouped_gemm`` (CUTLASS grouped GEMM on CUDA, the C++ handler on CPU);
- ``xla``: ``jax.lax.ragged_dot`` over the codes widened to bf16 (the op's ``backend="xla"``);
- ``xla-loop``: one XLA FP8 dot per expert over every row, rows of other experts masked off (the
  dense path a JAX user writes without a grouped op; E times the work, one weight read per expert;
  run for up to 16 experts);
- ``torch``: ``torch._scaled_grouped_mm`` (CUTLASS grouped GEMM in PyTorch, row-wise scales), else a
  loop of ``torch._scaled_mm`` over the non-empty experts.
On a GPU each JAX time is one program's wall time over R distinct operand sets (bench/timing.py: so
weights stream from HBM, not L2) divided by R, torch's CUDA events over the same rotation; both carry
launch costs, which dominate ops of a few microseconds. ``--device-timing`` reports the GPU kernel
time per call instead (CUPTI: every kernel the op launches, for ours and torch alike). TB/s counts the
weight bytes of the experts the tokens touch plus activations and output. The ratio columns are ours
over the best XLA path and over torch.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.timing import device_time_jax, device_time_torch, repetitions, time_jax, time_torch  # noqa: E402
from modelopt_jax.ops.grouped_gemm import grouped_fp8_gemm  # noqa: E402

# experts, top-k, hidden, expert intermediate
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336), "small": (64, 8, 512, 256)}
E4M3 = ml_dtypes.float8_e4m3fn


def _dims(shape: str, proj: str):
    experts, top_k, hidden, inter = SHAPES[shape]
    n, k = (2 * inter, hidden) if proj == "gate_up" else (hidden, inter)
    return experts, top_k, n, k


def _routing(rng, tokens, experts, top_k, routing):
    p = None
    if routing == "skewed":  # expert e picked with weight (E - e)^2: a few hot experts, a long tail
        weights = np.arange(experts, 0, -1.0) ** 2
        p = weights / weights.sum()
    picks = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)]).reshape(-1)
    return np.bincount(picks, minlength=experts).astype(np.int32), len(picks)


def _xla_loop(x, w, sizes, col):
    """Every expert's FP8 dot over all rows (XLA's FP8 GEMM), each row keeping its own expert's result."""
    m = x.shape[0]
    group_of_row = jnp.repeat(jnp.arange(w.shape[0], dtype=jnp.int32), sizes, total_repeat_length=m)
    valid = jnp.arange(m) < jnp.sum(sizes)
    out = jnp.zeros((m, w.shape[1]), jnp.float32)
    for g in range(w.shape[0]):
        acc = jax.lax.dot_general(x, w[g], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        out = jnp.where(((group_of_row == g) & valid)[:, None], acc * col[g], out)
    return out.astype(jnp.bfloat16)


def _torch_fn(n_experts):
    import torch

    def grouped(x, w, offs, scale_a, scale_b):
        return torch._scaled_grouped_mm(x, w.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    def loop(x, w, offs, scale_a, scale_b):
        outs, start = [], 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                outs.append(torch._scaled_mm(x[start:end], w[g].t(), scale_a=scale_a[start:end, None],
                                             scale_b=scale_b[g][None, :], out_dtype=torch.bfloat16,
                                             use_fast_accum=True))
            start = end
        return torch.cat(outs)

    return grouped if hasattr(torch, "_scaled_grouped_mm") else loop, loop


def _time_torch(w_np, x_np, sizes, col, reps, device_timing=False):
    import torch

    dev = torch.device("cuda")
    ws = [torch.from_numpy(w_np.view(np.uint8)).to(dev).view(torch.float8_e4m3fn) for _ in range(reps)]
    m = x_np.shape[0]
    pad = (-m) % 16  # torch's grouped kernel wants row counts in multiples of 16 per tensor
    x = torch.from_numpy(np.concatenate([x_np, np.zeros((pad, x_np.shape[1]), E4M3)]).view(np.uint8))
    x = x.to(dev).view(torch.float8_e4m3fn)
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).to(dev)
    scale_a = torch.ones(m + pad, dtype=torch.float32, device=dev)
    scale_b = torch.from_numpy(col).to(dev)
    grouped, loop = _torch_fn(len(sizes))
    for fn, name in ((grouped, "torch._scaled_grouped_mm"), (loop, "torch._scaled_mm loop")):
        try:
            out = fn(x, ws[0], offs, scale_a, scale_b)
            torch.cuda.synchronize()
            if out.shape[0] < int(sizes.sum()):
                raise RuntimeError(f"returned {tuple(out.shape)}")
            timer = device_time_torch if device_timing else time_torch
            t = timer(lambda xx, ww: fn(xx, ww, offs, scale_a, scale_b), [x] * reps, ws)
            return t, name
        except Exception as e:  # noqa: BLE001 -- an unsupported torch path is reported, the next one tried
            print(f"    ({name} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--proj", default="gate_up,down")
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--backends", default="ffi,xla,xla-loop,torch")
    ap.add_argument("--tile", default="-1", help="our CUDA configurations, comma-separated (-1: the handler's "
                                                "choice); each gets a column, the ratios use the fastest")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device-timing", action="store_true",
                    help="GPU kernel time per call (CUPTI, every kernel of the op) instead of the program's wall "
                         "time / R, which carries the program's launch; for ops of a few microseconds")
    args = ap.parse_args()
    tiles = [int(t) for t in args.tile.split(",")]
    backends = []
    for b in args.backends.split(","):  # "ffi" once per configuration asked for
        backends += [f"ffi:{t}" for t in tiles] if b == "ffi" and len(tiles) > 1 else [b]
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for shape in args.shape.split(","):
        for proj in args.proj.split(","):
            experts, top_k, n, k = _dims(shape, proj)
            rng = np.random.default_rng(0)
            w = rng.normal(0, 60, (experts, n, k)).clip(-448, 448).astype(E4M3)
            col = rng.uniform(1e-4, 1e-3, (experts, n)).astype(np.float32)
            reps = repetitions(w.nbytes, 8)
            ws = [jax.device_put(w) for _ in range(reps)]
            print(f"{shape} {proj}: {experts} experts, top-{top_k}, w [{n}, {k}] per expert, {reps} weight copies")
            for routing in args.routing.split(","):
                for tokens in [int(t) for t in args.tokens.split(",")]:
                    sizes, m = _routing(rng, tokens, experts, top_k, routing)
                    x = rng.normal(0, 60, (m, k)).clip(-448, 448).astype(E4M3)
                    xs = [jax.device_put(x) for _ in range(reps)]
                    touched = int((sizes > 0).sum())
                    moved = touched * n * k + m * k + m * n * 2
                    times = {}
                    for backend in backends:
                        if backend == "torch":
                            if jax.default_backend() != "gpu":
                                continue
                            t, name = _time_torch(w, x, sizes, col, reps, args.device_timing)
                            if t is not None:
                                times["torch"] = t
                            continue
                        if backend == "xla-loop" and experts > 16:
                            continue  # one dot per expert: E x the work, and minutes to compile at 128 experts
                        if backend == "xla-loop":
                            fn = lambda xx, ww: _xla_loop(xx, ww, sizes, col)  # noqa: E731
                        else:
                            op, _, tile = backend.partition(":")
                            fn = lambda xx, ww, b=op, t=int(tile or tiles[0]): grouped_fp8_gemm(  # noqa: E731
                                xx, ww, sizes, col, out_dtype=jnp.bfloat16, backend=b,
                                tile=t if b == "ffi" else -1)
                        try:
                            times[backend] = (device_time_jax(fn, xs, ws) if args.device_timing
                                              else time_jax(fn, xs, ws, args.repeats))
                        except Exception as e:  # noqa: BLE001 -- a configuration that cannot run this shape
                            print(f"    ({backend} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]})")
                    ours = {b: t for b, t in times.items() if b.startswith("ffi")}
                    if ours:  # the ratios use our fastest configuration
                        best = min(ours, key=ours.get)
                        times["ffi"] = ours[best]
                    line = [f"  {routing:7s} tokens {tokens:5d} rows {m:6d} experts hit {touched:3d}"]
                    line += [f"{b} {t * 1e6:9.1f} us" for b, t in times.items() if b != "ffi" or b in ours]
                    if "ffi" in times:
                        if len(ours) > 1:
                            line.append(f"best {best}")
                        line.append(f"ffi {moved / times['ffi'] / 1e12:.2f} TB/s "
                                    f"{2 * m * n * k / times['ffi'] / 1e12:.0f} TFLOP/s")
                        xla_best = min((t for b, t in times.items() if b.startswith("xla")), default=None)
                        if xla_best:
                            line.append(f"vs best XLA {xla_best / times['ffi']:.2f}x")
                        if "torch" in times:
                            line.append(f"vs torch {times['torch'] / times['ffi']:.2f}x")
                    print("  ".join(line), flush=True)
                    del xs


if __name__ == "__main__":
    main()
