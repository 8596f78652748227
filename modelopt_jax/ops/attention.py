"""Attention over a dense cache and over a paged KV pool.

:func:`causal_attention` is the dense reference (the cache-less forward and the dense cache use it).
:func:`step_attention` is what the engine's steps call (one :class:`PagedStep`: decode rows and
prompt rows, the kernels named by its :class:`AttentionConfig`); :func:`paged_attention` and
:func:`paged_write_attention` are the same paths for loose arrays (tests, benchmarks). On CUDA, with
the native library built, decode rows run the decode kernel (``ffi/cuda/paged_decode.cu``) and
prompt rows the prefill kernel, both reading only the pages in use; elsewhere XLA over gathered
pages with the same masking.
Both read an FP8 page's value as code * scale; XLA rounds that to the compute dtype before its
einsums, the kernel computes in float32 (a difference within the compute dtype's rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.ops.paged_step import (AttentionConfig, PagedStep, kernel_supports, prefill_kernel_supports,
                                         tensor_cores_serve)
from modelopt_jax.ops.quantize import decode_stored

__all__ = ["AttentionConfig", "PagedStep", "causal_attention", "kernel_splits", "kernel_supports", "paged_attention",
           "paged_write_attention", "prefill_kernel_supports", "step_attention", "tensor_cores_serve"]

_DECODE_VARIANTS = {"staged": 1, "mma": 2}  # the FFI attribute "variant"
_FLOOR = np.float32(np.finfo(np.float32).min)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA. q [B,T,H,D], k/v [B,S,KV,D], mask [B,1,T,S] (True = attend)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * np.float32(d ** -0.5)
    # A finite floor (not -inf) keeps fully masked rows (left padding) finite instead of NaN.
    scores = jnp.where(mask[:, :, None], scores, _FLOOR)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h * d).astype(v.dtype)


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, *, k_scale: float | None,
                    v_scale: float | None, page_size: int, token_rows: jax.Array, positions: jax.Array,
                    block_tables: jax.Array, dtype, row_tokens: jax.Array | None = None, backend: str = "auto",
                    out_init: jax.Array | None = None, decode_variant: str = "mma",
                    decode_splits: int | None = None) -> jax.Array:
    """Each token's attention over its sequence's cached keys/values up to its own position.

    ``q`` [T, H, D] (RoPE applied); pools [slots, KV, D] already holding this step's keys/values;
    token t belongs to row ``token_rows[t]`` of ``block_tables`` [R, W] and sits at ``positions[t]``,
    so it sees that row's positions 0..positions[t]. ``k_scale``/``v_scale`` are the FP8 pages'
    static scales (None for bf16/f16 pages). ``row_tokens`` [R, Wq] (optional): the packed index of
    each row's tokens in order, T for padding -- with it, prompt chunks are laid out per row
    ([R, Wq] queries against each row's own keys) instead of scoring every token against every
    row's keys. Returns [T, H * D] in ``dtype``.

    ``backend``: "auto" picks, where the platform is CUDA, the native library is built and the
    shapes qualify, the decode kernel for decode-like steps (at most two tokens per row: it reads
    each token's pages separately, which prompt chunks of many tokens per sequence would re-read)
    and the prefill kernel for prompt chunks laid out per row (``row_tokens`` wider than 1: each
    CTA's 16-64 consecutive queries share every key tile, on the tensor cores; bf16 compute, see
    :func:`prefill_kernel_supports`); XLA otherwise.
    "xla", "kernel" (the decode kernel, any tokens) and "prefill_kernel" (needs ``row_tokens``)
    force one. ``out_init`` (kernels only, tests): a float32 [T, H, D] operand aliased to the
    kernel's output, e.g. NaN-filled so that an element the kernel does not write shows.
    ``decode_variant`` / ``decode_splits``: the decode kernel's (see :class:`AttentionConfig`; "mma"
    runs "staged" where the tensor cores do not serve the dtypes).
    """
    decode_like = _decode_like(q, block_tables)
    prompt_like = row_tokens is not None and row_tokens.shape[1] > 1
    xla = functools.partial(_xla_paged_attention, k_scale=k_scale, v_scale=v_scale, page_size=page_size,
                            dtype=dtype, row_tokens=row_tokens)
    operands = (q, k_pool, v_pool, token_rows, positions, block_tables)
    if backend == "prefill_kernel" and row_tokens is None:
        raise ValueError("backend='prefill_kernel' needs row_tokens")
    if backend == "auto":
        if decode_like and _kernel_qualifies(q, k_pool, dtype):
            backend = "auto_decode"
        elif prompt_like and _prefill_kernel_qualifies(q, k_pool, dtype):
            backend = "auto_prefill"
        else:
            return xla(*operands)
    if backend == "xla":
        return xla(*operands)
    if backend in ("kernel", "auto_decode"):
        kernel = functools.partial(_kernel_paged_attention, k_scale=k_scale, v_scale=v_scale, page_size=page_size,
                                   dtype=dtype, out_init=out_init, variant=decode_variant, splits=decode_splits)
    elif backend in ("prefill_kernel", "auto_prefill"):
        kernel = functools.partial(_prefill_kernel_paged_attention, k_scale=k_scale, v_scale=v_scale,
                                   page_size=page_size, dtype=dtype, row_tokens=row_tokens, out_init=out_init)
    else:
        raise ValueError(f"backend={backend!r}: choose auto, xla, kernel or prefill_kernel")
    if not backend.startswith("auto"):
        return kernel(*operands)
    return jax.lax.platform_dependent(*operands, cuda=kernel, default=xla)


def store_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """``pool`` with ``rows`` [T, ...] stored at ``slots`` [T]: a step's new keys or values.

    The slots of a step's real tokens never repeat (each token has its own position); padding
    tokens all write the scratch slot, whose content is unspecified either way (any XLA scatter
    of repeated indices keeps one of the writes). Saying so (``unique_indices``) lets XLA's GPU
    emitter store each element plainly: without it, it emits an atomic read-modify-write per
    element, a compare-and-swap loop for 16- and 8-bit elements. A profile of prompt steps on an H100 put
    the two scatters of a layer at about 0.2 TB/s (bench/RESULTS.md, 2026-12-06, third session).
    """
    return pool.at[slots].set(rows, unique_indices=True)


def paged_write_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                          slots: jax.Array, *, k_scale: float | None, v_scale: float | None, page_size: int,
                          token_rows: jax.Array, positions: jax.Array, block_tables: jax.Array, dtype,
                          row_tokens: jax.Array | None = None, backend: str = "auto", decode_variant: str = "mma",
                          decode_splits: int | None = None):
    """This step's keys/values stored at ``slots``, then :func:`paged_attention`: ``(out, k_pool, v_pool)``.

    ``k_new``/``v_new`` [T, KV, D] are already in the pool's dtype (``KVBuffer.encode``: FP8 codes
    for FP8 pools); ``slots`` [T] is where each token's go. Decode steps (``row_tokens`` one wide:
    one token per sequence) on CUDA write them inside the decode kernel -- the CTA that reads a
    token's last page stores its row first -- so a step runs no scatter per pool and layer (two
    launches of ~2.8 us each per layer at 64 rows on the H200). That needs what the engine's steps
    guarantee: no token of the step reads a slot another token writes (pages shared between
    sequences are full, read-only prefix pages). Everything else (prompt steps, other platforms,
    ``backend`` other than "auto" or "fused_kernel") scatters first and calls :func:`paged_attention`.
    The scatter is in place on GPU when the pool is donated; XLA:CPU copies a scatter's whole
    operand (~20 ms per 268 MB layer pool), which is why the engine's default pool on CPU is small.
    """
    attend = functools.partial(paged_attention, k_scale=k_scale, v_scale=v_scale, page_size=page_size, dtype=dtype,
                               row_tokens=row_tokens, decode_variant=decode_variant, decode_splits=decode_splits)

    def scatter_then_attend(q, k_new, v_new, k_pool, v_pool, slots, token_rows, positions, block_tables):
        k_pool, v_pool = store_rows(k_pool, slots, k_new), store_rows(v_pool, slots, v_new)
        out = attend(q, k_pool, v_pool, token_rows=token_rows, positions=positions, block_tables=block_tables,
                     backend="auto" if backend == "fused_kernel" else backend)
        return out, k_pool, v_pool

    operands = (q, k_new, v_new, k_pool, v_pool, slots, token_rows, positions, block_tables)
    fused = functools.partial(_kernel_write_paged_attention, k_scale=k_scale, v_scale=v_scale, page_size=page_size,
                              dtype=dtype, variant=decode_variant, splits=decode_splits)
    if backend == "fused_kernel":
        return fused(*operands)
    one_token_rows = row_tokens is not None and row_tokens.shape[1] == 1 and _decode_like(q, block_tables)
    if backend != "auto" or not one_token_rows or not _kernel_qualifies(q, k_pool, dtype):
        return scatter_then_attend(*operands)
    return jax.lax.platform_dependent(*operands, cuda=fused, default=scatter_then_attend)


def step_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array, v_pool: jax.Array, *,
                   k_scale: float | None, v_scale: float | None, step: PagedStep, dtype):
    """One engine step's attention: ``(out [T, H * D], k_pool, v_pool)``.

    Stores the step's keys/values (``k_new``/``v_new`` [T, KV, D] in the pool's dtype) at
    ``step.slots``, then runs each section of the step on the path ``step.attention`` names: decode
    rows (token i of row i, each over its pages up to its position) and prompt rows (each row's chunk
    causally over its cached prefix and itself). A decode-only step on "fused_kernel" stores inside
    the decode kernel; any other step scatters first, so prompt rows and decode rows read every key
    of the step. Kernels run under ``platform_dependent`` with XLA as the default, so a config
    resolved for CUDA still lowers elsewhere.
    """
    config, d = step.attention, step.num_decode
    t = q.shape[0]
    page = config.page_size
    decode_rows = jnp.arange(d, dtype=jnp.int32)
    first = step.first_pages  # None unless a sliding-window model's rows dropped early pages (XLA paths only)
    xla_decode = functools.partial(_xla_paged_attention, k_scale=k_scale, v_scale=v_scale, page_size=page, dtype=dtype,
                                   window=config.sliding_window, first_pages=None if first is None else first[:d])
    kernel_args = dict(k_scale=k_scale, v_scale=v_scale, page_size=page, dtype=dtype)
    if step.decode_count is not None:
        return _packed_step_attention(q, k_new, v_new, k_pool, v_pool, step, kernel_args)
    if d == t and config.decode == "fused_kernel" and step.shared_lengths is not None:
        out, k_pool, v_pool = _cascade_decode(q, k_new, v_new, k_pool, v_pool, step, fused=True, **kernel_args)
        return out, k_pool, v_pool
    if d == t and config.decode == "fused_kernel":
        fused = functools.partial(_kernel_write_paged_attention, **kernel_args, variant=config.decode_variant,
                                  splits=config.decode_splits)

        def scatter_then_xla(q, k_new, v_new, k_pool, v_pool, slots, token_rows, positions, tables):
            k_pool, v_pool = store_rows(k_pool, slots, k_new), store_rows(v_pool, slots, v_new)
            return xla_decode(q, k_pool, v_pool, token_rows, positions, tables), k_pool, v_pool

        return jax.lax.platform_dependent(q, k_new, v_new, k_pool, v_pool, step.slots, decode_rows, step.positions,
                                          step.block_tables[:d], cuda=fused, default=scatter_then_xla)
    k_pool, v_pool = store_rows(k_pool, step.slots, k_new), store_rows(v_pool, step.slots, v_new)
    parts = []
    if d:
        parts.append(_decode_section(q[:d], k_pool, v_pool, step, step.positions[:d], kernel_args))
    if d < t:
        parts.append(_prompt_rows(q[d:], k_pool, v_pool, step, step.positions[d:], kernel_args))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return out, k_pool, v_pool


def _decode_section(q, k_pool, v_pool, step: PagedStep, positions, kernel_args: dict):
    """The decode rows' attention (``q`` [d, H, D], token i of row i at ``positions[i]``; -1: a row that
    sees no key) on the path ``step.attention`` names, over pools that already hold the step's keys."""
    config, d = step.attention, step.num_decode
    if step.shared_lengths is not None:
        return _cascade_decode(q, None, None, k_pool, v_pool, step, fused=False, positions=positions,
                               **kernel_args)[0]
    first = step.first_pages
    operands = (q, k_pool, v_pool, jnp.arange(d, dtype=jnp.int32), positions, step.block_tables[:d])
    xla = functools.partial(_xla_paged_attention, **kernel_args, window=config.sliding_window,
                            first_pages=None if first is None else first[:d])
    if config.decode == "xla":
        return xla(*operands)
    kernel = functools.partial(_kernel_paged_attention, **kernel_args, variant=config.decode_variant,
                               splits=config.decode_splits)
    return jax.lax.platform_dependent(*operands, cuda=kernel, default=xla)


