"""Which programs the engine's steps run: mixed steps split into a decode and a prompt program (the
default) or packed into one program keyed by their token count, the kernels' prompt rows cut into
tiles, and the finite program table compiled at start-up.

Correctness is stated against the engine's other layout (one program per mixed step, one prompt
row per sequence) on the unquantized float32 checkpoint: the same tokens, log-probs to float32
summation order. The kernels' layout runs on a CPU through the XLA fallbacks that the kernels'
``platform_dependent`` calls lower to there, so its shapes and program table are checked here.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.engine import Engine, EngineConfig
from modelopt_jax.engine.buckets import (FINE_PROMPT_SIZES, decode_buckets, floor_token_bucket, token_bucket,
                                        token_buckets)
from modelopt_jax.engine.step_programs import PLAIN_DECODE_ROWS, PROMPT_TILE
from modelopt_jax.errors import ConfigError
from modelopt_jax.ops.paged_step import AttentionConfig

KERNELS = AttentionConfig(16, decode="fused_kernel", prefill="kernel")


@pytest.fixture(scope="module")
def llm():
    return LLM(str(fixture_dir("qwen2-bytes-bf16")), quantization=None, dtype="float32", max_model_len=256,
               compilation_cache_dir=None, kv_cache_bytes=64 << 20, max_num_seqs=8)


def _engine(llm, attention=None, **config):
    # one forward a launch: the tables below hold no multi-step programs (tests/test_multi_step.py has those)
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=128, kv_cache_bytes=64 << 20, precompile_samplers=(),
                    decode_steps=1)
    return Engine(llm.model, max_model_len=llm.max_model_len, pad_id=llm.engine.runner.pad_id,
                  config=EngineConfig(**{**defaults, **config}), attention=attention)


def _workload(seed=0):
    """Prompts of 3-150 tokens (several PROMPT_TILE rows; chunked across steps by a 128-token budget)
    arriving while others decode: steps hold decodes and prompt chunks together."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 256, int(n)).tolist() for n in (3, 150, 40, 70, 9, 130, 64, 65, 17, 100)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, logprobs=1) for m in rng.integers(4, 12, len(prompts))]
    return prompts, params


def _run(llm, engine, prompts, params):
    llm.engine = engine
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, dict(engine.last_stats)


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob, atol=1e-4)


@pytest.fixture(scope="module")
def one_program(llm):
    """The mixed workload (``_workload()``) in the one-program layout, split nor packed: the outputs
    both other layouts are held to, and its stats."""
    original = llm.engine
    try:
        return _run(llm, _engine(llm, split_steps=False, packed_steps=False), *_workload())
    finally:
        llm.engine = original


def _run_layout(llm, **layout):
    """The mixed workload under an engine of ``layout``: (outputs, stats, engine)."""
    original = llm.engine
    try:
        engine = _engine(llm, **layout)
        return (*_run(llm, engine, *_workload()), engine)
    finally:
        llm.engine = original


def test_mixed_steps_as_two_programs_give_what_one_program_gives(llm, one_program):
    """A step holding decode rows and prompt chunks runs as a decode program and a prompt program
    (one copy back): every request's tokens and log-probs equal the one-program step's, such steps
    count as mixed steps, and no program holds both kinds of row."""
    one, one_stats = one_program
    two, two_stats, engine = _run_layout(llm, packed_steps=False)
    _assert_same(two, one)
    # (the budgets differ: a split step's prompt chunks fill a prompt-token bucket, so chunks differ too)
    assert two_stats["mixed_steps"] > 0 and one_stats["mixed_steps"] > 0
    assert all(p.shape.decode_rows == 0 or p.shape.prompt_tokens == 0 for p in engine.runner.shapes)
    assert two_stats["free_pages_after"] == two_stats["num_pages"] - 1  # (cached pages nobody holds count as free)


