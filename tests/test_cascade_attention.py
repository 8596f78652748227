"""Cascade attention: decode rows that share a prefix of full pages read it once per line (up to
cascade_group rows, anywhere in the step) and their own pages after it, the two parts merged by
their log-sum-exps.

Correctness is stated against a float64 reference of each row's attention over its own table (no
sharing at all), and, at the engine's surface, against the same engine without cascade (same
tokens, log-probs to float32 summation order). On a CPU the kernels' calls lower to the XLA
fallbacks, so the host's plan (which rows share what) and the merge run here; the CUDA kernels
run the same step in tests/test_engine_gpu.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine import Engine, EngineConfig
from modelopt_jax.engine.request import Request
from modelopt_jax.engine.step_programs import shared_prefixes
from modelopt_jax.ops.attention import step_attention
from modelopt_jax.ops.paged_step import AttentionConfig, PagedStep, cascade_lines

PAGE = 4
HEADS, KV, HD = 4, 2, 16


def _reference(q, k_pool, v_pool, tables, positions, k_scale=None, v_scale=None, page=PAGE):
    """float64: row i's query against its table's positions 0 .. positions[i]."""
    _, heads, hd = q.shape
    kv = k_pool.shape[1]
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_pool.astype(np.float32), v_pool.astype(np.float32)))
    k = k * (k_scale or 1.0)
    v = v * (v_scale or 1.0)
    g = heads // kv
    out = np.zeros((len(q), heads, hd))
    for i, pos in enumerate(positions):
        slots = [tables[i][p // page] * page + p % page for p in range(pos + 1)]
        for h in range(heads):
            s = k[slots, h // g] @ q[i, h] / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[slots, h // g]
    return out.reshape(len(q), heads * hd)


def _decode_step(rng, pool_dtype, group):
    """Eleven decode rows (padded to 12) over a pool where rows 0-4 share 5 pages, rows 5-7 share 3
    pages with each other but 1 with rows 0-4, rows 8-10 share nothing; lines of at most ``group``
    rows: line 0 holds rows 7 and 6 (row 5, which could share, reads everything itself), line 1 rows
    4, 0, 2, 1, 3, the last line none."""
    pages = 64
    k_pool = rng.standard_normal((pages * PAGE, KV, HD)).astype(pool_dtype)
    v_pool = rng.standard_normal((pages * PAGE, KV, HD)).astype(pool_dtype)
    common = [1, 2, 3, 4, 5]
    fresh = iter(range(6, pages))
    tables, positions = [], []
    for i in range(11):
        if i < 5:
            own = common + [next(fresh) for _ in range(2)]
        elif i < 8:
            own = [1, 40, 41] + [next(fresh) for _ in range(2)] if i > 5 else [1, 40, 41, next(fresh), next(fresh)]
        else:
            own = [next(fresh) for _ in range(4)]
        tables.append(own)
        positions.append((len(own) - 1) * PAGE + int(rng.integers(0, PAGE)))
    d = 12
    width = 8
    block = np.zeros((d, width), np.int32)
    for i, t in enumerate(tables):
        block[i, :len(t)] = t
    pos = np.zeros(d, np.int32)
    pos[:11] = positions
    # the plan a host would make: rows 0-4 share 5 pages (20 tokens), rows 6-7 share 3 (12 tokens)
    shared = np.zeros(d, np.int32)
    shared[:5] = 5 * PAGE
    shared[6:8] = 3 * PAGE
    lines = cascade_lines(d, group)
    shared_tables = np.zeros((lines, width), np.int32)
    shared_rows = np.full((lines, group), d, np.int32)
    for c, members in enumerate(([7, 6], [4, 0, 2, 1, 3])):
        n = shared[members[0]] // PAGE
        assert all(shared[i] == shared[members[0]] and tables[i][:n] == tables[members[0]][:n] for i in members)
        shared_tables[c, :n] = tables[members[0]][:n]
        shared_rows[c, :len(members)] = members
    q = rng.standard_normal((d, HEADS, HD)).astype(np.float32)
    return q, k_pool, v_pool, block, pos, shared, shared_tables, shared_rows, tables, positions


@pytest.fixture
def on_cpu():
    """XLA's path on the CPU device even where a GPU is the default: there float32 dots keep float32
    (a GPU's default precision rounds their operands, which the 2e-5 tolerances below do not allow)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "fp8"])
def test_cascade_decode_equals_the_float64_reference(pool, on_cpu):
    """The merged shared-prefix and own-pages attention equals each row attending over its whole
    table (float64), for rows on lines (in any order), rows that could share but are on none, rows
    that share nothing and padding."""
    rng = np.random.default_rng(1)
    dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}[pool]
    k_scale, v_scale = (0.5, 0.25) if pool == "fp8" else (None, None)
    q, k_pool, v_pool, block, pos, shared, shared_tables, shared_rows, tables, positions = \
        _decode_step(rng, dtype, group=6)
    compute = jnp.float32
    d = len(pos)
    step = PagedStep(jnp.zeros(d, jnp.int32), jnp.asarray(pos), jnp.zeros(d, jnp.int32), jnp.asarray(block),
                     jnp.zeros((0, 1), jnp.int32), jnp.arange(d, dtype=jnp.int32), d,
                     AttentionConfig(PAGE, cascade_group=6), shared_tables=jnp.asarray(shared_tables),
                     shared_rows=jnp.asarray(shared_rows), shared_lengths=jnp.asarray(shared))
    step.check()
    # this step writes nothing new: the "new" keys go to the scratch page's slot 0, which no table reads
    k_new = jnp.asarray(k_pool[:d])
    v_new = jnp.asarray(v_pool[:d])
    run = jax.jit(lambda q, kp, vp, step: step_attention(q, k_new, v_new, kp, vp, k_scale=k_scale, v_scale=v_scale,
                                                         step=step, dtype=compute)[0])
    got = np.asarray(run(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), step))
    want = _reference(q[:11], k_pool, v_pool, tables, positions, k_scale, v_scale)
    np.testing.assert_allclose(got[:11], want, atol=2e-5, rtol=2e-5)
    assert np.isfinite(got).all()
    plain = dataclasses.replace(step, shared_tables=None, shared_rows=None, shared_lengths=None)
    np.testing.assert_allclose(np.asarray(run(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), plain))[:11],
                               want, atol=2e-5, rtol=2e-5)


