"""Multi-step decode (``EngineConfig.decode_steps``): a decode-only step of a few rows runs several
forwards in one launch, each feeding the token the one before sampled.

Correctness is stated against the one-forward engine on the unquantized float32 checkpoint: the
same tokens, log-probs to float32 summation order (the forwards run inside one program's loop, so
XLA may order a sum differently), seeded samples drawn from the same keys. The kernels' layout runs
on a CPU through the kernels' CPU paths, so its program table is checked here too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine import Engine, EngineConfig
from modelopt_jax.engine.buckets import decode_buckets, token_buckets
from modelopt_jax.engine.step_programs import MULTI_STEP_ROWS
from modelopt_jax.errors import ConfigError
from modelopt_jax.ops.paged_step import AttentionConfig

KERNELS = AttentionConfig(16, decode="fused_kernel", prefill="kernel")


@pytest.fixture(scope="module")
def llm():
    return LLM(str(fixture_dir("qwen2-bytes-bf16")), quantization=None, dtype="float32", max_model_len=256,
               compilation_cache_dir=None, kv_cache_bytes=64 << 20, max_num_seqs=16)


def _engine(llm, attention=None, **config):
    # one forward a launch unless a test asks for more (the reference the multi-step runs are held to)
    defaults = dict(max_num_seqs=16, max_num_batched_tokens=128, kv_cache_bytes=64 << 20, precompile_samplers=(),
                    decode_steps=1)
    return Engine(llm.model, max_model_len=llm.max_model_len, pad_id=llm.engine.runner.pad_id,
                  config=EngineConfig(**{**defaults, **config}), attention=attention)


def _run(llm, engine, prompts, params):
    original = llm.engine
    llm.engine = engine
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine = original
    engine.pool.check()
    assert engine.pool.free == engine.pool.num_pages - 1, "a page is still held"
    return outputs, dict(engine.last_stats)


def _assert_same(got, want, atol=1e-4):
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
        if b.logprobs is not None:
            assert [e.keys() for e in a.logprobs] == [e.keys() for e in b.logprobs]
            for ea, eb in zip(a.logprobs, b.logprobs):
                np.testing.assert_allclose(list(ea.values()), list(eb.values()), atol=atol)
        np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, atol=atol * max(len(b.token_ids), 1))


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(rng.integers(3, 60))).tolist() for _ in range(n)]


def test_multi_step_greedy_equals_one_forward_a_launch(llm):
    """Budgets that are not multiples of the forwards a launch runs (the tail runs one forward a
    launch), a stop token that comes in the middle of a launch (the tokens after it are dropped) and
    log-probs: the same outputs as one forward a launch, and every page back afterwards."""
    prompts = _prompts(5, 0)
    budgets = [21, 15, 30, 13, 18]
    plain_params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in budgets]
    plain, _ = _run(llm, _engine(llm), prompts, plain_params)
    # stop tokens the requests really sample, at positions inside a 4-forward launch
    params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2,
                             stop_token_ids=[] if i % 2 else [o.token_ids[9]])
              for i, (m, o) in enumerate(zip(budgets, plain))]
    want, one = _run(llm, _engine(llm), prompts, params)
    got, multi = _run(llm, _engine(llm, decode_steps=4), prompts, params)
    _assert_same(got, want)
    assert {o.finish_reason for o in got} == {"stop", "length"}
    assert one["multi_step_launches"] == 0 and multi["multi_step_launches"] > 0, multi
    # every forward counts as a step; the launches that ran four of them cut the host's cycles
    assert multi["steps"] == one["steps"], (multi, one)


def test_multi_step_seeded_sampling_draws_what_one_forward_draws(llm):
    """A row's token i is drawn from its request's key folded with i, whichever forward of a launch
    draws it: seeded samples equal one forward a launch's, alone and in a batch."""
    prompts = _prompts(4, 1)
    params = [SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want, _ = _run(llm, _engine(llm), prompts, params)
    got, stats = _run(llm, _engine(llm, decode_steps=3), prompts, params)
    assert stats["multi_step_launches"] > 0
    _assert_same(got, want)
    alone, _ = _run(llm, _engine(llm, decode_steps=3), prompts[2:3], params[2:3])
    assert alone[0].token_ids == want[2].token_ids


def test_multi_step_waits_for_few_rows_and_an_empty_queue(llm):
    """More decode rows than MULTI_STEP_ROWS, or a request waiting to be admitted, run one forward a
    launch (a waiting prompt would otherwise wait several forwards): here the first steps hold more
    rows than that, and multi-step launches start once the rows that finish early leave."""
    n = MULTI_STEP_ROWS + 4
    prompts = _prompts(n, 2)
    params = [SamplingParams(max_tokens=3 if i < 6 else 17, ignore_eos=True) for i in range(n)]
    engine = _engine(llm, decode_steps=4)
    launches = []
    real_launch = engine.runner.launch

    def launch(batch, steps=1):
        launches.append((len(batch), steps, len(engine._scheduler.waiting)))
        return real_launch(batch, steps)

    engine.runner.launch = launch
    got, stats = _run(llm, engine, prompts, params)
    want, _ = _run(llm, _engine(llm), prompts, params)
    _assert_same(got, want)
    assert any(steps > 1 for _, steps, _ in launches)
    for rows, steps, waiting in launches:
        assert steps == 1 or (rows <= MULTI_STEP_ROWS and waiting == 0), launches


def test_multi_step_in_the_step_wise_engine(llm):
    """A server's loop: requests arrive while others run and one is aborted; each request's tokens are
    reported once, in order, and equal what it generates alone."""
    prompts = _prompts(4, 3)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 9, 18, 6)]
    alone = [_run(llm, _engine(llm), [p], [q])[0][0].token_ids for p, q in zip(prompts, params)]
    engine = _engine(llm, decode_steps=4)
    requests = [llm.requests(p, q)[0] for p, q in zip(prompts, params)]
    seen = {id(r): 0 for r in requests}
    arrivals, victim, steps = list(requests), requests[1], 0
    while arrivals or engine.has_work:
        if arrivals and steps % 4 == 0:
            engine.add(arrivals.pop(0))
        if victim.finish_reason is None and len(victim.generated) >= 4:
            engine.abort(victim)
        for r in engine.step() if engine.has_work else []:
            assert len(r.generated) > seen[id(r)]
            seen[id(r)] = len(r.generated)
        steps += 1
    assert victim.finish_reason == "abort" and victim.generated == alone[1][:len(victim.generated)]
    for r, want in zip(requests, alone):
        if r is not victim:
            assert r.finish_reason == "length" and r.generated == want
    engine.pool.check()
    assert engine.pool.free == engine.pool.num_pages - 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU these attention paths are the CUDA kernels, "
                    "which round float32 to bf16 (tests/test_engine_gpu.py runs them)")
