"""What ``kv_cache_dtype="fp8"`` costs in accuracy on checkpoints without k/v scales.

    python bench/kv_cache_fp8_accuracy.py [--json bench/results/kv_cache_fp8_accuracy_cpu_DATE.json] [--label TEXT]

Why: without ModelOpt k_scale/v_scale, ``kv_cache_dtype="fp8"`` stores e4m3 codes with scale 1.0
(and warns); the default ("auto") keeps the compute dtype. The README has to say what that costs.
Measured on the trained byte-level fixtures (shared/fixtures/modelopt-trained, see its README):
the variants without KV scales (bf16, fp8, fp8-pc-pt) and, for comparison, fp8-kv with its own
calibrated scales (there the baseline is ``kv_cache_dtype=<compute dtype>``, since its "auto" is FP8).

1. Teacher-forced, cache-less ``model(ids)`` (it applies the same k/v rounding as the cache,
   ``LayerKVSpec.round_trip``), float32 and bfloat16 compute: mean NLL per predicted token of
   held-out text (nats; /ln2 = bits per byte, the tokens are bytes), its change, max |logit diff|,
   mean KL(base || fp8) per position, top-1 agreement. Texts: the fixtures' own held-out rows
   (``ref_logits.npz``: <|bos|> + 23 bytes of 6 held-out paragraphs) and the last paragraph of each
   of the six novels (the held-out last 5%; typed from memory, punctuation may differ from the
   corpus), each <|bos|> + at most 255 bytes (the model trained on 256-token windows).
2. ``LLM.generate`` (float32, greedy, 64 tokens) on reference.json's four prompts: leading tokens
   equal between fp8 and base, and each against the fixture's 48-token greedy reference; the base
   model's top1-top2 logit margin where fp8 first departs from it (small = a near-tie flipped).
3. Why: per layer, max |k|, |v|, the share of k/v values below e4m3's smallest normal (2^-6),
   i.e. on the coarse subnormal grid at scale 1.0, and the round trip's relative RMS error at scale
   1.0 and at absmax/448 (what a calibrated scale would give).
Runs in ~2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
import modelopt_jax  # noqa: E402
from fixture_paths import TRAINED  # noqa: E402  (the tests' fixture location, MODELOPT_JAX_FIXTURES)
from modelopt_jax import LLM, SamplingParams  # noqa: E402
from modelopt_jax.kv_cache import LayerKVSpec  # noqa: E402
from modelopt_jax.ops.quantize import fake_quantize_static  # noqa: E402

VARIANTS = ["qwen2-bytes-bf16", "qwen2-bytes-fp8", "qwen2-bytes-fp8-pc-pt", "qwen2-bytes-fp8-kv"]
BOS, NEW_TOKENS = 256, 64
NOVEL_ENDINGS = [  # last paragraphs (held out); from memory, may differ slightly from the corpus text
    "With the Gardiners, they were always on the most intimate terms. Darcy, as well as Elizabeth, really loved "
    "them; and they were both ever sensible of the warmest gratitude towards the persons who, by bringing her into "
    "Derbyshire, had been the means of uniting them.",
    "Between Barton and Delaford, there was that constant communication which strong family affection would "
    "naturally dictate;--and among the merits and the happiness of Elinor and Marianne, let it not be ranked as the "
    "least considerable, that though sisters, and living almost within sight of each other, they could live without "
    "disagreement between themselves, or producing coolness between their husbands.",
    "The wedding was very much like other weddings, where the parties have no taste for finery or parade; and "
    "Mrs. Elton, from the particulars detailed by her husband, thought it all extremely shabby, and very inferior "
    "to her own.",
    "Anne was tenderness itself, and she had the full worth of it in Captain Wentworth's affection. His profession "
    "was all that could ever make her friends wish that tenderness less; the dread of a future war all that could "
    "dim her sunshine.",
    "Henry and Catherine were married, the bells rang, and everybody smiled; and, as this took place within a "
    "twelvemonth from the first day of their meeting, it will not appear, after all the dreadful delays occasioned "
    "by the General's cruelty, that they were essentially hurt by it.",
    "On that event they removed to Mansfield; and the Parsonage there, which, under each of its two former owners, "
    "Fanny had never been able to approach but with some painful sensation of restraint or alarm, soon grew as dear "
    "to her heart, and as thoroughly perfect in her eyes, as everything else within the view and patronage of "
    "Mansfield Park had long been.",
]


def texts() -> list[list[int]]:
    rows = {tuple(int(t) for t in r) for v in VARIANTS for r in np.load(TRAINED / v / "ref_logits.npz")["input_ids"]}
    return sorted(list(r) for r in rows) + [[BOS] + list(t.encode()[:255]) for t in NOVEL_ENDINGS]


def load(variant: str, dtype: str, kv: str):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*scale 1.0")  # expected: that is what is measured
        return modelopt_jax.load(TRAINED / variant, dtype=dtype, kv_cache_dtype=kv)


def has_kv_scales(variant: str) -> bool:
    return load(variant, "float32", "auto").kv_cache.is_fp8


def batch_logits(model, seqs) -> np.ndarray:
    """float32 [N, width, vocab]; right padding is invisible to real positions (causal attention)."""
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    return np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids)), np.float64)


def teacher_forced(variant: str, dtype: str, base_kv: str, seqs) -> dict:
    base, fp8 = (batch_logits(load(variant, dtype, kv), seqs) for kv in (base_kv, "fp8"))
    nll = {"base": [], "fp8": []}
    stats = {"max_abs_logit_diff": 0.0, "kl": [], "top1_agree": []}
    for i, s in enumerate(seqs):
        n, target = len(s) - 1, np.asarray(s[1:])
        lp = {k: jax.nn.log_softmax(x[i, :n], -1) for k, x in (("base", base), ("fp8", fp8))}
        lp = {k: np.asarray(v, np.float64) for k, v in lp.items()}
        for k in nll:
            nll[k].append(-lp[k][np.arange(n), target])
        stats["max_abs_logit_diff"] = max(stats["max_abs_logit_diff"], float(np.abs(base[i, :n] - fp8[i, :n]).max()))
        stats["kl"].append((np.exp(lp["base"]) * (lp["base"] - lp["fp8"])).sum(-1))
        stats["top1_agree"].append(base[i, :n].argmax(-1) == fp8[i, :n].argmax(-1))
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    per_text = [float(f.mean() - b.mean()) for b, f in zip(nll["base"], nll["fp8"])]
    return {"tokens": int(cat(nll["base"]).size), "nll_base": float(cat(nll["base"]).mean()),
            "nll_fp8": float(cat(nll["fp8"]).mean()),
            "nll_delta": float(cat(nll["fp8"]).mean() - cat(nll["base"]).mean()),
            "nll_delta_per_text": per_text, "max_abs_logit_diff": stats["max_abs_logit_diff"],
            "mean_kl_base_fp8": float(cat(stats["kl"]).mean()), "max_kl_base_fp8": float(cat(stats["kl"]).max()),
            "top1_agreement": float(cat(stats["top1_agree"]).mean())}


def leading_equal(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def generation(variant: str, base_kv: str) -> dict:
    refs = json.loads((TRAINED / variant / "reference.json").read_text())["results"]
    prompts, params = [r["input_ids"] for r in refs], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = {}
    for kv in (base_kv, "fp8"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*scale 1.0")
            llm = LLM(TRAINED / variant, quantization=None, dtype="float32", kv_cache_dtype=kv, max_model_len=128,
                      compilation_cache_dir=None)
        outs[kv] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if kv == base_kv:
            base_model = llm.model
    rows = []
    for r, b, f in zip(refs, outs[base_kv], outs["fp8"]):
        div = leading_equal(b, f)
        margin = None
        if div < NEW_TOKENS:  # base model's top1-top2 margin at the first differing step
            top2 = np.sort(np.asarray(base_model(jnp.asarray([r["input_ids"] + b[:div]], jnp.int32)))[0, -1])[-2:]
            margin = float(top2[1] - top2[0])
        rows.append({"prompt": r["prompt"], "fp8_eq_base_leading": div, "base_margin_at_divergence": margin,
                     "base_eq_ref_leading": leading_equal(b, r["new_token_ids"]),
                     "fp8_eq_ref_leading": leading_equal(f, r["new_token_ids"]),
                     "fp8_eq_base_positions": int(sum(x == y for x, y in zip(b, f))),
                     "base_text": bytes(t for t in b if t < 256).decode("utf-8", "replace"),
                     "fp8_text": bytes(t for t in f if t < 256).decode("utf-8", "replace")})
    return {"new_tokens": NEW_TOKENS, "reference_tokens": len(refs[0]["new_token_ids"]), "prompts": rows}


def kv_statistics(variant: str, seqs) -> list[dict]:
    """Per layer: k/v ranges and how e4m3 at scale 1.0 represents them (eager float32 forward)."""
    seen, original = [], LayerKVSpec.round_trip

    def record(self, k, v):
        seen.append((np.asarray(k), np.asarray(v)))
        return original(self, k, v)

    LayerKVSpec.round_trip = record
    try:
        model = load(variant, "float32", "float32")
        for s in seqs:
            model(jnp.asarray([s], jnp.int32))
    finally:
        LayerKVSpec.round_trip = original
    layers = model.config.num_hidden_layers
    out = []
    for layer in range(layers):
        entry = {"layer": layer}
        for j, name in enumerate("kv"):
            x = np.concatenate([seen[i][j].ravel() for i in range(layer, len(seen), layers)])
            amax = float(np.abs(x).max())
            err = lambda r: float(np.sqrt(((np.asarray(r) - x) ** 2).mean() / (x ** 2).mean()))  # noqa: E731
            at_one = np.asarray(fake_quantize_static(jnp.asarray(x), 1.0))
            entry |= {f"{name}_absmax": amax,
                      f"{name}_share_subnormal_at_scale1": float((np.abs(x) < 2 ** -6).mean()),
                      f"{name}_share_flushed_to_zero_at_scale1": float(((at_one == 0) & (x != 0)).mean()),
                      f"{name}_rel_rms_err_scale1": err(at_one),
                      f"{name}_rel_rms_err_scale_absmax_over_448": err(fake_quantize_static(jnp.asarray(x), amax / 448))}
        out.append(entry)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--label", help="stored in the JSON, e.g. which commit / tree was measured")
    args = ap.parse_args()
    t0 = time.perf_counter()
    seqs = texts()
    result = {"label": args.label, "jax": jax.__version__, "backend": jax.default_backend(),
              "cpus": os.cpu_count(), "fixtures": str(TRAINED), "texts": len(seqs),
              "new_tokens": NEW_TOKENS, "variants": {}}
    for variant in VARIANTS:
        scaled = has_kv_scales(variant)
        entry = {"has_kv_scales": scaled, "teacher_forced": {}}
        for dtype in ("float32", "bfloat16"):
            base_kv = dtype if scaled else "auto"
            entry["teacher_forced"][dtype] = tf = teacher_forced(variant, dtype, base_kv, seqs) | {"base_kv": base_kv}
            print(f"{variant:22s} {dtype:8s} base={base_kv:8s} NLL {tf['nll_base']:.4f} -> fp8 {tf['nll_fp8']:.4f} "
                  f"({tf['nll_delta']:+.4f} nats/token), max|dlogit| {tf['max_abs_logit_diff']:.3f}, "
                  f"KL {tf['mean_kl_base_fp8']:.2e}, top1 {tf['top1_agreement']:.4f}", flush=True)
        entry["generation_float32"] = g = generation(variant, "float32" if scaled else "auto")
        print(f"{variant:22s} greedy fp8=base leading {[p['fp8_eq_base_leading'] for p in g['prompts']]} / "
              f"{NEW_TOKENS}; base=ref {[p['base_eq_ref_leading'] for p in g['prompts']]}, fp8=ref "
              f"{[p['fp8_eq_ref_leading'] for p in g['prompts']]} / {g['reference_tokens']}; base margin at "
              f"divergence {[p['base_margin_at_divergence'] for p in g['prompts']]}", flush=True)
        entry["kv_stats_float32"] = ks = kv_statistics(variant, seqs)
        print(f"{variant:22s} per layer (k, v) share below 2^-6: "
              f"{[(round(x['k_share_subnormal_at_scale1'], 3), round(x['v_share_subnormal_at_scale1'], 3)) for x in ks]}"
              f", rel RMS err at scale 1: "
              f"{[(round(x['k_rel_rms_err_scale1'], 4), round(x['v_rel_rms_err_scale1'], 4)) for x in ks]}", flush=True)
        if scaled:
            entry["kv_scales"] = [list(s) for s in load(variant, "float32", "auto").kv_cache.scales]
        result["variants"][variant] = entry
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"done in {result['seconds']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