def test_packed_steps_give_what_one_program_gives_with_prompt_tokens_right_after_the_decodes(llm, one_program):
    """The packed layout runs a step holding decode rows and prompt chunks as one program of
    token_bucket(decodes + prompt tokens) tokens: every request's tokens and log-probs equal the
    one-program layout's, every program with prompt tokens is packed, and the scheduler fills a busy
    step's bucket with decodes and prompt tokens together."""
    packed, stats, engine = _run_layout(llm, packed_steps=True)
    _assert_same(packed, one_program[0])
    assert stats["mixed_steps"] > 0
    fine = engine.config.fine_prompt_buckets
    shapes = [p.shape for p in engine.runner.shapes]
    assert all(s.packed and s.tokens == token_bucket(s.tokens, fine=fine) for s in shapes if s.prompt_tokens)
    assert any(s.packed and s.decode_rows for s in shapes)  # a program that held decodes and prompt tokens
    assert stats["free_pages_after"] == stats["num_pages"] - 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU these attention paths are the CUDA kernels, "
                    "which round float32 to bf16 (tests/test_engine_gpu.py runs them)")
@pytest.mark.parametrize("packed", [True, False])
def test_kernel_layout_cuts_prompts_into_tiles_and_runs_only_table_programs(llm, packed):
    """Where the kernels run (here: their XLA fallbacks), prompt chunks are cut into rows of
    PROMPT_TILE tokens, so a prompt program's shape depends on its token bucket alone: the engine
    compiles the table (decode-row buckets + prompt-token buckets, packed or not) at start-up, a
    greedy run then compiles nothing, and its outputs equal the XLA layout's."""
    original = llm.engine
    try:
        prompts, params = _workload(1)
        greedy = [dataclasses.replace(p, logprobs=None) for p in params]
        want, _ = _run(llm, _engine(llm), prompts, greedy)
        engine = _engine(llm, KERNELS, precompile_samplers=("greedy",), packed_steps=packed)
        assert engine.runner.has_program_table
        table = engine.runner.program_table(128)
        assert len(table) == len(decode_buckets(8)) + len(token_buckets(128)) == 1 + 4
        assert engine.precompiled == len(table) and engine.runner.compiled_programs == set(table)
        got, stats = _run(llm, engine, prompts, greedy)
    finally:
        llm.engine = original
    _assert_same(got, want)
    assert stats["inline_compiles"] == 0 and stats["mixed_steps"] > 0
    assert engine.runner.shapes <= set(table)
    # some prompt program really held a chunk longer than one tile
    assert any(p.shape.prompt_width == PROMPT_TILE and p.shape.prompt_tokens > PROMPT_TILE
               for p in engine.runner.shapes)


def test_prompt_token_buckets_with_and_without_the_fine_sizes():
    """Powers of two up to 1024 and multiples of 1024 above; with ``fine`` also 384, 768 and 1536.
    A step's prompt tokens pad to the smallest size that holds them, a budget rounds down to the
    largest size it holds, and ``token_buckets`` lists every size a step can pad to."""
    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert token_buckets(8192, fine=True) == sorted(token_buckets(8192) + list(FINE_PROMPT_SIZES))
    assert token_buckets(300, fine=True) == [16, 32, 64, 128, 256, 384]
    for fine in (False, True):
        sizes = token_buckets(20000, fine=fine)
        for n in range(1, 20001):
            assert token_bucket(n, fine=fine) == min(s for s in sizes if s >= max(n, 16)), (n, fine)
            assert floor_token_bucket(n, fine=fine) == (n if n < 16 else max(s for s in sizes if s <= n)), (n, fine)
    assert [token_bucket(n) for n in (300, 600, 1100)] == [512, 1024, 2048]
    assert [token_bucket(n, fine=True) for n in (300, 600, 1100)] == [384, 768, 1536]


