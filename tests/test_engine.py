"""The generation engine: paged attention, continuous batching, preemption, memory budget, bad input.

Correctness is stated against things that do not share the engine's code: the dense-cache forward
(``forward_cached``), each prompt generated alone, and runs with an unconstrained pool. float32
throughout. On the unquantized checkpoint "the same" means the same tokens, with logprobs equal to
float32 summation order. With FP8 activations a different batch (another summation order) can flip
an activation's FP8 code at a rounding near-tie, moving logits by ~0.02-0.1: there, tokens are
compared up to the first step whose top-1/top-2 margin is under 0.3, and most steps must be compared.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine.pages import PagePool
from modelopt_jax.errors import ConfigError


def _llm(name="qwen2-bytes-bf16", **kw):
    path = fixture_dir(name) if name != "demo" else modelopt_jax.demo_checkpoint_path()
    return LLM(str(path), quantization=None, dtype="float32", max_model_len=kw.pop("max_model_len", 256),
               compilation_cache_dir=None, **kw)


def _prompts(n, rng, low=1, high=40, vocab=256):
    return [rng.integers(1, vocab, rng.integers(low, high + 1)).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# Paged attention = the dense cache
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2-bytes-fp8", "qwen2-bytes-fp8-kv", "llama-tiny-fp8-kv"])
def test_paged_forward_equals_dense_cached_forward(name):
    """Ragged rows crossing page boundaries, GQA, bf16-grid or FP8 pages: the paged forward's logits
    equal the dense cache's (same writes, same rounding, same mask), to float32 order."""
    model = modelopt_jax.load(fixture_dir(name), dtype="float32")
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    lengths = [5, 16, 17, 33]  # inside a page, exactly one page, one past, three pages
    page = 16
    # dense reference: each row alone in a dense cache
    dense = []
    for n in lengths:
        ids = rng.integers(1, vocab, n)
        cache = model.init_cache(1, 64)
        logits, _ = model.forward_cached(jnp.asarray(ids[None], jnp.int32), jnp.arange(n)[None], cache)
        dense.append((ids, np.asarray(logits)[0]))
    # paged: all rows in one step, pages handed out non-contiguously and interleaved
    pool = model.init_paged_cache(num_pages=16, page_size=page)
    free = list(range(15, 0, -1))
    tables = np.zeros((4, 4), np.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page)):
            tables[b, j] = free.pop(0 if b % 2 else -1)
    width = 48
    ids = np.zeros((4, width), np.int32)
    pos = np.zeros((4, width), np.int32)
    slots = np.zeros((4, width), np.int32)
    for b, (row, _) in enumerate(dense):
        n = len(row)
        ids[b, :n], pos[b, :n] = row, np.arange(n)
        slots[b, :n] = tables[b, np.arange(n) // page] * page + np.arange(n) % page
    logits, pool = model.forward_paged(ids, pos, pool, slots, tables)
    logits = np.asarray(logits)
    assert pool.is_fp8 == model.kv_cache.is_fp8
    for b, (row, want) in enumerate(dense):
        np.testing.assert_allclose(logits[b, :len(row)], want, atol=2e-4, rtol=0, err_msg=f"row {b}")
    # nothing was written outside the rows' pages and the scratch page
    used = set(tables[tables > 0].tolist()) | {0}
    data = np.asarray(pool.keys[0].data).reshape(16, page, -1)
    untouched = [p for p in range(16) if p not in used]
    assert untouched and not np.asarray(data[untouched], np.float32).any()


# ------------------------------------------------------------------------------------------------
# Continuous batching changes nothing
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def roomy():
    return _llm()


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_batched_equals_alone_and_tight_pool_equals_roomy(roomy):
    rng = np.random.default_rng(1)
    prompts = _prompts(12, rng)
    # long generations: admitted requests outgrow the pool while decoding (preemption)
    params = [SamplingParams(max_tokens=int(rng.integers(20, 41)), ignore_eos=True, logprobs=2) for _ in prompts]
    together = roomy.generate(prompts, params, use_tqdm=False)
    alone = [roomy.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert _tokens(together) == _tokens(alone)
    for a, b in zip(together, alone):
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert ea.keys() == eb.keys()
            np.testing.assert_allclose(list(ea.values()), list(eb.values()), atol=1e-4)
    # a pool of 12 usable pages (192 tokens) with max_model_len 128: requests wait; without a reserve
    # for the running requests' growth they get preempted, with the default reserve they do not
    tight = _llm(max_model_len=128, kv_cache_bytes=13 * _page_bytes(roomy), max_num_batched_tokens=64)
    assert tight.engine.pool.num_pages == 13
    for reserve in (0, 1024):
        _replace_engine(tight, reserve_tokens=reserve)
        squeezed = tight.generate(prompts, params, use_tqdm=False)
        assert _tokens(squeezed) == _tokens(together)
        stats = tight.last_stats
        # the budget really was too small to run them all at once
        assert (stats["preemptions"] > 0) == (reserve == 0), stats
        assert stats["free_pages_after"] == tight.engine.pool.num_pages - 1  # every page back (scratch excepted)
        tight.engine.pool.check()
        for a, b in zip(squeezed, together):
            assert a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, atol=1e-3)


def _replace_engine(llm, **config):
    """``llm`` with a new engine of the same pool size and ``config`` changes (fields LLM does not take)."""
    import dataclasses

    from modelopt_jax.engine import Engine

    old = llm.engine
    llm.engine = Engine(llm.model, max_model_len=old.max_model_len, pad_id=old.runner.pad_id,
                        config=dataclasses.replace(old.config, kv_cache_bytes=old.pool.num_pages * _page_bytes(llm),
                                                   **config))


def test_requests_added_while_others_run_and_aborted_ones_free_their_pages(roomy):
    """The step-wise engine (a server's loop): requests join mid-run, one is aborted mid-decode; the
    rest produce exactly what they produce alone, and every page is free when the engine is idle.
    (A step may give a request several tokens: a multi-step launch, EngineConfig.decode_steps.)"""
    rng = np.random.default_rng(5)
    prompts = _prompts(6, rng)
    params = [SamplingParams(max_tokens=int(rng.integers(8, 25)), ignore_eos=True) for _ in prompts]
    alone = [roomy.generate(p, q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
    engine = roomy.engine
    requests = [roomy.requests(p, q)[0] for p, q in zip(prompts, params)]
    seen = {id(r): [] for r in requests}
    arrivals = list(requests)
    victim = requests[2]
    steps = 0
    while arrivals or engine.has_work:
        if arrivals and steps % 3 == 0:  # one new request every third step
            engine.add(arrivals.pop(0))
        if victim.finish_reason is None and len(victim.generated) >= 4:
            engine.abort(victim)
        for r in engine.step() if engine.has_work else []:
            seen[id(r)] += r.generated[len(seen[id(r)]):]  # what this step added
        steps += 1
    kept = len(victim.generated)
    assert victim.finish_reason == "abort" and 4 <= kept < len(alone[2]) and not victim.pages
    assert victim.generated == alone[2][:kept]
    for r, want in zip(requests, alone):
        if r is not victim:
            assert r.finish_reason == "length"
            assert seen[id(r)] == r.generated == want  # each token reported once, in order
    assert engine.pool.free == engine.pool.num_pages - 1


def test_overlapped_steps_change_nothing(roomy):
    """Launching step N+1 before collecting step N (its input tokens read on the device) gives what a
    plain loop gives, with requests that stop early on a stop token (their next row is wasted) and
    finish by length under a tight pool; every page is free afterwards. (Preemption with overlap,
    the default, is in test_batched_equals_alone_and_tight_pool_equals_roomy.)"""
    rng = np.random.default_rng(1)
    prompts = _prompts(12, rng)
    budgets = [int(rng.integers(20, 41)) for _ in prompts]
    plain = roomy.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in budgets], use_tqdm=False)
    # a stop token each request really samples late (so it stops mid-run of the others); every third runs to length
    params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=1,
                             stop_token_ids=[] if i % 3 == 0 else [o.token_ids[3 * len(o.token_ids) // 4]])
              for i, (m, o) in enumerate(zip(budgets, plain))]
    tight = _llm(max_model_len=128, kv_cache_bytes=13 * _page_bytes(roomy), max_num_batched_tokens=64)
    runs = {}
    for overlap in (False, True):
        tight.engine.overlap = overlap
        runs[overlap] = tight.generate(prompts, params, use_tqdm=False)
        stats = tight.last_stats
        assert (stats["overlapped_steps"] > stats["steps"] // 2) == overlap, stats
        assert stats["free_pages_after"] == tight.engine.pool.num_pages - 1, stats
    for a, b in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [e.keys() for e in a.logprobs] == [e.keys() for e in b.logprobs]
        np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, atol=1e-4)
    assert {o.finish_reason for o in runs[True]} == {"stop", "length"}


def test_new_prompt_shape_compiles_while_running_requests_decode():
    """Prompt chunks whose step program is not compiled yet do not stall the running requests: the
    program compiles on a helper thread while they decode alone (a server meets new step shapes long
    after it starts; an 8B program took 6-8 s on the H200), then the chunks join them from that
    compiled program. Tokens equal those of the same requests with in-line compiles. Deterministic:
    the first question about an uncompiled shape always answers "not yet"."""
    rng = np.random.default_rng(11)
    # A decodes long enough for B's program to compile beside it; its block table stays in one width
    # bucket (9-15 pages: 16) throughout, so the program compiled for A + B is the one they run
    first, late = rng.integers(1, 256, 140).tolist(), rng.integers(1, 256, 90).tolist()
    runs = {}
    for background in (True, False):
        llm = _llm()
        engine = llm.engine
        engine.compile_in_background = background
        a = llm.requests(first, SamplingParams(max_tokens=100, ignore_eos=True))[0]
        b = llm.requests(late, SamplingParams(max_tokens=30, ignore_eos=True))[0]
        engine.add(a)
        while len(a.generated) < 3:
            engine.step()
        engine.add(b)
        decoded_while_b_waited = 0
        while engine.has_work:
            before = len(a.generated)
            engine.step()
            decoded_while_b_waited += b.computed == 0 and len(a.generated) > before
            if engine.runner._compiling is not None:  # (a CPU decode step is faster than a compile:
                engine.runner._compiling[1].result()  # let it finish while A still runs)
        runs[background] = (a.generated, b.generated, decoded_while_b_waited, len(engine.runner._compiled),
                            engine._stats["mixed_steps"])
        assert engine.pool.free == engine.pool.num_pages - 1
    (a_bg, b_bg, waited_bg, compiled_bg, mixed_bg), (a_in, b_in, waited_in, compiled_in, _) = runs[True], runs[False]
    assert a_bg == a_in and b_bg == b_in and len(b_bg) == 30
    assert waited_bg >= 1 and compiled_bg >= 1  # A decoded while B's program compiled off-thread
    assert mixed_bg >= 1                        # ... and B's prompt then joined A's decodes
    assert waited_in == 0 and compiled_in == 0   # in line: B's prompt ran at once


def _page_bytes(llm):
    return llm.model.kv_cache.page_bytes(16)


def test_seeded_sampling_does_not_depend_on_batching(roomy):
    rng = np.random.default_rng(2)
    prompts = _prompts(6, rng)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    together = roomy.generate(prompts, params, use_tqdm=False)
    alone = [roomy.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert _tokens(together) == _tokens(alone)
    assert len({tuple(t) for t in _tokens(together)}) > 1


def test_prompt_logprobs_with_chunked_prefill(roomy):
    """A prompt prefilled in 16-token chunks reports the same prompt log-probs as in one piece."""
    prompt = np.random.default_rng(3).integers(1, 256, 70).tolist()
    params = SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    whole = roomy.generate(prompt, params, use_tqdm=False)[0]
    chunked = _llm(max_num_batched_tokens=16).generate(prompt, params, use_tqdm=False)[0]
    assert whole.token_ids == chunked.token_ids
    assert chunked.prompt_logprobs[0] is None and len(chunked.prompt_logprobs) == 70
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


def _decisive_prefix_equal(got, want, margin=0.3) -> tuple[int, int]:
    """(tokens compared, tokens generated): compare up to each request's first near-tie of ``want``."""
    compared = total = 0
    for g, w in zip(got, want):
        total += len(w.token_ids)
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            top = sorted(w.logprobs[i].values(), reverse=True)  # chosen + top-2: at least two values
            if top[0] - top[1] < margin:
                break
            assert a == b, (i, g.token_ids, w.token_ids)
            compared += 1
    return compared, total


def _many(n, seed):
    rng = np.random.default_rng(seed)
    prompts = _prompts(n, rng, 1, 24)
    return prompts, [SamplingParams(max_tokens=int(rng.integers(1, 9)), ignore_eos=True, logprobs=2) for _ in prompts]


def _small_and_big(name, pages):
    """A pool of ``pages`` usable pages, and one roomy enough to run 256 requests of 64 tokens at once."""
    small = _llm(name, max_model_len=64, kv_cache_bytes=(pages + 1) * _page_bytes(_llm(name)), max_num_seqs=256)
    big = _llm(name, max_model_len=64, kv_cache_bytes=(256 * 4 + 1) * _page_bytes(small), max_num_seqs=256)
    return small, big


@pytest.mark.slow
def test_thousand_prompts_with_a_small_pool_on_the_demo():
    """1000 requests through a 40-page pool finish with the outputs of an unconstrained run; no page leaks.

    The demo has FP8 activations, so tokens are compared up to each request's first near-tie
    (measured: about half of all generated tokens are compared; none differs there)."""
    prompts, params = _many(1000, 4)
    small, big = _small_and_big("demo", 40)
    want, got = big.generate(prompts, params, use_tqdm=False), small.generate(prompts, params, use_tqdm=False)
    compared, total = _decisive_prefix_equal(got, want)
    assert compared >= total / 3, (compared, total)
    assert [len(o.token_ids) for o in got] == [q.max_tokens for q in params]
    assert small.last_stats["free_pages_after"] == 40
    # the small pool really held requests back: at most 40 pages' worth ran at once
    assert small.last_stats["max_running"] <= 40 < big.last_stats["max_running"]


@pytest.mark.slow
def test_many_prompts_with_a_small_pool_exactly_equal_without_fp8_activations():
    """Without FP8 activations nothing can flip: every token of 300 requests through a 24-page pool
    equals the unconstrained run's, log-probs to float32 order."""
    prompts, params = _many(300, 5)
    small, big = _small_and_big("qwen2-bytes-bf16", 24)
    want, got = big.generate(prompts, params, use_tqdm=False), small.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert max(abs(a.cumulative_logprob - b.cumulative_logprob) for a, b in zip(got, want)) < 1e-3
    assert small.last_stats["free_pages_after"] == 24 and small.last_stats["max_running"] <= 24


def test_more_than_256_running_requests():
    """max_num_seqs above 256: a 300-row decode step (bucketed to 512 rows) runs, and each request's
    tokens are those it gets in a batch of the default size."""
    prompts, params = _many(300, 6)
    params = [SamplingParams(max_tokens=3, ignore_eos=True) for _ in prompts]
    wide = _llm(max_model_len=48, kv_cache_bytes=(300 * 3 + 1) * 32768, max_num_seqs=300)
    assert wide.engine.pool.num_pages >= 901
    got = wide.generate(prompts, params, use_tqdm=False)
    assert wide.last_stats["max_running"] == 300
    want = _llm(max_model_len=48, kv_cache_bytes=(300 * 3 + 1) * 32768, max_num_seqs=64).generate(
        prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)


# ------------------------------------------------------------------------------------------------
# Bookkeeping and bad input
# ------------------------------------------------------------------------------------------------

def test_page_pool_bookkeeping():
    pool = PagePool(5, 16)
    a, b = [], []
    assert pool.grow(a, 17) and a == [1, 2] and pool.free == 2
    assert not pool.grow(b, 48) and b == [] and pool.free == 2  # all or nothing
    assert pool.grow(b, 32) and pool.free == 0
    pool.release(a)
    assert a == [] and pool.free == 2 and 0 not in b  # page 0 is never handed out
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1, 16)


def _request(i, n, max_tokens=8, tokens=None):
    from modelopt_jax.engine.request import Request

    ids = list(range(1, n + 1)) if tokens is None else list(tokens)
    return Request(index=i, prompt=None, prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens),
                   stop_ids=frozenset(), budget=max_tokens, row_key=np.zeros(2, np.uint32))


def test_waiting_prompt_chunks_never_cost_a_needless_preemption():
    """Prompt chunks wait for their program only while decodes can run instead; if the decode rows
    get preempted for pages, the part-way prompt runs at once -- it is not preempted too (nor does an
    empty running set crash the scheduler)."""
    from modelopt_jax.engine.scheduler import Scheduler

    pool = PagePool(3, 4)  # two usable pages of 4 tokens
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=2)
    part_way, decoding = _request(0, 6), _request(1, 4)
    assert pool.grow(part_way.pages, 2) and pool.grow(decoding.pages, 4) and pool.free == 0
    part_way.computed, decoding.computed, decoding.generated = 2, 4, [9]  # 4 prompt tokens left / 1 to feed
    scheduler.running = [part_way, decoding]
    asked = []
    batch = scheduler.schedule(ready=lambda rows: asked.append(rows) or False)
    assert batch == [(part_way, 2)]   # the decode row had to go: nothing else runs, so no question asked
    assert asked == []
    assert scheduler.running == [part_way] and list(scheduler.waiting) == [decoding]
    assert scheduler.preemptions == 1 and decoding.pages == [] and part_way.pages
    assert scheduler.decodes_while_compiling == 0