def test_a_step_without_any_shared_prefix_is_unchanged(on_cpu):
    """All shared lengths 0 and every line padding (nobody shares): the cascade step gives what the
    plain step gives."""
    rng = np.random.default_rng(2)
    q, k_pool, v_pool, block, pos, *_, tables, positions = _decode_step(rng, np.float32, group=6)
    d = len(pos)
    config = AttentionConfig(PAGE, cascade_group=4)
    step = PagedStep(jnp.zeros(d, jnp.int32), jnp.asarray(pos), jnp.zeros(d, jnp.int32), jnp.asarray(block),
                     jnp.zeros((0, 1), jnp.int32), jnp.arange(d, dtype=jnp.int32), d, config,
                     shared_tables=jnp.zeros((3, block.shape[1]), jnp.int32),
                     shared_rows=jnp.full((3, 4), d, jnp.int32), shared_lengths=jnp.zeros(d, jnp.int32))
    out = step_attention(jnp.asarray(q), jnp.asarray(k_pool[:d]), jnp.asarray(v_pool[:d]), jnp.asarray(k_pool),
                         jnp.asarray(v_pool), k_scale=None, v_scale=None, step=step, dtype=jnp.float32)[0]
    np.testing.assert_allclose(np.asarray(out)[:11], _reference(q[:11], k_pool, v_pool, tables, positions), atol=2e-5)


def test_step_shapes_of_the_cascade_fields_are_checked():
    d = 8
    base = dict(input_ids=jnp.zeros(d, jnp.int32), positions=jnp.zeros(d, jnp.int32), slots=jnp.zeros(d, jnp.int32),
                block_tables=jnp.zeros((d, 4), jnp.int32), prompt_tokens=jnp.zeros((0, 1), jnp.int32),
                logit_index=jnp.arange(d, dtype=jnp.int32), num_decode=d)
    assert cascade_lines(d, 4) == 2 and cascade_lines(d, 16) == 2 and cascade_lines(9, 16) == 3
    assert cascade_lines(d, 2) == 4  # lines of 2 rows: as many as it takes to put every row on one
    ok = PagedStep(**base, attention=AttentionConfig(PAGE, cascade_group=4),
                   shared_tables=jnp.zeros((2, 4), jnp.int32), shared_rows=jnp.full((2, 4), d, jnp.int32),
                   shared_lengths=jnp.zeros(d, jnp.int32))
    ok.check()
    with pytest.raises(ValueError, match=r"cascade_lines\(8, 4\) lines"):
        dataclasses.replace(ok, shared_tables=jnp.zeros((3, 4), jnp.int32)).check()
    with pytest.raises(ValueError, match="shared_rows has shape"):
        dataclasses.replace(ok, shared_rows=jnp.full((2, 5), d, jnp.int32)).check()
    with pytest.raises(ValueError, match="shared_rows must be int32"):
        dataclasses.replace(ok, shared_rows=jnp.full((2, 4), d, jnp.int16)).check()
    with pytest.raises(ValueError, match="shared_lengths has shape"):
        dataclasses.replace(ok, shared_lengths=jnp.zeros(d - 1, jnp.int32)).check()
    with pytest.raises(ValueError, match="come together"):
        dataclasses.replace(ok, shared_lengths=None).check()
    with pytest.raises(ValueError, match="come together"):
        dataclasses.replace(ok, shared_rows=None).check()
    with pytest.raises(ValueError, match="cascade_group is 0"):
        dataclasses.replace(ok, attention=AttentionConfig(PAGE)).check()
    with pytest.raises(ValueError, match="cascade_group"):
        AttentionConfig(PAGE, cascade_group=-1)
    with pytest.raises(ValueError, match="sliding-window"):
        AttentionConfig(PAGE, cascade_group=4, sliding_window=8)


