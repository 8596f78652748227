"""The engine's step contract (``PagedStep``, ``AttentionConfig``) and the attention of a step that
mixes decode rows with prompt chunks.

Each field of the step has a shape rule that ``PagedStep.check`` enforces (one test per rule); the
attention paths are an argument of the traced program, never module state; and a mixed step's
attention equals a float64 reference computed here from the pools, on XLA (CPU, CI) and, on a GPU,
with the decode and prefill kernels in one program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modelopt_jax.ops import attention, native
from modelopt_jax.ops.paged_step import AttentionConfig, PagedStep, StepShape

PAGE = 16
XLA = AttentionConfig(page_size=PAGE)


def _mixed_step(seed, *, heads=8, kv_heads=2, head_dim=64, pool_dtype="bfloat16", dtype="float32",
                decodes=(1, 15, 16, 17, 100), prompts=((0, 5), (16, 16), (33, 20), (0, 1)), pad_decode=3,
                pad_prompt=6, config=XLA):
    """A step as the runner lays it out: decode rows (context c, one new token at position c)
    with padding rows after them, then prompt rows (cached prefix c, a chunk of m tokens), padding
    tokens last. Pages are handed out shuffled. Returns (step, q, k_new, v_new, k_pool, v_pool)."""
    rng = np.random.default_rng(seed)
    rows = [(c, 1) for c in decodes] + list(prompts)
    pages_needed = sum(-(-(c + m) // PAGE) for c, m in rows)
    num_pages = pages_needed + 4
    order = rng.permutation(np.arange(1, num_pages))
    width = max(-(-(c + m) // PAGE) for c, m in rows) + 1
    tables, taken = [], 0
    for c, m in rows:
        n = -(-(c + m) // PAGE)
        tables.append(np.pad(order[taken:taken + n], (0, width - n)))
        taken += n
    d = len(decodes) + pad_decode
    tables = tables[:len(decodes)] + [np.zeros(width, np.int64)] * pad_decode + tables[len(decodes):]
    ids, positions, slots, logit_index = [], [], [], []

    def slot(table, p):
        return int(table[p // PAGE] * PAGE + p % PAGE)
    for i, c in enumerate(decodes):
        positions.append(c)
        slots.append(slot(tables[i], c))
        logit_index.append(i)
    for _ in range(pad_decode):
        positions.append(0)
        slots.append(0)
        logit_index.append(len(positions) - 1)
    wq = max(m for _, m in prompts)
    prompt_tokens = np.full((len(prompts), wq), len(prompts) and sum(m for _, m in prompts) + pad_prompt, np.int32)
    k = 0
    for r, (c, m) in enumerate(prompts):
        table = tables[d + r]
        for j in range(m):
            prompt_tokens[r, j] = k
            positions.append(c + j)
            slots.append(slot(table, c + j))
            k += 1
        logit_index.append(d + k - 1)
    positions += [0] * pad_prompt
    slots += [0] * pad_prompt
    t = len(positions)
    ids = rng.integers(1, 100, t)
    i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    real = [1] * len(decodes) + [0] * pad_decode + [1] * k + [0] * pad_prompt
    step = PagedStep(i32(ids), i32(positions), i32(slots), i32(np.stack(tables)), i32(prompt_tokens), i32(logit_index),
                     d, config, real_tokens=i32(real))
    step.check()
    pool_shape = (num_pages * PAGE, kv_heads, head_dim)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape), pool_dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape), pool_dtype)
    q = jnp.asarray(rng.standard_normal((t, heads, head_dim)), dtype)
    k_new = jnp.asarray(rng.standard_normal((t, kv_heads, head_dim)), pool_dtype)
    v_new = jnp.asarray(rng.standard_normal((t, kv_heads, head_dim)), pool_dtype)
    return step, q, k_new, v_new, k_pool, v_pool


def _reference(step, q, k_new, v_new, k_pool, v_pool):
    """float64: the pools after the step's writes, each real token over its row's positions 0..its own."""
    k = np.asarray(k_pool, np.float64).copy()
    v = np.asarray(v_pool, np.float64).copy()
    slots = np.asarray(step.slots)
    k[slots], v[slots] = np.asarray(k_new, np.float64), np.asarray(v_new, np.float64)
    q = np.asarray(q, np.float64)
    t, h, dim = q.shape
    g = h // k.shape[1]
    d = step.num_decode
    row_of = {i: i for i in range(d)}
    for r, line in enumerate(np.asarray(step.prompt_tokens)):
        for j in line:
            if j < t - d:
                row_of[d + int(j)] = d + r
    out = np.full((t, h * dim), np.nan)
    tables, positions = np.asarray(step.block_tables), np.asarray(step.positions)
    for i, r in row_of.items():
        if not tables[r].any():
            continue  # a padding row
        pos = np.arange(positions[i] + 1)
        s = tables[r][pos // PAGE] * PAGE + pos % PAGE
        for head in range(h):
            scores = k[s, head // g] @ q[i, head] / np.sqrt(dim)
            p = np.exp(scores - scores.max())
            out[i, head * dim:(head + 1) * dim] = (p / p.sum()) @ v[s, head // g]
    return out


def _run(step, q, k_new, v_new, k_pool, v_pool):
    scale = 1.0 if k_pool.dtype == jnp.float8_e4m3fn else None  # FP8 pages carry a scale (1.0: codes are values)
    fn = jax.jit(lambda step, *a: attention.step_attention(*a, k_scale=scale, v_scale=scale, step=step, dtype=q.dtype))
    with jax.default_matmul_precision("highest"):  # float32 einsums on a GPU: not TF32
        return fn, fn(step, q, k_new, v_new, k_pool, v_pool)


def test_a_mixed_step_attends_each_row_over_its_own_pages():
    """Decode rows (at and across page edges, padding rows among them) and prompt rows (with and
    without a cached prefix, a one-token chunk, a chunk ending on a page edge) in one step: each real
    token equals the float64 reference, and the pools hold the step's keys/values at its slots."""
    case = _mixed_step(0)
    step = case[0]
    _, (out, k_pool, v_pool) = _run(*case)
    want = _reference(*case)
    real = ~np.isnan(want[:, 0])
    assert real.sum() == 5 + 42
    np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=2e-5, rtol=0)
    stored = np.asarray(step.slots)[np.asarray(step.slots) > 0]
    np.testing.assert_array_equal(np.asarray(k_pool)[stored].view(np.uint16),
                                  np.asarray(case[2])[np.asarray(step.slots) > 0].view(np.uint16))