def _prompt_rows(q, k_pool, v_pool, step: PagedStep, positions, kernel_args: dict):
    """The prompt rows' attention over the tokens ``q`` [T', H, D] that ``step.prompt_tokens`` index
    (the prompt section in the split layout, the whole step in the packed one); a token in no prompt
    row gets zeros."""
    config, d = step.attention, step.num_decode
    first = step.first_pages
    operands = (q, k_pool, v_pool, jnp.zeros(q.shape[0], jnp.int32), positions, step.block_tables[d:])
    xla = functools.partial(_xla_paged_attention, **kernel_args, row_tokens=step.prompt_tokens,
                            window=config.sliding_window, first_pages=None if first is None else first[d:])
    if config.prefill == "xla":
        return xla(*operands)
    kernel = functools.partial(_prefill_kernel_paged_attention, **kernel_args, row_tokens=step.prompt_tokens)
    return jax.lax.platform_dependent(*operands, cuda=kernel, default=xla)


def _packed_step_attention(q, k_new, v_new, k_pool, v_pool, step: PagedStep, kernel_args: dict):
    """:func:`step_attention` of a packed step (``step.decode_count`` given; ops.paged_step's module
    docstring): the keys/values stored, then the prompt rows over the whole step and the decode
    section (its first ``num_decode`` tokens, the rows from ``decode_count`` on given no keys),
    added: the prompt rows' paths give zeros for a token in no prompt row, and the decode section's
    unused rows are masked to zero."""
    d = step.num_decode
    k_pool, v_pool = store_rows(k_pool, step.slots, k_new), store_rows(v_pool, step.slots, v_new)
    out = _prompt_rows(q, k_pool, v_pool, step, step.positions, kernel_args)
    if not d:
        return out, k_pool, v_pool
    live = jnp.arange(d, dtype=jnp.int32) < step.decode_count
    decoded = _decode_section(q[:d], k_pool, v_pool, step, jnp.where(live, step.positions[:d], -1), kernel_args)
    # (where, not a product: an unused row's output may be NaN, 0/0 over no keys)
    return out.at[:d].add(jnp.where(live[:, None], decoded, 0).astype(out.dtype)), k_pool, v_pool


