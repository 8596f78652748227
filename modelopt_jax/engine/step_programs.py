"""Which step program runs a batch: the padded shapes of a step's programs and what a program is keyed by.

Pure planning on the host, shared by the runner (which compiles and launches these programs), the
scheduler's sequence cap and ``bench/schedule_sim.py`` (which replays a workload's schedule on a CPU):
a step's rows are split into programs (:func:`program_parts`), each bucketed to a shape
(:func:`step_shape`) so a workload compiles a handful of programs, and cascade attention's lines are
planned from the decode rows' shared pages (:func:`shared_prefixes`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from modelopt_jax.engine.buckets import (MAX_PROMPT_SEQS, MIN_DECODE_ROWS, MIN_PROMPT_TOKENS, PROMPT_SEQ_TOKENS,
                                         bucket, token_bucket)
from modelopt_jax.engine.request import Request
from modelopt_jax.ops.paged_step import AttentionConfig, StepShape

# Tokens per prompt row where the prefill kernel runs: a chunk is cut into rows of this many tokens
# (a multiple of every kernel CTA's tokens), so a step's prompt section has a shape that depends on
# its padded token count alone (see step_shape).
PROMPT_TILE = 64


# Cascade attention (AttentionConfig.cascade_group): rows share a prefix on a line only when it is at
# least this many tokens (shorter ones save less than the merge costs).
MIN_SHARED_TOKENS = 64

# Decode-row buckets up to this size also have a program without cascade attention, run when no row
# of the step shares a prefix: the cascade part costs a prefill-kernel launch and the merge's small
# kernels in every layer even with no line in use (about 5 us of GPU time and 1.5 us of gaps per
# layer in a batch-1 step on an H100, bench/RESULTS.md 2026-12-07), which matters in steps of a few
# milliseconds. Larger steps keep one program (their step time hides it).
PLAIN_DECODE_ROWS = 64

# Multi-step decode (EngineConfig.decode_steps = k > 1): decode-only steps of at most this many rows run
# k forwards in one program, each feeding the token the one before sampled, so the host's cycle per
# launch (scheduling, building the step's arrays, the dispatch, the copy back) is paid once per k
# tokens. It is for small batches, whose GPU work per step is shorter than that cycle; larger steps
# keep one forward a launch (their GPU work hides the host's).
MULTI_STEP_ROWS = 8


@dataclasses.dataclass(frozen=True)
class CascadePlan:
    """Which decode rows of a step read which shared prefix once per line (PagedStep's cascade fields)."""

    tables: np.ndarray    # [lines, table_width] int32: each line's shared pages (zeros: an unused line)
    rows: np.ndarray      # [lines, group] int32: the decode rows on each line (indices into the step's decode
                          # rows); the pad value fills the rest
    lengths: np.ndarray   # [decode rows] int32: tokens of its line's prefix each row reads there (0: on no line)

    @property
    def rows_sharing(self) -> int:
        return int(np.count_nonzero(self.lengths))


def _common_pages(a: list[int], b: list[int], limit: int) -> int:
    """How many leading pages ``a`` and ``b`` have in common, at most ``limit`` (by slice compares:
    binary search, so a long common prefix costs a few C-level comparisons, not a Python loop)."""
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_prefixes(decode: list[Request], group: int, page_size: int, table_width: int, lines: int, pad: int,
                    min_tokens: int = MIN_SHARED_TOKENS) -> CascadePlan:
    """Cascade attention's plan for a step's decode rows, at most ``lines`` lines of ``group`` rows.

    Rows whose full pages (those before the fed token) start with the same page are candidates to
    share: one prompt's n samples, requests behind one system prompt, the turns of one chat. Each
    such run is sorted by its rows' pages (rows with the longest prefixes in common become
    neighbours) and cut into near-equal chunks of at most ``group`` rows; a chunk shares the full
    pages all its rows start with (pages shared by page id hold equal tokens: the prefix cache
    shares only full pages, and nobody writes them). Where chunks outnumber ``lines``, those that
    save the most page reads ((rows - 1) x pages) get them. Rows keep their places in the step.
    ``pad`` fills the unused entries of ``rows`` (the step's padded decode-row count)."""
    min_pages = max(1, -(-min_tokens // page_size))
    full = [r.computed // page_size if not r.dropped else 0 for r in decode]  # pages before the fed token
    runs: dict[int, list[int]] = {}
    for i, r in enumerate(decode):
        if full[i] >= min_pages:
            runs.setdefault(r.pages[0], []).append(i)
    chunks = []  # (pages saved, rows, shared pages)
    for run in runs.values():
        if len(run) < 2:
            continue
        run.sort(key=lambda i: decode[i].pages[:full[i]])
        count = -(-len(run) // group)
        size, extra = divmod(len(run), count)
        at = 0
        for c in range(count):
            chunk = run[at:at + size + (c < extra)]
            at += len(chunk)
            if len(chunk) < 2:
                continue
            # sorted: the chunk's common prefix is its first and last rows' common prefix
            common = _common_pages(decode[chunk[0]].pages, decode[chunk[-1]].pages, min(full[i] for i in chunk))
            if common >= min_pages:
                chunks.append(((len(chunk) - 1) * common, chunk, common))
    chunks.sort(key=lambda item: -item[0])
    tables = np.zeros((lines, table_width), np.int32)
    rows = np.full((lines, group), pad, np.int32)
    lengths = np.zeros(len(decode), np.int32)
    for line, (_, chunk, common) in enumerate(chunks[:lines]):
        tables[line, :common] = decode[chunk[0]].pages[:common]
        rows[line, :len(chunk)] = chunk
        lengths[chunk] = common * page_size
    return CascadePlan(tables, rows, lengths)


def kernel_prompt_section(prompt_tokens: int, max_prompt_seqs: int) -> tuple[int, int, int]:
    """(rows, width, sampled sequences) of a prompt section of ``prompt_tokens`` padded tokens where
    the prefill kernel runs: rows of PROMPT_TILE tokens, enough for the chunks of up to one sequence
    per PROMPT_SEQ_TOKENS tokens (at most ``max_prompt_seqs``; the scheduler keeps to it), each of
    which may leave one partial row. The shape is then a function of the token count, and a
    workload's programs form a table."""
    seqs = max(1, min(max_prompt_seqs, prompt_tokens // PROMPT_SEQ_TOKENS))
    return -(-prompt_tokens // PROMPT_TILE) + seqs, PROMPT_TILE, seqs


def step_shape(batch: list[tuple[Request, int]], attention: AttentionConfig, fixed_table_width: int,
               planned: bool = False, max_prompt_seqs: int = MAX_PROMPT_SEQS,
               fine_prompt_buckets: bool = False, packed_decode_rows: int | None = None) -> StepShape:
    """The padded shape of the program that runs ``batch`` (rows feeding one token are decode rows).

    Bucketed so a workload compiles a handful of programs (each a whole-model compile): decode rows
    to powers of two (at least 8: a GEMM costs the same for M 1..8); prompt tokens by
    :func:`token_bucket` (the scheduler fills a busy step's budget exactly, so its steps repeat one
    shape). Where every section of the step runs a kernel that reads only the pages in use, block
    tables are ``fixed_table_width`` wide (the width then costs nothing and adds no program) and the
    prompt section is cut into rows of PROMPT_TILE tokens (:func:`kernel_prompt_section`): the
    program is then one of a table known ahead (``Runner.program_table``). Elsewhere XLA's
    attention gathers the whole width and every row's keys: tables are a power of two of pages (at
    least 8) covering the longest row, one prompt row per sequence, its width and the rows powers of
    two. ``planned``: the rows' pages are not allocated yet (count those their fed tokens will need).
    ``fine_prompt_buckets``: the prompt tokens' sizes include ``buckets.FINE_PROMPT_SIZES``.
    ``packed_decode_rows`` (the runner's largest decode bucket): a step with prompt chunks takes the
    packed layout (:class:`~modelopt_jax.ops.paged_step.PagedStep`), its token count padded as one,
    ``token_bucket(D + P)``; where the table is fixed, its decode section has room for every decode
    row that fits (``min(T, packed_decode_rows)``), so the program depends on T alone.
    """
    page = attention.page_size
    decode = [n for _, n in batch if n == 1]
    prompt = [n for _, n in batch if n > 1]
    fixed = (not decode or attention.decode != "xla") and (not prompt or attention.prefill != "xla")
    if fixed:
        width = fixed_table_width
    else:
        longest = max(max(len(r.pages), -(-(r.computed + n) // page) if planned else 0) - r.dropped for r, n in batch)
        width = bucket(longest, 8)
    decode_rows = bucket(len(decode), MIN_DECODE_ROWS) if decode else 0
    cascade = bool(attention.cascade_group and decode)  # the runner drops it where no row shares a prefix
    if not prompt:
        return StepShape(decode_rows, 0, 0, 1, width, 0, cascade)
    if packed_decode_rows is not None:
        tokens = token_bucket(len(decode) + sum(prompt), fine=fine_prompt_buckets)
        if fixed:
            decode_rows = min(tokens, packed_decode_rows)
            cascade = bool(attention.cascade_group)
        else:  # (a fine token bucket may be below the decode rows' power of two)
            decode_rows = min(tokens, decode_rows)
    else:
        tokens = token_bucket(sum(prompt), fine=fine_prompt_buckets)
    if fixed:
        rows, row_width, seqs = kernel_prompt_section(tokens, max_prompt_seqs)
        # a caller past the scheduler's sequence cap still gets a shape that holds its rows
        rows = max(rows, sum(-(-n // row_width) for n in prompt))
        seqs = max(seqs, len(prompt))
    else:
        rows = seqs = bucket(len(prompt))
        row_width = bucket(max(prompt), MIN_PROMPT_TOKENS)
    return StepShape(decode_rows, tokens, rows, row_width, width, seqs, cascade, packed_decode_rows is not None)


def program_parts(batch: list[tuple[Request, int]], split: bool) -> list[list[tuple[Request, int]]]:
    """The rows each program of a step of ``batch`` runs, in launch order (decode rows first): the
    decodes' and the prompt chunks' programs where ``split`` and the step holds both; else one."""
    decode = [(r, n) for r, n in batch if n == 1]
    prompt = [(r, n) for r, n in batch if n > 1]
    if split and decode and prompt:
        return [decode, prompt]
    return [decode + prompt]


def prompt_logprobs_k(batch: list[tuple[Request, int]]) -> int | None:
    """The most prompt log-prob alternatives a row of ``batch`` wants for the tokens it feeds (None: none)."""
    ks = [r.params.prompt_logprobs for r, _ in batch
          if r.params.prompt_logprobs is not None and r.computed + 1 < len(r.prompt_ids)]
    return max(ks) if ks else None


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What, beside the step's shape, a compiled step program is specialised to."""

    shape: StepShape
    num_logprobs: int                 # top alternatives returned per sampled token
    prompt_logprobs: int | None       # top alternatives per prompt token (None: no prompt log-probs)
    sampler: str                      # sampling.sampler_for: greedy steps skip the sort top-k/top-p need
    decode_steps: int = 1             # forwards one launch runs (> 1: a decode-only step without cascade
                                      # attention; forward i + 1 feeds each row the token forward i sampled)