@pytest.mark.parametrize("fine", [False, True])
def test_fine_prompt_buckets_pad_a_step_less_and_run_from_the_table(llm, fine):
    """With ``fine_prompt_buckets`` (the default) two prompts of 150 tokens admitted together pad to a
    384-token prompt program, not 512; the table holds that program, nothing compiles in line, and
    the tokens equal the XLA layout's and the powers-of-two run's."""
    original = llm.engine
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, 150).tolist() for _ in range(2)]
    greedy = [SamplingParams(max_tokens=5, ignore_eos=True)] * 2
    try:
        want, _ = _run(llm, _engine(llm, max_num_batched_tokens=512), prompts, greedy)
        engine = _engine(llm, KERNELS, precompile_samplers=("greedy",), max_num_batched_tokens=512,
                         fine_prompt_buckets=fine)
        table = engine.runner.program_table(512)
        got, stats = _run(llm, engine, prompts, greedy)
    finally:
        llm.engine = original
    _assert_same(got, want)
    assert stats["inline_compiles"] == 0 and engine.runner.shapes <= set(table)
    prompt_sizes = {p.shape.prompt_tokens for p in engine.runner.shapes if p.shape.prompt_tokens}
    assert prompt_sizes == ({384} if fine else {512})
    assert (384 in {p.shape.prompt_tokens for p in table}) == fine


@pytest.mark.parametrize("cascade_group", [0, 4])
def test_packed_mixed_steps_run_from_the_table_one_program_per_token_bucket(llm, cascade_group):
    """Where the kernels run, a packed program's decode section has room for every decode row a step
    of its tokens can hold (min(T, the largest decode bucket)), so the table holds one packed program
    per token bucket, beside the decode buckets; mixed and prompt-only steps run from it and nothing
    compiles in line. Tokens and log-probs equal the XLA layout's. With cascade attention the packed
    programs keep the cascade part (only decode-only steps switch to a plain twin: the GPU run of
    2026-12-07 met a mixed step that switched, and compiled it in line)."""
    original = llm.engine
    try:
        prompts, params = _workload(3)
        greedy = [dataclasses.replace(p, logprobs=None) for p in params]
        want, _ = _run(llm, _engine(llm), prompts, greedy)
        attention = dataclasses.replace(KERNELS, cascade_group=cascade_group)
        engine = _engine(llm, attention, precompile_samplers=("greedy",), max_num_seqs=16, packed_steps=True)
        runner = engine.runner
        assert runner.max_decode_rows == 16
        table = runner.program_table(128)
        packed = sorted((p.shape.tokens, p.shape.decode_rows) for p in table if p.shape.packed)
        assert packed == [(16, 16), (32, 16), (64, 16), (128, 16)]
        assert all(p.shape.cascade == bool(cascade_group) for p in table if p.shape.packed)
        decode_programs = len(decode_buckets(16)) * (2 if cascade_group else 1)  # plain twins of small buckets
        assert len(table) == decode_programs + len(token_buckets(128))
        got, stats = _run(llm, engine, prompts, greedy)
    finally:
        llm.engine = original
    _assert_same(got, want)
    assert stats["inline_compiles"] == 0 and runner.shapes <= set(table)
    assert stats["mixed_steps"] > 0 and all(p.shape.packed for p in runner.shapes if p.shape.prompt_tokens)
    assert stats["free_pages_after"] == stats["num_pages"] - 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="see above")
def test_a_program_outside_the_table_compiles_in_line_and_is_counted(llm):
    """Log-probs and samplers outside the precompiled table still run (compiled on first use), and
    ``inline_compiles`` says how many programs a run waited for."""
    original = llm.engine
    try:
        engine = _engine(llm, KERNELS, precompile_samplers=("greedy",))
        _, stats = _run(llm, engine, [[5, 6, 7, 8]], [SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True)])
    finally:
        llm.engine = original
    assert stats["inline_compiles"] == 2  # its prompt program and its decode program, with log-probs


def test_the_program_table_is_refused_where_programs_have_no_table(llm):
    """XLA's attention gathers a power of two of pages per step: its programs form no table, and
    asking for one is an error rather than a table that steps would not use."""
    engine = llm.engine
    assert not engine.runner.has_program_table  # the CPU's default paths
    with pytest.raises(ValueError, match="form a table only where"):
        engine.runner.program_table(128)
    assert engine.precompiled == 0


