"""The engine on a thread of the server's own process (``build_app(llm)``: tests, embedding).

``python -m modelopt_jax serve`` runs the engine in a process of its own instead
(:mod:`.core_client`), so that HTTP and text work never hold up a step; both run the same
:class:`~.core_loop.CoreLoop` and hand the frontend the same outputs through a
:class:`~.streams.StreamRouter`.

The engine is not thread-safe and its steps block (a device call), so one thread runs it: it
takes submissions and aborts from a thread-safe inbox between steps, and after each step hands
the outputs to the router (which wakes each stream's event loop). Failures never hang a client:
a step that raises fails the requests that were in the engine and the thread goes on serving;
if the loop itself dies, or the server stops, every pending and later request fails.
"""

from __future__ import annotations

import logging
import queue
import threading

from modelopt_jax.engine.request import Request
from modelopt_jax.serve.core_loop import CoreLoop
from modelopt_jax.serve.core_protocol import EngineGauges
from modelopt_jax.serve.streams import EngineFailure, Stream, StreamRouter

log = logging.getLogger(__name__)


class EngineThread:
    """Runs ``engine`` on a thread of its own; :meth:`submit` from an event loop, :meth:`stop` to end."""

    def __init__(self, engine, *, tokenizer, vocab_size: int):
        self.core = CoreLoop(engine, vocab_size)
        self.router = StreamRouter(tokenizer, self._abort)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()       # orders submit() against the loop's death
        self._dead: BaseException | None = None
        self.gauges: EngineGauges | None = None  # after the last step
        self._thread = threading.Thread(target=self._run, name="modelopt_jax-engine", daemon=True)

    @property
    def stats(self) -> dict:
        return self.core.stats

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
        with self._lock:
            if self._dead is not None:
                raise EngineFailure(f"the engine is not running ({type(self._dead).__name__}: {self._dead})")
            stream, core_requests = self.router.open(requests)
            self._inbox.put(("submit", core_requests))
        return stream

    def _abort(self, ids: list[int]) -> None:
        self._inbox.put(("abort", ids))

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                # idle: sleep until something arrives; busy: take what arrived and step again
                items = ([self._inbox.get()] if not self.core.has_work else []) + self._drain_inbox()
                for kind, payload in items:
                    if kind == "stop":
                        raise EngineFailure("the server is shutting down")
                    if kind == "submit":
                        self.router.deliver(self.core.submit(payload))
                    else:
                        self.core.abort(payload)
                if self.core.has_work:
                    self.router.deliver(self.core.step())
                    self.gauges = self.core.gauges()
        except BaseException as e:  # noqa: BLE001 -- whatever ended the loop, no client may wait forever
            if not isinstance(e, EngineFailure):
                log.exception("the engine thread died")
            with self._lock:
                self._dead = e
                self._drain_inbox()
            self.core.fail_all(str(e))
            self.router.fail_all(e)

    def _drain_inbox(self) -> list[tuple[str, object]]:
        """Everything waiting in the inbox, without blocking."""
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items
