"""Engine v2 at the LLM surface: automatic prefix caching, n > 1 samples on shared pages, and steps
that mix decode rows with prompt chunks under a token budget.

What "correct" means here does not come from the engine's own code: prefix caching off (every
prompt computed), each request generated alone, and the page pool's own invariants
(``PagePool.check``). float32 throughout on the unquantized bf16 fixture, so "equal" is the same
tokens with log-probs equal to float32 summation order.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine.pages import PagePool, page_keys
from modelopt_jax.engine.request import Request
from modelopt_jax.engine.scheduler import Scheduler

PAGE = 16


def _llm(name="qwen2-bytes-bf16", **kw):
    path = fixture_dir(name) if name != "demo" else modelopt_jax.demo_checkpoint_path()
    return LLM(str(path), quantization=None, dtype="float32", max_model_len=kw.pop("max_model_len", 256),
               compilation_cache_dir=None, **kw)


def _assert_same(got, want, atol=1e-4):
    for a, b in zip(got, want, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for ea, eb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert ea.keys() == eb.keys()
                np.testing.assert_allclose(list(ea.values()), list(eb.values()), atol=atol)


def _no_leak(llm):
    pool = llm.engine.pool
    pool.check()
    assert pool.held == 0, "a finished run left pages held"
    assert llm.last_stats["free_pages_after"] == pool.num_pages - 1


def _prefix_workload(vocab, seed=0):
    """Prompts that share prefixes in every way the page keys must get right."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, vocab, n).tolist()  # noqa: E731
    system = tok(40)                    # a shared "system prompt": 2 full pages and 8 tokens
    at_boundary = tok(32)               # exactly 2 pages
    base = tok(37)
    return [
        system + tok(5), system + tok(12), system + tok(30),           # shared system prompt, distinct tails
        at_boundary + tok(9), at_boundary + tok(16),                   # diverge at a page boundary
        base[:20] + tok(10), base[:25] + tok(3),                       # diverge inside the second page
        base, list(base),                                              # identical prompts
        base[:33], base[:16], base[:17],                               # prefixes of another (one exactly a page)
    ]


@pytest.fixture(scope="module")
def cached_and_plain():
    return _llm(), _llm(enable_prefix_caching=False)


@pytest.mark.parametrize("name", ["demo", "qwen2-bytes-bf16"])
def test_prefix_caching_changes_no_output(name, cached_and_plain):
    """Greedy outputs and log-probs with prefix caching equal those without, on the first run (pages
    shared between requests of one batch) and again (pages kept from the run before)."""
    cached, plain = cached_and_plain if name == "qwen2-bytes-bf16" else (_llm(name), _llm(name, enable_prefix_caching=False))
    prompts = _prefix_workload(cached.model.config.vocab_size)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert plain.last_stats["prefix_cache_hit_tokens"] == 0
    assert plain.last_stats["prefill_tokens_computed"] == sum(map(len, prompts))
    first = cached.generate(prompts, params, use_tqdm=False)
    _assert_same(first, want)
    stats = cached.last_stats
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefill_tokens_computed"] + stats["prefix_cache_hit_tokens"] == sum(map(len, prompts))
    _no_leak(cached)
    assert cached.engine.pool.cached > 0  # the finished requests' full pages stay
    again = cached.generate(prompts, params, use_tqdm=False)
    _assert_same(again, want)
    stats = cached.last_stats
    # every prompt finds all its full pages but the one holding its last token
    assert stats["prefix_cache_hit_tokens"] == sum((len(p) - 1) // PAGE * PAGE for p in prompts)
    _no_leak(cached)


def test_cached_pages_survive_and_are_evicted_under_pressure(cached_and_plain):
    """A small pool keeps a finished prompt's pages; other prompts that need the room evict them
    (least recently released first) and a later run of the first prompt still gives its output."""
    page_bytes = cached_and_plain[0].model.kv_cache.page_bytes(PAGE)
    llm = _llm(max_model_len=128, kv_cache_bytes=12 * page_bytes, max_num_batched_tokens=64)
    assert llm.engine.pool.num_pages == 12
    pool = llm.engine.pool
    rng = np.random.default_rng(3)
    vocab = llm.model.config.vocab_size
    first = rng.integers(1, vocab, 50).tolist()  # 3 full pages + 2 tokens
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)
    want = llm.generate(first, params, use_tqdm=False)
    assert pool.cached == 3 + 0 and llm.last_stats["prefix_cache_evictions"] == 0  # generated tokens end mid-page
    llm.generate(first, params, use_tqdm=False)
    assert llm.last_stats["prefix_cache_hit_tokens"] == 48
    others = [rng.integers(1, vocab, 60).tolist() for _ in range(3)]
    llm.generate(others, params, use_tqdm=False)
    assert llm.last_stats["prefix_cache_evictions"] > 0
    _no_leak(llm)
    again = llm.generate(first, params, use_tqdm=False)
    assert llm.last_stats["prefix_cache_hit_tokens"] < 48  # (some of) its pages went
    _assert_same(again, want)
    _no_leak(llm)