def _request(pages, computed, page=16):
    params = SamplingParams(max_tokens=4)
    r = Request(index=0, prompt=None, prompt_ids=list(range(1, computed + 2)), params=params, stop_ids=frozenset(),
                budget=params.max_tokens, row_key=np.zeros(2, np.uint32))
    r.pages = list(pages)
    r.computed = computed
    return r


def _lines(plan, rows):
    """The plan as {line: (its rows as objects in line order, its pages)} for the lines in use."""
    used = {}
    for c, members in enumerate(plan.rows.tolist()):
        members = [i for i in members if i < len(rows)]
        if members:
            pages = plan.tables[c]
            used[c] = ([rows[i] for i in members], pages[pages > 0].tolist())
    return used


def test_the_host_puts_sharers_on_lines_with_their_common_full_pages():
    """Rows whose full pages start alike go on one line wherever they sit in the step, sharing the
    longest run of full pages they all hold; a page being written is never shared; rows that share
    under min_tokens, or nothing, or have no full page, stay off every line; each row is on at most
    one line, and its shared length is its line's pages."""
    page = 16
    a = [_request([7, 8, 9, 10, 11 + i], 4 * page + 3) for i in range(3)]     # 4 full pages shared
    b = [_request([20, 21, 30 + i, 40 + i], 3 * page) for i in range(2)]      # share 2, then diverge
    lone = _request([50, 51, 52], 2 * page + 1)                               # nobody shares its pages
    young = _request([7, 60], 10)                                             # no full page yet
    short = [_request([70, 71], page + 5), _request([70, 72], page + 5)]       # 1 shared page: under 64 tokens
    rows = [b[0], a[0], lone, a[1], young, b[1], a[2]] + short
    plan = shared_prefixes(rows, group=4, page_size=page, table_width=6, lines=3, pad=12)
    assert plan.tables.shape == (3, 6) and plan.rows.shape == (3, 4) and plan.lengths.shape == (len(rows),)
    lines = _lines(plan, rows)
    assert len(lines) == 1
    (members, pages), = lines.values()
    assert sorted(map(id, members)) == sorted(map(id, a)) and pages == [7, 8, 9, 10]
    assert set(plan.rows.ravel().tolist()) == {1, 3, 6, 12}  # a's places in the step, then padding
    assert plan.lengths.tolist() == [0, 4 * page, 0, 4 * page, 0, 0, 4 * page, 0, 0]
    assert plan.rows_sharing == 3
    # with a 32-token floor b's rows (2 shared pages) share too; a saves more, so it takes line 0
    plan = shared_prefixes(rows, group=4, page_size=page, table_width=6, lines=3, pad=12, min_tokens=32)
    lines = _lines(plan, rows)
    assert [sorted(map(id, m)) for m, _ in lines.values()] == [sorted(map(id, a)), sorted(map(id, b))]
    assert [p for _, p in lines.values()] == [[7, 8, 9, 10], [20, 21]]
    assert plan.lengths[[0, 5]].tolist() == [2 * page] * 2
    # one line only: the run that saves the most page reads keeps it
    plan = shared_prefixes(rows, group=4, page_size=page, table_width=6, lines=1, pad=12, min_tokens=32)
    assert [p for _, p in _lines(plan, rows).values()] == [[7, 8, 9, 10]] and plan.rows_sharing == 3


