"""Which FP8 GEMM path ``backend="auto"`` runs on a GPU, per device and (M bucket, N, K): measured.

Our CUTLASS kernel is not the fastest path at every shape: at some large-M shapes cuBLASLt (which
XLA calls for an FP8 dot) wins by a few percent, and at some mid-M ones XLA's FP8 dot does
(bench/RESULTS.md, the GEMM tables). ``bench/tune_dispatch.py`` times the paths on a device and
writes its table into :mod:`.gemm_dispatch_tables`; "auto" then runs, per call, the fastest path
measured for its device kind, N, K and M bucket. A device or an (N, K) without a table entry runs
our kernel, as before any table existed.

Every path computes the same thing -- FP8 codes, float32 accumulation, the epilogue in float32 in
the kernels' order (alpha, row, col, bias) -- so a table changes speed, never the math; only the
accumulation order differs, as between any two GEMM kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from modelopt_jax.errors import ModelOptJaxError

CUTLASS = "cutlass"  # our modelopt_fp8_gemm custom call
XLA = "xla"          # XLA's FP8 dot_general with float32 accumulation (cuBLASLt FP8 on Hopper)
PATHS = (CUTLASS, XLA)


class DispatchTableError(ModelOptJaxError):
    """A dispatch table (``gemm_dispatch_tables.TABLES``) is malformed."""


@dataclasses.dataclass(frozen=True)
class ShapeRule:
    """The measured choice for one (N, K) on one device kind."""

    n: int                                 # output features (the weight's rows)
    k: int                                 # input features
    buckets: tuple[tuple[int, str], ...]   # (largest M of the bucket, path), ascending M; an M past
                                           # the last bucket takes the last bucket's path

    def path(self, m: int) -> str:
        for m_max, path in self.buckets:
            if m <= m_max:
                return path
        return self.buckets[-1][1]


def parse_table(device_kind: str, shapes: Mapping[tuple[int, int], Sequence[Sequence]]) -> dict[tuple[int, int], ShapeRule]:
    """``{(n, k): ((m_max, path), ...)}`` checked into rules; a malformed entry is an error naming it."""
    rules = {}
    for key, buckets in shapes.items():
        where = f"GEMM dispatch table for {device_kind!r}, shape {key!r}"
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(v, int) and v > 0 for v in key)):
            raise DispatchTableError(f"{where}: the key must be (N, K), two positive ints")
        if not buckets:
            raise DispatchTableError(f"{where}: no M buckets")
        parsed = []
        for bucket in buckets:
            if len(bucket) != 2 or not isinstance(bucket[0], int) or bucket[0] <= 0 or bucket[1] not in PATHS:
                raise DispatchTableError(f"{where}: bucket {bucket!r} must be (largest M > 0, one of {PATHS})")
            parsed.append((int(bucket[0]), str(bucket[1])))
        if [m for m, _ in parsed] != sorted({m for m, _ in parsed}):
            raise DispatchTableError(f"{where}: M buckets must be strictly ascending, got {[m for m, _ in parsed]}")
        rules[key] = ShapeRule(n=key[0], k=key[1], buckets=tuple(parsed))
    return rules


def merge_buckets(choices: Sequence[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """Measured (M, path) pairs, ascending M, merged into a table's (largest M, path) buckets: an M
    between two measured ones takes the next measured one's path."""
    merged: list[tuple[int, str]] = []
    for m, path in choices:
        if merged and merged[-1][1] == path:
            merged[-1] = (m, path)
        else:
            merged.append((m, path))
    return tuple(merged)


@functools.cache
def _packaged_rules(device_kind: str) -> dict[tuple[int, int], ShapeRule]:
    from modelopt_jax.ops.gemm_dispatch_tables import TABLES

    table = TABLES.get(device_kind)
    return {} if table is None else parse_table(device_kind, table["shapes"])


def choose(device_kind: str | None, m: int, n: int, k: int, tables: Mapping | None = None) -> str:
    """The path "auto" runs on a GPU of ``device_kind`` for an [M, K] x [N, K] GEMM (``tables``:
    instead of the packaged ones, e.g. a table just measured)."""
    if device_kind is None:
        return CUTLASS
    if tables is None:
        rules = _packaged_rules(device_kind)
    else:
        rules = parse_table(device_kind, tables[device_kind]["shapes"]) if device_kind in tables else {}
    rule = rules.get((n, k))
    return CUTLASS if rule is None else rule.path(m)


@functools.cache
def gpu_kind() -> str | None:
    """The device kind of the first GPU (what "auto" traces for), or None on a machine without one
    (asked once: a process's devices do not change, and every GEMM's trace asks)."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0].device_kind if gpus else None
