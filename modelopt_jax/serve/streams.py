"""The frontend's side of generation: per-HTTP-request streams of token deltas, and the router that
hands each engine output to its stream.

Whatever runs the engine (the in-process :class:`~.engine_thread.EngineThread` or the engine-core
process behind :class:`~.core_client.CoreClient`) reports token ids, log-probs and finish flags
only (:class:`~.core_protocol.TokenOutput`). Text is made here, on the event loop's side: each
sequence has its own :class:`~modelopt_jax.detokenizer.IncrementalDetokenizer`, which also decides
stop strings, and a sequence a stop string ends is aborted in the engine (it may have sampled a
token or two more meanwhile; those are dropped, as the text is cut at the stop string anyway).
So the engine's loop never decodes text, and both engines give a client the same bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading

from modelopt_jax.detokenizer import IncrementalDetokenizer
from modelopt_jax.engine.request import Request
from modelopt_jax.serve.core_protocol import CoreRequest, TokenOutput


class EngineFailure(RuntimeError):
    """The engine could not finish a request (a failed step, a dead engine, a shutdown)."""


@dataclasses.dataclass
class Delta:
    """What one step added to one sequence of a stream."""

    index: int                          # the sequence's position in its stream
    token_ids: list[int]
    text: str                           # may be empty (an incomplete character, text held back for a stop string)
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int              # generated so far
    cumulative_logprob: float           # of every token generated so far (ranks best_of samples)
    prompt_logprobs: list | None = None  # first delta of a sequence that asked for them: one entry per
                                        # prompt token ({token: logprob, ...}; None for the first)


def core_request(request: Request, request_id: int) -> CoreRequest:
    """``request`` (built and checked by the frontend's PromptProcessor) as the engine core takes it."""
    params = {f.name: getattr(request.params, f.name) for f in dataclasses.fields(request.params)}
    params["stop"] = list(params["stop"]) if not isinstance(params["stop"], str) else [params["stop"]]
    params["stop_token_ids"] = list(params["stop_token_ids"])
    return CoreRequest(id=request_id, prompt_ids=list(request.prompt_ids), params=params,
                       stop_ids=sorted(request.stop_ids), budget=request.budget,
                       row_key=[int(k) for k in request.row_key], sample_index=request.sample_index)


@dataclasses.dataclass
class _Sequence:
    """The frontend's record of one engine request of a stream."""

    prompt_tokens: int
    detokenizer: IncrementalDetokenizer | None
    generated: int = 0                  # tokens handed to the client
    cumulative_logprob: float = 0.0
    finished: bool = False


class Stream:
    """One HTTP request's engine requests; ``async for delta in stream`` until each has finished."""

    def __init__(self, router: "StreamRouter", requests: list[Request], ids: list[int], tokenizer,
                 loop: asyncio.AbstractEventLoop):
        self.router, self.requests, self.ids, self.loop = router, requests, ids, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._sequences = [_Sequence(len(r.prompt_ids), None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, stop=r.params.stop, include_stop_str_in_output=r.params.include_stop_str_in_output))
            for r in requests]
        self._open = len(requests)

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        async for deltas in self.batches():
            for delta in deltas:
                yield delta

    async def batches(self):
        """The deltas as lists: each wake-up takes every output already queued, so a reader that
        fell behind (the event loop busy with other streams) catches up in one go -- a streaming
        response then sends them in one write rather than one per token."""
        while self._open:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            deltas = []
            for item in items:
                if not self._open:
                    break
                try:
                    if isinstance(item, BaseException):
                        self._close()
                        raise EngineFailure(str(item)) from item
                    delta = self._delta(*item)
                except EngineFailure:
                    if deltas:  # what came before the failure still reaches the client
                        yield deltas
                    raise
                if delta is not None:
                    deltas.append(delta)
            if deltas:
                yield deltas

    @property
    def finished(self) -> bool:
        return self._open == 0

    def abort(self) -> None:
        """Drops whatever is unfinished (the client went away); the engine frees its pages."""
        if self._open:
            self._close()

    def _close(self) -> None:
        self._open = 0
        live = [i for i, s in zip(self.ids, self._sequences) if not s.finished]
        for s in self._sequences:
            s.finished = True
        self.router.abort(live)

    def _delta(self, i: int, out: TokenOutput) -> Delta | None:
        seq = self._sequences[i]
        if seq.finished:
            return None  # a token sampled before the engine heard of this sequence's stop string
        if out.error is not None:
            self._close()
            raise EngineFailure(out.error)
        tokens, chosen, logprobs = out.token_ids, out.chosen_logprobs, out.logprobs
        finish, stop_reason = out.finish_reason, out.stop_reason
        detok = seq.detokenizer
        if detok is not None:
            for k, token in enumerate(tokens):
                if detok.add(token):
                    last = k == len(tokens) - 1
                    if not (last and finish == "stop"):  # a stop token in the same token names itself
                        finish, stop_reason = "stop", detok.stop_reason
                    tokens, chosen = tokens[:k + 1], chosen[:k + 1]
                    logprobs = None if logprobs is None else logprobs[:k + 1]
                    if not last or out.finish_reason is None:
                        self.router.abort([self.ids[i]])  # the engine would go on: stop it
                    break
            if finish is not None:
                detok.finish()
        seq.generated += len(tokens)
        seq.cumulative_logprob += float(sum(chosen))
        if finish is not None:
            seq.finished = True
            self._open -= 1
        return Delta(index=i, token_ids=list(tokens), text=detok.take_delta() if detok is not None else "",
                     logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason,
                     prompt_tokens=seq.prompt_tokens, completion_tokens=seq.generated,
                     cumulative_logprob=seq.cumulative_logprob, prompt_logprobs=out.prompt_logprobs)