def test_a_run_longer_than_a_line_is_cut_into_even_lines_of_neighbours():
    """Nine rows of one system prompt (3 pages) whose turns then differ: lines of at most 4 rows, cut
    4 + 3 + 2 -> 3 + 3 + 3, and rows that share a longer prefix (the same 4th page) sit on one line
    and share it."""
    page = 16
    rows = [_request([1, 2, 3, 10 + i % 3, 50 + i], 5 * page + 1) for i in range(9)]
    plan = shared_prefixes(rows, group=4, page_size=page, table_width=6, lines=4, pad=16)
    lines = _lines(plan, rows)
    assert sorted(len(m) for m, _ in lines.values()) == [3, 3, 3]
    for members, pages in lines.values():
        fourth = {r.pages[3] for r in members}
        assert len(fourth) == 1 and pages == [1, 2, 3, fourth.pop()]
    assert plan.rows_sharing == 9 and set(plan.lengths.tolist()) == {4 * page}


def test_every_sample_of_each_prompt_shares_its_prompt():
    """n = 8 samples of each of 16 prompts (128 rows, as in RL rollouts): with lines of 16 rows, each
    prompt's samples get a line of their own, so every row reads its prompt once per line (not half
    of them, as groups of consecutive rows that must share one prefix gave)."""
    page = 16
    rows = [_request([1000 * p + j + 1 for j in range(32)] + [90000 + 8 * p + s], 32 * page + 3)
            for p in range(16) for s in range(8)]
    order = np.random.default_rng(0).permutation(len(rows))
    rows = [rows[i] for i in order]
    plan = shared_prefixes(rows, group=16, page_size=page, table_width=40, lines=cascade_lines(128, 16), pad=128)
    assert plan.rows_sharing == 128
    for members, pages in _lines(plan, rows).values():
        assert len(members) == 8 and pages == members[0].pages[:32]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(fixture_dir("qwen2-bytes-bf16")), quantization=None, dtype="float32", max_model_len=256,
               compilation_cache_dir=None, kv_cache_bytes=64 << 20, max_num_seqs=8)


def _engine(llm, attention):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, kv_cache_bytes=64 << 20, precompile_samplers=())
    return Engine(llm.model, max_model_len=llm.max_model_len, pad_id=llm.engine.runner.pad_id, config=config,
                  attention=attention)


@pytest.mark.parametrize("layout", ["xla", "kernels"])
def test_cascade_steps_generate_what_plain_steps_do(llm, layout):
    """A shared 70-token system prompt with distinct tails, and n = 3 samples of one prompt: with
    cascade attention the engine generates the same tokens and log-probs as without, and the rows
    that share did read their prefix as a group."""
    rng = np.random.default_rng(5)
    system = rng.integers(1, 256, 70).tolist()
    prompts = [system + rng.integers(1, 256, int(n)).tolist() for n in (3, 20, 9, 33, 1)]
    prompts.append(rng.integers(1, 256, 90).tolist())
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, logprobs=1) for m in (9, 12, 6, 10, 14)]
    params.append(SamplingParams(max_tokens=10, n=3, temperature=0.8, seed=11, logprobs=1))
    if layout == "kernels" and jax.default_backend() == "gpu":
        pytest.skip("a float32 pool: the kernels run here through their CPU handlers; the CUDA kernels take "
                    "bf16/fp16/FP8 pools and their cascade path is tested in test_cascade_kernels_equal_the_float64_"
                    "reference and tests/test_engine_gpu.py")
    base = AttentionConfig(16) if layout == "xla" else AttentionConfig(16, decode="fused_kernel", prefill="kernel")
    outputs = {}
    for group in (0, 4):
        engine = _engine(llm, dataclasses.replace(base, cascade_group=group))
        llm.engine = engine
        with jax.default_matmul_precision("highest"):  # float32 einsums on a GPU: not TF32
            outputs[group] = llm.generate(prompts, params, use_tqdm=False)
        stats = dict(engine.last_stats)
        if group:
            assert stats["shared_prefix_rows"] > 0
        else:
            assert stats["shared_prefix_rows"] == 0
        engine.pool.check()
        assert engine.pool.held == 0
    for a, b in zip(outputs[4], outputs[0], strict=True):
        assert len(a.outputs) == len(b.outputs)
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            np.testing.assert_allclose(ca.cumulative_logprob, cb.cumulative_logprob, atol=1e-4)


def _gpu_kernels():
    from modelopt_jax.ops import native

    try:
        on_gpu = jax.default_backend() == "gpu"
    except RuntimeError:
        on_gpu = False
    return on_gpu and native.has_cuda_handler()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_kernels(), reason="needs a GPU and the CUDA attention kernels with the log-sum-exp variant")
