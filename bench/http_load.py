"""Server benchmark (issue 14): many concurrent streaming clients against ``python -m modelopt_jax serve``,
then ``LLM.generate`` on the same prompts for a ratio.

Run on the H200 (not a test), e.g. through ``bash bench/gpu_session.sh serve-http CKPT_DIR``:
    python bench/http_load.py --checkpoint DIR [--write-preset llama3-8b] [--clients 200] [--requests 1000]
                              [--prompt-len 64,1024] [--max-tokens 32,512] [--warmup-passes 1] [--json out.json]

What runs:

1. The server, as users run it: a subprocess ``python -m modelopt_jax serve DIR --host 127.0.0.1
   --port 0`` (a subprocess rather than the tests' in-process uvicorn thread, so that the server's
   event loop, engine thread and GIL are not shared with the load generator, as on a real host).
   Its ready line names the port; ``/health`` must answer 200 and ``/v1/models`` gives
   ``max_model_len``. Its stdout and stderr go to ``--server-log``, with ``JAX_LOG_COMPILES=1`` so
   that each pass reports how many programs the server compiled during it.
2. A bounded, closed-loop load generator: ``--clients`` asyncio workers (one httpx client whose pool
   keeps a connection per worker) take the ``--requests`` requests in order; each posts a streaming ``/v1/completions`` and reads
   its server-sent events before taking the next. Prompts are token-id lists (the server takes them
   as they are: no tokenization, exact lengths); prompt lengths and ``max_tokens`` are drawn
   uniformly from ``--prompt-len`` and ``--max-tokens`` (seeded). Greedy, ``ignore_eos: true`` (a
   vLLM extension the server honours) and no stop strings, so every request generates exactly
   ``max_tokens`` tokens; ``stream_options.include_usage`` makes the server report the count.
   The workload runs ``--warmup-passes`` times (default 1) before the reported pass, against the
   same server: the first pass compiles the engine's step programs (as in bench/serve.py). Which
   step shapes a server meets depends on how requests happen to arrive, so a later pass can still
   compile one; its ``server_compiles`` says so (0: a clean measurement).
3. After the server has exited (it held the device), ``LLM.generate`` in this process with the same
   model options, prompts and ``SamplingParams`` -- all prompts at once, so its concurrency is the
   engine's ``max_num_seqs``, not ``--clients`` -- after as many warm-up runs; the ratio of generated
   tokens/s is printed, and how many completions the two produced identically (greedy on both; a
   batch composition that differs can flip a near-tie, so this is reported, not required).

What is measured, per request, on the client's clock: time to first token (TTFT: from sending the
request to the first event that carries text -- the response headers come earlier and do not
count); inter-token latency (ITL: the gaps between successive text-carrying events); end-to-end
time; TPOT (time per output token after the first: ``(e2e - TTFT) / (tokens - 1)``). An event is
one engine step's *delta* of one request: one token, unless a token decoded to no printable text
yet (part of a UTF-8 character), whose text then comes with a later event. So ITL is per event;
``tokens_per_event`` (usage tokens / text events) says how close that is to per token. A checkpoint
without a tokenizer.json (the synthetic ones) gets a synthetic tokenizer in which every id decodes
to a space and a short word, so there an event is exactly one token. Totals: requests/s and
generated tokens/s over the pass's wall time, p50/p99 of TTFT, ITL (all gaps pooled), TPOT and
end-to-end, and the load generator's own CPU use (near 1.0: the client, not the server, may be the
bottleneck).

Errors are counted, never ignored: a non-200 status, a transport error or timeout, an event that is
not ``data: <json>`` or ``data: [DONE]``, an ``error`` event, a stream without ``[DONE]``, a missing
or unexpected ``finish_reason`` or usage, or a token count other than ``max_tokens``. Errors, or a
server whose exit status after SIGINT (a graceful shutdown) is not 0, make the script exit 1; the
JSON lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import signal
import string
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL_NAME = "bench"
READY = re.compile(r"^serving .* on (http://\S+)$", re.MULTILINE)


# -- workload ------------------------------------------------------------------------------------

def int_range(text: str) -> tuple[int, int]:
    """``"64,1024"`` -> (64, 1024), both inclusive; ``"16"`` -> (16, 16)."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) not in (1, 2) or not 1 <= parts[0] <= parts[-1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI with 1 <= LO <= HI")
    return parts[0], parts[-1]


