"""The engine-core process: ``python -m modelopt_jax.serve.core SOCKET_DIR`` (started by the server).

It loads the model (``LLM(**options)``, the options as JSON on stdin), connects to the two ZeroMQ
sockets the frontend bound in ``SOCKET_DIR`` (a directory only this user can enter), says
:class:`~.core_protocol.Ready`, and then does nothing but the step loop: take every submission
and abort that arrived, run one engine step, send its outputs as one message. It sleeps on the
socket when idle. No HTTP, JSON, tokenization or text happens here, so a step is never delayed by
a client.

It exits when the frontend says :class:`~.core_protocol.Shutdown`, and by itself within about a
second when the frontend process is gone (its parent changes), so it never outlives the server.
SIGINT is ignored: a Ctrl-C reaches the whole process group, and the frontend decides how the
requests still running end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time

log = logging.getLogger("modelopt_jax.serve.core")

PARENT_CHECK_S = 1.0   # how often the core looks for its frontend while busy
REPORT_S = 10.0        # a log line of throughput and state this often while busy


def _llm(options: dict):
    from modelopt_jax import LLM
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    quiet = options.pop("quiet", False)
    if not quiet:
        print(format_report(inspect_checkpoint(options["model"])), end="\n\n", file=sys.stderr)
        print(f"[load] {options['model']} ({options.get('dtype')}, backend {options.get('backend')}) ...",
              file=sys.stderr, flush=True)
    llm = LLM(**options)
    if not quiet:
        import jax

        print(f"[load] done in {llm.load_seconds:.2f} s on {jax.devices()[0].device_kind}", file=sys.stderr, flush=True)
    return llm


def step_mix(before: dict, after: dict) -> str:
    """What the engine's steps between two ``Engine.counters()`` were: how many held prompt chunks
    and how long those and the decode-only ones took on average (a server's inter-token latency
    is these step times), the prompt tokens computed, and the decode rows that read a shared
    prefix once per line (cascade attention)."""
    d = {k: after[k] - before[k] for k in after}
    decode_only = d["steps"] - d["prefill_steps"]
    per_step = lambda s, n: f"{1000 * s / n:.1f} ms" if n else "-"  # noqa: E731
    return (f"{d['steps']} steps: {d['prefill_steps']} with prompt chunks ({d['mixed_steps']} beside decodes) at "
            f"{per_step(d['prefill_s'], d['prefill_steps'])}, {decode_only} decode-only at "
            f"{per_step(d['decode_s'], decode_only)}; {d['prefill_tokens_computed']} prompt tokens computed, "
            f"{d['shared_prefix_rows']} decode rows read a shared prefix, {d['inline_compiles']} compiled in line")


def main(argv: list[str]) -> int:
    import zmq

    from modelopt_jax.errors import ModelOptJaxError
    from modelopt_jax.serve.core_loop import CoreLoop
    from modelopt_jax.serve.core_protocol import (Abort, CoreFailed, IpcError, Ready, Shutdown, StepOutputs, Submit,
                                                  decode_to_core, encode)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    socket_dir = argv[0]
    parent = os.getppid()
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(f"ipc://{socket_dir}/to_core")
    outbox.connect(f"ipc://{socket_dir}/from_core")
    try:
        options = json.loads(sys.stdin.read())
        t0 = time.perf_counter()
        llm = _llm(options)
        core = CoreLoop(llm.engine, llm.model.config.vocab_size)
    except (ModelOptJaxError, ValueError, TypeError, OSError) as e:
        outbox.send(encode(CoreFailed(f"{type(e).__name__}: {e}")))
        context.destroy(linger=2000)
        return 1
    outbox.send(encode(Ready(pid=os.getpid(), load_seconds=time.perf_counter() - t0,
                             max_model_len=llm.max_model_len)))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    checked = reported = time.monotonic()
    last_steps = last_tokens = 0
    last_counters = llm.engine.counters()
    try:
        while True:
            outputs = []
            if poller.poll(0 if core.has_work else int(PARENT_CHECK_S * 1000)):
                while True:
                    try:
                        data = inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = decode_to_core(data)
                    except IpcError as e:
                        log.error("%s; message dropped", e)
                        continue
                    if isinstance(message, Submit):
                        outputs += core.submit(message.requests)
                    elif isinstance(message, Abort):
                        core.abort(message.ids)
                    elif isinstance(message, Shutdown):
                        outputs += core.fail_all(f"the server is shutting down ({message.reason})")
                        outbox.send(encode(StepOutputs(outputs)))
                        return 0
            if core.has_work:
                outputs += core.step()
            if outputs:
                outbox.send(encode(StepOutputs(outputs, core.gauges())))
            now = time.monotonic()
            if now - reported >= REPORT_S and core.stats["steps"] != last_steps:
                g, tokens, counters = core.gauges(), core.stats["tokens"], llm.engine.counters()
                log.info("%.0f tokens/s over %.0f s; running %d, waiting %d, KV %.0f%%, %d step programs used, "
                         "%d steps deferred prompts for a compile, %d preempted; %s",
                         (tokens - last_tokens) / (now - reported),
                         now - reported, g.running, g.waiting, 100 * g.kv_cache_usage, g.programs,
                         g.decodes_while_compiling, g.preemptions, step_mix(last_counters, counters))
                reported, last_steps, last_tokens, last_counters = now, core.stats["steps"], tokens, counters
            if now - checked >= PARENT_CHECK_S:
                checked = now
                if os.getppid() != parent:
                    log.error("the frontend process is gone; the engine core exits")
                    shutil.rmtree(socket_dir, ignore_errors=True)  # nobody else will
                    return 1
    finally:
        context.destroy(linger=2000)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
