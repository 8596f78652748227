"""The sizes a step is padded to, shared by the scheduler (which fills them) and the runner (which
compiles one program per size): each distinct padded shape is a whole-model compile, so a workload
must meet few of them, and where the attention kernels run, a finite table known before the first
request (compiled ahead, see :meth:`modelopt_jax.engine.runner.Runner.precompile`).
"""

from __future__ import annotations

MIN_DECODE_ROWS = 8   # a GEMM costs the same for M 1..8
MIN_PROMPT_TOKENS = 16
# Prompt sequences one step's prompt section holds at most. The scheduler stops admitting past it;
# the kernels' step shapes reserve a row per sequence for its partial tile and one sampled row each,
# one sequence per PROMPT_SEQ_TOKENS padded tokens (more would cost a small step empty prefill CTAs).
MAX_PROMPT_SEQS = 128
PROMPT_SEQ_TOKENS = 4


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= ``n`` (at least ``minimum``)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def token_bucket(n: int, minimum: int = MIN_PROMPT_TOKENS) -> int:
    """Powers of two up to 1024 tokens, multiples of 1024 above (a step of 4100 prompt tokens pads
    to 5120, not 8192: padded tokens cost the GEMMs as much as real ones)."""
    return bucket(n, minimum) if n <= 1024 else -(-n // 1024) * 1024


def floor_token_bucket(n: int) -> int:
    """The largest :func:`token_bucket` size <= ``n`` (``n`` itself below the smallest): a prompt
    budget rounded down to it fills its program exactly."""
    if n < MIN_PROMPT_TOKENS:
        return n
    return 1 << (n.bit_length() - 1) if n < 1024 else n // 1024 * 1024


def token_buckets(limit: int) -> list[int]:
    """Every :func:`token_bucket` size a step of at most ``limit`` prompt tokens can have."""
    sizes, n = [], MIN_PROMPT_TOKENS
    while n < min(limit, 1024):
        sizes.append(n)
        n *= 2
    sizes += [n] if n <= 1024 else []
    sizes += list(range(2048, token_bucket(limit) + 1, 1024)) if limit > 1024 else []
    return sorted(set(s for s in sizes if s <= token_bucket(limit)))


def decode_buckets(max_rows: int) -> list[int]:
    """Every padded decode-row count a step of at most ``max_rows`` decode rows can have."""
    sizes, n = [], MIN_DECODE_ROWS
    while n < bucket(max_rows, MIN_DECODE_ROWS):
        sizes.append(n)
        n *= 2
    return sizes + [n]