@pytest.mark.parametrize("pool", ["bfloat16", "fp8"])
@pytest.mark.parametrize("decode", ["kernel", "fused_kernel"])
def test_cascade_kernels_equal_the_float64_reference(pool, decode):
    """On CUDA: the prefill kernel's log-sum-exp variant over each line's shared pages, merged with
    the decode kernel over each row's own pages, equals float64 attention over each whole table
    (bf16 compute: within bf16 rounding), for 40 decode rows (padded to 64) where 30 rows share 20
    pages on 3 lines of 10 scattered rows (13 lines unused) and 10 share nothing. Outputs start
    as NaN-poisoned buffers in the kernels' own tests; here a row the merge missed would be 0 or NaN."""
    page, heads, kv, hd = 16, 8, 2, 64
    rng = np.random.default_rng(7)
    dtype = ml_dtypes.bfloat16 if pool == "bfloat16" else ml_dtypes.float8_e4m3fn
    k_scale, v_scale = (None, None) if pool == "bfloat16" else (0.05, 0.04)
    num_pages = 400
    k_pool = (rng.standard_normal((num_pages * page, kv, hd)) * (1 if k_scale is None else 10)).astype(dtype)
    v_pool = (rng.standard_normal((num_pages * page, kv, hd)) * (1 if v_scale is None else 10)).astype(dtype)
    common = list(range(1, 21))
    fresh = iter(range(21, num_pages))
    tables, positions = [], []
    for i in range(40):
        own = (common if i < 30 else []) + [next(fresh) for _ in range(1 + i % 3)]
        tables.append(own)
        positions.append((len(own) - 1) * page + int(rng.integers(0, page)))
    d, width, group = 64, 32, 16
    block = np.zeros((d, width), np.int32)
    for i, t in enumerate(tables):
        block[i, :len(t)] = t
    pos = np.zeros(d, np.int32)
    pos[:40] = positions
    shared = np.zeros(d, np.int32)
    shared[:30] = 20 * page
    # lines: rows 0-29 are sharers, cut into 3 lines of 10 in a scattered order (as a host plan
    # places them: anywhere in the step), the other lines unused
    lines = cascade_lines(d, group)
    shared_tables = np.zeros((lines, width), np.int32)
    shared_tables[:3, :20] = common
    shared_rows = np.full((lines, group), d, np.int32)
    shared_rows[:3, :10] = np.random.default_rng(8).permutation(30).reshape(3, 10)
    q = rng.standard_normal((d, heads, hd)).astype(np.float32)
    slots = np.zeros(d, np.int32)
    slots[:40] = [t[p // page] * page + p % page for t, p in zip(tables, positions)]
    # the step's own keys/values: what the pool already holds at those slots, so the reference sees them
    k_new, v_new = jnp.asarray(k_pool[slots]), jnp.asarray(v_pool[slots])
    config = AttentionConfig(page, decode=decode, prefill="kernel", cascade_group=group)
    step = PagedStep(jnp.zeros(d, jnp.int32), jnp.asarray(pos), jnp.asarray(slots), jnp.asarray(block),
                     jnp.zeros((0, 1), jnp.int32), jnp.arange(d, dtype=jnp.int32), d, config,
                     shared_tables=jnp.asarray(shared_tables), shared_rows=jnp.asarray(shared_rows),
                     shared_lengths=jnp.asarray(shared))
    step.check()

    def run(step):
        fn = jax.jit(lambda q, kp, vp, step: step_attention(q, k_new, v_new, kp, vp, k_scale=k_scale,
                                                            v_scale=v_scale, step=step, dtype=jnp.bfloat16)[0])
        return np.asarray(fn(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), step).astype(jnp.float32))

    hlo = jax.jit(lambda q, kp, vp, step: step_attention(q, k_new, v_new, kp, vp, k_scale=k_scale, v_scale=v_scale,
                                                         step=step, dtype=jnp.bfloat16)[0]).lower(
        jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), step).as_text()
    assert "modelopt_paged_prefill_lse" in hlo and "modelopt_paged_decode" in hlo
    want = _reference(q[:40], k_pool, v_pool, tables, positions, k_scale, v_scale, page=page)
    got = run(step)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:40], want, atol=2.5e-2, rtol=2e-2)
    plain = run(dataclasses.replace(step, shared_tables=None, shared_rows=None, shared_lengths=None))
    np.testing.assert_allclose(got[:40], plain[:40], atol=2.5e-2, rtol=2e-2)