def test_n_samples_share_the_prompt_and_keep_their_streams(cached_and_plain):
    """n=4 greedy: four equal completions from one computed prompt (the other three share its full
    pages and compute only its last partial page). n=4 seeded: the same four completions alone as
    in a batch, and they differ from each other."""
    llm, plain = cached_and_plain
    rng = np.random.default_rng(5)
    vocab = llm.model.config.vocab_size
    length = 45
    prompt = rng.integers(1, vocab, length).tolist()
    llm.generate(rng.integers(1, vocab, 7).tolist(), SamplingParams(max_tokens=1), use_tqdm=False)  # no cache hit below
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == out.outputs[0].token_ids for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == "length"  # aliases of outputs[0]
    tail = length - (length - 1) // PAGE * PAGE
    assert llm.last_stats["prefill_tokens_computed"] == length + 3 * tail
    alone_plain = plain.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1), use_tqdm=False)
    _assert_same([type(out)(out.prompt, out.prompt_token_ids, out.outputs[:1], None)], alone_plain)
    _no_leak(llm)

    seeded = SamplingParams(n=4, max_tokens=16, temperature=0.9, seed=11, ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0]
    others = [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(3, 60, 5)]
    batch = llm.generate(others[:2] + [prompt] + others[2:], [SamplingParams(max_tokens=9)] * 2 + [seeded]
                         + [SamplingParams(max_tokens=9, temperature=1.0)] * 3, use_tqdm=False)
    assert [c.token_ids for c in batch[2].outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    _no_leak(llm)


def test_best_of_keeps_the_n_most_likely_samples(cached_and_plain):
    llm, _ = cached_and_plain
    prompt = list(range(3, 40))
    out = llm.generate(prompt, SamplingParams(n=2, best_of=5, max_tokens=8, temperature=1.0, seed=3), use_tqdm=False)[0]
    every = llm.generate(prompt, SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=3), use_tqdm=False)[0]
    best = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.index for c in out.outputs] == [0, 1]


@pytest.mark.parametrize("kw,match", [
    (dict(n=0), r"n must be in \[1, 1024\], got 0"), (dict(n=2, best_of=1), "best_of=1 must be >= n=2"),
    (dict(n=1.5), "n must be an integer, got 1.5"),
])
def test_bad_n_is_a_clear_error(kw, match):
    from modelopt_jax.errors import ModelOptJaxError

    with pytest.raises(ModelOptJaxError, match=match):
        SamplingParams(**kw)


