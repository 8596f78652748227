"""vLLM 0.26.0 on bench/serve.py's workloads (a-f), the other column of ``serve.py --peer-json``.

Run on the H200 once tools/peer's bundle is unpacked there (vLLM in /tmp/vsite; ``VLLM_SITE`` overrides):
    python3 bench/peer_vllm_workloads.py --checkpoint /tmp/ck --workloads a,b,c,d,e,f [--no-prefix-caching]
                                         [--json vllm.json] [--scale 1] [--kv-cache-dtype auto]
    python3 bench/peer_vllm_workloads.py --workloads a,d,e,f --scale 0.02 --dry-run   (no vLLM needed)

Why a second runner: the shared peer script knows only greedy n=1 workloads, and (e), (f) need prefix
reuse and ``n``/seeded sampling. The prompts and sampling settings are serve.py's own ``workload``
(imported, so both engines get the same token ids, n, temperature, seeds, max_tokens, ignore_eos);
nothing else of the project is imported, and vllm only inside ``main`` (``--help`` and ``--dry-run``
work on a machine without it). vLLM keeps its defaults except ``skip_tokenizer_init`` (synthetic
checkpoints have no tokenizer), ``max_model_len=4096`` (our default), ``seed=0`` and, when asked,
prefix caching off. As in serve.py each workload runs twice and the second run is reported; with
prefix caching on (vLLM's default and ours) that run reuses the prompt KV the first run left.
(c) is ms per decode step of one request: (time for 64 new tokens - time for 1) / 63.
The JSON is rewritten after every workload, so a run cut short by a time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# bench/ is on sys.path when this runs as a script; its modules (timing.py, attention.py, ...) must not
# shadow anything vLLM or its dependencies import, in this process or in vLLM's engine subprocess
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

SITE = os.environ.get("VLLM_SITE", "/tmp/vsite")
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0",  # the bundle has no FlashInfer
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # the GPU machine has no network
       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "JAX_PLATFORMS": "cpu"}  # should anything pull in jax, it takes no GPU memory from vLLM
PARAM_FIELDS = {"n", "temperature", "seed", "max_tokens", "ignore_eos"}


def load_workload():
    """serve.py's ``workload`` (numpy only at import), loaded by path with ``sys.path`` left as it was
    (serve.py puts the repository root first)."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(HERE, "serve.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.path[:] = saved
    return module.workload


def to_vllm(fields: dict, make, **override):
    """Our SamplingParams fields -> ``make(**vLLM kwargs)``. ``temperature`` is always passed: vLLM's
    default is 1.0, ours 0 (greedy). A field with no mapping here fails rather than being dropped."""
    f = {**fields, **override}
    unknown = set(f) - PARAM_FIELDS
    if unknown:
        raise ValueError(f"no vLLM mapping for SamplingParams fields {sorted(unknown)}")
    return make(n=f.get("n", 1), temperature=f.get("temperature", 0.0), seed=f.get("seed"),
                max_tokens=f["max_tokens"], ignore_eos=f.get("ignore_eos", False), detokenize=False)


def import_vllm():
    """vLLM from the unpacked bundle; ``PYTHONPATH`` too, for the engine-core subprocess vLLM starts."""
    sys.path.insert(0, SITE)
    os.environ["PYTHONPATH"] = SITE + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    return vllm.__version__, LLM, SamplingParams, TokensPrompt


def dry_run(args, workload, vocab: int) -> None:
    """Each workload's prompts and the vLLM kwargs they map to, without vLLM (a check on a CPU machine)."""
    for name in args.workloads.split(","):
        for sub in (("c1024", "c4096") if name == "c" else (name,)):
            prompts, fields = workload(sub, vocab, args.scale, dict)
            mapped = [to_vllm(f, dict) for f in fields]
            lengths = [len(p) for p in prompts]
            print(f"({sub}) {len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens, "
                  f"{sum(m['n'] * m['max_tokens'] for m in mapped)} tokens to generate; first: {mapped[0]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", help="the ModelOpt FP8 checkpoint serve.py ran (its config.json gives the vocab)")
    ap.add_argument("--workloads", default="a,b,c,d,e,f")
    ap.add_argument("--json", help="write the report here (after every workload)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="vLLM's enable_prefix_caching=False (on by default, as ours)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--scale", type=float, default=1.0, help="serve.py's --scale (1: the full workloads)")
    ap.add_argument("--dry-run", action="store_true", help="build the workloads and their vLLM params; no vLLM")
    ap.add_argument("--vocab", type=int, default=128256, help="--dry-run without a checkpoint: the vocab size")
    args = ap.parse_args()
    workload = load_workload()
    vocab = args.vocab
    if args.checkpoint:
        with open(os.path.join(args.checkpoint, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
    if args.dry_run:
        return dry_run(args, workload, vocab)
    if not args.checkpoint:
        ap.error("--checkpoint is required (unless --dry-run)")

    version, LLM, SamplingParams, TokensPrompt = import_vllm()
    t = time.perf_counter()
    llm = LLM(model=args.checkpoint, quantization="modelopt", skip_tokenizer_init=True, max_model_len=4096,
              kv_cache_dtype=args.kv_cache_dtype, seed=0, enable_prefix_caching=not args.no_prefix_caching)
    report = {"engine": "vllm", "version": version, "checkpoint": args.checkpoint, "scale": args.scale,
              "prefix_caching": not args.no_prefix_caching, "kv_cache_dtype": args.kv_cache_dtype,
              "startup_s": time.perf_counter() - t, "runs": {}}
    print(f"# vLLM {version}: startup {report['startup_s']:.1f} s, prefix caching "
          f"{'on' if report['prefix_caching'] else 'off'}", flush=True)

    def generate(prompts, fields, **override):
        """(seconds, tokens generated over every completion) of one ``llm.generate`` call."""
        params = [to_vllm(f, SamplingParams, **override) for f in fields]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    for name in args.workloads.split(","):
        if name == "c":
            for context in (1024, 4096):
                prompts, fields = workload(f"c{context}", vocab, args.scale, dict)
                new = fields[0]["max_tokens"]
                first, _ = generate(prompts, fields)
                generate(prompts, fields, max_tokens=1)
                t_new, _ = generate(prompts, fields)
                t_one, _ = generate(prompts, fields, max_tokens=1)
                ms = 1e3 * (t_new - t_one) / max(new - 1, 1)
                report["runs"][f"c{context}"] = {"ms_per_decode_step": ms, "t_new_s": t_new, "t_one_s": t_one,
                                                 "first_run_s": first, "first_over_second": first / t_new}
                print(f"(c) batch 1, {context} context: {ms:.2f} ms/step (prompt + 1 token {1e3 * t_one:.1f} ms); "
                      f"first/second run {first / t_new:.2f}x", flush=True)
                save()
            continue
        prompts, fields = workload(name, vocab, args.scale, dict)
        first, _ = generate(prompts, fields)
        dt, n = generate(prompts, fields)
        report["runs"][name] = {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                "generated_tokens": n, "total_s": dt, "generated_tokens_per_s": n / dt,
                                "first_run_s": first, "first_over_second": first / dt}
        print(f"({name}) {len(prompts)} prompts: {n} tokens in {dt:.2f} s = {n / dt:.0f} generated tok/s "
              f"(first run {first:.1f} s = {first / dt:.2f}x)", flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
