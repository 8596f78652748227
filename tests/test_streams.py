"""The frontend's streams (``serve/streams.py``) without a server: how engine outputs reach a stream
and in what groups a streaming response takes them.

A stream whose reader fell behind (its event loop busy with other streams) takes every output queued
so far in one wake-up, so the response writes them together; outputs before a failure still reach
the client, then the failure is raised; a step's outputs reach an event loop in one callback.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("msgspec")

from modelopt_jax.engine.request import Request  # noqa: E402
from modelopt_jax.sampling import SamplingParams  # noqa: E402
from modelopt_jax.serve.core_protocol import TokenOutput  # noqa: E402
from modelopt_jax.serve.streams import EngineFailure, StreamRouter  # noqa: E402


def _request(index: int) -> Request:
    return Request(index=index, prompt=None, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8),
                   stop_ids=frozenset(), budget=8, row_key=np.asarray([1, index], np.uint32))


def _output(request_id: int, token: int, finish: str | None = None, error: str | None = None) -> TokenOutput:
    return TokenOutput(id=request_id, token_ids=[] if error else [token], chosen_logprobs=[] if error else [-0.5],
                       logprobs=None, finish_reason=finish, stop_reason=None, error=error)


def _open(router: StreamRouter, n: int):
    stream, core = router.open([_request(i) for i in range(n)])
    return stream, [c.id for c in core]


def test_a_reader_that_fell_behind_takes_every_queued_output_in_one_batch():
    async def main():
        router = StreamRouter(None, lambda ids: None)
        stream, (a, b) = _open(router, 2)
        router.deliver([_output(a, 11), _output(b, 21)])  # one step: one callback for both
        router.deliver([_output(a, 12)])
        router.deliver([_output(a, 13, "length"), _output(b, 22, "length")])
        await asyncio.sleep(0)  # the three callbacks run before the reader looks
        batches = [[(d.index, d.token_ids, d.finish_reason) for d in batch] async for batch in stream.batches()]
        return batches, stream.finished, len(router)

    batches, finished, routes = asyncio.run(main())
    assert batches == [[(0, [11], None), (1, [21], None), (0, [12], None), (0, [13], "length"), (1, [22], "length")]]
    assert finished and routes == 0


def test_a_reader_that_keeps_up_takes_one_output_per_step():
    async def main():
        router = StreamRouter(None, lambda ids: None)
        stream, (a,) = _open(router, 1)
        seen = []

        async def read():
            async for batch in stream.batches():
                seen.append([d.token_ids for d in batch])

        reader = asyncio.ensure_future(read())
        for k in range(3):
            await asyncio.sleep(0)
            router.deliver([_output(a, 30 + k, "length" if k == 2 else None)])
            await asyncio.sleep(0.01)
        await reader
        return seen

    assert asyncio.run(main()) == [[[30]], [[31]], [[32]]]


def test_outputs_before_a_failure_reach_the_reader_then_it_raises():
    async def main():
        aborted = []
        router = StreamRouter(None, aborted.extend)
        stream, (a, b) = _open(router, 2)
        router.deliver([_output(a, 11), _output(b, 21)])
        router.deliver([_output(a, 0, error="generation failed: boom")])
        await asyncio.sleep(0)
        got = []
        with pytest.raises(EngineFailure, match="boom"):
            async for batch in stream.batches():
                got.append([(d.index, d.token_ids) for d in batch])
        return got, stream.finished, aborted

    got, finished, aborted = asyncio.run(main())
    assert got == [[(0, [11]), (1, [21])]]
    assert finished  # the stream is closed: the other sequence was aborted in the engine
    assert aborted == [2]


def test_per_delta_iteration_still_gives_each_delta_in_order():
    async def main():
        router = StreamRouter(None, lambda ids: None)
        stream, (a,) = _open(router, 1)
        router.deliver([_output(a, 1)])
        router.deliver([_output(a, 2)])
        router.deliver([_output(a, 3, "length")])
        await asyncio.sleep(0)
        return [d.token_ids async for d in stream]

    assert asyncio.run(main()) == [[1], [2], [3]]