def _decoding(scheduler, count, max_tokens=64):
    """``count`` running requests that each feed one token next."""
    rows = []
    for i in range(count):
        r = _request(100 + i, 4, max_tokens)
        assert scheduler.pool.grow(r.pages, 5)
        r.computed, r.generated = 4, [9]
        scheduler.running.append(r)
        rows.append(r)
    return rows


def test_mixed_steps_carry_every_decode_and_prompt_chunks_within_the_budget():
    """A step holds every running decode (first) plus prompt chunks until the token budget, with the
    decode rows counted as the step pads them (at least 8); a long prompt continues in later steps;
    a compiling program makes the decodes run alone."""
    from modelopt_jax.engine.scheduler import Scheduler

    scheduler = Scheduler(PagePool(64, 4), max_num_seqs=8, max_num_batched_tokens=24)
    rows = _decoding(scheduler, 2)
    long, short = _request(0, 30), _request(1, 5, tokens=range(50, 55))  # no shared first page
    scheduler.add(long)
    scheduler.add(short)
    batch = scheduler.schedule()
    assert batch == [(rows[0], 1), (rows[1], 1), (long, 16)]  # 24 - 8 (padded decode rows) = 16 prompt tokens
    for r, n in batch:
        r.computed += n
    for r in rows:
        r.generated.append(9)
    batch = scheduler.schedule(ready=lambda rows: False)  # still compiling: decodes alone, chunks wait
    assert batch == [(rows[0], 1), (rows[1], 1)] and scheduler.decodes_while_compiling == 1
    for r, n in batch:
        r.computed += n
    for r in rows:
        r.generated.append(9)
    batch = scheduler.schedule()
    assert batch == [(rows[0], 1), (rows[1], 1), (long, 14), (short, 2)]
    assert sum(n for _, n in batch) <= 24 - 8 + 2


