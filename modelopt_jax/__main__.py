"""Command line: ``python -m modelopt_jax {inspect,generate,weight-cache} ...`` (also installed as ``modelopt-jax``)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _inspect(args) -> int:
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


DEFAULT_PROMPT = "It is a truth universally acknowledged"


def _prompts(args) -> list:
    """--prompt and --ids, each repeatable, in that order; the default prompt when neither is given."""
    from modelopt_jax.errors import InvalidArgumentError

    prompts = list(args.prompt or [])
    for ids in args.ids or []:
        try:
            tokens = [int(t) for t in ids.split(",")]
        except ValueError:
            raise InvalidArgumentError(f"--ids {ids!r}: expected comma-separated integers, e.g. --ids 1,2,3") from None
        prompts.append(tokens)
    return prompts or [DEFAULT_PROMPT]


def _generate(args) -> int:
    from modelopt_jax import SamplingParams

    # Everything that can be checked without the model is checked before the (slow) load.
    prompts = _prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                            stop_token_ids=args.stop_token_ids or ())

    import jax

    import modelopt_jax
    from modelopt_jax import LLM
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    path = args.model or modelopt_jax.demo_checkpoint_path()
    if not args.quiet:
        print(format_report(inspect_checkpoint(path)), end="\n\n", file=sys.stderr)
    progress = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress(f"[load] {path} ({args.dtype}, backend {args.backend}) ...")
    llm = LLM(path, quantization=None if args.quantization == "auto" else args.quantization, dtype=args.dtype,
              max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, backend=args.backend,
              tokenizer=args.tokenizer, tensor_parallel_size=args.tensor_parallel_size,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
              weight_cache=args.weight_cache)
    progress(f"[load] done in {llm.load_seconds:.2f} s on {jax.devices()[0].device_kind}")
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet and len(prompts) > 1)
    stats = llm.last_stats
    decode_rate = stats["decode_steps"] / stats["decode_s"] if stats["decode_s"] else float("nan")
    progress(f"[generate] {len(prompts)} prompt(s), {stats['prompt_tokens']} prompt tokens -> "
             f"{stats['generated_tokens']} new tokens in {stats['total_s']:.2f} s (first call: includes "
             f"compilation, {stats['generated_tokens_per_s']:.1f} tokens/s); first token after "
             f"{stats['first_token_s']:.2f} s, then {decode_rate:.1f} decode steps/s (finish: {', '.join(sorted({o.finish_reason for o in outs}))})")
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i:
            print()
        print((prompt if isinstance(prompt, str) else "") + (out.text if out.text is not None else str(out.token_ids)))
        if args.logprobs is not None:
            for token, entry in zip(out.token_ids, out.logprobs):
                alternatives = ", ".join(f"{t}: {v:.4f}" for t, v in sorted(entry.items(), key=lambda kv: -kv[1]))
                print(f"  token {token}: logprob {entry[token]:.4f}; top: {alternatives}")
    return 0


def _weight_cache(args) -> int:
    import logging

    if args.wc_command == "serve":
        # Give processing memory back to the driver once the cache is built (the default BFC pool
        # would keep it, and preallocating 75% would starve the clients on the same GPU).
        os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
        from modelopt_jax.weight_cache.daemon import serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

        def ready(daemon):
            print(f"serving {daemon.model_path} on {daemon.socket_path} ({daemon.nbytes} bytes in {daemon.store.where})",
                  flush=True)

        serve(args.model, device=args.device, socket_dir=args.socket_dir, dtype=args.dtype, backend=args.backend,
              tensor_parallel=args.tensor_parallel, message_timeout=args.message_timeout, ready=ready)
        return 0
    from modelopt_jax.weight_cache.client import request, stop

    if args.wc_command == "stop":  # also cleans up after a daemon that was killed
        reply = stop(socket_dir=args.socket_dir, device=args.device)
    else:
        reply = request(args.wc_command, socket_dir=args.socket_dir, device=args.device)
    print(json.dumps(reply, indent=2, sort_keys=True))
    return 0 if reply.get("ok") else 1


def main(argv=None) -> int:
    from modelopt_jax.dtypes import COMPUTE_DTYPES, KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(prog="python -m modelopt_jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a checkpoint (format, schemes, scales, bytes, warnings)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_inspect)
    g = sub.add_parser("generate", help="generate text with KV cache (default model: the embedded demo)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--model", help="checkpoint directory (default: the embedded qwen2-bytes-fp8 demo)")
    g.add_argument("--prompt", action="append",
                   help=f"a text prompt; repeat for several, generated as one batch (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--ids", action="append", help="a prompt as comma-separated token ids; repeatable")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1, help="<= 0 disables")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--logprobs", type=int, help="print each generated token's log-prob and the top N alternatives")
    g.add_argument("--stop-token-ids", type=int, nargs="+", help="stop at any of these token ids (besides EOS)")
    g.add_argument("--tokenizer", help="tokenizer.json, or a directory holding one (default: the checkpoint's)")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests decoded together at most")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="GPU: share of device memory the weights and the KV pool may use")
    g.add_argument("--weight-cache", default="off", choices=["off", "auto", "require"],
                   help="attach to a weight-cache daemon serving this checkpoint (see weight-cache serve)")
    g.add_argument("--dtype", default="bfloat16", choices=list(COMPUTE_DTYPES), help="compute dtype")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: FP8 when the checkpoint has KV scales, else the compute dtype")
    g.add_argument("--max-model-len", type=int, help="prompt + generated tokens at most (default: min(model, 4096))")
    g.add_argument("--quantization", default="auto", choices=["auto", "modelopt"],
                   help="'modelopt' insists on a ModelOpt checkpoint; 'auto' loads either")
    g.add_argument("--backend", default="auto", help="FP8 GEMM backend: auto, xla or cutlass")
    g.add_argument("--ignore-eos", action="store_true", help="generate max-tokens even past EOS")
    g.add_argument("--quiet", action="store_true", help="print only the text")
    g.set_defaults(func=_generate)
    w = sub.add_parser("weight-cache", help="weight-cache daemon: serve, status, stop")
    wsub = w.add_subparsers(dest="wc_command", required=True)
    ws = wsub.add_parser("serve", help="load and process a checkpoint once and serve it to other processes")
    ws.add_argument("--model", required=True)
    ws.add_argument("--dtype", default="bfloat16", choices=list(COMPUTE_DTYPES))
    ws.add_argument("--backend", default="auto")
    ws.add_argument("--tensor-parallel", type=int, default=1,
                    help="serve shard DEVICE of a split over this many GPUs (one daemon per GPU; clients use "
                         "LLM(..., tensor_parallel_size=N, weight_cache=...))")
    ws.add_argument("--message-timeout", type=float, default=60.0,
                    help="seconds a client has to send one whole request (default 60)")
    for q in (ws, wsub.add_parser("status", help="describe the daemon serving a device"),
              wsub.add_parser("stop", help="stop the daemon serving a device")):
        q.add_argument("--device", type=int, default=0)
        q.add_argument("--socket-dir", help="default: $MODELOPT_JAX_WEIGHT_CACHE_DIR or a per-user directory")
    w.set_defaults(func=_weight_cache)
    args = parser.parse_args(argv)
    from modelopt_jax.errors import ModelOptJaxError

    try:
        return args.func(args)
    except (ModelOptJaxError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
