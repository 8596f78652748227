"""Command line: ``python -m modelopt_jax {inspect,generate,serve,weight-cache} ...`` (also installed as ``modelopt-jax``)."""

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


# The server runs one forward a launch: a streaming client then gets each token as its step ends,
# one event per token, rather than a burst of EngineConfig.decode_steps tokens per launch.
SERVER_DECODE_STEPS = 1


def _llm_options(args, **overrides) -> dict:
    """``LLM`` keyword arguments from the model and engine options of ``generate`` / ``serve``
    (:func:`_model_options`), the model path aside; ``overrides`` replace or add some. The one
    place that maps the flags, whether the LLM is built here or in the engine-core process."""
    options = dict(quantization=None if args.quantization == "auto" else args.quantization, dtype=args.dtype,
                   max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, backend=args.backend,
                   tokenizer=args.tokenizer, tensor_parallel_size=args.tensor_parallel_size,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=not args.no_prefix_caching, precompile=not args.no_precompile,
                   kv_cache_memory_fraction=args.kv_cache_memory_fraction, weight_cache=args.weight_cache)
    return {**options, **overrides}


def _load(args, path: str, progress, **overrides):
    """The LLM the model options of ``generate`` / ``serve`` describe (after an inspect report unless --quiet)."""
    import jax

    from modelopt_jax import LLM
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    if not args.quiet:
        print(format_report(inspect_checkpoint(path)), end="\n\n", file=sys.stderr)
    progress(f"[load] {path} ({args.dtype}, backend {args.backend}) ...")
    llm = LLM(path, **_llm_options(args, **overrides))
    progress(f"[load] done in {llm.load_seconds:.2f} s on {jax.devices()[0].device_kind}")
    return llm


def _progress(args):
    return (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))


def _generate(args) -> int:
    import time

    import modelopt_jax
    from modelopt_jax import SamplingParams

    # Everything that can be checked without the model is checked before the (slow) load.
    prompts = _prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                            stop_token_ids=args.stop_token_ids or (), stop=args.stop or ())
    progress = _progress(args)
    llm = _load(args, args.model or modelopt_jax.demo_checkpoint_path(), progress)
    requests = llm.requests(prompts, params, detokenize=True)
    for i, r in enumerate(requests):  # as the server answers: refused, not silently shortened
        if r.budget < args.max_tokens:
            from modelopt_jax.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"--max-tokens {args.max_tokens}: prompt {i} has {len(r.prompt_ids)} tokens and --max-model-len "
                f"{llm.max_model_len} leaves room for {r.budget}; lower --max-tokens or raise --max-model-len")
    t0 = time.perf_counter()
    first_token_s = _stream_to_stdout(llm.engine, requests, prompts, args.logprobs is not None)
    total = time.perf_counter() - t0
    generated = sum(len(r.generated) for r in requests)
    later = generated - len(requests)
    progress(f"[generate] {len(prompts)} prompt(s), {sum(len(r.prompt_ids) for r in requests)} prompt tokens -> "
             f"{generated} new tokens in {total:.2f} s (first call: includes compilation, "
             f"{generated / total:.1f} tokens/s); first token after {first_token_s:.2f} s, then "
             f"{later / max(total - first_token_s, 1e-9):.1f} tokens/s "
             f"(finish: {', '.join(sorted({r.finish_reason for r in requests}))})")
    return 0


def _stream_to_stdout(engine, requests, prompts, logprobs: bool) -> float:
    """Runs ``requests`` step by step and prints each prompt's text as its tokens arrive, prompts in
    order, separated by blank lines (a later prompt's text waits until the earlier ones are done).
    Returns the seconds to the first token. An interrupted run leaves no pages taken."""
    import time

    pending = [[(("\n" if i else "") + (p if isinstance(p, str) else ""))] for i, p in enumerate(prompts)]
    shown = 0  # the prompt whose text goes straight to stdout

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(r) -> str:
        tail = (r.detokenizer.take_delta() if r.detokenizer is not None else str(r.generated)) + "\n"
        if logprobs:
            for token, entry in zip(r.generated, r.logprobs):
                alternatives = ", ".join(f"{t}: {v:.4f}" for t, v in sorted(entry.items(), key=lambda kv: -kv[1]))
                tail += f"  token {token}: logprob {entry[token]:.4f}; top: {alternatives}\n"
        return tail

    for r in requests:
        engine.add(r)
    write("".join(pending[0]))
    pending[0] = []
    t0, first = time.perf_counter(), None
    try:
        while engine.has_work:
            for r in engine.step():
                first = first if first is not None else time.perf_counter() - t0
                text = close(r) if r.finish_reason is not None else \
                    (r.detokenizer.take_delta() if r.detokenizer is not None else "")
                if r.index == shown:
                    write(text)
                else:
                    pending[r.index].append(text)
            while shown < len(requests) and requests[shown].finish_reason is not None:
                shown += 1
                if shown < len(requests):
                    write("".join(pending[shown]))
                    pending[shown] = []
    except BaseException:
        for r in requests:
            engine.abort(r)
        raise
    return first if first is not None else time.perf_counter() - t0