def test_mixed_steps_give_each_row_what_it_gets_alone(cached_and_plain):
    """With a small token budget, prompts arrive in chunks while earlier requests decode: steps mix
    both kinds of row, and every request's tokens and log-probs equal its solo run's."""
    _, plain = cached_and_plain
    llm = _llm(enable_prefix_caching=False, max_num_batched_tokens=40, max_num_seqs=4)
    rng = np.random.default_rng(8)
    vocab = llm.model.config.vocab_size
    prompts = [rng.integers(1, vocab, int(n)).tolist() for n in (5, 70, 12, 33, 51, 3, 90)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, logprobs=2) for m in (20, 6, 15, 9, 4, 18, 7)]
    budgets = []
    scheduler = llm.engine._scheduler
    schedule = scheduler.schedule

    def recording(*a, **kw):
        batch = schedule(*a, **kw)
        if batch:
            decodes = sum(1 for r, n in batch if n == 1 and r.computed >= len(r.prompt_ids))
            prompt_tokens = sum(n for r, n in batch) - decodes
            if prompt_tokens:
                budgets.append(prompt_tokens + max(8, 1 << (decodes - 1).bit_length()) * (decodes > 0))
        return batch
    scheduler.schedule = recording
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.last_stats["mixed_steps"] > 0
    assert budgets and max(budgets) <= 40
    alone = [plain.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    _assert_same(got, alone)
    _no_leak(llm)


# ------------------------------------------------------------------------------------------------
# The pool's reference counts over random workloads (no model: the scheduler and pool alone)
# ------------------------------------------------------------------------------------------------

def _random_request(i, rng, prefixes):
    tokens = list(rng.choice(prefixes)) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 30))]
    tokens = tokens or [1]
    params = SamplingParams(max_tokens=rng.randrange(1, 25))
    return Request(index=i, prompt=None, prompt_ids=tokens, params=params, stop_ids=frozenset(),
                   budget=params.max_tokens, row_key=np.zeros(2, np.uint32))


@pytest.mark.parametrize("seed", range(12))
def test_reference_counts_hold_over_random_workloads(seed):
    """Requests with shared prefixes arrive, run (prompt chunks, decodes, preemptions), finish or
    are aborted at random; after every step each page is in exactly one state, no count is
    negative, a shared page's count is the number of requests holding it, and at the end every
    page is free or cached."""
    rng = random.Random(seed)
    pool = PagePool(rng.randrange(12, 40), 4)
    scheduler = Scheduler(pool, max_num_seqs=rng.randrange(1, 9), max_num_batched_tokens=rng.choice([16, 24, 64]),
                          reserve_tokens=rng.choice([0, 8]))
    prefixes = [[], [rng.randrange(1, 50) for _ in range(9)], [rng.randrange(1, 50) for _ in range(16)]]
    live, i = [], 0
    for _ in range(300):
        while rng.random() < 0.3 and i < 60:
            r = _random_request(i, rng, prefixes)
            i += 1
            if pool.pages_for(len(r.prompt_ids) + r.budget) < pool.num_pages - 1:
                scheduler.add(r)
                live.append(r)
        if scheduler.done:
            if i >= 60:
                break
            continue
        batch = scheduler.schedule()
        for r, n in batch:
            r.computed += n
            scheduler.register_pages(r)
            if r.computed == r.length:  # fed everything it has: samples a token
                r.generated.append(rng.randrange(1, 50))
                if len(r.generated) >= r.budget:
                    r.finish_reason = "length"
                    scheduler.finish(r)
        if rng.random() < 0.05 and scheduler.running:
            victim = rng.choice(scheduler.running)
            scheduler.abort(victim)
            victim.finish_reason = "abort"
        pool.check()
        holders = {}
        for r in scheduler.running:
            assert len(set(r.pages)) == len(r.pages), "a request holds a page twice"
            for p in r.pages:
                holders[p] = holders.get(p, 0) + 1
        for p in range(1, pool.num_pages):
            assert pool.refcount(p) == holders.get(p, 0), f"page {p}"
    for r in list(scheduler.running) + list(scheduler.waiting):
        scheduler.abort(r)
    pool.check()
    assert pool.held == 0 and pool.free == pool.num_pages - 1


def test_page_keys_chain_the_whole_prefix():
    """Equal keys mean equal token prefixes: a page's key depends on every page before it, and the
    salt (the KV layout) roots the chain."""
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, [])
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second page, different first
    assert page_keys([1, 2, 3, 4, 5, 6, 7], 4, []) == a[:1]  # a partial page has no key
    assert page_keys([1, 2, 3, 4], 4, [], salt=b"fp8") != a[:1]