def _recut(step, tile):
    """``step`` with each prompt row cut into rows of at most ``tile`` tokens (each with its sequence's
    block table), as the runner lays out prompt chunks where the prefill kernel runs."""
    d = step.num_decode
    tables, lines = np.asarray(step.block_tables), np.asarray(step.prompt_tokens)
    pad = step.num_tokens - d
    new_tables, new_lines = list(tables[:d]), []
    for r, line in enumerate(lines):
        real = line[line < pad]
        for cut in range(0, len(real), tile):
            new_tables.append(tables[d + r])
            new_lines.append(np.pad(real[cut:cut + tile], (0, tile - len(real[cut:cut + tile])), constant_values=pad))
    i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    out = dataclasses.replace(step, block_tables=i32(np.stack(new_tables)), prompt_tokens=i32(np.stack(new_lines)))
    out.check()
    return out


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_cutting_prompt_chunks_into_rows_changes_no_output(tile):
    """A prompt chunk may be laid out as several rows of one sequence (the runner's PROMPT_TILE rows,
    which make a program's shape depend on its token count alone): every token's output equals the
    one-row-per-sequence layout's and the float64 reference; the logits rows are untouched."""
    case = _mixed_step(2)
    step = case[0]
    cut = _recut(step, tile)
    assert cut.num_rows > step.num_rows and cut.logit_index.shape == step.logit_index.shape
    _, (out, k_pool, _) = _run(*case)
    _, (out_cut, k_pool_cut, _) = _run(cut, *case[1:])
    want = _reference(*case)
    real = ~np.isnan(want[:, 0])
    np.testing.assert_allclose(np.asarray(out_cut)[real], np.asarray(out)[real], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(out_cut)[real], want[real], atol=2e-5, rtol=0)
    # (padding tokens all write the scratch page 0, in no set order on a GPU)
    np.testing.assert_array_equal(np.asarray(k_pool_cut)[PAGE:], np.asarray(k_pool)[PAGE:])


