"""The device side of the engine: the model's page pool and one jitted step over it.

A step (:class:`~modelopt_jax.ops.paged_step.PagedStep`) feeds each row a chunk of tokens (a
prompt chunk, or the one token a decode feeds), writes their keys/values into the pool, and samples
each row's next token from its last position, on the device. Shapes are bucketed (see
:func:`step_shape`) so a workload compiles a handful of programs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.engine.request import Request
from modelopt_jax.ops.paged_step import AttentionConfig, PagedStep, StepShape
from modelopt_jax.sampling import sample, sampler_for, token_logprobs


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def token_bucket(n: int, minimum: int = 16) -> int:
    """Powers of two up to 1024 tokens, multiples of 1024 above (a step of 4100 prompt tokens pads
    to 5120, not 8192: padded tokens cost the GEMMs as much as real ones)."""
    return bucket(n, minimum) if n <= 1024 else -(-n // 1024) * 1024


def _padded(values, size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``size``, as one array."""
    out = np.full(size, fill, dtype)
    out[:len(values)] = values
    return out


def step_shape(batch: list[tuple[Request, int]], attention: AttentionConfig, fixed_table_width: int,
               planned: bool = False) -> StepShape:
    """The padded shape of the program that runs ``batch`` (rows feeding one token are decode rows).

    Bucketed so a workload compiles a handful of programs (each a whole-model compile): decode rows
    to powers of two (at least 8: a GEMM costs the same for M 1..8); prompt tokens by
    :func:`token_bucket` (the scheduler fills a busy step's budget exactly, so its steps repeat one
    shape); prompt rows and tokens per prompt row to powers of two (padding rows and the padding
    tail of a row cost the prefill kernel CTAs that return at once). Block tables are
    ``fixed_table_width`` wide where every section of the step runs a kernel that reads only the
    pages in use (the width then costs nothing and adds no program), else a power of two of pages
    (at least 8) covering the longest row, since XLA's attention gathers the whole width.
    ``planned``: the rows' pages are not allocated yet (count those their fed tokens will need).
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
    return StepShape(decode_rows=bucket(len(decode), 8) if decode else 0,
                     prompt_tokens=token_bucket(sum(prompt)) if prompt else 0,
                     prompt_rows=bucket(len(prompt)) if prompt else 0,
                     prompt_width=bucket(max(prompt), 16) if prompt else 1, table_width=width)


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


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling inputs of a step (device arrays; R rows, T tokens)."""

    temperature: jax.Array            # [R] float32, 0 = greedy
    top_k: jax.Array                  # [R] int32, <= 0 = off
    top_p: jax.Array                  # [R] float32, 1 = off
    keys: jax.Array                   # [R, 2] uint32 each row's request PRNG key
    counters: jax.Array               # [R] uint32 index of the token being sampled (folded into the key)
    prompt_next_ids: jax.Array        # [T] int32 the prompt token after each fed position (prompt log-probs)
    from_last: jax.Array              # [T] int32 row of the previous step whose sampled token is this
                                      # token's input (its value is still on the device), -1: known

    @staticmethod
    def abstract(shape: StepShape) -> "RowSampling":
        s = jax.ShapeDtypeStruct
        r, t = shape.rows, shape.tokens
        return RowSampling(s((r,), np.float32), s((r,), np.int32), s((r,), np.float32), s((r, 2), np.uint32),
                           s((r,), np.uint32), s((t,), np.int32), s((t,), np.int32))


