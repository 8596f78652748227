"""Paged attention (``modelopt_jax.ops.attention.paged_attention``) against a float64 reference.

Every case draws a pool of random keys/values (bf16, f16 or FP8 codes with a static scale), block
tables of shuffled, non-contiguous pages, and tokens from several sequences with ragged lengths
that start, end and cross page boundaries -- decode tokens (one per sequence) and prompt chunks
(many per sequence) packed side by side. The reference decodes the stored values exactly as the
cache is read (code * scale in float32, rounded to the compute dtype), then computes each token's
softmax attention over its own sequence up to its position in float64.

The XLA path runs everywhere; its two layouts (per-token and flat) are both exercised. The CUDA
kernel runs on a GPU with the native library built: its output is aliased to a NaN-filled operand,
so an element it fails to write shows, and the compiled HLO must hold the custom call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from modelopt_jax.ops import attention, native
from modelopt_jax.ops.attention import kernel_splits, paged_attention

E4M3 = ml_dtypes.float8_e4m3fn


def _case(seed, *, heads, kv_heads, head_dim, page, lengths_and_new, pool_dtype, dtype):
    """Pools, tables and a packed batch: sequence i has ``lengths_and_new[i] = (context, new)`` tokens,
    its last ``new`` positions being this step's queries."""
    rng = np.random.default_rng(seed)
    rows = len(lengths_and_new)
    pages_per_row = [-(-ctx // page) for ctx, _ in lengths_and_new]
    num_pages = 1 + sum(pages_per_row) + 3                       # page 0 scratch, a few never used
    order = rng.permutation(np.arange(1, num_pages))
    width = max(pages_per_row) + 2
    tables = np.zeros((rows, width), np.int32)
    used = 0
    for r, n in enumerate(pages_per_row):
        tables[r, :n] = order[used:used + n]
        used += n
    slots = num_pages * page
    values = rng.standard_normal((2, slots, kv_heads, head_dim)).astype(np.float32) * 2
    k_scale = v_scale = None
    if pool_dtype == "float8_e4m3fn":
        k_scale, v_scale = 0.0173, 0.0121
        k_pool = (values[0] / k_scale).clip(-448, 448).astype(E4M3)
        v_pool = (values[1] / v_scale).clip(-448, 448).astype(E4M3)
    else:
        k_pool, v_pool = (values[i].astype(jnp.dtype(pool_dtype)) for i in (0, 1))
    token_rows, positions = [], []
    row_tokens = np.full((rows, 1 << max(n for _, n in lengths_and_new).bit_length()), -1, np.int32)
    for r, (ctx, new) in enumerate(lengths_and_new):
        row_tokens[r, :new] = np.arange(len(positions), len(positions) + new)
        token_rows += [r] * new
        positions += list(range(ctx - new, ctx))
    t = len(positions)
    row_tokens[row_tokens < 0] = t  # padding
    q = (rng.standard_normal((t, heads, head_dim)) * 1.5).astype(np.float32).astype(jnp.dtype(dtype))
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, k_scale=k_scale, v_scale=v_scale, page_size=page,
                token_rows=np.asarray(token_rows, np.int32), positions=np.asarray(positions, np.int32),
                block_tables=tables, dtype=dtype, row_tokens=row_tokens)


STATIC = ("k_scale", "v_scale", "page_size", "dtype")


def _split(c) -> tuple[dict, dict]:
    """A case as paged_attention's (array arguments, as jax arrays; static arguments)."""
    arrays = {k: jnp.asarray(v) for k, v in c.items() if k not in STATIC}
    return arrays, {k: c[k] for k in STATIC}


def _decoded(pool, scale, dtype) -> np.ndarray:
    x = pool.astype(np.float32) * np.float32(scale) if scale is not None else pool.astype(np.float32)
    return x.astype(jnp.dtype(dtype)).astype(np.float64)


def _reference(c) -> np.ndarray:  # row_tokens only says where tokens are; the reference does not need it
    k = _decoded(c["k_pool"], c["k_scale"], c["dtype"])
    v = _decoded(c["v_pool"], c["v_scale"], c["dtype"])
    q = np.asarray(c["q"], np.float64)
    t, h, d = q.shape
    g = h // k.shape[1]
    page = c["page_size"]
    out = np.zeros((t, h, d))
    for i in range(t):
        table = c["block_tables"][c["token_rows"][i]]
        pos = np.arange(c["positions"][i] + 1)
        slots = table[pos // page] * page + pos % page
        for head in range(h):
            scores = k[slots, head // g] @ q[i, head] / np.sqrt(d)
            p = np.exp(scores - scores.max())
            out[i, head] = (p / p.sum()) @ v[slots, head // g]
    return out.reshape(t, h * d)


# (context, new) per sequence: decode rows (new = 1) at and around page edges, prompt chunks
# with and without a cached prefix.
DECODE = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (257, 1)]
MIXED = [(1, 1), (33, 1), (40, 40), (70, 23), (16, 16), (129, 1), (48, 17)]
CASES = [
    # heads, kv_heads, head_dim, page, rows
    (8, 2, 32, 16, DECODE),    # per-token layout (rows * group >= head_dim)
    (8, 2, 64, 16, MIXED),     # flat layout on XLA
    (4, 4, 64, 8, MIXED),      # no GQA, small pages
    (14, 2, 64, 16, DECODE),   # group of 7 (Qwen2)
]


def _tolerance(dtype, pool_dtype):
    return 2e-2 if "bfloat16" in (dtype, pool_dtype) else 4e-3  # relative Frobenius error; bf16 rounds at 4e-3


@pytest.mark.parametrize("pool_dtype,dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                              ("float8_e4m3fn", "float32"), ("float8_e4m3fn", "bfloat16")])
@pytest.mark.parametrize("shape", range(len(CASES)))
@pytest.mark.parametrize("per_row", [True, False])
def test_xla_paged_attention_matches_float64(shape, pool_dtype, dtype, per_row):
    """Per row (the engine's prompt steps) and per token / flat (chosen by cost without ``row_tokens``)."""
    heads, kv_heads, head_dim, page, rows = CASES[shape]
    c = _case(shape, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, lengths_and_new=rows,
              pool_dtype=pool_dtype, dtype=dtype)
    args, static = _split(c)
    if not per_row:
        args["row_tokens"] = None
    got = np.asarray(paged_attention(**args, **static, backend="xla"), np.float64)
    want = _reference(c)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    # float32 einsums: exact-ish on CPU; on a GPU, XLA's default precision is TF32 (10-bit mantissa)
    f32 = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    assert err < (f32 if dtype == "float32" else _tolerance(dtype, pool_dtype)), err


def test_splits_fill_the_gpu_and_stay_within_the_table():
    assert kernel_splits(1, 8, 256, 132) == 32          # one sequence: as many splits as allowed
    assert kernel_splits(64, 8, 256, 132) == 2
    assert kernel_splits(4096, 8, 256, 132) == 1
    assert kernel_splits(1, 8, 3, 132) == 3              # never more splits than pages
    assert kernel_splits(64, 8, 256, 132, page_bytes=1) == 1  # FP8 pages: 3 waves
    assert kernel_splits(1, 8, 256, 132, page_bytes=1) == 32


@pytest.mark.parametrize("pool_dtype,dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                              ("float8_e4m3fn", "bfloat16"), ("float8_e4m3fn", "float32")])
@pytest.mark.parametrize("shape", [1, 2, 3, 4])
@pytest.mark.parametrize("variant", ["mma", "staged"])
@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged attention kernel not built")
def test_cuda_kernel_matches_float64_and_writes_every_element(shape, pool_dtype, dtype, variant):
    if variant == "mma" and not attention.tensor_cores_serve(pool_dtype, dtype):
        assert attention.decode_kernel_variant(variant, pool_dtype, dtype) == "staged"  # float32 compute falls back
    cases = CASES + [(32, 8, 128, 16, [(1024, 1)] * 3 + [(4000, 1), (2, 1)] + MIXED)]  # Llama-3-8B heads
    heads, kv_heads, head_dim, page, rows = cases[shape]
    c = _case(10 + shape, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, lengths_and_new=rows,
              pool_dtype=pool_dtype, dtype=dtype)
    args, static = _split(c)
    t = len(c["positions"])
    poison = jnp.full((t, heads, head_dim), jnp.nan, jnp.float32)
    fn = jax.jit(lambda a, o: paged_attention(**a, **static, backend="kernel", out_init=o, decode_variant=variant))
    hlo = fn.lower(args, poison).compile().as_text()
    assert "modelopt_paged_decode_poisoned" in hlo
    got = np.asarray(fn(args, poison), np.float64)
    assert np.isfinite(got).all()
    want = _reference(c)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < _tolerance(dtype, pool_dtype), err
    xla = np.asarray(paged_attention(**args, **static, backend="xla"), np.float64)
    assert np.linalg.norm(got - xla) / np.linalg.norm(xla) < _tolerance(dtype, pool_dtype)


# Prompt steps as the engine packs them: chunks with and without a cached prefix, a decode row
# riding along, rows of different widths, contexts across many 64-key tiles and page edges.
PREFILL_CASES = [
    # heads, kv_heads, head_dim, page, rows
    (32, 8, 128, 16, [(1024, 1024), (700, 300), (2000, 77), (1, 1), (64, 64), (129, 1)]),  # Llama-3-8B heads
    (8, 2, 64, 16, MIXED),
    (4, 4, 64, 8, MIXED),                     # no GQA, small pages
    (14, 2, 64, 16, MIXED + [(300, 130)]),    # group of 7 (Qwen2): a CTA's rows straddle tokens
    (16, 2, 128, 24, [(500, 200), (97, 97), (30, 3)]),  # group of 8; a page size that is not a power of two
]


@pytest.mark.parametrize("pool_dtype,dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                              ("float16", "bfloat16"), ("float8_e4m3fn", "bfloat16")])
@pytest.mark.parametrize("shape", range(len(PREFILL_CASES)))
@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged prefill kernel not built")
def test_cuda_prefill_kernel_matches_float64_and_writes_every_element(shape, pool_dtype, dtype):
    heads, kv_heads, head_dim, page, rows = PREFILL_CASES[shape]
    c = _case(40 + shape, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, lengths_and_new=rows,
              pool_dtype=pool_dtype, dtype=dtype)
    want = _reference(c)
    real = len(c["positions"])
    # step padding, as the engine packs it: tokens in no row (their outputs must read zeros)
    pad = 5
    c["q"] = np.concatenate([c["q"], np.ones((pad, heads, head_dim), c["q"].dtype)])
    c["positions"] = np.concatenate([c["positions"], np.zeros(pad, np.int32)])
    c["token_rows"] = np.concatenate([c["token_rows"], np.zeros(pad, np.int32)])
    c["row_tokens"][c["row_tokens"] == real] = real + pad
    args, static = _split(c)
    # poisoned in the compute dtype: the output the engine's prompt steps take (bf16 or f16 stores)
    poison = jnp.full((real + pad, heads, head_dim), jnp.nan, dtype)
    fn = jax.jit(lambda a, o: paged_attention(**a, **static, backend="prefill_kernel", out_init=o))
    hlo = fn.lower(args, poison).compile().as_text()
    assert "modelopt_paged_prefill_poisoned" in hlo
    got = np.asarray(fn(args, poison), np.float64)
    assert np.isfinite(got).all()  # every token's output was written, padding included
    assert (got[real:] == 0).all()
    got = got[:real]
    for key in ("q", "positions", "token_rows"):
        c[key] = c[key][:real]
    c["row_tokens"][c["row_tokens"] == real + pad] = real
    args, static = _split(c)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < _tolerance(dtype, pool_dtype), err
    # row by row too: a wrong mask on one short row would hide in the long rows' norm
    for r in range(len(rows)):
        mine = c["token_rows"] == r
        row_err = np.linalg.norm(got[mine] - want[mine]) / np.linalg.norm(want[mine])
        assert row_err < _tolerance(dtype, pool_dtype), (r, row_err)
    xla = np.asarray(paged_attention(**args, **static, backend="xla"), np.float64)
    assert np.linalg.norm(got - xla) / np.linalg.norm(xla) < _tolerance(dtype, pool_dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prefill_kernel_takes_q_and_gives_its_output_in_the_compute_dtype(dtype):
    """No float32 copy of a prompt step's q or attention output: the op's CUDA lowering (made here
    on any machine) passes q and returns the output in bf16 / f16, beside the pools."""
    heads, kv_heads, head_dim, page, rows = PREFILL_CASES[1]
    c = _case(7, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, lengths_and_new=rows,
              pool_dtype=dtype, dtype=dtype)
    args, static = _split(c)
    text = jax.jit(lambda a: paged_attention(**a, **static, backend="prefill_kernel")).trace(args).lower(
        lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "custom_call @modelopt_paged_prefill(" in line)
    el = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    t = len(c["positions"])
    signature = call.rsplit(" : ", 1)[1]
    assert signature.startswith(f"(tensor<{t}x{heads}x{head_dim}x{el}>"), signature
    assert signature.endswith(f"-> tensor<{t}x{heads}x{head_dim}x{el}>"), signature


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged prefill kernel not built")
def test_auto_runs_the_prefill_kernel_for_bf16_prompt_chunks_and_xla_for_float32():
    heads, kv_heads, head_dim, page, rows = PREFILL_CASES[1]
    for dtype, target in [("bfloat16", "modelopt_paged_prefill"), ("float32", None)]:
        c = _case(5, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page, lengths_and_new=rows,
                  pool_dtype="bfloat16", dtype=dtype)
        args, static = _split(c)
        hlo = jax.jit(lambda a: paged_attention(**a, **static)).lower(args).compile().as_text()
        if target:
            assert target in hlo
        else:
            assert "modelopt_paged" not in hlo


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged attention kernel not built")
def test_cuda_kernel_is_what_auto_runs_on_gpu():
    c = _case(3, heads=8, kv_heads=2, head_dim=64, page=16, lengths_and_new=DECODE, pool_dtype="bfloat16",
              dtype="bfloat16")
    args, static = _split(c)
    hlo = jax.jit(lambda a: paged_attention(**a, **static)).lower(args).compile().as_text()
    assert "modelopt_paged_decode" in hlo


def _decode_step(seed, pool_dtype, *, heads=32, kv_heads=8, head_dim=128, page=16,
                 contexts=(1024, 1, 17, 16, 300, 2000, 64, 5, 100, 65, 129)):
    """A decode step as the engine packs it: one token per sequence at its last position (one past
    what its pages held), padding tokens of row 0 at position 0 writing to the scratch page 0,
    row_tokens one wide. Returns the case plus the step's new stored rows and slots."""
    c = _case(seed, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page=page,
              lengths_and_new=[(n, 1) for n in contexts], pool_dtype=pool_dtype, dtype="bfloat16")
    rng = np.random.default_rng(seed + 1)
    rows, pad = len(contexts), 4
    positions = np.concatenate([c["positions"], np.zeros(pad, np.int32)])
    token_rows = np.concatenate([c["token_rows"], np.zeros(pad, np.int32)])
    tables = c["block_tables"]
    slots = tables[token_rows, positions // page] * page + positions % page
    slots[rows:] = np.arange(pad)  # padding: the scratch page 0
    new = rng.standard_normal((2, rows + pad, kv_heads, head_dim)).astype(np.float32) * 2
    if pool_dtype == "float8_e4m3fn":
        k_new = (new[0] / c["k_scale"]).clip(-448, 448).astype(E4M3)
        v_new = (new[1] / c["v_scale"]).clip(-448, 448).astype(E4M3)
    else:
        k_new, v_new = (new[i].astype(jnp.dtype(pool_dtype)) for i in (0, 1))
    q = np.concatenate([c["q"], np.asarray(rng.standard_normal((pad, heads, head_dim)), c["q"].dtype)])
    c.update(q=q, positions=positions.astype(np.int32), token_rows=token_rows.astype(np.int32),
             row_tokens=np.arange(rows, dtype=np.int32)[:, None])
    return c, k_new, v_new, slots.astype(np.int32)


@pytest.mark.parametrize("pool_dtype", ["bfloat16", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("variant", ["mma", "staged"])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged decode write kernel not built")
def test_cuda_fused_page_write_equals_scatter_then_kernel(pool_dtype, variant, splits):
    """The decode kernel that writes the step's keys/values itself leaves the pools bit for bit as a
    scatter does and attends over them bit for bit as the plain kernel does after the scatter (the
    same kernel reads the same bytes); its output also matches the float64 reference over the
    written pools. Real tokens' rows sit at page starts, page ends and mid-page, and (the MMA
    kernel stores as late as it can) in a CTA's first 64-key tile, its second and later ones."""
    dtype = "float16" if pool_dtype == "float16" else "bfloat16"
    c, k_new, v_new, slots = _decode_step(5, pool_dtype)
    c["dtype"] = dtype
    c["q"] = c["q"].astype(jnp.dtype(dtype))
    args, static = _split(c)
    new = (jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))

    def run(backend):
        def step(a, k_new, v_new, slots):
            rest = {k: v for k, v in a.items() if k not in ("q", "k_pool", "v_pool")}
            return attention.paged_write_attention(a["q"], k_new, v_new, a["k_pool"], a["v_pool"], slots, **rest,
                                                   **static, backend=backend, decode_variant=variant,
                                                   decode_splits=splits)
        return jax.jit(step)

    fused = run("fused_kernel")
    assert "modelopt_paged_decode_write" in fused.lower(args, *new).compile().as_text()
    out, k_pool, v_pool = fused(args, *new)
    want_out, want_k, want_v = run("kernel")(args, *new)  # scatter, then the plain decode kernel
    assert "modelopt_paged_decode_write" not in run("kernel").lower(args, *new).compile().as_text()
    np.testing.assert_array_equal(np.asarray(k_pool).view(np.uint8), np.asarray(want_k).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v_pool).view(np.uint8), np.asarray(want_v).view(np.uint8))
    rows = len(c["row_tokens"])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[:rows], np.asarray(want_out, np.float32)[:rows])
    written = dict(c, k_pool=np.asarray(k_pool), v_pool=np.asarray(v_pool))
    want = _reference(written)[:rows]
    got = np.asarray(out, np.float64)[:rows]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < _tolerance(dtype, pool_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged decode write kernel not built")
def test_auto_fuses_the_page_write_only_into_decode_steps():
    c, k_new, v_new, slots = _decode_step(6, "bfloat16", heads=8, kv_heads=2, head_dim=64)
    args, static = _split(c)
    rest = {k: v for k, v in args.items() if k not in ("q", "k_pool", "v_pool", "row_tokens")}

    def hlo(row_tokens):
        fn = jax.jit(lambda a, r: attention.paged_write_attention(
            a["q"], jnp.asarray(k_new), jnp.asarray(v_new), a["k_pool"], a["v_pool"], jnp.asarray(slots), **rest,
            **static, row_tokens=r))
        return fn.lower(args, row_tokens).compile().as_text()
    assert "modelopt_paged_decode_write" in hlo(args["row_tokens"])
    wide = jnp.concatenate([args["row_tokens"], jnp.full_like(args["row_tokens"], len(c["positions"]))], axis=1)
    assert "modelopt_paged_decode_write" not in hlo(wide)  # a prompt step's layout: scatter first


def test_paged_write_attention_without_the_fused_kernel_is_scatter_then_paged_attention():
    """``backend="xla"`` (and every platform but CUDA under "auto"): a scatter of the stored rows,
    then paged_attention over the written pools -- FP8 codes stored as given, bit for bit."""
    c, k_new, v_new, slots = _decode_step(7, "float8_e4m3fn", heads=8, kv_heads=2, head_dim=64)
    args, static = _split(c)
    rest = {k: v for k, v in args.items() if k not in ("q", "k_pool", "v_pool")}
    out, k_pool, v_pool = attention.paged_write_attention(args["q"], jnp.asarray(k_new), jnp.asarray(v_new),
                                                          args["k_pool"], args["v_pool"], jnp.asarray(slots), **rest,
                                                          **static, backend="xla")
    for pool, before, new in ((k_pool, c["k_pool"], k_new), (v_pool, c["v_pool"], v_new)):
        want_pool = before.copy()
        want_pool[slots] = new
        np.testing.assert_array_equal(np.asarray(pool).view(np.uint8), want_pool.view(np.uint8))
    want = attention.paged_attention(args["q"], k_pool, v_pool, **rest, **static, backend="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def _raw_decode(q, pool, group, page=16):
    b, h, d = q.shape
    kv = pool.shape[1]
    out_types = (jax.ShapeDtypeStruct((b, h, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, 1, group, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, 1, group, 2), jnp.float32))
    call = jax.ffi.ffi_call(native.PAGED_DECODE_TARGET, out_types, vmap_method="broadcast_all")
    tables, lengths = jnp.ones((b, 2), jnp.int32), jnp.full((b,), 5, jnp.int32)
    return call(q, pool, pool, tables, lengths, k_scale=np.float32(1), v_scale=np.float32(1),
                softmax_scale=np.float32(0.1), page_size=np.int32(page), variant=np.int32(2))


def _raw_prefill(q, pool, page=16):
    t = q.shape[0]
    call = jax.ffi.ffi_call(native.PAGED_PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="broadcast_all")
    tables, row_tokens = jnp.ones((1, 2), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]
    return call(q, pool, pool, tables, row_tokens, jnp.arange(t, dtype=jnp.int32), k_scale=np.float32(1),
                v_scale=np.float32(1), softmax_scale=np.float32(0.1), page_size=np.int32(page))


# (q heads, kv heads, head_dim, pool dtype, page size) -> the message both handlers give, from the
# pool parser they share (ffi/cuda/paged_pool.h)
BAD_POOLS = [
    ((6, 4, 64, jnp.bfloat16, 16), r"heads \(6\) must be a multiple of kv_heads \(4\)"),
    ((4, 2, 96, jnp.bfloat16, 16), r"compiled for head_dim 64 or 128 and 1\.\.8 query heads per kv head; got head_dim 96"),
    ((18, 1, 64, jnp.bfloat16, 16), r"compiled for head_dim 64 or 128 and 1\.\.8 query heads per kv head; got head_dim 64, 18 per kv head"),
    ((4, 2, 64, jnp.float32, 16), r"the pool must be bfloat16, float16 or float8_e4m3fn"),
    ((4, 2, 64, jnp.bfloat16, 12), r"page_size 12 must divide the pool's slots 64"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged attention kernels not built")
@pytest.mark.parametrize("op", ["modelopt_paged_decode", "modelopt_paged_prefill"])
@pytest.mark.parametrize("shape,message", BAD_POOLS)
def test_cuda_handlers_refuse_a_bad_pool_naming_the_op_and_what_is_wrong(op, shape, message):
    heads, kv_heads, head_dim, pool_dtype, page = shape
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((3, heads, head_dim)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((64, kv_heads, head_dim)), pool_dtype)
    group = max(1, heads // kv_heads)
    run = (lambda: _raw_decode(q, pool, group, page)) if op.endswith("decode") else (lambda: _raw_prefill(q, pool, page))
    with pytest.raises(Exception, match=f"{op}: {message}"):
        jax.block_until_ready(run())


@pytest.mark.gpu
@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA paged attention kernels not built")
def test_cuda_prefill_handler_refuses_a_q_it_cannot_read():
    q = jnp.asarray(np.arange(3 * 4 * 64).reshape(3, 4, 64) % 7, jnp.int32)
    pool = jnp.asarray(np.random.default_rng(4).standard_normal((64, 2, 64)), jnp.bfloat16)
    with pytest.raises(Exception, match="modelopt_paged_prefill: q must be float32, bfloat16 or float16"):
        jax.block_until_ready(_raw_prefill(q, pool))
