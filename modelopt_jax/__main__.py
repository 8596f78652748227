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


def _generate(args) -> int:
    import jax

    import modelopt_jax
    from modelopt_jax import LLM, SamplingParams
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    path = args.model or modelopt_jax.demo_checkpoint_path()
    if not args.quiet:
        print(format_report(inspect_checkpoint(path)), end="\n\n", file=sys.stderr)
    progress = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    progress(f"[load] {path} ({args.dtype}, backend {args.backend}) ...")
    llm = LLM(path, quantization=None if args.quantization == "auto" else args.quantization, dtype=args.dtype,
              max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, backend=args.backend)
    progress(f"[load] done in {llm.load_seconds:.2f} s on {jax.devices()[0].device_kind}")
    prompt = [int(t) for t in args.ids.split(",")] if args.ids else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    (out,) = llm.generate([prompt], params)
    stats = llm.last_stats
    decode_rate = stats["decode_steps"] / stats["decode_s"] if stats["decode_s"] else float("nan")
    progress(f"[generate] {stats['prompt_tokens']} prompt tokens -> {len(out.token_ids)} new tokens in "
             f"{stats['total_s']:.2f} s (first call: includes compilation); first token after "
             f"{stats['first_token_s']:.2f} s, then {decode_rate:.1f} tokens/s (finish: {out.finish_reason})")
    print((args.prompt if not args.ids else "") + (out.text if out.text is not None else str(out.token_ids)))
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
    g = sub.add_parser("generate", help="generate text with KV cache (default model: the embedded demo)")
    g.add_argument("--model", help="checkpoint directory (default: embedded qwen2-bytes-fp8 demo)")
    g.add_argument("--prompt", default="It is a truth universally acknowledged")
    g.add_argument("--ids", help="comma-separated prompt token ids instead of --prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", default="bfloat16", choices=list(COMPUTE_DTYPES))
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--quantization", default="auto", choices=["auto", "modelopt"],
                   help="'modelopt' insists on a ModelOpt checkpoint; 'auto' loads either")
    g.add_argument("--backend", default="auto")
    g.add_argument("--ignore-eos", action="store_true")
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