jax.tree_util.register_dataclass(RowSampling, data_fields=[f.name for f in dataclasses.fields(RowSampling)],
                                 meta_fields=[])


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device and not yet copied back: its rows and its device outputs."""

    rows: list[tuple[Request, int, int, bool, int]]  # (request, tokens fed, first position fed, samples a token,
                                                     #  its row in the step's outputs)
    outputs: tuple                          # device arrays: tokens, (chosen, top values, top ids), prompt

    @property
    def is_prompt(self) -> bool:
        return any(n > 1 for _, n, _, _, _ in self.rows)

    @property
    def is_mixed(self) -> bool:
        return self.is_prompt and any(n == 1 for _, n, _, _, _ in self.rows)


@dataclasses.dataclass
class StepResult:
    """What one step returns to the host (one device-to-host copy)."""

    tokens: np.ndarray                      # [R] sampled token per row
    chosen: np.ndarray                      # [R] its log-prob
    top_values: np.ndarray                  # [R, k]
    top_ids: np.ndarray                     # [R, k]
    prompt: dict | None                     # per prompt row (by output row): its tokens' (chosen, top values, top ids)


class Runner:
    """Runs packed steps (:class:`PagedStep`): decode rows and prompt chunks side by side.

    ``fixed_table_width`` (pages, a full-length sequence's): the block tables' width in steps whose
    attention reads only the pages in use (see :func:`step_shape`).
    """

    def __init__(self, model, num_pages: int, attention: AttentionConfig, pad_id: int = 0,
                 fixed_table_width: int = 1, max_rows: int = 256):
        from flax import nnx

        self.attention = attention
        self.page_size = attention.page_size
        # Every step's sampled tokens, padded to one length, stay on the device: the next step,
        # launched before this one is collected, reads its in-flight input tokens from them.
        # A step has at most max_rows decode rows (bucketed) and as many prompt rows.
        self.max_rows = 2 * bucket(max_rows, 8)
        self._last_tokens = jnp.zeros(self.max_rows, jnp.int32)
        self.pad_id = pad_id
        self.fixed_table_width = fixed_table_width
        self.cache = model.init_paged_cache(num_pages, self.page_size)
        graphdef, state = nnx.split(model)
        # The weights go to every step as a flat tuple: jit flattens a tuple in C++, an nnx.State
        # by a Python callback per node (~350 us a step for 32 layers, bench/host_loop.py), time the
        # host loop does not have at 256 rows (it was the GPU that waited, bench/RESULTS.md).
        leaves, state_def = jax.tree_util.tree_flatten(state)
        self.weights = tuple(leaves)

        def forward(weights, cache, step, all_logits):
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, weights))
            return model.forward_step(cache, step, all_logits=all_logits)

        self._forward = forward
        self._step = jax.jit(self._step_fn, static_argnums=(0,), donate_argnums=(2,))
        self.shapes: set[StepProgram] = set()  # programs run so far
        # Programs compiled off the engine's thread (see ready); one compile at a time.
        self._compiled: dict[StepProgram, object] = {}
        self._compiling: tuple[StepProgram, concurrent.futures.Future] | None = None
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    def step_key(self, batch: list[tuple[Request, int]], planned: bool = True) -> StepProgram:
        """The program a step of ``batch`` rows runs. The rows' pages need not be allocated yet."""
        params = [r.params for r, _ in batch]
        return StepProgram(step_shape(batch, self.attention, self.fixed_table_width, planned),
                           max((p.logprobs or 0) for p in params), prompt_logprobs_k(batch), sampler_for(params))

    def ready(self, batch: list[tuple[Request, int]]) -> bool:
        """Whether a step of ``batch`` can launch without compiling first. When it cannot, its program
        starts compiling on a helper thread (unless another compile runs), so the caller can run other
        steps meanwhile: a new step shape met by a server costs its streams nothing but the wait of
        the requests in that step (an 8B program took 6-8 s to compile on the H200)."""
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

    def _take_compiled(self, wait: bool = False) -> StepProgram | None:
        """The key of the off-thread compile, once finished (waited for if ``wait``), its program
        moved into the table (a failed one is dropped); None while it still runs."""
        key, future = self._compiling
        if not (wait or future.done()):
            return None
        self._compiling = None
        if future.exception() is None:
            self._compiled[key] = future.result()
        return key

    def _abstract_operands(self, key: StepProgram) -> tuple:
        """Shapes, dtypes and shardings of a step's operands (taken on the engine's thread: the live
        cache is donated by every step)."""
        def like(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        return (tuple(like(x) for x in self.weights), jax.tree_util.tree_map(like, self.cache),
                key.shape.abstract(self.attention), RowSampling.abstract(key.shape), like(self._last_tokens))

    def _compile(self, key: StepProgram, operands: tuple):
        return self._step.lower(key, *operands).compile()

    def _step_fn(self, program: StepProgram, weights, cache, step: PagedStep, rows: RowSampling, last_tokens):
        ids = jnp.where(rows.from_last >= 0, last_tokens[jnp.maximum(rows.from_last, 0)], step.input_ids)
        step = dataclasses.replace(step, input_ids=ids)
        if program.prompt_logprobs is None:
            logits, cache = self._forward(weights, cache, step, False)
            prompt = None
        else:
            all_logits, cache = self._forward(weights, cache, step, True)
            logits = all_logits[step.logit_index]
            prompt = token_logprobs(all_logits, rows.prompt_next_ids, program.prompt_logprobs)
        keys = jax.vmap(jax.random.fold_in)(rows.keys, rows.counters)
        tokens = sample(logits, rows.temperature, rows.top_k, rows.top_p, keys, program.sampler)
        padded = jnp.zeros(self.max_rows, jnp.int32).at[:tokens.shape[0]].set(tokens)
        return padded, token_logprobs(logits, tokens, program.num_logprobs), prompt, cache

    def launch(self, batch: list[tuple[Request, int]]) -> LaunchedStep:
        """Dispatches one step for ``batch`` rows of (request, tokens to feed) without waiting for it.

        Rows feeding one token become the step's decode rows (in ``batch`` order), the others its
        prompt rows. A row's input token may still be in flight (``request.inflight_row`` >= 0 and
        its value unknown on the host): it is read on the device from the previous launched step's
        tokens. Requests are not modified: the caller advances ``computed`` and ``inflight``. A
        program compiled off-thread (:meth:`ready`) runs as compiled; one still compiling is waited
        for; any other compiles here, as ``jax.jit`` does.
        """
        page = self.page_size
        key = self.step_key(batch, planned=False)
        shape = key.shape
        decode = [(r, n) for r, n in batch if n == 1]
        prompt = [(r, n) for r, n in batch if n > 1]
        t, rows, nd = shape.tokens, shape.rows, shape.decode_rows
        # Per-row values are collected in Python lists and converted once per array: a numpy
        # element assignment costs ~1 us, and a 256-row decode step made ~4,000 of them.
        tok_ids, tok_pos, tok_slots, tok_from_last = [], [], [], []
        tables = np.zeros((rows, shape.table_width), np.int32)
        first_pages = np.zeros(rows, np.int32)  # sliding-window rows: the leading pages they gave back
        prompt_tokens = np.full((shape.prompt_rows, shape.prompt_width), shape.prompt_tokens, np.int32)
        next_ids = np.zeros(t, np.int32)
        logit_index = np.zeros(rows, np.int32)
        launched = []
        for b, (r, _) in enumerate(decode):
            start, pages = r.computed, r.pages
            tables[b, :len(pages) - r.dropped] = pages[r.dropped:]
            first_pages[b] = r.dropped
            token = r.token_at(start)
            tok_ids.append(self.pad_id if token is None else token)
            tok_from_last.append(r.inflight_row if token is None else -1)
            tok_pos.append(start)
            tok_slots.append(pages[start // page] * page + start % page)
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                next_ids[b] = r.prompt_ids[start + 1]
            launched.append((r, 1, start, start + 1 == r.length, b))
        pad = nd - len(decode)
        tok_ids += [self.pad_id] * pad
        tok_from_last += [-1] * pad
        tok_pos += [0] * pad
        tok_slots += [0] * pad  # padding tokens write to the scratch page 0
        logit_index[:len(decode)] = np.arange(len(decode))
        offset = 0  # within the prompt section
        for j, (r, n) in enumerate(prompt):
            start, pages = r.computed, r.pages
            row = nd + j
            tables[row, :len(pages) - r.dropped] = pages[r.dropped:]
            first_pages[row] = r.dropped
            pos = range(start, start + n)
            tok_ids += [r.token_at(p) for p in pos]  # prompt chunks: every token is known
            tok_from_last += [-1] * n
            tok_pos += pos
            tok_slots += [pages[p // page] * page + p % page for p in pos]
            prompt_tokens[j, :n] = np.arange(offset, offset + n)
            logit_index[row] = nd + offset + n - 1
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                end = min(start + n + 1, len(r.prompt_ids))  # next prompt token of each fed position
                next_ids[nd + offset:nd + offset + end - start - 1] = r.prompt_ids[start + 1:end]
            launched.append((r, n, start, start + n == r.length, row))
            offset += n
        step = PagedStep(input_ids=_padded(tok_ids, t, self.pad_id), positions=_padded(tok_pos, t),
                         slots=_padded(tok_slots, t), block_tables=tables, prompt_tokens=prompt_tokens,
                         logit_index=logit_index, num_decode=nd, attention=self.attention,
                         first_pages=None if self.attention.sliding_window is None else first_pages)
        ordered = [r for r, _ in decode] + [r for r, _ in prompt]
        params = [r.params for r in ordered]
        row_keys = np.zeros((rows, 2), np.uint32)
        row_ids = [row for *_, row in launched]
        row_keys[row_ids] = [r.row_key for r in ordered]
        sampling = RowSampling(
            temperature=_scattered([q.temperature for q in params], row_ids, rows, 0.0, np.float32),
            top_k=_scattered([q.top_k for q in params], row_ids, rows, -1),
            top_p=_scattered([q.top_p for q in params], row_ids, rows, 1.0, np.float32),
            keys=row_keys,
            counters=_scattered([len(r.generated) + r.inflight for r in ordered], row_ids, rows, 0, np.uint32),
            prompt_next_ids=next_ids, from_last=_padded(tok_from_last, t, -1))
        operands = (self.weights, self.cache, step, sampling, self._last_tokens)
        if self._compiling is not None and self._compiling[0] == key:  # compiling off-thread: wait for it
            self._take_compiled(wait=True)
        compiled = self._compiled.get(key)
        if compiled is not None:
            tokens, logprobs, prompt_out, self.cache = compiled(*operands)
        else:
            tokens, logprobs, prompt_out, self.cache = self._step(key, *operands)
        self.shapes.add(key)
        self._last_tokens = tokens
        return LaunchedStep(launched, (tokens, logprobs, prompt_out))

    @staticmethod
    def collect(launched: LaunchedStep) -> StepResult:
        """Waits for a launched step and copies its results to the host (one transfer)."""
        tokens, (chosen, top_v, top_i), prompt = jax.device_get(launched.outputs)
        prompt_rows = None
        if prompt is not None:  # per row: its fed tokens' (chosen, top values, top ids)
            prompt_rows = {}
            nd = sum(1 for _, n, _, _, _ in launched.rows if n == 1)
            decode_rows = bucket(nd, 8) if nd else 0
            offset = decode_rows
            for r, n, _, _, row in launched.rows:
                first = row if n == 1 else offset
                if n > 1:
                    offset += n
                prompt_rows[row] = tuple(a[first:first + n] for a in prompt)
        return StepResult(tokens, chosen, top_v, top_i, prompt_rows)


def _scattered(values, rows: list[int], size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """``values`` placed at ``rows`` of an array of ``fill``."""
    out = np.full(size, fill, dtype)
    out[rows] = values
    return out