class StreamRouter:
    """Request ids -> streams. :meth:`open` on the event loop; :meth:`deliver` and :meth:`fail_all`
    from whichever thread reads the engine; ``send_abort(ids)`` tells the engine to drop requests."""

    def __init__(self, tokenizer, send_abort):
        self.tokenizer, self._send_abort = tokenizer, send_abort
        self._ids = itertools.count(1)
        self._routes: dict[int, tuple[Stream, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._routes)

    def open(self, requests: list[Request]) -> tuple[Stream, list[CoreRequest]]:
        """A stream for ``requests`` and their engine form (to submit)."""
        ids = [next(self._ids) for _ in requests]
        stream = Stream(self, requests, ids, self.tokenizer, asyncio.get_running_loop())
        with self._lock:
            for index, request_id in enumerate(ids):
                self._routes[request_id] = (stream, index)
        return stream, [core_request(r, i) for r, i in zip(requests, ids)]

    def abort(self, ids: list[int]) -> None:
        with self._lock:
            live = [i for i in ids if self._routes.pop(i, None) is not None]
        if live:
            self._send_abort(live)

    def deliver(self, outputs: list[TokenOutput]) -> None:
        """Hands each output to its stream (outputs of forgotten requests are dropped).

        One step's outputs reach each event loop in one callback: a wake-up per token per stream
        would cost the reading thread a self-pipe write and the loop a callback each, hundreds per
        step under load."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, tuple[int, TokenOutput]]]] = {}
        with self._lock:
            for out in outputs:
                route = self._routes.get(out.id)
                if route is None:
                    continue
                if out.finish_reason is not None or out.error is not None:
                    del self._routes[out.id]
                stream, index = route
                by_loop.setdefault(stream.loop, []).append((stream, (index, out)))
        for loop, items in by_loop.items():
            _post_many(loop, items)

    def fail_all(self, error: BaseException) -> None:
        """Every open stream raises ``error`` (the engine is gone or failed)."""
        with self._lock:
            streams = {id(s): s for s, _ in self._routes.values()}
            self._routes.clear()
        for stream in streams.values():
            _post(stream, error)


def _post(stream: Stream, item) -> None:
    _post_many(stream.loop, [(stream, item)])


def _post_many(loop: asyncio.AbstractEventLoop, items: list[tuple[Stream, object]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody reads these streams any more
        pass


def _put_all(items: list[tuple[Stream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
