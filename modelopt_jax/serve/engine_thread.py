"""The one thread that owns the :class:`~modelopt_jax.engine.Engine`, and the streams that read it.

The engine is not thread-safe and its steps block (a device call), so one thread runs it: it
takes new requests and aborts from a thread-safe inbox between steps, and after each step hands
every request that got a token a :class:`Delta` on its stream's asyncio queue, through
``loop.call_soon_threadsafe`` (the only way to wake an event loop from another thread). Requests
of every client join the same steps: that is the engine's continuous batching.

Failures never hang a client: a step that raises fails the requests that were in the engine (each
stream raises :class:`EngineFailure`, which the server answers with a 500) and frees their pages,
and the thread goes on serving; if the loop itself dies, or the server stops, every pending and
later request fails the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from modelopt_jax.engine.request import Request

log = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The engine could not finish a request (a failed step, a dead engine thread, a shutdown)."""


@dataclasses.dataclass
class Delta:
    """What one step added to one request of a stream."""

    index: int                          # the request's position in its stream
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int              # generated so far
    cumulative_logprob: float           # of every token generated so far (ranks best_of samples)
    prompt_logprobs: list | None = None  # first delta of a request that asked for them: one entry per
                                        # prompt token ({token: logprob, ...}; None for the first)


class Stream:
    """One HTTP request's engine requests; ``async for delta in stream`` until each has finished."""

    def __init__(self, owner: "EngineThread", requests: list[Request], loop: asyncio.AbstractEventLoop):
        self.owner, self.requests, self.loop = owner, requests, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._sent = [0] * len(requests)   # tokens already handed out, per request (engine thread only)
        self._cumulative = [0.0] * len(requests)  # their summed log-probs (engine thread only)
        self._open = len(requests)

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while self._open:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._open = 0
                raise EngineFailure(f"generation failed: {type(item).__name__}: {item}") from item
            if item.finish_reason is not None:
                self._open -= 1
            yield item

    @property
    def finished(self) -> bool:
        return self._open == 0

    def abort(self) -> None:
        """Drops whatever is unfinished (the client went away); its pages are freed by the engine thread."""
        if self._open:
            self._open = 0
            self.owner.abort(self.requests)

    # -- engine thread side --------------------------------------------------------------------

    def _post(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _delta(self, i: int, r: Request) -> Delta:
        start, self._sent[i] = self._sent[i], len(r.generated)
        self._cumulative[i] += sum(e[t] for e, t in zip(r.logprobs[start:], r.generated[start:]))
        prompt = r.prompt_logprobs_list() if start == 0 else None
        return Delta(index=i, token_ids=r.generated[start:], text=r.detokenizer.take_delta(),
                     logprobs=r.logprobs[start:] if r.params.logprobs is not None else None,
                     finish_reason=r.finish_reason, stop_reason=r.stop_reason, prompt_tokens=len(r.prompt_ids),
                     completion_tokens=len(r.generated), cumulative_logprob=self._cumulative[i],
                     prompt_logprobs=prompt)


class EngineThread:
    """Runs ``engine`` on a thread of its own; :meth:`submit` from an event loop, :meth:`stop` to end."""

    def __init__(self, engine):
        self.engine = engine
        # Requests arrive at any time, so prompt steps meet new shapes long after start-up: their
        # programs compile off-thread while the running streams keep decoding (Engine.step).
        engine.compile_in_background = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[Request, tuple[Stream, int]] = {}   # live requests -> (stream, index in it)
        self._lock = threading.Lock()       # orders submit() against the loop's death
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="modelopt_jax-engine", daemon=True)
        # steps: engine steps run; max_batch: most requests that got a token in one step (proof of batching)
        self.stats = {"steps": 0, "max_batch": 0, "tokens": 0, "failed_steps": 0}

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def stop(self, timeout: float = 30.0) -> None:
        """Fails whatever is still pending and ends the thread."""
        with self._lock:
            if self._dead is None:
                self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, requests: list[Request]) -> Stream:
        """Queues ``requests`` (from the event loop's thread); returns the stream of their deltas."""
        stream = Stream(self, requests, asyncio.get_running_loop())
        with self._lock:
            if self._dead is not None:
                raise EngineFailure(f"the engine is not running ({type(self._dead).__name__}: {self._dead})")
            self._inbox.put(("add", stream))
        return stream

    def abort(self, requests: list[Request]) -> None:
        self._inbox.put(("abort", requests))

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # idle: sleep until something arrives; busy: take what arrived and step again
                items = ([self._inbox.get()] if not self.engine.has_work else []) + self._drain_inbox()
                for kind, payload in items:
                    if kind == "stop":
                        raise EngineFailure("the server is shutting down")
                    if kind == "add":
                        for i, r in enumerate(payload.requests):
                            self._routes[r] = (payload, i)
                            self.engine.add(r)
                    else:
                        self._abort_routed(payload)
                if self.engine.has_work:
                    self._step()
        except BaseException as e:  # noqa: BLE001 -- whatever ended the loop, no client may wait forever
            if not isinstance(e, EngineFailure):
                log.exception("the engine thread died")
            with self._lock:
                self._dead = e
                leftovers = self._drain_inbox()
            self._fail_all(e, [s for kind, s in leftovers if kind == "add"])

    def _drain_inbox(self) -> list[tuple[str, object]]:
        """Everything waiting in the inbox, without blocking."""
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _abort_routed(self, requests: list[Request]) -> None:
        """Aborts those of ``requests`` still routed to a stream (frees their pages)."""
        for r in requests:
            if self._routes.pop(r, None) is not None:
                self.engine.abort(r)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            advanced = self.engine.step()
        except Exception as e:  # a failed step (device error, out of memory): fail its requests, keep serving
            log.exception("engine step failed; failing the %d requests in the engine", len(self._routes))
            self.stats["failed_steps"] += 1
            self._fail_all(e, [])
            return
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(advanced))
        self.stats["tokens"] += len(advanced)
        self.stats["last_step_s"] = time.perf_counter() - t0
        for r in advanced:
            route = self._routes.get(r)
            if route is None:
                continue
            stream, i = route
            if r.finish_reason is not None:
                del self._routes[r]
            try:
                stream._post(stream._delta(i, r))
            except RuntimeError:  # its event loop is closed: nobody reads this stream any more
                self._abort_routed(stream.requests)

    def _fail_all(self, error: BaseException, streams: list[Stream]) -> None:
        failed = {id(s): s for s in streams}
        for r, (stream, _) in list(self._routes.items()):
            failed[id(stream)] = stream
            try:
                self.engine.abort(r)  # frees its pages
            except Exception:  # noqa: BLE001 -- the clients must hear of the failure regardless
                log.exception("could not abort a request after a failure")
        self._routes.clear()
        for stream in failed.values():
            try:
                stream._post(error)
            except RuntimeError:
                pass