def _packed(step, decodes, capacity):
    """``step`` (the split layout, its first ``decodes`` rows real decodes) in the packed layout: the
    real decode tokens, then the prompt section's tokens right after them, the decode section a
    capacity of ``capacity`` rows. Returns (packed step, index of each packed token in ``step``)."""
    d, t = step.num_decode, step.num_tokens
    idx = np.r_[0:decodes, d:t]
    tables = np.asarray(step.block_tables)
    lines = np.asarray(step.prompt_tokens)
    i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    taken = {name: i32(np.asarray(getattr(step, name))[idx]) for name in ("input_ids", "positions", "slots",
                                                                          "real_tokens")}
    logits = np.asarray(step.logit_index)
    logit_index = np.r_[np.arange(decodes), np.zeros(capacity - decodes, np.int64), logits[d:] - d + decodes]
    packed = PagedStep(**taken, block_tables=i32(np.concatenate([tables[:decodes], np.zeros((capacity - decodes,
                                                                 tables.shape[1]), np.int64), tables[d:]])),
                       prompt_tokens=i32(np.where(lines < t - d, lines + decodes, len(idx))),
                       logit_index=i32(logit_index), num_decode=capacity, attention=step.attention,
                       decode_count=i32(decodes))
    packed.check()
    return packed, idx


@pytest.mark.parametrize("capacity", [5, 8, 20])
def test_a_packed_step_equals_the_split_layout_and_float64(capacity):
    """The packed layout (decode tokens, then the prompt tokens right after them; the decode section
    a capacity of rows, some unused): every real token's output equals the split layout's and the
    float64 reference, the unused decode rows add nothing to the prompt tokens sitting at their
    indices, and the pools hold the same keys/values."""
    case = _mixed_step(3)
    step = case[0]
    packed, idx = _packed(step, 5, capacity)
    assert packed.num_tokens == step.num_tokens - 3  # the split layout's 3 padding decode rows are gone
    q, k_new, v_new = (a[idx] for a in case[1:4])
    _, (out, k_pool, _) = _run(*case)
    fn, (out_packed, k_pool_packed, _) = _run(packed, q, k_new, v_new, *case[4:])
    want = _reference(*case)[idx]
    real = ~np.isnan(want[:, 0])
    assert real.sum() == 5 + 42
    np.testing.assert_allclose(np.asarray(out_packed)[real], want[real], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(out_packed)[real], np.asarray(out)[idx][real], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(k_pool_packed)[PAGE:], np.asarray(k_pool)[PAGE:])
    # the decode count is an operand, not a shape: the same compiled program with 2 of the 5 decode rows
    # in use gives rows 2..4 nothing (no prompt row holds their tokens either) and the others the same
    fewer = dataclasses.replace(packed, decode_count=jnp.asarray(2, jnp.int32))
    with jax.default_matmul_precision("highest"):  # (as _run calls it: the precision is part of jit's key)
        out_fewer = np.asarray(fn(fewer, q, k_new, v_new, *case[4:])[0])
    assert fn._cache_size() == 1
    np.testing.assert_array_equal(out_fewer[2:5], 0)
    keep = np.r_[0:2, 5:len(idx)]
    np.testing.assert_array_equal(out_fewer[keep], np.asarray(out_packed)[keep])