def test_a_request_waiting_for_a_prefix_being_computed_does_not_hold_up_the_queue():
    """The second sample of a prompt waits one step for the pages the first computes (and then
    computes only its last partial page), while a request behind it with another prompt is admitted
    at once: n > 1 fans out without serializing the queue."""
    from modelopt_jax.engine.scheduler import Scheduler

    scheduler = Scheduler(PagePool(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first, sibling, other = _request(0, 10), _request(1, 10), _request(2, 6, tokens=range(50, 56))
    for r in (first, sibling, other):
        scheduler.add(r)
    batch = scheduler.schedule()
    assert batch == [(first, 10), (other, 6)] and list(scheduler.waiting) == [sibling]
    for r, n in batch:
        r.computed += n
        scheduler.register_pages(r)
        r.generated.append(9)
    batch = scheduler.schedule()
    assert batch == [(first, 1), (other, 1), (sibling, 2)] and sibling.cached_tokens == 8
    assert first.pages[:2] == sibling.pages[:2] and scheduler.pool.refcount(first.pages[0]) == 2
    scheduler.pool.check()


def test_admission_reserves_pages_for_the_running_requests_growth():
    """With reserve_tokens a waiting request is admitted only while the running ones keep pages for
    their next tokens (at most their max_tokens); without, it is admitted at once."""
    from modelopt_jax.engine.scheduler import Scheduler

    # 7 usable pages: the two running requests hold 2 each (room for 8 tokens, they have 5), the new
    # one needs 2 of the 3 left; a reserve of 4 more tokens each (positions up to 9) needs 2 pages more
    for reserve, admitted in ((0, True), (16, False), (3, True), (4, False)):
        scheduler = Scheduler(PagePool(8, 4), max_num_seqs=8, max_num_batched_tokens=64, reserve_tokens=reserve)
        _decoding(scheduler, 2, max_tokens=17)
        new = _request(0, 8, tokens=range(60, 68))
        scheduler.add(new)
        batch = scheduler.schedule()
        assert ((new, 8) in batch) == admitted, reserve
        scheduler.pool.check()


@pytest.mark.parametrize("kw,match", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0 must be a positive integer"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching='yes' must be a bool"),
    (dict(kv_cache_memory_fraction=0), "kv_cache_memory_fraction=0 must be in"),
    (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction=1.5 must be in"),
    (dict(kv_cache_bytes=1000), "fewer than one sequence of max_model_len=256"),
    (dict(max_num_seqs=0), "max_num_seqs=0 must be a positive integer"),
])
def test_bad_engine_settings_are_clear_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        _llm(**kw)


def test_max_num_seqs_default_follows_the_pool():
    """max_num_seqs=None: 512 rows where the pool holds 512 sequences of 512 tokens (a big GPU's),
    256 where it does not (the small default CPU pool); resolved once, into engine.config; an
    explicit value is kept whatever the pool."""
    from modelopt_jax.engine.engine import default_max_num_seqs

    assert default_max_num_seqs(512 * 32, 16) == 512
    assert default_max_num_seqs(512 * 32 - 1, 16) == 256
    assert default_max_num_seqs(28405, 16) == 512  # the H100 80GB's pool for an 8B FP8 model
    small = _llm()
    assert small.engine.config.max_num_seqs == 256
    assert small.engine.pool.num_pages * small.engine.pool.page_size < 512 * 1024
    page = _page_bytes(small)
    big = _llm(kv_cache_bytes=(512 * 64 + 1) * page)
    assert big.engine.config.max_num_seqs == 512
    assert big.engine.runner.max_rows == 512 + 128  # a step's decode rows and its prompt sequences
    assert _llm(kv_cache_bytes=(512 * 64 + 1) * page, max_num_seqs=100).engine.config.max_num_seqs == 100


def test_prompt_longer_than_max_model_len_is_refused_before_any_work(roomy):
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens; max_model_len=256"):
        roomy.generate([[1, 2, 3], [5] * 300], use_tqdm=False)
    assert roomy.engine.pool.free == roomy.engine.pool.num_pages - 1


def test_steps_take_the_fixed_table_width_only_where_kernels_run_every_section():
    """Where a step's sections all run kernels that read only the pages in use, its table width is
    the fixed full-sequence width (one program fewer per width); where XLA gathers the whole width
    it stays bucketed to the longest row."""
    from modelopt_jax.engine.step_programs import step_shape
    from modelopt_jax.ops.paged_step import AttentionConfig, StepShape

    def request(i, n, computed):
        r = _request(i, n)
        r.computed = computed
        return r

    pool = PagePool(64, 16)
    prompt = [(request(0, 40, 0), 40), (request(1, 20, 0), 20)]
    decode = [(request(2, 30, 30), 1)]
    for r, n in prompt + decode:
        assert pool.grow(r.pages, r.computed + n)
    xla = AttentionConfig(16)
    kernels = AttentionConfig(16, decode="fused_kernel", prefill="kernel")
    decode_kernel_only = AttentionConfig(16, decode="fused_kernel", prefill="xla")
    assert step_shape(prompt, xla, 256) == StepShape(0, 64, 2, 64, 8, 2)  # 3 pages, bucketed to the minimum 8
    # kernels: rows of PROMPT_TILE tokens, as many as 64 tokens of up to 64 / PROMPT_SEQ_TOKENS chunks can need
    assert step_shape(prompt, kernels, 256) == StepShape(0, 64, 1 + 16, 64, 256, 16)
    assert step_shape(prompt, kernels, 256, max_prompt_seqs=2) == StepShape(0, 64, 1 + 2, 64, 256, 2)
    # more chunks than the scheduler allows still get a shape that holds them
    many = [(request(3 + i, 8, 0), 8) for i in range(8)]
    for r, n in many:
        assert pool.grow(r.pages, n)
    assert step_shape(many, kernels, 256, max_prompt_seqs=2) == StepShape(0, 64, 8, 64, 256, 8)
    assert step_shape(decode, decode_kernel_only, 256) == StepShape(8, 0, 0, 1, 256, 0)
    assert step_shape(decode + prompt, decode_kernel_only, 256) == StepShape(8, 64, 2, 64, 8, 2)
    assert step_shape(decode + prompt, kernels, 256) == StepShape(8, 64, 1 + 16, 64, 256, 16)


def test_attention_config_is_resolved_once_and_checked():
    """The kernels a step runs are its AttentionConfig (static step data), resolved from the geometry
    and platform: "mma" falls back to the CUDA-core kernel where tensor cores do not serve the
    compute dtype, the CPU runs XLA, a kernel forced where it cannot run is an error, and a bad
    name is an error, not a silent fallback."""
    from modelopt_jax.ops import attention
    from modelopt_jax.ops.paged_step import AttentionConfig

    assert attention.decode_kernel_variant("mma", "bfloat16", "bfloat16") == "mma"
    assert attention.decode_kernel_variant("mma", "float8_e4m3fn", "bfloat16") == "mma"
    assert attention.decode_kernel_variant("mma", "float16", "float16") == "mma"
    assert attention.decode_kernel_variant("mma", "bfloat16", "float32") == "staged"
    assert attention.decode_kernel_variant("mma", "bfloat16", "float16") == "staged"
    assert attention.decode_kernel_variant("staged", "bfloat16", "bfloat16") == "staged"
    with pytest.raises(ValueError, match="register"):
        attention.decode_kernel_variant("register", "bfloat16", "bfloat16")
    geometry = dict(num_heads=32, num_kv_heads=8, head_dim=128, pool_dtype="bfloat16", compute_dtype="bfloat16",
                    page_size=16)
    cpu = AttentionConfig.resolve(**geometry, platform="cpu")
    assert (cpu.decode, cpu.prefill, cpu.decode_variant) == ("xla", "xla", "mma")
    assert AttentionConfig.resolve(**{**geometry, "compute_dtype": "float32"}, platform="cpu").decode_variant == \
        "staged"
    with pytest.raises(ValueError, match="decode='kernel'"):
        AttentionConfig.resolve(**geometry, platform="cpu", decode="kernel")
    with pytest.raises(ValueError, match="prefill='kernel'"):
        AttentionConfig.resolve(**geometry, platform="cpu", prefill="kernel")
    with pytest.raises(ValueError, match="decode='fast'"):
        AttentionConfig(16, decode="fast")
    with pytest.raises(ValueError, match="decode_splits=0"):
        AttentionConfig(16, decode_splits=0)


def test_an_attention_config_given_by_hand_is_checked_before_any_step(monkeypatch):
    """``Engine(..., attention=...)`` takes a hand-made AttentionConfig for A/B runs. One the model's
    devices cannot run is a ConfigError naming it when the engine is built, not a handler error inside
    the first compiled step: on a GPU, the CUDA kernels for a float32 pool (what ``attention_config``
    refuses there); anywhere, a sliding window other than the model's."""
    import dataclasses
    from types import SimpleNamespace

    from modelopt_jax.engine import Engine, engine as engine_module
    from modelopt_jax.ops.paged_step import AttentionConfig

    llm = _llm(kv_cache_bytes=4 << 20)
    model = llm.model
    settings = dict(max_model_len=256, pad_id=llm.engine.runner.pad_id,  # (no start-up compiles: not what is tested)
                    config=dataclasses.replace(llm.engine.config, precompile_samplers=()))
    kernels = AttentionConfig(16, decode="fused_kernel", prefill="kernel")
    llm.engine = None
    with pytest.raises(ConfigError, match="sliding_window=8 differs"):
        Engine(model, attention=AttentionConfig(16, sliding_window=8), **settings)
    # a CPU runs the kernels' CPU handlers for any pool: accepted
    assert Engine(model, attention=kernels, **settings).attention == kernels
    # on a GPU (the device stubbed; the model's own resolution still sees no CUDA kernel for this
    # float32 model here, as on a GPU), the same config is refused with what cannot run it
    monkeypatch.setattr(engine_module, "_first_device", lambda m: SimpleNamespace(platform="gpu"))
    with pytest.raises(ConfigError, match=r"attention=AttentionConfig\(page_size=16, decode='fused_kernel'.*decode="):
        engine_module.check_attention(model, kernels)
    engine_module.check_attention(model, AttentionConfig(16))  # the XLA paths run everywhere