def _cascade_decode(q, k_new, v_new, k_pool, v_pool, step: PagedStep, *, fused: bool, k_scale, v_scale, page_size,
                    dtype, positions=None):
    """Decode rows' attention as two parts merged by their log-sum-exps (cascade attention): each
    line's shared prefix (``step.shared_tables``), read once per line, the queries of the rows on it
    (``step.shared_rows``) scored against each key as it arrives (the prefill kernel, or XLA), and
    each row's own pages after it (the decode kernel over its table shifted past the prefix, or XLA). Exact in real
    arithmetic: softmax over the union of two key sets is the two softmaxes weighted by their
    denominators. ``fused``: the decode kernel also stores the step's keys/values (``k_new``,
    ``v_new``). ``positions`` [d] (default the step's first d): each decode row's position (-1: a
    packed step's unused row, which sees no key). Returns ``(out [d, H * D] in dtype, k_pool, v_pool)``."""
    config, d = step.attention, step.num_decode
    _, h, hd = q.shape
    shared = step.shared_lengths                                           # [d]
    width = step.block_tables.shape[1]
    # each row's own pages: its table shifted past its line's shared pages; its length past them too
    index = jnp.arange(width, dtype=jnp.int32)[None] + (shared // page_size)[:, None]
    tables = step.block_tables[:d]
    own_tables = jnp.where(index < width, jnp.take_along_axis(tables, jnp.minimum(index, width - 1), axis=1), 0)
    own_positions = (step.positions[:d] if positions is None else positions) - shared
    decode_rows = jnp.arange(d, dtype=jnp.int32)
    args = dict(k_scale=k_scale, v_scale=v_scale, page_size=page_size, dtype=dtype)
    xla_own = functools.partial(_xla_attention_lse, **args)
    if fused:
        def kernel_own(q, k_new, v_new, k_pool, v_pool, slots, tables, positions):
            return _kernel_write_paged_attention(q, k_new, v_new, k_pool, v_pool, slots, decode_rows, positions, tables,
                                                 **args, variant=config.decode_variant, splits=config.decode_splits,
                                                 with_lse=True)

        def scatter_then_xla(q, k_new, v_new, k_pool, v_pool, slots, tables, positions):
            k_pool, v_pool = store_rows(k_pool, slots, k_new), store_rows(v_pool, slots, v_new)
            return (*xla_own(q, k_pool, v_pool, tables, positions + 1), k_pool, v_pool)

        own_out, own_lse, k_pool, v_pool = jax.lax.platform_dependent(
            q, k_new, v_new, k_pool, v_pool, step.slots, own_tables, own_positions, cuda=kernel_own,
            default=scatter_then_xla)
    else:
        operands = (q, k_pool, v_pool, own_tables, own_positions)
        if config.decode == "xla":
            own_out, own_lse = xla_own(q, k_pool, v_pool, own_tables, own_positions + 1)
        else:
            def kernel_own(q, k_pool, v_pool, tables, positions):
                return _kernel_paged_attention(q, k_pool, v_pool, decode_rows, positions, tables, **args,
                                               variant=config.decode_variant, splits=config.decode_splits,
                                               with_lse=True)

            own_out, own_lse = jax.lax.platform_dependent(
                *operands, cuda=kernel_own,
                default=lambda q, k_pool, v_pool, tables, positions: xla_own(q, k_pool, v_pool, tables, positions + 1))
    # the shared prefixes: line c's rows are the decode rows step.shared_rows[c] (d marks padding); each
    # line is one row of the prefill kernel, its tokens those decode rows at position shared - 1
    def xla_shared(q, k_pool, v_pool, shared_tables, shared, shared_rows):
        lines, width = shared_rows.shape
        line_of = jnp.zeros(d + 1, jnp.int32).at[shared_rows.reshape(-1)].set(
            jnp.repeat(jnp.arange(lines, dtype=jnp.int32), width), mode="drop")[:d]  # padding lands on d
        return xla_own(q, k_pool, v_pool, shared_tables[line_of], shared)

    def kernel_shared(q, k_pool, v_pool, shared_tables, shared, shared_rows):
        return _prefill_kernel_lse(q, k_pool, v_pool, shared_tables, shared_rows, shared - 1, **args)

    operands = (q, k_pool, v_pool, step.shared_tables, shared, step.shared_rows)
    if config.prefill == "xla":
        pre_out, pre_lse = xla_shared(*operands)
    else:
        pre_out, pre_lse = jax.lax.platform_dependent(*operands, cuda=kernel_shared, default=xla_shared)
    member = (shared > 0)[:, None]                                          # [d, 1]
    pre_lse = jnp.where(member, pre_lse, -jnp.inf)
    pre_out = jnp.where(member[:, :, None], pre_out, 0.0)
    top = jnp.maximum(pre_lse, own_lse)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_pre, w_own = jnp.exp(pre_lse - top), jnp.exp(own_lse - top)         # [d, H]
    total = w_pre + w_own
    out = (pre_out * w_pre[..., None] + own_out * w_own[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(d, h * hd).astype(dtype), k_pool, v_pool


def _xla_attention_lse(q, k_pool, v_pool, tables, lengths, *, k_scale, v_scale, page_size, dtype):
    """XLA: token t's attention over keys 0 .. lengths[t] - 1 of its own table ``tables[t]`` [T, W]:
    ``(out [T, H, D] float32, lse [T, H])``, lse the natural log-sum-exp of its scaled scores
    (-inf where it saw no key, its output then 0)."""
    t, h, hd = q.shape
    kv = k_pool.shape[1]
    g = h // kv
    width = tables.shape[1]
    slots = (tables[:, :, None] * page_size + jnp.arange(page_size, dtype=tables.dtype)).reshape(t, width * page_size)
    k = decode_stored(k_pool[slots], k_scale, dtype)                        # [T, S, KV, D]
    v = decode_stored(v_pool[slots], v_scale, dtype)
    scores = jnp.einsum("tkgd,tskd->tkgs", q.astype(dtype).reshape(t, kv, g, hd), k,
                        preferred_element_type=jnp.float32) * np.float32(hd ** -0.5)
    visible = (jnp.arange(width * page_size, dtype=lengths.dtype)[None] < lengths[:, None])[:, None, None]
    scores = jnp.where(visible, scores, _FLOOR)
    top = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(visible, jnp.exp(scores - top), 0.0)
    total = jnp.sum(probs, axis=-1)                                         # [T, KV, G]
    out = jnp.einsum("tkgs,tskd->tkgd", (probs / jnp.where(total > 0, total, 1.0)[..., None]).astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    lse = jnp.where(total > 0, top[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out.reshape(t, h, hd), lse.reshape(t, h)


def _decode_like(q, block_tables) -> bool:
    """At most two tokens per row on average: steps the decode kernel serves (it reads each token's
    pages separately, which prompt chunks of many tokens per sequence would re-read)."""
    return q.shape[0] <= 2 * block_tables.shape[0]


def _kernel_qualifies(q, k_pool, dtype) -> bool:
    _, h, d = q.shape
    return kernel_supports(h, k_pool.shape[1], d, k_pool.dtype, dtype)


def _prefill_kernel_qualifies(q, k_pool, dtype) -> bool:
    _, h, d = q.shape
    return prefill_kernel_supports(h, k_pool.shape[1], d, k_pool.dtype, dtype)


def kernel_splits(tokens: int, kv_heads: int, table_width: int, sm_count: int = 132, page_bytes: int = 2) -> int:
    """How many CTAs share one (token, kv head)'s context: enough CTAs to fill the GPU ~4 times over
    (3 for FP8 pages, whose half-size tiles leave each CTA less to read per launch: the H200 sweep of
    ``bench/attention.py --splits`` had one split beat two at 64 x 1024 FP8, 49 vs 55 us, and two
    beat one in bf16, 85 vs 92).

    Each CTA then reads an equal share of its own sequence's pages (a short sequence leaves
    the later splits empty, which cost a launch slot and nothing else).
    """
    waves = 4 if page_bytes >= 2 else 3
    want = -(-waves * sm_count // max(1, tokens * kv_heads))
    return int(max(1, min(want, table_width, 32)))


def decode_kernel_variant(variant: str, pool_dtype, dtype) -> str:
    """The decode kernel that runs for ``variant``: "mma" falls back to "staged" where the tensor
    cores do not serve the dtypes (float32 compute)."""
    if variant not in _DECODE_VARIANTS:
        raise ValueError(f"decode variant {variant!r}: choose one of {', '.join(_DECODE_VARIANTS)}")
    if variant == "mma" and not tensor_cores_serve(pool_dtype, dtype):
        return "staged"
    return variant


def _decode_call(q, k_pool, v_pool, token_rows, positions, block_tables, *, k_scale, v_scale, page_size, dtype,
                 variant: str = "mma", splits: int | None = None):
    """The decode kernel's common operands, result types (output, split partials) and attributes."""
    from modelopt_jax.ops import native

    native.cuda_library()  # registers the kernel's FFI targets
    t, h, d = q.shape
    kv = k_pool.shape[1]
    g = h // kv
    # The kernel indexes block tables per token: expand [R, W] to the tokens' rows (int32; the same
    # gather in every layer, which XLA computes once).
    tables = block_tables[token_rows]
    if splits is None:
        splits = kernel_splits(t, kv, block_tables.shape[1], _sm_count(), jnp.dtype(k_pool.dtype).itemsize)
    else:
        splits = int(max(1, min(splits, block_tables.shape[1])))
    out_types = (jax.ShapeDtypeStruct((t, h, d), jnp.float32),
                 jax.ShapeDtypeStruct((t, kv, splits, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((t, kv, splits, g, 2), jnp.float32))
    operands = [q.astype(jnp.float32), k_pool, v_pool, tables.astype(jnp.int32), (positions + 1).astype(jnp.int32)]
    attrs = dict(k_scale=np.float32(1.0 if k_scale is None else k_scale),
                 v_scale=np.float32(1.0 if v_scale is None else v_scale),
                 softmax_scale=np.float32(d ** -0.5), page_size=np.int32(page_size),
                 variant=np.int32(_DECODE_VARIANTS[decode_kernel_variant(variant, k_pool.dtype, dtype)]))
    return operands, out_types, attrs


def _split_lse(partial_ml: jax.Array) -> jax.Array:
    """The log-sum-exp [T, H] of the decode kernel's split partials [T, KV, S, G, 2] (each split's
    running max, natural units, and its sum of exponentials under it; empty splits -inf, 0; the
    kernel writes them with one split too)."""
    t, kv, _, g, _ = partial_ml.shape
    m, l = partial_ml[..., 0], partial_ml[..., 1]
    top = jnp.max(m, axis=2, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.where(l > 0, l * jnp.exp(m - top), 0.0), axis=2)
    lse = jnp.where(total > 0, top[:, :, 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return lse.reshape(t, kv * g)


def _kernel_paged_attention(q, k_pool, v_pool, token_rows, positions, block_tables, *, k_scale, v_scale, page_size,
                            dtype, out_init=None, variant="mma", splits=None, with_lse: bool = False):
    """The decode kernel; ``with_lse``: ``(out [T, H, D] float32, lse [T, H])`` instead of ``out``
    [T, H * D] in ``dtype`` (cascade attention merges it with a shared prefix's)."""
    from modelopt_jax.ops import native

    operands, out_types, attrs = _decode_call(q, k_pool, v_pool, token_rows, positions, block_tables, k_scale=k_scale,
                                              v_scale=v_scale, page_size=page_size, dtype=dtype, variant=variant,
                                              splits=splits)
    target, aliases = native.PAGED_DECODE_TARGET, {}
    if out_init is not None:
        target, aliases = native.PAGED_DECODE_POISONED_TARGET, {len(operands): 0}
        operands.append(out_init)
    call = jax.ffi.ffi_call(target, out_types, vmap_method="broadcast_all", input_output_aliases=aliases)
    out, _, partial_ml = call(*operands, **attrs)
    if with_lse:
        return out, _split_lse(partial_ml)
    t, h, d = q.shape
    return out.reshape(t, h * d).astype(dtype)


def _kernel_write_paged_attention(q, k_new, v_new, k_pool, v_pool, slots, token_rows, positions, block_tables, *,
                                  k_scale, v_scale, page_size, dtype, variant="mma", splits=None,
                                  with_lse: bool = False):
    """The decode kernel writing this step's rows into the pools (results 3, 4: the pools, in place).
    ``with_lse``: returns ``(out [T, H, D] float32, lse [T, H], k_pool, v_pool)`` (cascade attention)."""
    from modelopt_jax.ops import native

    if k_new.dtype != k_pool.dtype or v_new.dtype != v_pool.dtype:
        raise ValueError(f"new keys/values ({k_new.dtype}, {v_new.dtype}) must be in the pool's dtype "
                         f"({k_pool.dtype}): pass KVBuffer.encode(...)")
    operands, out_types, attrs = _decode_call(q, k_pool, v_pool, token_rows, positions, block_tables, k_scale=k_scale,
                                              v_scale=v_scale, page_size=page_size, dtype=dtype, variant=variant,
                                              splits=splits)
    operands += [k_new, v_new, slots.astype(jnp.int32)]
    out_types += (jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype), jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype))
    call = jax.ffi.ffi_call(native.PAGED_DECODE_WRITE_TARGET, out_types, vmap_method="broadcast_all",
                            input_output_aliases={1: 3, 2: 4})
    out, _, partial_ml, k_pool, v_pool = call(*operands, **attrs)
    if with_lse:
        return out, _split_lse(partial_ml), k_pool, v_pool
    t, h, d = q.shape
    return out.reshape(t, h * d).astype(dtype), k_pool, v_pool


def _kernel_io_dtype(dtype):
    """What the prefill kernel's q (and plain output) travel as: the compute dtype where it is bf16 or f16."""
    return jnp.dtype(dtype) if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.float32


def _prefill_kernel_paged_attention(q, k_pool, v_pool, token_rows, positions, block_tables, *, k_scale, v_scale,
                                    page_size, dtype, row_tokens, out_init=None):
    """The prefill kernel: it writes each row's tokens in the packed order; a packed token in no
    row (step padding) gets zeros, as on XLA's per-row path. q goes in, and the output comes out,
    in the compute dtype where that is bf16 or f16 (the kernel converts on load and rounds on store,
    as a float32 round trip would): a prompt step's float32 copies of q and of the output cost more
    memory traffic than the attention's own reads of a short prefix. ``out_init``'s dtype is the
    output's."""
    from modelopt_jax.ops import native

    del token_rows  # the kernel finds each row's tokens through row_tokens
    native.cuda_library()  # registers the kernel's FFI target
    t, h, d = q.shape
    io_dtype = _kernel_io_dtype(dtype)
    operands = [q.astype(io_dtype), k_pool, v_pool, block_tables.astype(jnp.int32), row_tokens.astype(jnp.int32),
                positions.astype(jnp.int32)]
    target, aliases, out_dtype = native.PAGED_PREFILL_TARGET, {}, io_dtype
    if out_init is not None:
        target, aliases, out_dtype = native.PAGED_PREFILL_POISONED_TARGET, {len(operands): 0}, out_init.dtype
        operands.append(out_init)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, h, d), out_dtype),
                            vmap_method="broadcast_all", input_output_aliases=aliases)
    out = call(*operands, k_scale=np.float32(1.0 if k_scale is None else k_scale),
               v_scale=np.float32(1.0 if v_scale is None else v_scale),
               softmax_scale=np.float32(d ** -0.5), page_size=np.int32(page_size))
    return out.reshape(t, h * d).astype(dtype)


def _prefill_kernel_lse(q, k_pool, v_pool, block_tables, row_tokens, positions, *, k_scale, v_scale, page_size,
                        dtype):
    """The prefill kernel's log-sum-exp variant: ``(out [T, H, D] float32, lse [T, H])`` (cascade
    attention: each row's tokens are decode rows whose queries share the row's prefix pages)."""
    from modelopt_jax.ops import native

    native.cuda_library()  # out stays float32: the caller merges it with the decode kernel's, then casts
    t, h, d = q.shape
    call = jax.ffi.ffi_call(native.PAGED_PREFILL_LSE_TARGET, (jax.ShapeDtypeStruct((t, h, d), jnp.float32),
                                                              jax.ShapeDtypeStruct((t, h), jnp.float32)),
                            vmap_method="broadcast_all")
    return call(q.astype(_kernel_io_dtype(dtype)), k_pool, v_pool, block_tables.astype(jnp.int32),
                row_tokens.astype(jnp.int32), positions.astype(jnp.int32),
                k_scale=np.float32(1.0 if k_scale is None else k_scale),
                v_scale=np.float32(1.0 if v_scale is None else v_scale), softmax_scale=np.float32(d ** -0.5),
                page_size=np.int32(page_size))


@functools.cache
def _sm_count() -> int:
    try:
        gpu = jax.devices("gpu")[0]
        return int(getattr(gpu, "core_count", 0)) or 132
    except RuntimeError:
        return 132


def _xla_paged_attention(q, k_pool, v_pool, token_rows, positions, block_tables, *, k_scale, v_scale, page_size,
                         dtype, row_tokens=None, window: int | None = None, first_pages=None):
    """XLA: gather the rows' pages, mask by position (and row; and ``window``: keys less than that many
    positions back), softmax as :func:`causal_attention`. ``first_pages`` [R] (None: zeros): which page
    of its sequence each row's table starts at, so a windowed row gathers only its live pages.

    Three layouts: per row (``row_tokens`` given: each row's [Wq] queries against its own [S]
    keys; prompt chunks), per token (each token gathers its own row's context: T x S keys; decode
    steps, one token per row) or flat (the R rows' contexts gathered once, every token scored
    against all R x S keys and masked to its own row; prompt chunks when rows are not given). The
    latter two are chosen by static cost.
    """
    t, h, d = q.shape
    kv = k_pool.shape[1]
    g = h // kv
    rows, width = block_tables.shape
    s = width * page_size
    slots = (block_tables[:, :, None] * page_size + jnp.arange(page_size, dtype=block_tables.dtype)).reshape(rows, s)
    key_pos = jnp.arange(s, dtype=positions.dtype)
    if first_pages is None:
        row_key_pos = jnp.broadcast_to(key_pos, (rows, s))                                    # [R, S]
    else:
        row_key_pos = first_pages.astype(positions.dtype)[:, None] * page_size + key_pos[None]
    if row_tokens is not None:  # per row
        q_rows = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])[row_tokens]             # [R, Wq, H, D]
        q_pos = jnp.concatenate([positions, jnp.full((1,), -1, positions.dtype)])[row_tokens]  # padding: -1
        k = decode_stored(k_pool[slots], k_scale, dtype)                                            # [R, S, KV, D]
        v = decode_stored(v_pool[slots], v_scale, dtype)
        mask = _visible(row_key_pos[:, None, :], q_pos[:, :, None], window)[:, None]         # [R, 1, Wq, S]
        out_rows = causal_attention(q_rows, k, v, mask)                                        # [R, Wq, H * D]
        out = jnp.zeros((t + 1, h * d), out_rows.dtype).at[row_tokens.reshape(-1)].set(
            out_rows.reshape(-1, h * d), mode="drop")
        return out[:t]
    if rows * g >= d:  # per token: [T, S] keys, mask by position
        tok_slots = slots[token_rows]
        k = decode_stored(k_pool[tok_slots], k_scale, dtype)               # [T, S, KV, D]: batch T, one query each
        v = decode_stored(v_pool[tok_slots], v_scale, dtype)
        mask = _visible(row_key_pos[token_rows], positions[:, None], window)[:, None, None, :]  # [T, 1, 1, S]
        out = causal_attention(q[:, None], k, v, mask)
        return out.reshape(t, h * d)
    k = decode_stored(k_pool[slots.reshape(-1)], k_scale, dtype)[None]      # [1, R*S, KV, D]
    v = decode_stored(v_pool[slots.reshape(-1)], v_scale, dtype)[None]
    key_rows = jnp.repeat(jnp.arange(rows, dtype=token_rows.dtype), s)
    mask = (key_rows[None, :] == token_rows[:, None]) & _visible(row_key_pos.reshape(-1)[None, :], positions[:, None],
                                                                 window)
    out = causal_attention(q[None], k, v, mask[None, None])
    return out.reshape(t, h * d)


def _visible(key_positions: jax.Array, query_positions: jax.Array, window: int | None) -> jax.Array:
    """Causal mask, narrowed to the sliding window where there is one (broadcasting)."""
    causal = key_positions <= query_positions
    return causal if window is None else causal & (query_positions - key_positions < window)
