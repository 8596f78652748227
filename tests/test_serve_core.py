"""The server as ``python -m modelopt_jax serve`` runs it: a frontend process and an engine-core process.

What crosses between them (typed messages), that answers equal the in-process engine's, and that
neither process outlives or hangs on the other: the core killed -> the frontend fails the open
streams (error event, then [DONE]) and exits with a message naming the core; the frontend killed
-> the core exits within seconds and removes its socket directory.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from modelopt_jax import LLM, SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")
pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from modelopt_jax.serve import core_protocol  # noqa: E402
from modelopt_jax.serve.core_client import socket_base  # noqa: E402
from modelopt_jax.serve.core_loop import CoreLoop  # noqa: E402
from modelopt_jax.serve.streams import core_request  # noqa: E402

PROMPT = "It is a truth universally acknowledged"


def _start(*extra: str, max_model_len: int = 128) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "modelopt_jax", "serve", "--port", "0", "--quiet", "--dtype",
                             "float32", "--max-model-len", str(max_model_len), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    line = proc.stdout.readline()  # the ready line, once the core has loaded
    if not line.startswith("serving "):
        proc.kill()
        raise AssertionError(f"no ready line: {line!r}\n{proc.communicate()[1]}")
    return proc, line.split(" on ")[-1].strip()


def _children(pid: int) -> list[int]:
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(dtype="float32", max_model_len=128, kv_cache_bytes=1 << 20)


def test_messages_round_trip_and_garbage_is_a_typed_error():
    request = core_protocol.CoreRequest(id=7, prompt_ids=[1, 2, 3], params={"max_tokens": 4}, stop_ids=[2],
                                        budget=4, row_key=[0, 5], sample_index=0)
    for message in (core_protocol.Submit([request]), core_protocol.Abort([7, 8]), core_protocol.Shutdown("bye")):
        assert core_protocol.decode_to_core(core_protocol.encode(message)) == message
    out = core_protocol.StepOutputs([core_protocol.TokenOutput(7, [5], [-0.25], [{5: -0.25, 9: -1.5}], None, None)],
                                    core_protocol.EngineGauges(1, 0, 0.5, 16, 0, 3, 1))
    assert core_protocol.decode_from_core(core_protocol.encode(out)) == out
    for garbage in (b"", b"\xff\x00junk", core_protocol.encode(out)):  # a StepOutputs is no message *to* the core
        with pytest.raises(core_protocol.IpcError, match="does not decode"):
            core_protocol.decode_to_core(garbage)


def test_the_core_refuses_a_bad_request_alone(reference):
    """A request the frontend should never send (ids outside the vocabulary, a budget past the
    context) fails alone; the good one beside it completes with the in-process answer."""
    llm = LLM(dtype="float32", max_model_len=128, kv_cache_bytes=1 << 20)
    loop = CoreLoop(llm.engine, llm.model.config.vocab_size)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    good = core_request(llm.requests(PROMPT, params)[0], 1)
    bad_ids = core_request(llm.requests(PROMPT, params)[0], 2)
    bad_ids.prompt_ids = [llm.model.config.vocab_size]
    bad_budget = core_request(llm.requests(PROMPT, params)[0], 3)
    bad_budget.budget = 10 ** 6
    refused = loop.submit([good, bad_ids, bad_budget])
    assert sorted(o.id for o in refused) == [2, 3] and all(o.error and o.finish_reason == "abort" for o in refused)
    tokens = []
    while loop.has_work:
        for o in loop.step():
            assert o.id == 1 and o.error is None
            tokens += o.token_ids
    (want,) = reference.generate(PROMPT, params, use_tqdm=False)
    assert tokens == want.token_ids
    assert loop.gauges().running == 0 and loop.gauges().kv_cache_usage == 0.0


def test_the_core_log_line_says_what_the_steps_were():
    """The engine core's periodic log line reports the steps of its window from ``Engine.counters()``:
    those with prompt chunks and the decode-only ones, with their mean times, and the prompt tokens
    computed (a server's inter-token latency is these step times)."""
    from modelopt_jax.serve.core import step_mix

    llm = LLM(dtype="float32", max_model_len=128, kv_cache_bytes=1 << 20)
    loop = CoreLoop(llm.engine, llm.model.config.vocab_size)
    before = llm.engine.counters()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    loop.submit([core_request(r, i) for i, r in enumerate(llm.requests([PROMPT, PROMPT + " again"], params))])
    while loop.has_work:
        loop.step()
    after = llm.engine.counters()
    prompt_tokens = sum(len(r.prompt_ids) for r in llm.requests([PROMPT, PROMPT + " again"], params))
    # the second prompt starts with the first: the prefix cache may hold some of its pages
    assert 0 < after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= prompt_tokens
    assert after["steps"] - before["steps"] >= 5 and after["prefill_steps"] > before["prefill_steps"]
    line = step_mix(before, after)
    decode_only = (after["steps"] - before["steps"]) - (after["prefill_steps"] - before["prefill_steps"])
    assert f"{after['steps'] - before['steps']} steps: {after['prefill_steps'] - before['prefill_steps']} with " \
        "prompt chunks" in line and f"{decode_only} decode-only at " in line and " ms" in line, line
    assert step_mix(after, after).startswith(
        "0 steps: 0 with prompt chunks (0 beside decodes) at -, 0 decode-only at -")


def test_served_by_the_core_process_equals_the_in_process_engine(reference):
    proc, url = _start()
    try:
        (core,) = _children(proc.pid)
        with httpx.Client(base_url=url, timeout=120) as c:
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
            got = c.post("/v1/completions", json=body).json()["choices"][0]
            (want,) = reference.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2),
                                         use_tqdm=False)
            assert got["text"] == want.text
            assert np.allclose(got["logprobs"]["token_logprobs"], [e[t] for e, t in zip(want.logprobs, want.token_ids)],
                               atol=1e-5)
            # a stop string is the frontend's: the text is cut there and the engine stops the request
            stop = want.text[5:7]
            got = c.post("/v1/completions", json={**body, "stop": [stop], "logprobs": None}).json()["choices"][0]
            (want_stop,) = reference.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]),
                                              use_tqdm=False)
            assert (got["text"], got["stop_reason"], got["finish_reason"]) == (want_stop.text, stop, "stop")
            # seeded samples: n=2, streamed, one event per generated token
            events = []
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0,
                                                           "seed": 3, "n": 2, "stream": True, "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            per_choice = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i)
                          for i in (0, 1)}
            (want_n,) = reference.generate(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2,
                                                                   ignore_eos=True), use_tqdm=False)
            assert per_choice == {o.index: o.text for o in want_n.outputs}
            assert c.get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _wait_gone(core, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_core_fails_the_open_streams_and_stops_the_server():
    proc, url = _start(max_model_len=512)
    try:
        (core,) = _children(proc.pid)
        lines: list[str] = []
        streaming = threading.Event()

        def stream():
            body = {"prompt": PROMPT, "max_tokens": 470, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(60)
        os.kill(core, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        assert "engine core exited" in json.loads(lines[-2][6:])["error"]["message"]
        assert proc.wait(timeout=30) == 2  # the CLI's status for a ModelOptJaxError
        err = proc.stderr.read()
        assert "EngineCoreError: the engine core exited with status -9; the server stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_frontend_takes_the_core_with_it():
    pattern = os.path.join(socket_base(), "modelopt_jax-core-*")
    before = set(glob.glob(pattern))
    proc, url = _start()
    try:
        (core,) = _children(proc.pid)
        proc.kill()
        proc.wait()
        assert _wait_gone(core, 10), "the engine core outlived its frontend"
        assert set(glob.glob(pattern)) <= before  # its socket directory went with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_core_that_cannot_load_is_a_clear_error(tmp_path):
    """Options only the core can check fail the command with the core's reason, and no process is left."""
    run = subprocess.run([sys.executable, "-m", "modelopt_jax", "serve", "--port", "0", "--quiet", "--dtype",
                          "float32", "--kv-cache-memory-fraction", "7"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode != 0
    assert "engine core could not load" in run.stderr and "kv_cache_memory_fraction" in run.stderr, run.stderr


def _open_streams(url: str, count: int, max_tokens: int,
                  wait_all: bool = True) -> tuple[list[threading.Thread], list[list[str]]]:
    """``count`` streaming completions, returned once each has received its first event (``wait_all``)
    or once the first of them has."""
    logs: list[list[str]] = [[] for _ in range(count)]
    started = [threading.Event() for _ in range(count)]

    def stream(i: int):
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    logs[i].append(line)
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    if wait_all:
        for e in started:
            assert e.wait(60)
    else:
        deadline = time.monotonic() + 60
        while not any(e.is_set() for e in started):
            assert time.monotonic() < deadline, "no stream started"
            time.sleep(0.01)
    return threads, logs


@pytest.mark.parametrize("grace", [0, 60])
def test_sigterm_drains(grace):
    """SIGTERM: running streams may finish within the grace period; past it each open stream ends
    with an error event and [DONE], never a cut connection; the server exits 0 and so does its core."""
    proc, url = _start("--timeout-graceful-shutdown", str(grace), max_model_len=512)
    try:
        (core,) = _children(proc.pid)
        # Without a grace period, stop as soon as one stream runs: waiting for all three let the first
        # ones finish their 470 tokens while a later one waited for its step to compile (Bazel, 2 cores)
        threads, logs = _open_streams(url, 3, 470, wait_all=bool(grace))
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
            assert not t.is_alive()
        for lines in logs:
            assert lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][6:])
            if grace:  # every request had the time to finish
                assert last["choices"][0]["finish_reason"] == "length"
                assert sum(1 for line in lines if '"text"' in line) >= 470
            else:  # cut by the shutdown, or (a stream that never got to run) failed the same way
                assert "shutting down" in last["error"]["message"], last
        assert proc.wait(timeout=120) == 0
        assert _wait_gone(core, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_idle_and_trickling_connections_are_bounded():
    """Connections beyond --limit-concurrency get a 503 (so /health answers rather than the accept
    failing), and connections that send no whole request head are closed at --timeout-request-head."""
    import socket

    proc, url = _start("--limit-concurrency", "6", "--timeout-request-head", "1")
    try:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(6)]
        time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/health").status_code == 503
        t0 = time.monotonic()
        idle[0].sendall(b"GET /health HTTP/1.1\r\n")  # a head that never ends: trickled, one byte at a time
        for _ in range(20):
            try:
                idle[0].sendall(b"X")
            except OSError:
                break
            time.sleep(0.1)
        for s in idle:
            s.settimeout(10)
            try:
                assert s.recv(1024) == b""  # closed by the server
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - t0 < 5
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/health").status_code == 200
    finally:
        proc.kill()
        proc.wait()