def test_the_sections_of_a_mixed_step_equal_each_section_alone():
    """A decode row's output does not depend on prompt rows riding along, nor a prompt row's on
    decodes: the decode-only and prompt-only steps give the same rows, bit for bit on XLA."""
    step, q, k_new, v_new, k_pool, v_pool = _mixed_step(1)
    _, (mixed, _, _) = _run(step, q, k_new, v_new, k_pool, v_pool)
    d = step.num_decode
    decode_only = PagedStep(step.input_ids[:d], step.positions[:d], step.slots[:d], step.block_tables[:d],
                            jnp.zeros((0, 1), jnp.int32), step.logit_index[:d], d, step.attention,
                            real_tokens=step.real_tokens[:d])
    prompt_only = PagedStep(step.input_ids[d:], step.positions[d:], step.slots[d:], step.block_tables[d:],
                            step.prompt_tokens, step.logit_index[d:] - d, 0, step.attention,
                            real_tokens=step.real_tokens[d:])
    # each section alone over the pools the whole step writes (a mixed step's rows read disjoint pages)
    _, (alone_d, _, _) = _run(decode_only, q[:d], k_new[:d], v_new[:d], *_written(step, k_new, v_new, k_pool, v_pool))
    _, (alone_p, _, _) = _run(prompt_only, q[d:], k_new[d:], v_new[d:], *_written(step, k_new, v_new, k_pool, v_pool))
    real = ~np.isnan(_reference(step, q, k_new, v_new, k_pool, v_pool)[:, 0])  # padding reads the scratch page
    np.testing.assert_array_equal(np.asarray(mixed[:d])[real[:d]], np.asarray(alone_d)[real[:d]])
    np.testing.assert_array_equal(np.asarray(mixed[d:])[real[d:]], np.asarray(alone_p)[real[d:]])


def _written(step, k_new, v_new, k_pool, v_pool):
    return k_pool.at[step.slots].set(k_new), v_pool.at[step.slots].set(v_new)


def test_the_attention_config_is_an_argument_of_the_program():
    """Two configs are two programs (the config is static data of the step, part of jit's key), and
    no module global chooses a kernel any more."""
    traces = []

    @jax.jit
    def fn(step, q, k_new, v_new, k_pool, v_pool):
        traces.append(step.attention)
        return attention.step_attention(q, k_new, v_new, k_pool, v_pool, k_scale=None, v_scale=None, step=step,
                                        dtype=q.dtype)
    step, *rest = _mixed_step(2)
    fn(step, *rest)
    fn(step, *rest)
    fn(dataclasses.replace(step, attention=AttentionConfig(page_size=PAGE, decode_splits=2)), *rest)
    assert traces == [XLA, AttentionConfig(page_size=PAGE, decode_splits=2)]
    for name in ("DECODE_KERNEL", "PREFILL_KERNEL", "DECODE_SPLITS", "FUSED_PAGE_WRITE"):
        assert not hasattr(attention, name), name


def test_attention_config_resolves_from_the_platform_and_refuses_impossible_kernels():
    geometry = dict(num_heads=8, num_kv_heads=2, head_dim=64, pool_dtype="bfloat16", compute_dtype="bfloat16",
                    page_size=PAGE)
    cpu = AttentionConfig.resolve(platform="cpu", **geometry)
    assert (cpu.decode, cpu.prefill, cpu.reads_only_used_pages) == ("xla", "xla", False)
    with pytest.raises(ValueError, match="decode='kernel': the CUDA decode kernel does not serve"):
        AttentionConfig.resolve(platform="cpu", decode="kernel", **geometry)
    with pytest.raises(ValueError, match="prefill='kernel'"):
        AttentionConfig.resolve(platform="cpu", prefill="kernel", **geometry)
    with pytest.raises(ValueError, match="decode='turbo': choose one of fused_kernel, kernel, xla"):
        AttentionConfig(page_size=PAGE, decode="turbo")
    with pytest.raises(ValueError, match="page_size=0"):
        AttentionConfig(page_size=0)
    with pytest.raises(ValueError, match="decode_splits=0"):
        AttentionConfig(page_size=PAGE, decode_splits=0)
    f32 = AttentionConfig.resolve(platform="cpu", **dict(geometry, compute_dtype="float32"))
    assert f32.decode_variant == "staged"  # the tensor-core decode kernel does not serve float32 compute


# One test per field's shape rule: a step that breaks it is refused, naming the field.
def _broken(step, field):
    i32 = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    t, r, d = step.num_tokens, step.num_rows, step.num_decode
    return {
        "input_ids": dataclasses.replace(step, input_ids=i32(t + 1)),
        "positions": dataclasses.replace(step, positions=i32(t, 1)),
        "slots": dataclasses.replace(step, slots=i32(t - 1)),
        "block_tables": dataclasses.replace(step, block_tables=i32(r * 4)),
        "prompt_tokens": dataclasses.replace(step, prompt_tokens=i32(r - d + 1, 4)),
        "logit_index": dataclasses.replace(step, logit_index=i32(d - 1)),
        "num_decode": dataclasses.replace(step, num_decode=r + 1),
        "dtype": dataclasses.replace(step, slots=step.slots.astype(jnp.float32)),
        "real_tokens": dataclasses.replace(step, real_tokens=i32(t - 2)),
    }[field]