def make_workload(n: int, vocab: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs, lengths uniform in the inclusive ranges, ids in [10, vocab)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        out.append((rng.integers(10, vocab, length).tolist(), int(rng.integers(max_tokens[0], max_tokens[1] + 1))))
    return out


def vocab_size(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def write_synthetic_tokenizer(path: str, vocab: int) -> None:
    """A byte-level BPE tokenizer.json (Llama-3's kind) of ``vocab`` ids, id i decoding to a space and the
    i-th word of a..z, aa..zz, ... (printable, so each token streams as its own event)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ("".join(w) for k in itertools.count(1) for w in itertools.product(string.ascii_lowercase, repeat=k))
    tokenizer = Tokenizer(models.BPE(vocab={"\u0120" + w: i for i, w in zip(range(vocab), words)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(path)


# -- the server ----------------------------------------------------------------------------------

def tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "\n".join(f.read().splitlines()[-lines:])


class Server:
    """``python -m modelopt_jax serve`` in a subprocess; ``with Server(...) as s: s.url``. Leaving the block
    sends SIGINT (a graceful shutdown) and records the exit status in ``s.exit_status``."""

    def __init__(self, checkpoint: str, model_args: list[str], log_path: str, startup_timeout: float):
        self.command = [sys.executable, "-m", "modelopt_jax", "serve", checkpoint, "--host", "127.0.0.1", "--port", "0",
                        "--quiet", "--log-level", "warning", "--served-model-name", MODEL_NAME, *model_args]
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self.url = self.proc = self.exit_status = None
        self.startup_s = None

    def __enter__(self) -> "Server":
        env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_LOG_COMPILES="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            self.url = self._wait_ready(t0)
        except BaseException:
            self._stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> str:
        """The ready line's URL once /health answers 200 (the log names the port: the server bound port 0)."""
        import httpx

        while time.perf_counter() - t0 < self.startup_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready:\n"
                                   + self.log_tail())
            match = READY.search(self.log_text())
            if match and httpx.get(match.group(1) + "/health", trust_env=False).status_code == 200:
                return match.group(1)
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready in {self.startup_timeout:.0f} s:\n" + self.log_tail())

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self) -> str:
        return tail(self.log_path)

    def cpu_seconds(self) -> dict:
        """CPU seconds (user + system) the frontend process and its children (the engine core) have used so
        far, from /proc (Linux; {} elsewhere): whether the frontend's Python is what limits a pass shows as
        its share of one core and its cost per streamed event."""
        def stat(pid) -> tuple[int, float] | None:
            """(parent pid, CPU seconds) from /proc/PID/stat (the fields after the command's ")")."""
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
            except (OSError, ValueError, IndexError):
                return None

        frontend = stat(self.proc.pid)
        if frontend is None:
            return {}
        children = [stat(entry) for entry in os.listdir("/proc") if entry.isdigit()]
        return {"frontend": frontend[1],
                "core": sum(seconds for ppid, seconds in filter(None, children) if ppid == self.proc.pid)}

    def compiles(self) -> int:
        """Programs the server has compiled so far (JAX_LOG_COMPILES lines in its log)."""
        return self.log_text().count("Compiling jit(")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_status = self.proc.returncode

    def __exit__(self, *exc) -> None:
        self._stop()

    def max_model_len(self) -> int:
        import httpx

        models = httpx.get(self.url + "/v1/models", trust_env=False).json()["data"]
        return int(models[0]["max_model_len"])


# -- one streaming request -----------------------------------------------------------------------

class StreamError(Exception):
    """A malformed or failed stream (counted as an error)."""


def request_body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def parse_event(line: str):
    """One SSE line -> ``None`` (blank), ``"[DONE]"``, or the decoded JSON object."""
    if not line:
        return None
    if not line.startswith("data: "):
        raise StreamError(f"not a data event: {line[:200]!r}")
    data = line[len("data: "):]
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"event is not JSON ({e}): {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise StreamError(f"event is not a JSON object: {data[:200]!r}")
    if "error" in event:
        raise StreamError(f"error event: {data[:300]}")
    return event