@pytest.mark.parametrize("field,value,match", [
    ("split_steps", 1, "split_steps=1 must be a bool"),
    ("packed_steps", 1, "packed_steps=1 must be a bool"),
    ("packed_steps", None, "packed_steps=None must be a bool"),
    ("precompile_samplers", ["greedy"], "precompile_samplers=\\['greedy'\\] must be a tuple of"),
    ("precompile_samplers", ("beam",), "must be a tuple of 'greedy', 'tempered', 'truncated'"),
])
def test_bad_step_program_settings_are_typed_errors(field, value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{field: value})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="see above")
def test_decode_steps_without_a_shared_prefix_run_the_program_without_cascade_attention(llm):
    """With cascade attention (cascade_group > 0), the table holds each small decode bucket twice: with
    the cascade part and without it. A step where no row shares a prefix runs the program without it
    (the cascade part's launches cost a few-millisecond step several percent); n samples of one long
    prompt share it and run the cascade program. Neither waits for a compile, and the tokens are the
    same either way."""
    original = llm.engine
    cascade = dataclasses.replace(KERNELS, cascade_group=4)
    rng = np.random.default_rng(2)
    alone = [rng.integers(1, 256, 100).tolist()]
    shared = rng.integers(1, 256, 100).tolist()
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    try:
        engine = _engine(llm, cascade, precompile_samplers=("greedy",))
        table = engine.runner.program_table(128)
        decode = [p.shape for p in table if p.shape.decode_rows and not p.shape.prompt_tokens]
        assert sorted((s.decode_rows, s.cascade) for s in decode) == [(8, False), (8, True)]
        assert PLAIN_DECODE_ROWS >= 8
        _, stats = _run(llm, engine, alone, [greedy])
        assert {p.shape.cascade for p in engine.runner.shapes if p.shape.decode_rows and not p.shape.prompt_tokens} == {False}
        assert stats["shared_prefix_rows"] == 0 and stats["inline_compiles"] == 0
        engine.runner.shapes.clear()
        got, stats = _run(llm, engine, [shared], [dataclasses.replace(greedy, n=3)])
        # (the first sample decodes alone for a step while the others take the prompt's pages: plain)
        assert True in {p.shape.cascade for p in engine.runner.shapes if p.shape.decode_rows and not p.shape.prompt_tokens}
        assert stats["shared_prefix_rows"] > 0 and stats["inline_compiles"] == 0
        want, _ = _run(llm, _engine(llm, KERNELS), [shared], [dataclasses.replace(greedy, n=3)])
    finally:
        llm.engine = original
    assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in want[0].outputs]


def test_a_prompt_step_stores_its_keys_and_values_with_plain_stores(llm):
    """The prompt program's page writes are scatters that declare their indices unique (a step's
    real tokens never share a slot), so XLA's GPU emitter stores each element plainly instead of
    an atomic read-modify-write per element; every pool scatter of the program says so."""
    engine = _engine(llm, KERNELS)
    runner = engine.runner
    (key,) = [p for p in runner.program_table(128) if p.shape.prompt_tokens == 128]
    text = runner._step.lower(key, *runner._abstract_operands(key)).as_text()
    # (unique flag, operand type) of every scatter: its attributes open it, its signature closes it
    scatters = re.findall(r'"stablehlo\.scatter".*?unique_indices = (\w+).*?\}\) : \((tensor<[^>]*>)', text, re.S)
    data = runner.cache.keys[0].data  # [pages * page size, kv heads, head dim]
    assert data.dtype == np.float32
    pool_type = f"tensor<{'x'.join(map(str, data.shape))}xf32>"
    pool_scatters = [unique for unique, operand in scatters if operand == pool_type]
    assert len(pool_scatters) == 2 * len(runner.cache.keys), scatters  # keys and values, every layer
    assert set(pool_scatters) == {"true"}, scatters
