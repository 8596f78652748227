"""The engine core's work, apart from how messages reach it: requests in, one engine step, outputs out.

Used by the engine-core process (:mod:`.core`, messages over ZeroMQ) and by the in-process
engine thread (:mod:`.engine_thread`, messages through a queue), so both run the same code.
It never decodes text: stop strings are the frontend's (it aborts what they end).

A request that does not check out (the frontend is trusted to validate, but the core checks the
bounds a step depends on again) fails alone with an error output; a step that raises fails the
requests that were in the engine and frees their pages, and the loop goes on.
"""

from __future__ import annotations

import logging

import numpy as np

from modelopt_jax.engine.request import Request
from modelopt_jax.errors import ModelOptJaxError
from modelopt_jax.sampling import SamplingParams
from modelopt_jax.serve.core_protocol import CoreRequest, EngineGauges, TokenOutput

log = logging.getLogger(__name__)


class CoreLoop:
    """Owns ``engine`` (a :class:`~modelopt_jax.engine.Engine`): ``vocab_size`` and the engine's
    ``max_model_len`` bound what a request may hold."""

    def __init__(self, engine, vocab_size: int):
        self.engine, self.vocab_size = engine, int(vocab_size)
        # Requests arrive at any time, so prompt steps meet new shapes long after start-up: their
        # programs compile off-thread while the running requests keep decoding (Engine.step).
        engine.compile_in_background = True
        # Streams see every token as its forward ends: no multi-step launches (EngineConfig.decode_steps).
        engine.multi_step = False
        self._live: dict[int, Request] = {}     # id -> request in the engine
        self._ids: dict[Request, int] = {}      # and back
        self._reported: dict[int, int] = {}     # id -> tokens already reported
        # steps: engine steps run; max_batch: most requests that got a token in one step (proof of batching)
        self.stats = {"steps": 0, "max_batch": 0, "tokens": 0, "failed_steps": 0}

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def submit(self, requests: list[CoreRequest]) -> list[TokenOutput]:
        """Queues ``requests``; returns an error output for each that is refused."""
        refused = []
        for cr in requests:
            try:
                request = self._request(cr)
            except (ModelOptJaxError, ValueError, TypeError) as e:
                refused.append(_failed(cr.id, f"request refused by the engine core: {e}"))
                continue
            self._live[cr.id], self._ids[request] = request, cr.id
            self._reported[cr.id] = 0
            self.engine.add(request)
        return refused

    def _request(self, cr: CoreRequest) -> Request:
        params = SamplingParams(**cr.params)
        if not cr.prompt_ids or len(cr.prompt_ids) >= self.engine.max_model_len:
            raise ValueError(f"{len(cr.prompt_ids)} prompt tokens for max_model_len={self.engine.max_model_len}")
        if min(cr.prompt_ids) < 0 or max(cr.prompt_ids) >= self.vocab_size or \
                any(not 0 <= t < self.vocab_size for t in cr.stop_ids):
            raise ValueError(f"token ids outside [0, {self.vocab_size})")
        if not 0 <= cr.budget <= self.engine.max_model_len - len(cr.prompt_ids):
            raise ValueError(f"budget {cr.budget} beyond max_model_len={self.engine.max_model_len}")
        if len(cr.row_key) != 2 or any(not 0 <= k < 2 ** 32 for k in cr.row_key):
            raise ValueError("row_key must be two uint32")
        return Request(index=cr.id, prompt=None, prompt_ids=list(cr.prompt_ids), params=params,
                       stop_ids=frozenset(cr.stop_ids), budget=cr.budget, row_key=np.asarray(cr.row_key, np.uint32),
                       sample_index=cr.sample_index)

    def abort(self, ids: list[int]) -> None:
        for request_id in ids:
            request = self._live.pop(request_id, None)
            if request is not None:
                del self._ids[request], self._reported[request_id]
                self.engine.abort(request)  # frees its pages

    def step(self) -> list[TokenOutput]:
        """One engine step; the outputs of every live request that got a token."""
        try:
            advanced = self.engine.step()
        except Exception as e:  # a failed step (device error, out of memory): fail its requests, keep serving
            log.exception("engine step failed; failing the %d requests in the engine", len(self._live))
            self.stats["failed_steps"] += 1
            return self.fail_all(f"generation failed: {type(e).__name__}: {e}")
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(advanced))
        self.stats["tokens"] += len(advanced)
        outputs = []
        for r in advanced:
            request_id = self._ids.get(r)
            if request_id is not None:
                outputs.append(self._output(request_id, r))
        return outputs

    def _output(self, request_id: int, r: Request) -> TokenOutput:
        start = self._reported[request_id]
        self._reported[request_id] = len(r.generated)
        new = r.generated[start:]
        entries = r.logprobs[start:]
        out = TokenOutput(id=request_id, token_ids=new, chosen_logprobs=[e[t] for e, t in zip(entries, new)],
                          logprobs=entries if r.params.logprobs is not None else None,
                          finish_reason=r.finish_reason, stop_reason=r.stop_reason if isinstance(r.stop_reason, int)
                          else None, prompt_logprobs=r.prompt_logprobs_list() if start == 0 else None)
        if r.finish_reason is not None:
            del self._live[request_id], self._ids[r], self._reported[request_id]
        return out

    def fail_all(self, reason: str) -> list[TokenOutput]:
        """Aborts every live request (frees its pages); an error output for each."""
        outputs = [_failed(request_id, reason) for request_id in self._live]
        for request in list(self._live.values()):
            try:
                self.engine.abort(request)
            except Exception:  # noqa: BLE001 -- the clients must hear of the failure regardless
                log.exception("could not abort a request after a failure")
        self._live.clear(), self._ids.clear(), self._reported.clear()
        return outputs

    def gauges(self) -> EngineGauges:
        return EngineGauges(**self.engine.gauges())


def _failed(request_id: int, reason: str) -> TokenOutput:
    return TokenOutput(id=request_id, token_ids=[], chosen_logprobs=[], logprobs=None, finish_reason="abort",
                       stop_reason=None, error=reason)