class Record:
    """What one request saw: event times, text, token count and finish reason."""

    def __init__(self, index: int, prompt_tokens: int, max_tokens: int):
        self.index, self.prompt_tokens, self.max_tokens = index, prompt_tokens, max_tokens
        self.t0 = self.end = None
        self.text_times: list[float] = []   # arrival of each event that carried text
        self.text, self.finish_reasons, self.completion_tokens, self.done = "", [], None, False
        self.error: str | None = None

    def add(self, event, now: float) -> None:
        if self.done:
            raise StreamError("an event after [DONE]")
        if event == "[DONE]":
            self.done = True
            return
        if event.get("usage"):
            self.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            if choice.get("text"):
                self.text += choice["text"]
                self.text_times.append(now)
            if choice.get("finish_reason") is not None:
                self.finish_reasons.append(choice["finish_reason"])

    def check(self) -> None:
        """Raises StreamError unless the stream ended as a greedy ``ignore_eos`` request must."""
        if not self.done:
            raise StreamError("the stream ended without [DONE]")
        if self.finish_reasons != ["length"]:
            raise StreamError(f"finish_reason(s) {self.finish_reasons}, expected one 'length'")
        if self.completion_tokens != self.max_tokens:
            raise StreamError(f"usage.completion_tokens {self.completion_tokens}, expected max_tokens "
                              f"{self.max_tokens}")
        if not self.text_times:
            raise StreamError("no event carried text")

    def summary(self) -> dict:
        out = {"index": self.index, "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
               "error": self.error}
        if self.error is None:
            out.update(ttft_s=self.ttft, e2e_s=self.end - self.t0, tokens=self.completion_tokens,
                       text_events=len(self.text_times), tpot_s=self.tpot)
        return out

    @property
    def ttft(self) -> float:
        return self.text_times[0] - self.t0

    @property
    def itls(self) -> list[float]:
        return np.diff(self.text_times).tolist()

    @property
    def tpot(self) -> float | None:
        return (self.end - self.text_times[0]) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None


async def one_request(client, index: int, prompt: list[int], max_tokens: int) -> Record:
    """Posts one streaming completion and reads it to the end; never raises (failures land in ``error``)."""
    import httpx

    rec = Record(index, len(prompt), max_tokens)
    rec.t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(prompt, max_tokens)) as response:
            if response.status_code != 200:
                raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                event = parse_event(line)
                if event is not None:
                    rec.add(event, time.perf_counter())
        rec.end = time.perf_counter()
        rec.check()
    except StreamError as e:
        rec.error = str(e)
    except (httpx.HTTPError, OSError) as e:  # refused, reset, timed out, protocol errors
        rec.error = f"{type(e).__name__}: {e}"
    return rec


# -- the load generator --------------------------------------------------------------------------

