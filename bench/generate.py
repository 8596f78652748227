"""End-to-end generation benchmark: FP8 (our GEMM) vs the same weights in bf16, side by side.

Run on the H200 (not a test):
    python bench/generate.py [--preset llama3-8b] [--batches 1,8,64] [--prompt 128] [--new 256]
                             [--prefill 2048] [--checkpoint DIR [--tensor-parallel 1,2]] [--json out.json]

Weights: by default random, made on the device in the exact plan and module structure ``load`` builds for a
per-tensor ModelOpt FP8 Llama-3 checkpoint (fused q/k/v and gate/up FP8 layers with static scales,
bf16 embeddings / lm_head / norms) -- writing an 8 GB synthetic checkpoint to disk first measures
the disk, not decoding. The bf16 model holds the same weights dequantized. ``--checkpoint DIR``
loads a real (or ``modelopt_jax.synthetic``-written) checkpoint instead, bf16 peer omitted;
with ``--tensor-parallel 1,2`` it is loaded once per size (TP=1 on one GPU, TP=2 split over two)
and the sizes run side by side, with the speed-up of each over TP=1.
Reports decode tokens/s per batch (prompt 128, 256 new tokens, greedy, KV cache donated), prefill
tokens/s, compile times, peak GPU memory, ratios to bf16 and to the weight-bytes roofline
(weight bytes read per decode step / 4.3 TB/s measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import modelopt_jax  # noqa: E402
from modelopt_jax.checkpoint import ModelConfig, RopeConfig  # noqa: E402
from modelopt_jax.generation import make_cached_forward  # noqa: E402
from modelopt_jax.kv_cache import KVCacheSpec  # noqa: E402
from modelopt_jax.ops.epilogue import Fp8Epilogue  # noqa: E402
from modelopt_jax.pipeline import build_model  # noqa: E402
from modelopt_jax.quant.plan import LinearPlan, ModelPlan, TensorPlan  # noqa: E402

COPY_BANDWIDTH = 4.3e12  # bytes/s, H200 device-to-device copy measured here
PRESETS = {
    "llama3-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256),
    "llama3-1b-ish": dict(hidden=2048, inter=8192, layers=16, heads=32, kv=8, vocab=128256),
    "tiny": dict(hidden=256, inter=512, layers=2, heads=4, kv=2, vocab=512),
}


def config_for(p, max_pos=8192) -> ModelConfig:
    return ModelConfig(family="llama", architecture="LlamaForCausalLM", vocab_size=p["vocab"], hidden_size=p["hidden"],
                       intermediate_size=p["inter"], num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                       num_key_value_heads=p["kv"], head_dim=p["hidden"] // p["heads"], rms_norm_eps=1e-5,
                       max_position_embeddings=max_pos,
                       rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=8192),
                       tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, mlp_bias=False,
                       torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


class RandomModels:
    """The FP8 model and, from the same FP8 codes, its bf16 twin: plans as ``load`` would make them
    for a per-tensor ModelOpt FP8 Llama checkpoint, arrays made on the device, built by the same
    pipeline stage as a load (``pipeline.build_model``)."""

    def __init__(self, cfg: ModelConfig, seed=0):
        self.cfg, self.key = cfg, jax.random.PRNGKey(seed)
        self.count = 0

    def _next(self):
        self.count += 1
        return jax.random.fold_in(self.key, self.count)

    def fp8(self, n, k):
        make = jax.jit(lambda key: (jax.random.normal(key, (n, k), jnp.float32) * 64).clip(-448, 448)
                       .astype(jnp.float8_e4m3fn))
        return make(self._next())

    def bf16(self, shape, scale=0.02):
        return (jax.random.normal(self._next(), shape, jnp.float32) * scale).astype(jnp.bfloat16)

    def build(self):
        cfg, h = self.cfg, self.cfg.hidden_size
        w_scale, x_scale = 1.0 / (64 * 4 * np.sqrt(h)), 0.02
        epilogue = Fp8Epilogue.fold(x_scale, float(w_scale))
        fp8_arrays = {"embed_tokens.table": self.bf16((cfg.vocab_size, h), 1.0), "norm.weight": jnp.ones((h,), jnp.bfloat16),
                      "lm_head.weight": self.bf16((cfg.vocab_size, h))}
        linears, tensors = [], [("embed_tokens.table", TensorPlan("e", (cfg.vocab_size, h), "bfloat16")),
                                ("norm.weight", TensorPlan("n", (h,), "bfloat16"))]
        shapes = {"self_attn.qkv": (cfg.q_size + 2 * cfg.kv_size, h), "self_attn.o_proj": (h, cfg.q_size),
                  "mlp.gate_up": (2 * cfg.intermediate_size, h), "mlp.down": (h, cfg.intermediate_size)}
        for i in range(cfg.num_hidden_layers):
            for name, (n, k) in shapes.items():
                linears.append((f"layers.{i}.{name}", LinearPlan("fp8", (name,), k, (n,), n, "float8_e4m3fn",
                                                                  input_scale=x_scale, epilogue=epilogue)))
                fp8_arrays[f"layers.{i}.{name}.weight"] = self.fp8(n, k)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors.append((f"layers.{i}.{norm}.weight", TensorPlan(norm, (h,), "bfloat16")))
                fp8_arrays[f"layers.{i}.{norm}.weight"] = jnp.ones((h,), jnp.bfloat16)
        head = ("lm_head", LinearPlan("unquantized", ("lm_head",), h, (cfg.vocab_size,), cfg.vocab_size, "bfloat16",
                                      out_dtype="float32"))
        fp8_plan = ModelPlan("llama", "bfloat16", "auto", 1, tuple(linears) + (head,), tuple(tensors), None)
        bf16_plan = dataclasses.replace(fp8_plan, linears=tuple(
            (path, dataclasses.replace(lp, scheme="unquantized", weight_dtype="bfloat16", input_scale=None,
                                       epilogue=None)) for path, lp in linears) + (head,))
        bf16_arrays = {k: (v.astype(jnp.float32) * w_scale).astype(jnp.bfloat16) if v.dtype == jnp.float8_e4m3fn else v
                       for k, v in fp8_arrays.items()}
        kv = KVCacheSpec.resolve("auto", None, jnp.bfloat16, cfg.num_hidden_layers)
        return (build_model(cfg, fp8_plan, [fp8_arrays], kv_cache=kv), build_model(cfg, bf16_plan, [bf16_arrays], kv_cache=kv))


def weight_bytes(model) -> int:
    """Weight bytes one device reads per decode step (its shards; one embedding row, not the table)."""
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    return per_device - model.embed_tokens.table[...].addressable_shards[0].data.nbytes


def bench_model(label, model, batches, prompt, new, prefill_len, max_len):
    forward, state = make_cached_forward(model)
    results = {"model": label, "weight_bytes": weight_bytes(model)}

    @jax.jit
    def prefill(state, cache, ids):
        b, t = ids.shape
        logits, cache = forward(state, ids, jnp.broadcast_to(jnp.arange(t), (b, t)), cache,
                                jnp.full((b,), t - 1))
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    def decode(state, cache, tokens, pos):
        logits, cache = forward(state, tokens[:, None], jnp.broadcast_to(pos, tokens.shape)[:, None], cache)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    decode = jax.jit(decode, donate_argnums=(1,))
    for b in batches:
        ids = jax.random.randint(jax.random.PRNGKey(b), (b, prompt), 3, model.config.vocab_size, jnp.int32)
        cache = model.init_cache(b, max_len)
        t0 = time.perf_counter()
        tok, cache = prefill(state, cache, ids)
        tok.block_until_ready()
        t1 = time.perf_counter()
        tok, cache = decode(state, cache, tok, jnp.int32(prompt))  # compile
        tok.block_until_ready()
        t2 = time.perf_counter()
        for step in range(1, new):
            tok, cache = decode(state, cache, tok, jnp.int32(prompt + step))
        tok.block_until_ready()
        t3 = time.perf_counter()
        per_step = (t3 - t2) / (new - 1)
        results[f"batch{b}"] = {"ms_per_step": per_step * 1e3, "tokens_per_s": b / per_step,
                                "prefill_compile_s": t1 - t0, "decode_compile_s": t2 - t1}
        print(f"{label:5s} batch {b:3d}: {per_step * 1e3:7.2f} ms/step, {b / per_step:9.1f} tok/s "
              f"(compile prefill {t1 - t0:.1f} s, decode {t2 - t1:.1f} s)", flush=True)
        del cache
    if prefill_len:
        ids = jax.random.randint(jax.random.PRNGKey(7), (1, prefill_len), 3, model.config.vocab_size, jnp.int32)
        cache = model.init_cache(1, prefill_len)
        tok, cache = prefill(state, cache, ids)  # compile
        tok.block_until_ready()
        times = []
        for _ in range(3):
            cache = model.init_cache(1, prefill_len)
            t0 = time.perf_counter()
            tok, cache = prefill(state, cache, ids)
            tok.block_until_ready()
            times.append(time.perf_counter() - t0)
        results["prefill_tokens_per_s"] = prefill_len / min(times)
        print(f"{label:5s} prefill {prefill_len}: {prefill_len / min(times):9.0f} tok/s", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--checkpoint")
    ap.add_argument("--tensor-parallel", default="1", help="with --checkpoint: TP sizes to compare, e.g. 1,2")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt + args.new
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}, jax {jax.__version__}, GEMM backend auto", flush=True)
    if args.checkpoint:
        from modelopt_jax.parallel import make_mesh

        sizes = [int(n) for n in args.tensor_parallel.split(",")]
        models = {("fp8" if sizes == [1] else f"tp{n}"): modelopt_jax.load(
            args.checkpoint, dtype="bfloat16", kv_cache_dtype="bfloat16", mesh=make_mesh(n) if n > 1 else None) for n in sizes}
    else:
        fp8, bf16 = RandomModels(config_for(PRESETS[args.preset], max(max_len, args.prefill))).build()
        models = {"fp8": fp8, "bf16": bf16}
    report = {"device": dev.device_kind, "preset": args.checkpoint or args.preset, "runs": []}
    for label, model in models.items():
        report["runs"].append(bench_model(label, model, batches, args.prompt, args.new, args.prefill, max_len))
    for run in report["runs"]:
        roofline_ms = run["weight_bytes"] / COPY_BANDWIDTH * 1e3
        run["roofline_ms_per_step"] = roofline_ms
        print(f"{run['model']}: weights read per step {run['weight_bytes'] / 1e9:.2f} GB -> roofline "
              f"{roofline_ms:.2f} ms; batch 1 {run['batch1']['ms_per_step'] / roofline_ms:.2f}x roofline"
              if "batch1" in run else "", flush=True)
    tp_runs = [r for r in report["runs"] if r["model"].startswith("tp")]
    if len(tp_runs) > 1:
        base = tp_runs[0]
        for run in tp_runs[1:]:
            for key in [k for k in run if k.startswith("batch")]:
                print(f"{key}: {run['model']} / {base['model']} tokens/s "
                      f"{run[key]['tokens_per_s'] / base[key]['tokens_per_s']:.2f}x")
            if "prefill_tokens_per_s" in run:
                print(f"prefill: {run['model']} / {base['model']} "
                      f"{run['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x")
    elif len(report["runs"]) == 2:
        f, b = report["runs"]
        for key in [k for k in f if k.startswith("batch")]:
            print(f"{key}: fp8 / bf16 decode speed {f[key]['tokens_per_s'] / b[key]['tokens_per_s']:.2f}x")
        if "prefill_tokens_per_s" in f:
            print(f"prefill: fp8 / bf16 {f['prefill_tokens_per_s'] / b['prefill_tokens_per_s']:.2f}x")
    stats = dev.memory_stats() or {}
    report["peak_gpu_bytes"] = stats.get("peak_bytes_in_use")
    print(f"peak device memory: {(stats.get('peak_bytes_in_use') or 0) / 1e9:.1f} GB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
