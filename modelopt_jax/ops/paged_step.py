"""The contract between the engine's runner, the model and the paged attention op.

A step is one :class:`PagedStep` (a registered pytree): the runner builds it on the host, the model
passes it whole through every layer, and :func:`modelopt_jax.ops.attention.step_attention` reads it.
Which attention kernels run is an :class:`AttentionConfig`, resolved once from the KV geometry and
the platform and carried by the step as static data, so a traced program's kernel choice is a
property of its arguments, not of module state read at trace time.

Layout of a step's T packed tokens: the first ``num_decode`` tokens are rows that feed one token
each (decodes, padding included): token i is row i's. The remaining tokens are prompt chunks, laid
out as prompt rows: a prompt row is a run of consecutive tokens of one sequence (its whole chunk, or
one tile of it: a sequence's chunk may span several rows, each with that sequence's block table),
row ``num_decode + r``'s tokens sitting at ``prompt_tokens[r]`` (indices into the prompt section).
Attention is row-local (each token sees its sequence's keys up to its own position), so how a chunk
is cut into rows changes no result, only the shapes. Both kinds share the step's forward; attention
runs the decode kernel over the first section and the prefill kernel over the second (two launches
of one step, or one when the step holds one kind). Logits are taken at ``logit_index``: one entry
per sampled row (decode rows first, then one per prompt sequence), independent of the row count.

The packed layout (``decode_count`` given) runs a step of D decodes and P prompt tokens as one
program keyed by its token count T alone (a bucket of D + P), not by D and P apart: the decode
section is ``num_decode`` rows of *capacity* (D <= num_decode, rows D.. unused), token i < D is
decode row i, the prompt tokens follow them at tokens D.., and ``prompt_tokens`` index the whole
step (T pads). The decode kernel runs over the first num_decode tokens with the unused rows given no
keys, the prefill kernel over all T tokens (a token in no prompt row gets zeros), and the two add
up. The padding is then only T - D - P tokens, and a step with both kinds reads the weights once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KERNEL_HEAD_DIMS = (64, 128)
KERNEL_MAX_GROUP = 8
KERNEL_POOL_DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
KERNEL_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DECODE_BACKENDS = ("fused_kernel", "kernel", "xla")
PREFILL_BACKENDS = ("kernel", "xla")
DECODE_VARIANTS = ("mma", "staged")
# Cascade attention: a step carries one shared-prefix line per this many decode rows (at most), so
# every run of this many sharers or more (the n = 4..8 samples of one prompt) gets a line of its own,
# and shorter runs get the lines left over. A line's CTAs exit at once when no row uses it.
CASCADE_ROWS_PER_LINE = 4


def cascade_lines(num_decode: int, group: int) -> int:
    """Shared-prefix lines (``PagedStep.shared_tables`` rows) of a step of ``num_decode`` decode rows
    whose lines hold at most ``group`` rows each: enough to cover every decode row when runs of
    sharers are CASCADE_ROWS_PER_LINE long (or ``group``, if that is smaller)."""
    return -(-num_decode // max(1, min(group, CASCADE_ROWS_PER_LINE)))


def tensor_cores_serve(pool_dtype, dtype) -> bool:
    """Whether the tensor-core kernels (prefill, and the "mma" decode kernel) serve this compute
    dtype: their MMAs take bf16 operands (f16 for f16 pages), so bf16 compute, and f16 compute over
    f16 pages; float32 compute would be rounded to bf16 and keeps the float32 paths."""
    pool, compute = jnp.dtype(pool_dtype).name, jnp.dtype(dtype).name
    return compute == "bfloat16" or (compute == "float16" and pool == "float16")


def kernel_supports(heads: int, kv_heads: int, head_dim: int, pool_dtype, dtype) -> bool:
    """Whether the CUDA decode kernel is built and compiled for this shape (it runs where the platform is CUDA)."""
    from modelopt_jax.ops import native

    return (native.has_cuda_handler() and head_dim in KERNEL_HEAD_DIMS and heads % kv_heads == 0
            and heads // kv_heads <= KERNEL_MAX_GROUP and jnp.dtype(pool_dtype).name in KERNEL_POOL_DTYPES
            and jnp.dtype(dtype).name in KERNEL_COMPUTE_DTYPES)


def prefill_kernel_supports(heads: int, kv_heads: int, head_dim: int, pool_dtype, dtype) -> bool:
    """Whether the CUDA prefill kernel is built and serves this shape and compute dtype (see
    :func:`tensor_cores_serve`; float32 compute keeps XLA's path, whose float32 einsums it would not match)."""
    return kernel_supports(heads, kv_heads, head_dim, pool_dtype, dtype) and tensor_cores_serve(pool_dtype, dtype)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention paths a model's paged steps take; hashable, static under ``jax.jit``."""

    page_size: int                   # tokens per KV page
    decode: str = "xla"              # decode rows: "fused_kernel" (the decode kernel also stores the
                                     # step's keys/values), "kernel" (scatter, then the kernel), "xla"
    prefill: str = "xla"             # prompt rows: "kernel" (the CUDA prefill kernel) or "xla"
    decode_variant: str = "mma"      # "mma" (tensor cores) or "staged" (CUDA cores; float32 compute)
    decode_splits: int | None = None  # CTAs per (token, kv head); None: kernel_splits decides per step
    sliding_window: int | None = None  # a token attends keys less than this many positions back (None: all);
                                      # the CUDA kernels have no window: such a model takes the XLA paths
    cascade_group: int = 0            # shared-prefix (cascade) attention for decode rows: up to this many
                                      # decode rows that share a prefix of full pages read it once, as one
                                      # line of the prefill kernel (64 query rows: 64 // GQA group rows;
                                      # 0: off; see PagedStep.shared_rows)

    def __post_init__(self):
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"AttentionConfig.page_size={self.page_size!r} must be a positive integer")
        for name, allowed in (("decode", DECODE_BACKENDS), ("prefill", PREFILL_BACKENDS),
                              ("decode_variant", DECODE_VARIANTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"AttentionConfig.{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.decode_splits is not None and (not isinstance(self.decode_splits, int) or self.decode_splits < 1):
            raise ValueError(f"AttentionConfig.decode_splits={self.decode_splits!r} must be a positive integer or None")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"AttentionConfig.sliding_window={self.sliding_window!r} must be a positive integer or None")
        if not isinstance(self.cascade_group, int) or isinstance(self.cascade_group, bool) or self.cascade_group < 0:
            raise ValueError(f"AttentionConfig.cascade_group={self.cascade_group!r} must be a non-negative integer")
        if self.cascade_group and self.sliding_window is not None:
            raise ValueError("AttentionConfig.cascade_group: a sliding-window model's rows drop their early pages, "
                             "so no prefix stays shared; use cascade_group=0")

    @property
    def reads_only_used_pages(self) -> bool:
        """Decode rows run a kernel that reads only the pages in use (block tables can be full width)."""
        return self.decode != "xla"

    @classmethod
    def resolve(cls, *, num_heads: int, num_kv_heads: int, head_dim: int, pool_dtype, compute_dtype,
                page_size: int, platform: str, sliding_window: int | None = None,
                **overrides) -> "AttentionConfig":
        """The fastest paths that serve this geometry on ``platform`` ("gpu" runs the CUDA kernels
        where the native library has them; anything else runs XLA). ``overrides`` (A/B runs, tests)
        replace a field after the choice; a kernel the platform or geometry cannot run is an error."""
        gpu = platform == "gpu" and sliding_window is None
        decode_ok = gpu and kernel_supports(num_heads, num_kv_heads, head_dim, pool_dtype, compute_dtype)
        prefill_ok = gpu and prefill_kernel_supports(num_heads, num_kv_heads, head_dim, pool_dtype, compute_dtype)
        # (kernel_supports implies the CUDA library, and with it the fused write and the prefill
        # kernel's log-sum-exp variant: one contract, ffi/abi_version.h)
        fused = decode_ok
        cascade_ok = decode_ok and prefill_ok
        cascade = max(1, 64 // max(1, num_heads // num_kv_heads)) if cascade_ok else 0
        config = cls(page_size=int(page_size), sliding_window=sliding_window, cascade_group=cascade,
                     decode="fused_kernel" if fused else "kernel" if decode_ok else "xla",
                     prefill="kernel" if prefill_ok else "xla",
                     decode_variant="mma" if tensor_cores_serve(pool_dtype, compute_dtype) else "staged")
        config = dataclasses.replace(config, **overrides)
        if config.decode != "xla" and not decode_ok:
            raise ValueError(f"decode={config.decode!r}: the CUDA decode kernel does not serve this model here "
                             f"(platform {platform}, {num_heads}/{num_kv_heads} heads, head_dim {head_dim}, "
                             f"sliding window {sliding_window})")
        if config.decode == "fused_kernel" and not fused:
            raise ValueError("decode='fused_kernel': the native library has no page-writing decode kernel")
        if config.prefill == "kernel" and not prefill_ok:
            raise ValueError(f"prefill='kernel': the CUDA prefill kernel does not serve this model here "
                             f"(platform {platform}, compute {jnp.dtype(compute_dtype).name}, "
                             f"sliding window {sliding_window})")
        return config


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """One step of the engine over a page pool (int32 device arrays; see the module docstring).

    Padding tokens write to the scratch page 0 and their outputs are ignored; padding rows' block
    tables are page 0 and their logits are ignored.
    """

    input_ids: jax.Array          # [T] token fed at each packed position (padding: the pad id)
    positions: jax.Array          # [T] its position in its sequence (padding: 0)
    slots: jax.Array              # [T] pool slot (page * page_size + offset) its key/value is stored at
    block_tables: jax.Array       # [R, W] each row's pages in order; rows 0..num_decode-1 are decode rows
    prompt_tokens: jax.Array      # [R - num_decode, Wq] prompt row r's tokens' indices into the prompt
                                  # section (tokens num_decode..T-1), in order; T - num_decode pads
    logit_index: jax.Array        # [S] packed index of each sampled row's token (its logits sample):
                                  # S >= num_decode, decode rows first, then one per prompt sequence
    num_decode: int               # static: decode rows (= decode tokens, padding included) lead the step
    attention: AttentionConfig    # static: which kernels run
    first_pages: jax.Array | None = None  # [R] which page of its sequence each row's block_tables[r, 0] is:
                                  # a sliding-window model's rows drop the pages that fell out of the window
                                  # (neither kept nor read). None: 0 for every row (the CUDA kernels' only case)
    shared_tables: jax.Array | None = None  # [C, W] cascade attention (attention.cascade_group = K > 0): line
                                  # c's shared prefix pages; C = cascade_lines(num_decode, K)
    shared_rows: jax.Array | None = None  # [C, K] the decode rows (< num_decode) that read line c's pages, each
                                  # row on at most one line; num_decode pads (a line no row uses: all padding)
    shared_lengths: jax.Array | None = None  # [num_decode] tokens of its line's shared prefix each decode row reads
                                  # through shared_tables (a multiple of page_size, below its position; 0: on
                                  # no line), its own pages after them through block_tables. None: no cascade
    real_tokens: jax.Array | None = None  # [T] 1 for a token of a request, 0 for padding (a sparse layer routes
                                  # padding to no expert, so its experts stream no weights for it). None: all real
    decode_count: jax.Array | None = None  # [] the packed layout (module docstring): how many of the num_decode
                                  # decode rows are real (tokens 0..decode_count-1); prompt_tokens then index
                                  # the whole step. None: the split layout (decode rows fill num_decode)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]

    @property
    def page_size(self) -> int:
        return self.attention.page_size

    def check(self) -> None:
        """Raises ValueError when the fields' shapes disagree (the shape rule of each field)."""
        t, r, d = self.num_tokens, self.num_rows, self.num_decode
        for name in ("input_ids", "positions", "slots"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"PagedStep.{name} has shape {getattr(self, name).shape}, expected ({t},) like input_ids")
        if self.block_tables.ndim != 2:
            raise ValueError(f"PagedStep.block_tables must be [rows, pages], got shape {self.block_tables.shape}")
        if not 0 <= d <= min(t, r):
            raise ValueError(f"PagedStep.num_decode={d} must be within [0, min(tokens {t}, rows {r})]")
        if self.prompt_tokens.ndim != 2 or self.prompt_tokens.shape[0] != r - d:
            raise ValueError(f"PagedStep.prompt_tokens has shape {self.prompt_tokens.shape}, expected "
                             f"({r - d}, width): one line per prompt row")
        if self.decode_count is not None and self.decode_count.shape != ():
            raise ValueError(f"PagedStep.decode_count has shape {self.decode_count.shape}, expected () (a scalar)")
        if self.decode_count is None and (r - d == 0) != (t - d == 0):
            raise ValueError(f"PagedStep: {t - d} prompt tokens but {r - d} prompt rows")
        if self.logit_index.ndim != 1 or self.logit_index.shape[0] < d:
            raise ValueError(f"PagedStep.logit_index has shape {self.logit_index.shape}, expected (S,) with S >= "
                             f"num_decode={d}: one entry per sampled row, decode rows first")
        if self.first_pages is not None and self.first_pages.shape != (r,):
            raise ValueError(f"PagedStep.first_pages has shape {self.first_pages.shape}, expected ({r},)")
        cascade = (self.shared_tables, self.shared_rows, self.shared_lengths)
        if any(x is None for x in cascade) and any(x is not None for x in cascade):
            raise ValueError("PagedStep.shared_tables, shared_rows and shared_lengths come together (cascade "
                             "attention) or not at all")
        if self.shared_lengths is not None:
            k = self.attention.cascade_group
            if not k:
                raise ValueError("PagedStep.shared_tables given but attention.cascade_group is 0")
            if self.shared_lengths.shape != (d,):
                raise ValueError(f"PagedStep.shared_lengths has shape {self.shared_lengths.shape}, expected ({d},)")
            c = cascade_lines(d, k)
            if self.shared_tables.ndim != 2 or self.shared_tables.shape[0] != c:
                raise ValueError(f"PagedStep.shared_tables has shape {self.shared_tables.shape}, expected "
                                 f"({c}, width): cascade_lines({d}, {k}) lines")
            if self.shared_rows.shape != (c, k):
                raise ValueError(f"PagedStep.shared_rows has shape {self.shared_rows.shape}, expected ({c}, {k}): "
                                 f"each line's decode rows, at most cascade_group={k}")
        if self.real_tokens is not None and self.real_tokens.shape != (t,):
            raise ValueError(f"PagedStep.real_tokens has shape {self.real_tokens.shape}, expected ({t},) like input_ids")
        if self.first_pages is not None and self.attention.sliding_window is None:
            raise ValueError("PagedStep.first_pages is for sliding-window models (their rows drop early pages); "
                             "this step's attention has no window")
        for name in ("input_ids", "positions", "slots", "block_tables", "prompt_tokens", "logit_index",
                     "first_pages", "shared_tables", "shared_rows", "shared_lengths", "real_tokens", "decode_count"):
            if getattr(self, name) is None:
                continue
            dtype = getattr(self, name).dtype
            if dtype != np.int32:
                raise ValueError(f"PagedStep.{name} must be int32, got {dtype}")


jax.tree_util.register_dataclass(
    PagedStep, data_fields=["input_ids", "positions", "slots", "block_tables", "prompt_tokens", "logit_index",
                            "first_pages", "shared_tables", "shared_rows", "shared_lengths", "real_tokens",
                            "decode_count"],
    meta_fields=["num_decode", "attention"])


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The padded shape of a step: what its compiled program is specialised to."""

    decode_rows: int              # decode rows (= decode tokens), padding included
    prompt_tokens: int            # tokens of the prompt section, padding included
    prompt_rows: int              # prompt rows (runs of one sequence's tokens), padding included
    prompt_width: int             # tokens per prompt row at most (Wq)
    table_width: int              # block-table width in pages (W)
    prompt_seqs: int              # sampled prompt sequences, padding included (<= prompt_rows)
    cascade: bool = False         # decode rows may read shared prefixes once per line (the step carries
                                  # PagedStep's cascade fields; needs attention.cascade_group)
    packed: bool = False          # the packed layout (PagedStep.decode_count): decode_rows is the decode
                                  # section's capacity and prompt_tokens the whole step's token count

    @property
    def tokens(self) -> int:
        return self.prompt_tokens if self.packed else self.decode_rows + self.prompt_tokens

    @property
    def rows(self) -> int:
        """Block-table rows."""
        return self.decode_rows + self.prompt_rows

    @property
    def sampled_rows(self) -> int:
        """Rows that sample a token (logit_index entries)."""
        return self.decode_rows + self.prompt_seqs

    def abstract(self, attention: AttentionConfig) -> PagedStep:
        """The step's operands as shapes (for compiling ahead of a call)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
        t, r = self.tokens, self.rows
        d, k = self.decode_rows, attention.cascade_group
        cascade = bool(self.cascade and k and d)
        return PagedStep(i32(t), i32(t), i32(t), i32(r, self.table_width), i32(self.prompt_rows, self.prompt_width),
                         i32(self.sampled_rows), d, attention, None if attention.sliding_window is None else i32(r),
                         i32(cascade_lines(d, k), self.table_width) if cascade else None,
                         i32(cascade_lines(d, k), k) if cascade else None, i32(d) if cascade else None,
                         real_tokens=i32(t), decode_count=i32() if self.packed else None)


def dense_rows_step(input_ids, positions, slots, block_tables, attention: AttentionConfig,
                    logit_positions=None) -> PagedStep:
    """A [B, Tq] batch as a step of B prompt rows (row b is sequence b, its Tq tokens in order):
    what ``forward_paged`` and callers with their own loops use. ``logit_positions`` [B]: the
    index into Tq of each row's token whose logits are wanted (default: its last)."""
    input_ids, positions, slots = (jnp.asarray(a, jnp.int32) for a in (input_ids, positions, slots))
    b, tq = input_ids.shape
    if tq == 1:  # one token per row: decode rows (the decode kernel, which stores them itself on CUDA)
        return PagedStep(input_ids.reshape(-1), positions.reshape(-1), slots.reshape(-1),
                         jnp.asarray(block_tables, jnp.int32), jnp.zeros((0, 1), jnp.int32),
                         jnp.arange(b, dtype=jnp.int32), b, attention)
    prompt_tokens = jnp.arange(b * tq, dtype=jnp.int32).reshape(b, tq)
    last = jnp.full((b,), tq - 1, jnp.int32) if logit_positions is None else jnp.asarray(logit_positions, jnp.int32)
    return PagedStep(input_ids.reshape(-1), positions.reshape(-1), slots.reshape(-1),
                     jnp.asarray(block_tables, jnp.int32), prompt_tokens, jnp.arange(b, dtype=jnp.int32) * tq + last,
                     0, attention)