async def _load(url: str, workload, clients: int, timeout: float) -> list[Record]:
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    pending = iter(enumerate(workload))
    records: list[Record] = []

    async def worker(client):
        for index, (prompt, max_tokens) in pending:  # a shared iterator: each request is taken once
            records.append(await one_request(client, index, prompt, max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return sorted(records, key=lambda r: r.index)


def percentiles(values, scale: float = 1.0) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(values) * scale
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def run_pass(server: Server, workload, clients: int, timeout: float) -> tuple[dict, list[Record]]:
    """One pass of the whole workload; returns (its summary, the records)."""
    compiles, cpu0, t0, server0 = server.compiles(), time.process_time(), time.perf_counter(), server.cpu_seconds()
    records = asyncio.run(_load(server.url, workload, clients, timeout))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    server1 = server.cpu_seconds()
    good = [r for r in records if r.error is None]
    tokens = sum(r.completion_tokens for r in good)
    events = sum(len(r.text_times) for r in good)
    summary = {"requests": len(records), "completed": len(good), "errors": len(records) - len(good), "wall_s": wall,
               "requests_per_s": len(good) / wall, "generated_tokens": tokens,
               "generated_tokens_per_s": tokens / wall, "prompt_tokens": sum(r.prompt_tokens for r in good),
               "text_events": events, "tokens_per_event": tokens / events if events else None,
               "ttft_ms": percentiles([r.ttft for r in good], 1e3),
               "itl_ms": percentiles([g for r in good for g in r.itls], 1e3),
               "tpot_ms": percentiles([r.tpot for r in good], 1e3),
               "e2e_s": percentiles([r.end - r.t0 for r in good]),
               "client_cpu_fraction": cpu / wall, "server_compiles": server.compiles() - compiles}
    if server0 and server1:
        frontend, core = server1["frontend"] - server0["frontend"], server1["core"] - server0["core"]
        summary.update(frontend_cpu_fraction=frontend / wall, core_cpu_fraction=core / wall,
                       frontend_cpu_us_per_event=1e6 * frontend / events if events else None)
    return summary, records


# -- the LLM.generate peer -----------------------------------------------------------------------

def generate_peer(checkpoint: str, llm_kwargs: dict, workload, warmups: int) -> tuple[dict, list[str]]:
    """``LLM.generate`` on the workload (all prompts in one call); (its summary, the texts)."""
    import jax

    from modelopt_jax import LLM, SamplingParams

    llm = LLM(checkpoint, **llm_kwargs)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in workload]
    first = None
    for _ in range(warmups + 1):  # the first compiles
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        first = wall if first is None else first
    st = dict(llm.last_stats)
    tokens = sum(len(o.token_ids) for o in outs)
    summary = {"device": jax.devices()[0].device_kind, "load_s": llm.load_seconds, "wall_s": wall,
               "first_run_s": first, "requests_per_s": len(outs) / wall, "generated_tokens": tokens,
               "generated_tokens_per_s": tokens / wall, "first_token_s": st.get("first_token_s"),
               "ms_per_decode_step": 1e3 * st["decode_s"] / max(st["decode_steps"], 1), "engine_stats": st}
    return summary, [o.text for o in outs]


# -- report --------------------------------------------------------------------------------------

def _pq(d: dict, fmt: str = "{:.1f}") -> str:
    return "-" if d["p50"] is None else f"{fmt.format(d['p50'])} / {fmt.format(d['p99'])}"


def print_table(report: dict) -> None:
    s, g = report["server"]["measured"], report.get("generate")
    print(f"\n{'':16} {'req/s':>8} {'gen tok/s':>10} {'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>16} "
          f"{'TPOT p50/p99 ms':>16} {'E2E p50/p99 s':>15}")
    print(f"{'server (HTTP)':16} {s['requests_per_s']:8.2f} {s['generated_tokens_per_s']:10.1f} "
          f"{_pq(s['ttft_ms']):>18} {_pq(s['itl_ms']):>16} {_pq(s['tpot_ms']):>16} {_pq(s['e2e_s'], '{:.2f}'):>15}")
    if g:
        print(f"{'LLM.generate':16} {g['requests_per_s']:8.2f} {g['generated_tokens_per_s']:10.1f} "
              f"{'first: ' + format(1e3 * g['first_token_s'], '.0f'):>18} {'-':>16} "
              f"{'step ' + format(g['ms_per_decode_step'], '.1f'):>16} {'-':>15}")
        print(f"server / generate generated tok/s: {report['ratio_tok_s']:.2f}; identical completions "
              f"{report['identical_texts']}/{s['completed']}")
        print("(LLM.generate: TTFT column = the batch's first token, TPOT column = ms per decode step)")
    print(f"{s['completed']}/{s['requests']} requests completed, {s['text_events']} text events for "
          f"{s['generated_tokens']} tokens ({s['tokens_per_event'] or 0:.2f} tokens/event); client CPU "
          f"{100 * s['client_cpu_fraction']:.0f}% of one core; {s['server_compiles']} server compiles during the "
          f"pass; errors {report['errors']}, server exit status {report['server']['exit_status']}")
    if s.get("frontend_cpu_fraction") is not None:
        print(f"server CPU: frontend {100 * s['frontend_cpu_fraction']:.0f}% of one core "
              f"({s['frontend_cpu_us_per_event'] or 0:.0f} us per text event), engine core "
              f"{100 * s['core_cpu_fraction']:.0f}%")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the embedded demo)")
    ap.add_argument("--write-preset", choices=["llama3-8b", "llama3-8b-kv", "qwen3-30b-a3b-12l", "tiny"],
                    help="write this synthetic checkpoint (bench/serve.py's PRESETS) into --checkpoint if absent")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's, else a synthetic one)")
    ap.add_argument("--clients", type=int, default=200, help="concurrent streaming clients (closed loop)")
    ap.add_argument("--requests", type=int, default=1000, help="requests per pass")
    ap.add_argument("--prompt-len", type=int_range, default=(64, 1024), help="LO,HI prompt tokens (uniform)")
    ap.add_argument("--max-tokens", type=int_range, default=(32, 512), help="LO,HI tokens to generate (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-passes", type=int, default=1,
                    help="unreported passes before the measured one, server and LLM.generate (0: compilation included)")
    ap.add_argument("--skip-generate", action="store_true", help="no LLM.generate peer")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per httpx operation")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds for the server to load")
    ap.add_argument("--server-log", help="the server's stdout+stderr (default: a temporary file)")
    ap.add_argument("--json")
    for name, default in (("--dtype", "bfloat16"), ("--kv-cache-dtype", "auto")):
        ap.add_argument(name, default=default, help="server and LLM option")
    for name, default in (("--max-model-len", None), ("--max-num-seqs", None), ("--max-num-batched-tokens", 8192)):
        ap.add_argument(name, type=int, default=default, help="server and LLM option")
    args = ap.parse_args(argv)
    if args.write_preset and not args.checkpoint:
        ap.error("--write-preset needs --checkpoint DIR")
    if args.clients < 1 or args.requests < 1 or args.warmup_passes < 0:
        ap.error("--clients and --requests must be positive, --warmup-passes not negative")
    return args