def test_multi_step_programs_join_the_table_where_kernels_run(llm):
    """Where the kernels run (here through their CPU paths), the table compiled at start-up holds a
    multi-step decode program per small decode bucket, and a run compiles nothing in line."""
    engine = _engine(llm, KERNELS, precompile_samplers=("greedy",), decode_steps=4)
    table = engine.runner.program_table(128)
    multi = [p for p in table if p.decode_steps > 1]
    assert [p.shape.decode_rows for p in multi] == [d for d in decode_buckets(16) if d <= MULTI_STEP_ROWS]
    assert all(p.decode_steps == 4 and not p.shape.cascade for p in multi)
    assert len(table) == len(decode_buckets(16)) + len(token_buckets(128)) + len(multi)
    prompts = _prompts(3, 4)
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * 3
    got, stats = _run(llm, engine, prompts, params)
    want, _ = _run(llm, _engine(llm, KERNELS), prompts, params)
    _assert_same(got, want, atol=1e-3)
    assert stats["inline_compiles"] == 0 and stats["multi_step_launches"] > 0, stats
    assert engine.runner.shapes <= set(table)


@pytest.mark.parametrize("value", [0, 65, 2.0, True])
def test_bad_decode_steps_are_typed_errors(value):
    with pytest.raises(ConfigError, match="decode_steps=.* must be an integer from 1 to 64"):
        EngineConfig(decode_steps=value)


def test_a_launch_of_several_forwards_refuses_prompt_rows(llm):
    engine = _engine(llm)
    request = llm.requests([1, 2, 3, 4], SamplingParams(max_tokens=4))[0]
    with pytest.raises(ValueError, match="runs at most .* decode rows"):
        engine.runner.launch([(request, 4)], steps=2)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS host device count, tests/conftest.py)")
def test_multi_step_under_tensor_parallelism():
    """The forwards' loop runs the sharded model (pages split by KV head, the collectives inside the
    loop): TP = 2 with four forwards a launch gives TP = 1's one-forward tokens (float32, unquantized:
    no FP8 rounding near-ties for the two summation orders to split)."""
    outputs = {}
    for tp, steps in ((1, 1), (2, 4)):
        llm = LLM(str(fixture_dir("qwen2-bytes-bf16")), quantization=None, dtype="float32", max_model_len=128,
                  compilation_cache_dir=None, tensor_parallel_size=tp, kv_cache_bytes=32 << 20)
        engine = Engine(llm.model, max_model_len=llm.max_model_len, pad_id=llm.engine.runner.pad_id,
                        config=EngineConfig(kv_cache_bytes=32 << 20, precompile_samplers=(), decode_steps=steps))
        got, stats = _run(llm, engine, [[5, 6, 7, 8, 9], [20, 21, 22]], [SamplingParams(max_tokens=12, ignore_eos=True)] * 2)
        assert (stats["multi_step_launches"] > 0) == (steps > 1)
        outputs[tp] = [o.token_ids for o in got]
    assert outputs[2] == outputs[1]