def _serve(args) -> int:
    import modelopt_jax
    from modelopt_jax.serve import require

    require()  # the [serve] extra, before anything slow
    from modelopt_jax.demo import DEMO_NAME
    from modelopt_jax.serve.app import build_app
    from modelopt_jax.serve.server import bind, serve

    from modelopt_jax.errors import InvalidArgumentError

    for flag, value in (("--timeout-graceful-shutdown", args.timeout_graceful_shutdown),
                        ("--timeout-request-head", args.timeout_request_head)):
        if not 0 <= value < 1e6:
            raise InvalidArgumentError(f"{flag} {value}: expected seconds in [0, 1e6)")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise InvalidArgumentError(f"--limit-concurrency {args.limit_concurrency}: expected a positive integer")
    names = args.served_model_name or [args.model or DEMO_NAME]
    path = args.model or modelopt_jax.demo_checkpoint_path()
    sock = bind(args.host, args.port)  # a taken port fails before the load
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    ready = f"serving {path} as {', '.join(names)} on {url}"  # stdout's first line: clients wait for it
    try:
        if args.in_process_engine:
            llm = _load(args, path, _progress(args), decode_steps=SERVER_DECODE_STEPS)
            app = build_app(llm, names, chat_template=args.chat_template, ready=lambda: print(ready, flush=True),
                            log_requests=not args.disable_log_requests)
            serve(app, sock, **_serve_options(args))
            return 0
        return _serve_with_core(args, path, names, sock, ready)
    finally:
        sock.close()


def _serve_options(args) -> dict:
    return dict(log_level=args.log_level, access_log=not args.disable_log_requests,
                grace=args.timeout_graceful_shutdown, header_timeout=args.timeout_request_head,
                limit_concurrency=args.limit_concurrency)


def _serve_with_core(args, path: str, names: list[str], sock, ready: str) -> int:
    """The frontend here (HTTP, tokenization, text), the engine in a process of its own (see
    modelopt_jax.serve.core): a step never waits for HTTP work, and HTTP never waits for a step."""
    import signal

    import jax

    # The frontend only draws PRNG keys with JAX: it must not take the accelerator from the core.
    jax.config.update("jax_platforms", "cpu")
    from modelopt_jax.checkpoint import Checkpoint
    from modelopt_jax.errors import EngineCoreError
    from modelopt_jax.prompts import PromptProcessor, resolve_max_model_len
    from modelopt_jax.serve.app import build_app
    from modelopt_jax.serve.core_client import CoreClient
    from modelopt_jax.serve.server import serve

    config = Checkpoint.open(path).model_config
    prompts = PromptProcessor(path, config, resolve_max_model_len(config, args.max_model_len), args.tokenizer)
    options = dict(model=path, **_llm_options(args, max_model_len=prompts.max_model_len,
                                              decode_steps=SERVER_DECODE_STEPS), quiet=args.quiet)
    client = CoreClient(options, tokenizer=prompts.tokenizer,
                        on_death=lambda reason: os.kill(os.getpid(), signal.SIGTERM))  # stop serving
    try:
        app = build_app(prompts, names, engine=client, chat_template=args.chat_template,
                        ready=lambda: print(ready, flush=True),  # checks the template before the load
                        log_requests=not args.disable_log_requests)
        client.launch()
        serve(app, sock, **_serve_options(args))
    finally:
        client.stop()
    if client.death is not None and client.death != "the server stopped":
        raise EngineCoreError(f"{client.death}; the server stopped")
    return 0