@pytest.mark.parametrize("field,match", [
    ("input_ids", r"PagedStep.positions has shape \(\d+,\), expected \(\d+,\) like input_ids"),
    ("positions", r"PagedStep.positions has shape \(\d+, 1\)"),
    ("slots", r"PagedStep.slots has shape"),
    ("block_tables", r"PagedStep.block_tables must be \[rows, pages\]"),
    ("prompt_tokens", r"PagedStep.prompt_tokens has shape \(5, 4\), expected \(4, width\)"),
    ("logit_index", r"PagedStep.logit_index has shape \(7,\), expected \(S,\) with S >= num_decode=8"),
    ("num_decode", r"PagedStep.num_decode=13 must be within"),
    ("dtype", r"PagedStep.slots must be int32, got float32"),
    ("real_tokens", r"PagedStep.real_tokens has shape \(\d+,\), expected \(\d+,\) like input_ids"),
])
def test_each_field_of_the_step_has_its_shape_rule(field, match):
    step = _mixed_step(3)[0]
    step.check()
    with pytest.raises(ValueError, match=match):
        _broken(step, field).check()


def test_a_step_with_prompt_tokens_but_no_prompt_rows_is_refused():
    step = _mixed_step(3)[0]
    d = step.num_decode
    bad = dataclasses.replace(step, block_tables=step.block_tables[:d], prompt_tokens=jnp.zeros((0, 4), jnp.int32),
                              logit_index=step.logit_index[:d])
    with pytest.raises(ValueError, match=r"PagedStep: \d+ prompt tokens but 0 prompt rows"):
        bad.check()


def test_step_shape_abstract_is_what_the_runner_builds():
    """A compiled program's operands (``StepShape.abstract``) have the shapes of a step of that shape."""
    step = _mixed_step(4)[0]
    shape = StepShape(decode_rows=step.num_decode, prompt_tokens=step.num_tokens - step.num_decode,
                      prompt_rows=step.prompt_tokens.shape[0], prompt_width=step.prompt_tokens.shape[1],
                      table_width=step.block_tables.shape[1],
                      prompt_seqs=step.logit_index.shape[0] - step.num_decode)
    abstract = shape.abstract(XLA)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), step)
    assert (shape.tokens, shape.rows) == (step.num_tokens, step.num_rows)
    packed, _ = _packed(step, 5, 8)
    shape = dataclasses.replace(shape, decode_rows=8, prompt_tokens=packed.num_tokens, packed=True)
    abstract = shape.abstract(XLA)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), packed)
    assert (shape.tokens, shape.rows, shape.sampled_rows) == (packed.num_tokens, packed.num_rows,
                                                               packed.logit_index.shape[0])


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(),
                    reason="CUDA paged attention kernels not built")
@pytest.mark.parametrize("pool_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_mixed_step_runs_both_kernels_and_matches_float64(pool_dtype, packed):
    """On CUDA a mixed step is one program holding the decode kernel (decode rows) and the prefill
    kernel (prompt rows); each real token is within bf16 tolerance of float64. Packed: the decode
    kernel also runs over rows with no keys (the unused capacity, prompt tokens at their indices),
    whose outputs must add nothing."""
    config = AttentionConfig(page_size=PAGE, decode="kernel", prefill="kernel")
    case = _mixed_step(5, pool_dtype=pool_dtype, dtype="bfloat16", config=config)
    want = _reference(*case)
    if packed:
        step, idx = _packed(case[0], 5, 16)
        case = (step, *(a[idx] for a in case[1:4]), *case[4:])
        want = want[idx]
    fn, (out, _, _) = _run(*case)
    hlo = fn.lower(*case).compile().as_text()
    assert "modelopt_paged_decode" in hlo and "modelopt_paged_prefill" in hlo
    real = ~np.isnan(want[:, 0])
    got = np.asarray(out, np.float64)[real]
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - want[real]) / np.linalg.norm(want[real])
    assert err < 2e-2, err
