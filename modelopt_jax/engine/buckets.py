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


# With fine prompt buckets (EngineConfig.fine_prompt_buckets), these sizes join the powers of two: a
# step's prompt chunks of 257-384, 513-768 or 1025-1536 tokens then pad to them rather than to the
# next power of two. One arriving prompt (a server's usual mixed step) is what pads most: a prompt
# of 64-1023 tokens pads to 1.33x its size with powers of two alone, 1.18x with these. Three more
# prompt programs per sampler.
FINE_PROMPT_SIZES = (384, 768, 1536)


def token_bucket(n: int, minimum: int = MIN_PROMPT_TOKENS, fine: bool = False) -> int:
    """Powers of two up to 1024 tokens (``fine``: and FINE_PROMPT_SIZES), multiples of 1024 above
    (a step of 4100 prompt tokens pads to 5120, not 8192: padded tokens cost the GEMMs as much as
    real ones)."""
    if n > 1024:
        return 1536 if fine and n <= 1536 else -(-n // 1024) * 1024
    size = bucket(n, minimum)
    three_quarters = size * 3 // 4
    return three_quarters if fine and three_quarters in FINE_PROMPT_SIZES and n <= three_quarters else size


def floor_token_bucket(n: int, fine: bool = False) -> int:
    """The largest :func:`token_bucket` size <= ``n`` (``n`` itself below the smallest): a prompt
    budget rounded down to it fills its program exactly."""
    if n < MIN_PROMPT_TOKENS:
        return n
    size = 1 << (n.bit_length() - 1) if n < 1024 else n // 1024 * 1024
    if fine:
        size = max([size] + [f for f in FINE_PROMPT_SIZES if f <= n])
    return size


def token_buckets(limit: int, fine: bool = False) -> list[int]:
    """Every :func:`token_bucket` size a step of at most ``limit`` prompt tokens can have."""
    top = token_bucket(limit, fine=fine)
    sizes, n = [], MIN_PROMPT_TOKENS
    while n <= min(top, 1024):
        sizes.append(n)
        n *= 2
    sizes += list(range(2048, top + 1, 1024))
    sizes += [f for f in FINE_PROMPT_SIZES if fine and f <= top]
    return sorted(set(sizes))


def decode_buckets(max_rows: int) -> list[int]:
    """Every padded decode-row count a step of at most ``max_rows`` decode rows can have."""
    sizes, n = [], MIN_DECODE_ROWS
    while n < bucket(max_rows, MIN_DECODE_ROWS):
        sizes.append(n)
        n *= 2
    return sizes + [n]