def _model_options(p) -> None:
    """The LLM/engine options ``generate`` and ``serve`` share."""
    from modelopt_jax.dtypes import COMPUTE_DTYPES, KV_CACHE_DTYPES

    p.add_argument("--tokenizer", help="tokenizer.json, or a directory holding one (default: the checkpoint's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the model is split over (attention heads, MLP width, KV pages by head)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests decoded together at most (default: 512 where the KV pool holds 512 sequences "
                        "of 1024 tokens, else 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step at most: the running requests' next tokens plus prompt chunks")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="no_prefix_caching", action="store_true",
                   help="compute every prompt in full (default: prompts share the cached pages of a common prefix; "
                        "the second spelling is vLLM's)")
    p.add_argument("--no-precompile", action="store_true",
                   help="compile each step program when first needed (default, where the CUDA kernels run: "
                        "compile every step program at start-up, so no request waits for a compile)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="GPU: share of device memory the weights and the KV pool may use")
    p.add_argument("--weight-cache", default="off", choices=["off", "auto", "require"],
                   help="attach to a weight-cache daemon serving this checkpoint (see weight-cache serve)")
    p.add_argument("--dtype", default="bfloat16", choices=list(COMPUTE_DTYPES), help="compute dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: FP8 when the checkpoint has KV scales, else the compute dtype")
    p.add_argument("--max-model-len", type=int, help="prompt + generated tokens at most (default: min(model, 4096))")
    p.add_argument("--quantization", default="auto", choices=["auto", "modelopt"],
                   help="'modelopt' insists on a ModelOpt checkpoint; 'auto' loads either")
    p.add_argument("--backend", default="auto", help="FP8 GEMM backend: auto, xla or cutlass")


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


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (None): the help text says what
    happens then ("default: the embedded demo"), and "(default: None)" would only contradict it."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv=None) -> int:
    from modelopt_jax.dtypes import COMPUTE_DTYPES

    parser = argparse.ArgumentParser(prog="python -m modelopt_jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a checkpoint (format, schemes, scales, bytes, warnings)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_inspect)
    g = sub.add_parser("generate", help="generate text with KV cache (default model: the embedded demo)",
                       formatter_class=_DefaultsFormatter)
    g.add_argument("--model", help="checkpoint directory (default: the embedded qwen2-bytes-fp8 demo)")
    g.add_argument("--prompt", action="append",
                   help=f"a text prompt; repeat for several, generated as one batch (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--ids", action="append", help="a prompt as comma-separated token ids; repeatable")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1, help="<= 0 disables")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this (1 disables)")
    g.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same text, whatever else is "
                   "batched with it (default: unseeded, each run differs)")
    g.add_argument("--logprobs", type=int, help="print each generated token's log-prob and the top N alternatives")
    g.add_argument("--stop-token-ids", type=int, nargs="+", help="stop at any of these token ids (besides EOS)")
    g.add_argument("--stop", action="append", help="stop where the text reaches this string (cut before it); repeatable")
    _model_options(g)
    g.add_argument("--ignore-eos", action="store_true", help="generate max-tokens even past EOS")
    g.add_argument("--quiet", action="store_true", help="print only the text")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the [serve] extra)",
                       formatter_class=_DefaultsFormatter,
                       description="/v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health")
    s.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded qwen2-bytes-fp8 demo)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one; the ready line names it)")
    s.add_argument("--served-model-name", nargs="+",
                   help="names clients may use as 'model' (the first one is reported; default: MODEL as given)")
    s.add_argument("--chat-template", help="Jinja file or source for /v1/chat/completions instead of the checkpoint's")
    _model_options(s)
    s.add_argument("--in-process-engine", action="store_true",
                   help="run the engine on a thread of the server's process instead of a process of its own "
                        "(slower under load: HTTP and text work share the step loop's interpreter)")
    s.add_argument("--timeout-graceful-shutdown", type=float, default=10.0,
                   help="SIGTERM / SIGINT: seconds running requests may take to finish; then each open stream "
                        "ends with an error event and [DONE]")
    s.add_argument("--timeout-request-head", type=float, default=10.0,
                   help="seconds a connection has to send a whole request head (a trickling client is cut)")
    s.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections held at most before new ones get 503 (default and ceiling: what the "
                        "descriptor limit allows)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (default: an access line, and one per generation with its "
                        "outcome, tokens and latencies)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--quiet", action="store_true", help="no inspect report or load progress on stderr")
    s.set_defaults(func=_serve)
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