def model_options(args, tokenizer: str | None) -> tuple[list[str], dict]:
    """The same model/engine options as serve's command line and as LLM keyword arguments."""
    kwargs = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens, "tokenizer": tokenizer}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    cli = [x for k, v in kwargs.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return cli, kwargs


def prepare(args, tmp: str) -> tuple[str, str | None]:
    """(checkpoint, tokenizer path or None): writes the preset and a synthetic tokenizer when needed."""
    if args.write_preset:
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(ROOT, "bench", "serve.py"))
        bench_serve = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_serve)
        bench_serve.write_preset(args.checkpoint, args.write_preset)
    if args.checkpoint is None:
        import modelopt_jax

        args.checkpoint = modelopt_jax.demo_checkpoint_path()
    if args.tokenizer or os.path.exists(os.path.join(args.checkpoint, "tokenizer.json")):
        return args.checkpoint, args.tokenizer
    path = os.path.join(tmp, "tokenizer.json")
    write_synthetic_tokenizer(path, vocab_size(args.checkpoint))
    print(f"{args.checkpoint} has no tokenizer.json: using a synthetic one of {vocab_size(args.checkpoint)} ids",
          flush=True)
    return args.checkpoint, path


def serve_passes(args, checkpoint: str, cli: list[str], workload, log_path: str) -> dict:
    """Starts the server, runs the warm-up passes and the measured one, stops it."""
    out = {"log": log_path, "warmup": [], "warmup_errors": []}
    with Server(checkpoint, cli, log_path, args.startup_timeout) as server:
        out.update(command=server.command, url=server.url, startup_s=server.startup_s,
                   max_model_len=server.max_model_len())
        print(f"server up at {server.url} in {server.startup_s:.1f} s (max_model_len {out['max_model_len']}); "
              f"log {log_path}", flush=True)
        longest = args.prompt_len[1] + args.max_tokens[1]
        if longest > out["max_model_len"]:
            raise SystemExit(f"--prompt-len + --max-tokens reach {longest} tokens > max_model_len "
                             f"{out['max_model_len']}: lengths would not be exact (pass --max-model-len)")
        for i in range(args.warmup_passes):
            summary, warm = run_pass(server, workload, args.clients, args.request_timeout)
            out["warmup"].append(summary)
            out["warmup_errors"] += [r.summary() for r in warm if r.error]
            print(f"warm-up pass {i + 1}: {summary['wall_s']:.1f} s, {summary['generated_tokens_per_s']:.1f} "
                  f"generated tok/s, {summary['server_compiles']} server compiles, {summary['errors']} errors",
                  flush=True)
        out["measured"], records = run_pass(server, workload, args.clients, args.request_timeout)
    out["exit_status"] = server.exit_status
    out["requests"] = [r.summary() for r in records]
    out["texts"] = [r.text if r.error is None else None for r in records]
    if server.exit_status != 0:
        print(f"server exit status {server.exit_status}:\n{server.log_tail()}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="http_load_") as tmp:
        checkpoint, tokenizer = prepare(args, tmp)
        cli, llm_kwargs = model_options(args, tokenizer)
        workload = make_workload(args.requests, vocab_size(checkpoint), args.prompt_len, args.max_tokens, args.seed)
        server = serve_passes(args, checkpoint, cli, workload, args.server_log or os.path.join(tmp, "server.log"))
        texts = server.pop("texts")
        report = {"checkpoint": checkpoint, "args": {k: v for k, v in vars(args).items()}, "server": server}
        errors = [r for r in server["requests"] if r["error"]] + server["warmup_errors"]
        report["errors"] = len(errors) + (server["exit_status"] != 0)
        if not args.skip_generate:
            report["generate"], want = generate_peer(checkpoint, llm_kwargs, workload, args.warmup_passes)
            report["ratio_tok_s"] = server["measured"]["generated_tokens_per_s"] / \
                report["generate"]["generated_tokens_per_s"]
            report["identical_texts"] = sum(a is not None and a == b for a, b in zip(texts, want))
        if args.server_log is None:  # the temporary log goes with the directory: keep its end
            server["log_tail"] = tail(server["log"])
    for e in errors[:5]:
        print(f"error in request {e['index']}: {e['error']}", flush=True)
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
