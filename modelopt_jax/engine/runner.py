"""The device side of the engine: the model's page pool and one jitted step over it.

A step feeds each row a chunk of tokens (a prompt chunk, or the one token a decode feeds), writes
their keys/values into the pool, and samples each row's next token from its last position, on the
device. Shapes are bucketed -- rows and tokens per row to powers of two, the block tables to a
power of two of pages -- so a workload compiles a handful of programs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.engine.request import Request
from modelopt_jax.sampling import sample, sampler_for, token_logprobs


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _padded(values, size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``size``, as one array."""
    out = np.full(size, fill, dtype)
    out[:len(values)] = values
    return out


def step_shape(batch: list[tuple[Request, int]], fixed_table_width: int | None,
               page_size: int | None = None, fixed_prompt_tables: bool = False) -> tuple[int, int, int, int]:
    """(tokens, rows, block-table width in pages, tokens per row) of the program that runs ``batch``.

    Bucketed so a workload compiles a handful of programs (each a whole-model compile): tokens to
    powers of two (at least 16); rows to powers of two (at least 8 in a decode step: a GEMM costs
    the same for M 1..8; prompt steps' rows unpadded, since each costs XLA's prompt attention a
    [row width x S] block, and the prefill kernel a grid row); tokens per row (prompt steps) to powers of two (at least 16); block
    tables to a power of two of pages (at least 8) unless fixed (decode steps that run the decode
    kernel; prompt steps too with ``fixed_prompt_tables``, when the prefill kernel runs them).
    With ``page_size``, a row's pages count those its fed tokens will need (a planned step whose
    pages are not allocated yet); without, the pages it holds.
    """
    total = sum(n for _, n in batch)
    decode = total == len(batch)
    rows = bucket(len(batch), 8 if decode else 1)
    row_width = 1 if decode else bucket(max(n for _, n in batch), 16)
    longest = max(max(len(r.pages), -(-(r.computed + n) // page_size) if page_size else 0) for r, n in batch)
    fixed = fixed_table_width is not None and (decode or fixed_prompt_tables)
    width = fixed_table_width if fixed else bucket(longest, 8)
    return bucket(total, 16), rows, width, row_width


def prompt_logprobs_k(batch: list[tuple[Request, int]]) -> int | None:
    """The most prompt log-prob alternatives a row of ``batch`` wants for the tokens it feeds (None: none)."""
    ks = [r.params.prompt_logprobs for r, _ in batch
          if r.params.prompt_logprobs is not None and r.computed + 1 < len(r.prompt_ids)]
    return max(ks) if ks else None


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device and not yet copied back: its rows and its device outputs."""

    rows: list[tuple[Request, int, int, bool]]  # (request, tokens fed, first position fed, samples a token)
    outputs: tuple                          # device arrays: tokens, (chosen, top values, top ids), prompt

    @property
    def is_prompt(self) -> bool:
        return any(n > 1 for _, n, _, _ in self.rows)


@dataclasses.dataclass
class StepResult:
    """What one step returns to the host (one device-to-host copy)."""

    tokens: np.ndarray                      # [B] sampled token per row
    chosen: np.ndarray                      # [B] its log-prob
    top_values: np.ndarray                  # [B, k]
    top_ids: np.ndarray                     # [B, k]
    prompt: list[tuple[np.ndarray, ...]] | None  # per row: its tokens' (chosen, top values, top ids)


class Runner:
    """Runs packed steps: the rows' tokens side by side in one [T] vector, whatever mix of prompt
    chunks and decode tokens they are.

    ``fixed_table_width`` (pages): decode steps' block tables always that wide -- right when their
    attention reads only the pages in use (the CUDA decode kernel), so the width costs nothing and
    never adds a program; prompt steps' too with ``fixed_prompt_tables`` (the CUDA prefill kernel
    runs them); otherwise the width is bucketed to the step's longest row, since XLA's attention
    gathers the whole width.
    """

    def __init__(self, model, num_pages: int, page_size: int, pad_id: int = 0, fixed_table_width: int | None = None,
                 max_rows: int = 256, fixed_prompt_tables: bool = False):
        from flax import nnx

        self.page_size = page_size
        # Every step's sampled tokens, padded to one length, stay on the device: the next step,
        # launched before this one is collected, reads its in-flight input tokens from them.
        self.max_rows = bucket(max_rows, 8)
        self._last_tokens = jnp.zeros(self.max_rows, jnp.int32)
        self.pad_id = pad_id
        self.fixed_table_width = fixed_table_width
        self.fixed_prompt_tables = fixed_prompt_tables
        self.cache = model.init_paged_cache(num_pages, page_size)
        graphdef, state = nnx.split(model)
        # The weights go to every step as a flat tuple: jit flattens a tuple in C++, an nnx.State
        # by a Python callback per node (~350 us a step for 32 layers, bench/host_loop.py), time the
        # host loop does not have at 256 rows (it was the GPU that waited, bench/RESULTS.md).
        leaves, state_def = jax.tree_util.tree_flatten(state)
        self.weights = tuple(leaves)

        def forward(weights, *args):
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, weights)).forward_packed(*args)

        self._forward = forward
        self._step = jax.jit(self._step_fn, static_argnums=(0, 1, 2), donate_argnums=(4,))
        self.shapes: set[tuple] = set()  # step keys (see step_key) run so far
        # Programs compiled off the engine's thread (see ready), by step key; one compile at a time.
        self._compiled: dict[tuple, object] = {}
        self._compiling: tuple[tuple, concurrent.futures.Future] | None = None
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    def step_key(self, batch: list[tuple[Request, int]]) -> tuple:
        """The program a step of ``batch`` rows runs: (tokens, rows, table width, row width, logprobs,
        prompt logprobs, sampler). The rows' pages need not be allocated yet."""
        shape = step_shape(batch, self.fixed_table_width, self.page_size, self.fixed_prompt_tables)
        params = [r.params for r, _ in batch]
        return (*shape, max((p.logprobs or 0) for p in params), prompt_logprobs_k(batch), sampler_for(params))

    def ready(self, batch: list[tuple[Request, int]]) -> bool:
        """Whether a step of ``batch`` can launch without compiling first. When it cannot, its program
        starts compiling on a helper thread (unless another compile runs), so the caller can run other
        steps meanwhile: a new prompt-step shape met by a server costs its streams nothing but the
        wait of the requests in that step (an 8B program took 6-8 s to compile on the H200)."""
        key = self.step_key(batch)
        if key in self.shapes or key in self._compiled:
            return True
        if self._compiling is not None:
            finished = self._take_compiled()
            if finished is None:  # still compiling
                return False
            if finished == key:  # done (or failed: launch then compiles in line and raises where it runs)
                return True
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="modelopt-jax-compile")
        self._compiling = (key, self._compiler.submit(self._compile, key, self._abstract_operands(key)))
        return False

    def _take_compiled(self, wait: bool = False) -> tuple | None:
        """The key of the off-thread compile, once finished (waited for if ``wait``), its program
        moved into the table (a failed one is dropped); None while it still runs."""
        key, future = self._compiling
        if not (wait or future.done()):
            return None
        self._compiling = None
        if future.exception() is None:
            self._compiled[key] = future.result()
        return key

    def _abstract_operands(self, key: tuple) -> tuple:
        """Shapes, dtypes and shardings of a step's operands (taken on the engine's thread: the live
        cache is donated by every step)."""
        tokens, rows, width, row_width = key[:4]

        def like(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        i32, f32, u32 = np.int32, np.float32, np.uint32
        per_token, per_row = jax.ShapeDtypeStruct((tokens,), i32), jax.ShapeDtypeStruct((rows,), i32)
        return (tuple(like(x) for x in self.weights), jax.tree_util.tree_map(like, self.cache),
                per_token, per_token, per_token, per_token,                         # ids, positions, slots, rows
                jax.ShapeDtypeStruct((rows, width), i32), jax.ShapeDtypeStruct((rows, row_width), i32),
                per_row, per_token,                                                  # last, next ids
                jax.ShapeDtypeStruct((rows,), f32), per_row, jax.ShapeDtypeStruct((rows,), f32),
                jax.ShapeDtypeStruct((rows, 2), u32), jax.ShapeDtypeStruct((rows,), u32),
                like(self._last_tokens), per_token)                                  # last tokens, from last

    def _compile(self, key: tuple, operands: tuple):
        num_logprobs, prompt_k, sampler = key[4:]
        return self._step.lower(num_logprobs, prompt_k, sampler, *operands).compile()

    def _step_fn(self, num_logprobs, prompt_logprobs, sampler, weights, cache, ids, positions, slots, token_rows, block_tables,
                 row_tokens, last, next_ids, temps, top_k, top_p, row_keys, counters, last_tokens, from_last):
        ids = jnp.where(from_last >= 0, last_tokens[jnp.maximum(from_last, 0)], ids)
        if prompt_logprobs is None:
            logits, cache = self._forward(weights, ids, positions, cache, slots, token_rows, block_tables, row_tokens,
                                          last)
            prompt = None
        else:
            all_logits, cache = self._forward(weights, ids, positions, cache, slots, token_rows, block_tables,
                                              row_tokens)
            logits = all_logits[last]
            prompt = token_logprobs(all_logits, next_ids, prompt_logprobs)
        keys = jax.vmap(jax.random.fold_in)(row_keys, counters)
        tokens = sample(logits, temps, top_k, top_p, keys, sampler)
        padded = jnp.zeros(self.max_rows, jnp.int32).at[:tokens.shape[0]].set(tokens)
        return padded, token_logprobs(logits, tokens, num_logprobs), prompt, cache

    def launch(self, batch: list[tuple[Request, int]]) -> LaunchedStep:
        """Dispatches one step for ``batch`` rows of (request, tokens to feed) without waiting for it.

        A row's input token may still be in flight (``request.inflight_row`` >= 0 and its value
        unknown on the host): it is read on the device from the previous launched step's tokens.
        Requests are not modified: the caller advances ``computed`` and ``inflight``. Shapes: see
        :func:`step_shape`. A program compiled off-thread (:meth:`ready`) runs as compiled; one still
        compiling is waited for; any other compiles here, as ``jax.jit`` does.
        """
        page = self.page_size
        decode = all(n == 1 for _, n in batch)
        key = self.step_key(batch)
        tokens_b, rows, width, row_width = key[:4]
        n_rows = len(batch)
        # Per-row values are collected in Python lists and converted once per array: a numpy
        # element assignment costs ~1 us, and a 256-row decode step made ~4,000 of them.
        tok_ids, tok_pos, tok_slots, tok_rows, tok_from_last = [], [], [], [], []
        tables = np.zeros((rows, width), np.int32)
        row_tokens = np.full((rows, row_width), tokens_b, np.int32)  # tokens_b: padding
        next_ids = np.zeros(tokens_b, np.int32)
        offset = 0
        for b, (r, n) in enumerate(batch):
            start, pages = r.computed, r.pages
            tables[b, :len(pages)] = pages
            if n == 1:
                token = r.token_at(start)
                tok_ids.append(self.pad_id if token is None else token)
                tok_from_last.append(r.inflight_row if token is None else -1)
                tok_pos.append(start)
                tok_slots.append(pages[start // page] * page + start % page)
                tok_rows.append(b)
                if not decode:  # a one-token chunk in a prompt step (decode steps fill theirs below)
                    row_tokens[b, 0] = offset
            else:
                pos = range(start, start + n)
                tok_ids += [r.token_at(p) for p in pos]  # prompt chunks: every token is known
                tok_from_last += [-1] * n
                tok_pos += pos
                tok_slots += [pages[p // page] * page + p % page for p in pos]
                tok_rows += [b] * n
                row_tokens[b, :n] = np.arange(offset, offset + n)
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                end = min(start + n + 1, len(r.prompt_ids))  # next prompt token of each fed position
                next_ids[offset:offset + end - start - 1] = r.prompt_ids[start + 1:end]
            offset += n
        if decode:
            row_tokens[:n_rows, 0] = np.arange(n_rows)
        ids = _padded(tok_ids, tokens_b, self.pad_id)
        positions = _padded(tok_pos, tokens_b)
        slots = _padded(tok_slots, tokens_b)  # padding tokens write to the scratch page 0
        token_rows = _padded(tok_rows, tokens_b)
        last = _padded(np.cumsum([n for _, n in batch]) - 1, rows)
        params = [r.params for r, _ in batch]
        temps = _padded([q.temperature for q in params], rows, 0.0, np.float32)
        top_k = _padded([q.top_k for q in params], rows, -1)
        top_p = _padded([q.top_p for q in params], rows, 1.0, np.float32)
        row_keys = np.zeros((rows, 2), np.uint32)
        row_keys[:n_rows] = [r.row_key for r, _ in batch]
        counters = _padded([len(r.generated) + r.inflight for r, _ in batch], rows, 0, np.uint32)
        from_last = _padded(tok_from_last, tokens_b, -1)
        num_logprobs, prompt_k, sampler = key[4:]  # sampler: greedy steps skip the sort top-k/top-p need
        operands = (self.weights, self.cache, ids, positions, slots, token_rows, tables, row_tokens, last, next_ids, temps,
                    top_k, top_p, row_keys, counters, self._last_tokens, from_last)
        if self._compiling is not None and self._compiling[0] == key:  # compiling off-thread: wait for it
            self._take_compiled(wait=True)
        compiled = self._compiled.get(key)
        if compiled is not None:
            tokens, logprobs, prompt, self.cache = compiled(*operands)
        else:
            tokens, logprobs, prompt, self.cache = self._step(num_logprobs, prompt_k, sampler, *operands)
        self.shapes.add(key)
        self._last_tokens = tokens
        return LaunchedStep([(r, n, r.computed, r.computed + n == r.length) for r, n in batch],
                            (tokens, logprobs, prompt))

    @staticmethod
    def collect(launched: LaunchedStep) -> StepResult:
        """Waits for a launched step and copies its results to the host (one transfer)."""
        batch = launched.rows
        tokens, (chosen, top_v, top_i), prompt = jax.device_get(launched.outputs)
        tokens = tokens[:len(chosen)]
        if prompt is not None:  # per row: its tokens' (chosen, top values, top ids)
            starts = np.concatenate([[0], np.cumsum([n for _, n, _, _ in batch])])
            prompt = [tuple(a[starts[b]:starts[b + 1]] for a in prompt) for b in range(len(batch))]
        return StepResult(tokens, chosen, top_v, top_i, prompt)
