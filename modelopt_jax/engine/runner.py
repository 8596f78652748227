"""The device side of the engine: the model's page pool and one jitted step over it.

A step (:class:`~modelopt_jax.ops.paged_step.PagedStep`) feeds each row a chunk of tokens (a
prompt chunk, or the one token a decode feeds), writes their keys/values into the pool, and samples
each row's next token from its last position, on the device. Which programs a step runs, and their
bucketed shapes, are :mod:`.step_programs`' to say.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.engine.buckets import (MAX_PROMPT_SEQS, MIN_DECODE_ROWS, bucket, decode_buckets, token_bucket,
                                         token_buckets)
from modelopt_jax.engine.request import Request
from modelopt_jax.engine.step_programs import (MULTI_STEP_ROWS, PLAIN_DECODE_ROWS, StepProgram, kernel_prompt_section,
                                               program_parts, prompt_logprobs_k, shared_prefixes, step_shape)
from modelopt_jax.ops.paged_step import AttentionConfig, PagedStep, StepShape, cascade_lines
from modelopt_jax.sampling import sample, sampler_for, token_logprobs


def _padded(values, size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """``values`` followed by ``fill`` up to ``size``, as one array."""
    out = np.full(size, fill, dtype)
    out[:len(values)] = values
    return out


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling inputs of a step program (device arrays; S sampled rows, T tokens)."""

    temperature: jax.Array            # [S] float32, 0 = greedy
    top_k: jax.Array                  # [S] int32, <= 0 = off
    top_p: jax.Array                  # [S] float32, 1 = off
    keys: jax.Array                   # [S, 2] uint32 each row's request PRNG key
    counters: jax.Array               # [S] uint32 index of the token being sampled (folded into the key)
    prompt_next_ids: jax.Array        # [T] int32 the prompt token after each fed position (prompt log-probs)
    from_last: jax.Array              # [T] int32 row of the previous step whose sampled token is this
                                      # token's input (its value is still on the device), -1: known
    out_row: jax.Array                # [] int32 the step's output row of this program's first sampled row

    @staticmethod
    def abstract(shape: StepShape) -> "RowSampling":
        s = jax.ShapeDtypeStruct
        r, t = shape.sampled_rows, shape.tokens
        return RowSampling(s((r,), np.float32), s((r,), np.int32), s((r,), np.float32), s((r, 2), np.uint32),
                           s((r,), np.uint32), s((t,), np.int32), s((t,), np.int32), s((), np.int32))


jax.tree_util.register_dataclass(RowSampling, data_fields=[f.name for f in dataclasses.fields(RowSampling)],
                                 meta_fields=[])


@dataclasses.dataclass
class LaunchedProgram:
    """One program of a launched step: where its rows' results sit (device arrays until collected)."""

    out_row: int                            # the step's output row of its first sampled row
    logprobs: tuple                         # (chosen [S], top values [S, k], top ids [S, k]); a multi-step
                                            # program's each have a leading [steps] axis
    prompt: tuple | None                    # per fed token (chosen [T], top values [T, k], top ids [T, k]) or None
    token_spans: dict[int, tuple[int, int]]  # output row -> (its first fed token in this program, tokens fed)
    step_tokens: jax.Array | None = None    # [steps, S] every forward's sampled tokens (multi-step programs;
                                            # None: the one forward's tokens are LaunchedStep.tokens')


@dataclasses.dataclass
class LaunchedStep:
    """A step dispatched to the device and not yet copied back: its rows and its device outputs."""

    rows: list[tuple[Request, int, int, bool, int]]  # (request, tokens fed, first position fed, samples a token,
                                                     #  its row in the step's outputs)
    tokens: jax.Array                       # [Runner.max_rows] every row's sampled token at its output row
    programs: list[LaunchedProgram]         # the programs that ran it, in launch order
    steps: int = 1                          # forwards it ran (decode-only multi-step: each row fed steps tokens
                                            # and sampled steps tokens)

    @property
    def is_prompt(self) -> bool:
        return any(n > 1 for _, n, _, _, _ in self.rows)

    @property
    def is_mixed(self) -> bool:
        return self.is_prompt and any(n == 1 for _, n, _, _, _ in self.rows)


@dataclasses.dataclass
class StepResult:
    """What one step returns to the host (one device-to-host copy)."""

    tokens: np.ndarray                      # [steps, rows] sampled token per forward and output row
    chosen: np.ndarray                      # [steps, rows] its log-prob
    top_values: np.ndarray                  # [steps, rows, k]
    top_ids: np.ndarray                     # [steps, rows, k]
    prompt: dict | None                     # per prompt row (by output row): its tokens' (chosen, top values, top ids)


class Runner:
    """Runs packed steps (:class:`PagedStep`): decode rows and prompt chunks side by side.

    ``fixed_table_width`` (pages, a full-length sequence's): the block tables' width in steps whose
    attention reads only the pages in use (see :func:`step_shape`). ``split_steps``: a step holding
    decode rows and prompt chunks runs as two programs, the decodes' then the prompts' (launched back
    to back, one copy back), so the programs a workload needs are the decode-row buckets plus the
    prompt-token buckets, not their product; the cost is the weights read twice in such a step.
    ``packed_steps``: a step with prompt chunks runs as one program in the packed layout
    (:class:`PagedStep`'s ``decode_count``): its decode and prompt tokens side by side, padded as one
    to a token bucket, so the programs are the decode buckets plus one per token bucket, and a mixed
    step reads the weights once.
    """

    def __init__(self, model, num_pages: int, attention: AttentionConfig, pad_id: int = 0,
                 fixed_table_width: int = 1, max_rows: int = 256, split_steps: bool = True,
                 packed_steps: bool = False, decode_steps: int = 1, fine_prompt_buckets: bool = False):
        from flax import nnx

        self.attention = attention
        self.decode_steps = decode_steps  # forwards of a multi-step decode launch (see MULTI_STEP_ROWS)
        self.page_size = attention.page_size
        self.split_steps = split_steps
        self.packed_steps = packed_steps  # steps with prompt chunks take the packed layout (one program)
        self.fine_prompt_buckets = fine_prompt_buckets  # prompt sections also pad to FINE_PROMPT_SIZES
        self.max_decode_rows = bucket(max_rows, MIN_DECODE_ROWS)
        self.max_prompt_seqs = min(MAX_PROMPT_SEQS, max_rows)  # the scheduler admits no more per step
        # Every step's sampled tokens, at their output rows, stay on the device: the next step,
        # launched before this one is collected, reads its in-flight input tokens from them.
        self.max_rows = self.max_decode_rows + bucket(self.max_prompt_seqs)
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
        self.inline_compiles = 0  # programs a launch compiled in line (not ahead, not in the background)
        self.shared_prefix_rows = 0  # decode rows that read a shared prefix once per line (cascade attention)
        # Programs compiled off the engine's thread (see ready, precompile); one background compile at a time.
        self._compiled: dict[StepProgram, object] = {}
        self._failed: set[StepProgram] = set()  # background compiles that raised (launch compiles them in line)
        self._compiling: tuple[StepProgram, concurrent.futures.Future] | None = None
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None

    # -- which programs a step runs ------------------------------------------------------------------

    def programs_of(self, batch: list[tuple[Request, int]]) -> list[list[tuple[Request, int]]]:
        return program_parts(batch, self.split_steps and not self.packed_steps)

    def step_key(self, batch: list[tuple[Request, int]], planned: bool = True) -> StepProgram:
        """The program one part of a step (:meth:`programs_of`) runs. The rows' pages need not be
        allocated yet."""
        params = [r.params for r, _ in batch]
        shape = step_shape(batch, self.attention, self.fixed_table_width, planned, self.max_prompt_seqs,
                           self.fine_prompt_buckets, self.max_decode_rows if self.packed_steps else None)
        return StepProgram(shape, max((p.logprobs or 0) for p in params), prompt_logprobs_k(batch),
                           sampler_for(params))

    def prompt_seqs_limit(self, tokens: int) -> int:
        """The prompt chunks a step may hold (the scheduler's cap) whose prompt section has ``tokens``
        tokens (the prompt tokens; with ``packed_steps``, the decode tokens too): where the prefill
        kernel runs, what its step shape has rows for (:func:`kernel_prompt_section`)."""
        if self.attention.prefill == "xla":
            return self.max_prompt_seqs
        return kernel_prompt_section(token_bucket(tokens, fine=self.fine_prompt_buckets), self.max_prompt_seqs)[2]

    def step_keys(self, batch: list[tuple[Request, int]], planned: bool = True) -> list[StepProgram]:
        return [self.step_key(part, planned) for part in self.programs_of(batch)]

    # -- compiling ahead ------------------------------------------------------------------------------

    @property
    def has_program_table(self) -> bool:
        """Whether every step's programs come from a table known ahead (:meth:`program_table`): the
        kernels read only the pages in use (fixed table width, prompt rows of PROMPT_TILE tokens) and
        mixed steps are split or packed."""
        return ((self.split_steps or self.packed_steps) and self.attention.decode != "xla"
                and self.attention.prefill != "xla")

    def program_table(self, max_prompt_tokens: int, samplers=("greedy",)) -> list[StepProgram]:
        """The programs steps of at most ``max_prompt_tokens`` prompt tokens can run, per sampler, without
        log-probs: a decode program per decode-row bucket (with cascade attention where the model has it, and
        also without it up to PLAIN_DECODE_ROWS rows), and a prompt program per prompt-token bucket (with
        ``packed_steps``: a packed program per token bucket, which any step with prompt chunks runs)."""
        if not self.has_program_table:
            raise ValueError("the step programs form a table only where both attention sections run the kernels "
                             "and mixed steps are split or packed (Runner.has_program_table)")
        width = self.fixed_table_width
        cascade = bool(self.attention.cascade_group)
        shapes = [StepShape(d, 0, 0, 1, width, 0, cascade) for d in decode_buckets(self.max_decode_rows)]
        if cascade:  # and without it, where no row shares a prefix (PLAIN_DECODE_ROWS)
            shapes += [StepShape(d, 0, 0, 1, width, 0) for d in decode_buckets(self.max_decode_rows)
                       if d <= PLAIN_DECODE_ROWS]
        for tokens in token_buckets(max_prompt_tokens, fine=self.fine_prompt_buckets):
            rows, row_width, seqs = kernel_prompt_section(tokens, self.max_prompt_seqs)
            if self.packed_steps:
                shapes.append(StepShape(min(tokens, self.max_decode_rows), tokens, rows, row_width, width, seqs,
                                        cascade, packed=True))
            else:
                shapes.append(StepShape(0, tokens, rows, row_width, width, seqs))
        programs = [StepProgram(shape, 0, None, sampler) for sampler in samplers for shape in shapes]
        if self.decode_steps > 1:  # multi-step decode programs (no cascade attention)
            programs += [StepProgram(StepShape(d, 0, 0, 1, width, 0), 0, None, sampler, self.decode_steps)
                         for sampler in samplers for d in decode_buckets(self.max_decode_rows) if d <= MULTI_STEP_ROWS]
        return programs

    def precompile(self, programs: list[StepProgram], workers: int = 1) -> int:
        """Compiles ``programs`` now (``workers`` at a time; XLA compiles outside the GIL), so no step
        waits for them; returns how many were compiled (the others were already)."""
        todo = [k for k in dict.fromkeys(programs) if k not in self._compiled and k not in self.shapes]
        operands = [self._abstract_operands(k) for k in todo]
        with concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="modelopt-jax-precompile") as ex:
            for key, compiled in zip(todo, ex.map(self._compile, todo, operands)):
                self._compiled[key] = compiled
        return len(todo)

    @property
    def compiled_programs(self) -> set[StepProgram]:
        """Programs compiled ahead or in the background (run or not)."""
        return set(self._compiled)

    def ready(self, batch: list[tuple[Request, int]]) -> bool:
        """Whether a step of ``batch`` can launch without compiling first. When it cannot, a missing
        program starts compiling on a helper thread (unless another compile runs), so the caller can
        run other steps meanwhile: a new step shape met by a server costs its streams nothing but the
        wait of the requests in that step (an 8B program took 6-8 s to compile on the H200)."""
        known = lambda k: k in self.shapes or k in self._compiled or k in self._failed  # noqa: E731
        missing = [k for k in self.step_keys(batch) if not known(k)]
        if not missing:
            return True
        if self._compiling is not None:
            if self._take_compiled() is None:  # still compiling
                return False
            missing = [k for k in missing if not known(k)]
            if not missing:
                return True
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="modelopt-jax-compile")
        key = missing[0]
        self._compiling = (key, self._compiler.submit(self._compile, key, self._abstract_operands(key)))
        return False

    def _take_compiled(self, wait: bool = False) -> StepProgram | None:
        """The key of the off-thread compile, once finished (waited for if ``wait``), its program
        moved into the table (a failed one is noted); None while it still runs."""
        key, future = self._compiling
        if not (wait or future.done()):
            return None
        self._compiling = None
        if future.exception() is None:
            self._compiled[key] = future.result()
        else:
            self._failed.add(key)
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
        if program.decode_steps > 1:
            return self._multi_step_fn(program, weights, cache, step, rows, last_tokens, ids)
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
        # the step's earlier programs' tokens stay where they are (out_row + rows <= max_rows, checked on the host)
        placed = jax.lax.dynamic_update_slice(last_tokens, tokens, (rows.out_row,))
        return placed, token_logprobs(logits, tokens, program.num_logprobs), prompt, cache

    def _multi_step_fn(self, program: StepProgram, weights, cache, step: PagedStep, rows: RowSampling, last_tokens,
                       ids):
        """``program.decode_steps`` forwards of a decode-only step (token b is row b's, sampled at row b):
        forward i feeds each row the token forward i - 1 sampled, at its position + i, into the slot its
        block table names (the scheduler grew every row's pages for all of them); padding tokens stay
        at position 0 of the scratch page. The key of a row's token is folded from its counter + i, so
        each token is drawn as a one-forward step would draw it. Returns the last forward's tokens
        placed like a one-forward step's, and every forward's tokens and log-probs."""
        page = self.page_size
        real = step.real_tokens != 0
        table_rows = jnp.arange(step.num_tokens)

        def forward(carry, i):
            cache, fed = carry
            pos = step.positions + i
            slots = step.block_tables[table_rows, pos // page] * page + pos % page
            at = dataclasses.replace(step, input_ids=fed, positions=jnp.where(real, pos, 0),
                                     slots=jnp.where(real, slots, 0))
            logits, cache = self._forward(weights, cache, at, False)
            keys = jax.vmap(jax.random.fold_in)(rows.keys, rows.counters + i.astype(jnp.uint32))
            tokens = sample(logits, rows.temperature, rows.top_k, rows.top_p, keys, program.sampler)
            return (cache, tokens), (tokens, token_logprobs(logits, tokens, program.num_logprobs))

        (cache, last), (tokens, logprobs) = jax.lax.scan(forward, (cache, ids),
                                                          jnp.arange(program.decode_steps, dtype=jnp.int32))
        placed = jax.lax.dynamic_update_slice(last_tokens, last, (rows.out_row,))
        return placed, (tokens, logprobs), None, cache

    # -- running a step --------------------------------------------------------------------------------

    def launch(self, batch: list[tuple[Request, int]], steps: int = 1) -> LaunchedStep:
        """Dispatches one step for ``batch`` rows of (request, tokens to feed) without waiting for it.
        ``steps`` > 1 (decode rows only, at most MULTI_STEP_ROWS, pages grown for as many tokens): that
        many forwards in one program, each row fed its in-flight token and then the tokens it samples.

        Rows feeding one token are the step's decode rows (in ``batch`` order), the others its
        prompt rows; they run as one program or two (:meth:`programs_of`), whose sampled tokens land
        in one array at the rows' output rows (decode rows first). A row's input token may still be
        in flight (``request.inflight_row`` >= 0 and its value unknown on the host): it is read on
        the device from the previous launched step's tokens. Requests are not modified: the caller
        advances ``computed`` and ``inflight``. A program compiled ahead or off-thread runs as
        compiled; one still compiling is waited for; any other compiles here, as ``jax.jit`` does.
        """
        if steps > 1 and (any(n != 1 for _, n in batch) or len(batch) > MULTI_STEP_ROWS):
            raise ValueError(f"a step of {steps} forwards runs at most {MULTI_STEP_ROWS} decode rows, got "
                             f"{sorted(n for _, n in batch)} tokens fed by row")
        rows, programs = [], []
        tokens, out_row = self._last_tokens, 0
        for part in self.programs_of(batch):
            tokens, launched, sampled = self._launch_program(part, tokens, out_row, steps)
            rows += launched.pop("rows")
            programs.append(LaunchedProgram(out_row, **launched))
            out_row += sampled
        self._last_tokens = tokens
        return LaunchedStep(rows, tokens, programs, steps)

    def _launch_program(self, batch: list[tuple[Request, int]], last_tokens: jax.Array, out_row: int,
                        steps: int = 1):
        """Builds and dispatches one program's step for ``batch`` (decode rows before prompt rows),
        its sampled rows placed at ``out_row`` onwards; returns the tokens array it leaves, what
        :class:`LaunchedProgram` records, and its sampled rows (padding included)."""
        page = self.page_size
        key = self.step_key(batch, planned=False)
        if steps > 1:  # multi-step programs read each row's own pages (no cascade lines)
            key = dataclasses.replace(key, shape=dataclasses.replace(key.shape, cascade=False), decode_steps=steps)
        shape = key.shape
        if out_row + shape.sampled_rows > self.max_rows:
            raise ValueError(f"a step of {len(batch)} rows needs {out_row + shape.sampled_rows} output rows; the "
                             f"runner has {self.max_rows} (max_num_seqs decode rows and {self.max_prompt_seqs} "
                             f"prompt sequences)")
        decode = [(r, n) for r, n in batch if n == 1]
        prompt = [(r, n) for r, n in batch if n > 1]
        t, nd, tile = shape.tokens, shape.decode_rows, shape.prompt_width
        # the prompt tokens' first index in the step: after the decode section (split layout), or right
        # after the decode rows in use (packed: the decode section is a capacity, and its unused rows
        # hold no token)
        first_prompt = len(decode) if shape.packed else nd
        plan = None
        if shape.cascade:
            plan = shared_prefixes([r for r, _ in decode], self.attention.cascade_group, page, shape.table_width,
                                   cascade_lines(nd, self.attention.cascade_group), pad=nd)
            # nothing shared in a decode-only step: the program without it (the table holds plain
            # variants of decode-only shapes only; a mixed step's prompt work hides the cascade part)
            if not plan.rows_sharing and nd <= PLAIN_DECODE_ROWS and not shape.prompt_tokens:
                plan = None
                key = dataclasses.replace(key, shape=dataclasses.replace(shape, cascade=False))
                shape = key.shape
            else:
                self.shared_prefix_rows += plan.rows_sharing
        # Per-row values are collected in Python lists and converted once per array: a numpy
        # element assignment costs ~1 us, and a 256-row decode step made ~4,000 of them.
        tok_ids, tok_pos, tok_slots, tok_from_last = [], [], [], []
        tables = np.zeros((shape.rows, shape.table_width), np.int32)
        first_pages = np.zeros(shape.rows, np.int32)  # sliding-window rows: the leading pages they gave back
        prompt_tokens = np.full((shape.prompt_rows, tile), shape.prompt_tokens, np.int32)
        next_ids = np.zeros(t, np.int32)
        logit_index = np.zeros(shape.sampled_rows, np.int32)
        launched, spans = [], {}
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
            launched.append((r, 1, start, start + 1 == r.length, out_row + b))
            spans[out_row + b] = (b, 1)
        pad = 0 if shape.packed else nd - len(decode)
        tok_ids += [self.pad_id] * pad
        tok_from_last += [-1] * pad
        tok_pos += [0] * pad
        tok_slots += [0] * pad  # padding tokens write to the scratch page 0
        logit_index[:len(decode)] = np.arange(len(decode))
        offset, table_row = 0, nd  # within the prompt section; the next prompt row
        for j, (r, n) in enumerate(prompt):
            start, pages = r.computed, r.pages
            for cut in range(0, n, tile):  # a chunk's rows: PROMPT_TILE tokens each, or the whole chunk
                width = min(tile, n - cut)
                tables[table_row, :len(pages) - r.dropped] = pages[r.dropped:]
                first_pages[table_row] = r.dropped
                at = offset + cut + (first_prompt if shape.packed else 0)  # (split: within the prompt section)
                prompt_tokens[table_row - nd, :width] = np.arange(at, at + width)
                table_row += 1
            pos = range(start, start + n)
            tok_ids += [r.token_at(p) for p in pos]  # prompt chunks: every token is known
            tok_from_last += [-1] * n
            tok_pos += pos
            tok_slots += [pages[p // page] * page + p % page for p in pos]
            logit_index[nd + j] = first_prompt + offset + n - 1
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                end = min(start + n + 1, len(r.prompt_ids))  # next prompt token of each fed position
                next_ids[first_prompt + offset:first_prompt + offset + end - start - 1] = r.prompt_ids[start + 1:end]
            launched.append((r, n, start, start + n == r.length, out_row + nd + j))
            spans[out_row + nd + j] = (first_prompt + offset, n)
            offset += n
        step = PagedStep(input_ids=_padded(tok_ids, t, self.pad_id), positions=_padded(tok_pos, t),
                         slots=_padded(tok_slots, t), block_tables=tables, prompt_tokens=prompt_tokens,
                         logit_index=logit_index, num_decode=nd, attention=self.attention,
                         first_pages=None if self.attention.sliding_window is None else first_pages,
                         shared_tables=None if plan is None else plan.tables,
                         shared_rows=None if plan is None else plan.rows,
                         shared_lengths=None if plan is None else _padded(plan.lengths, nd),
                         real_tokens=_padded([1] * len(decode) + [0] * pad + [1] * offset, t),
                         decode_count=np.int32(len(decode)) if shape.packed else None)
        ordered = [r for r, _ in decode] + [r for r, _ in prompt]
        params = [r.params for r in ordered]
        s = shape.sampled_rows
        row_ids = list(range(len(decode))) + [nd + j for j in range(len(prompt))]
        row_keys = np.zeros((s, 2), np.uint32)
        row_keys[row_ids] = [r.row_key for r in ordered]
        sampling = RowSampling(
            temperature=_scattered([q.temperature for q in params], row_ids, s, 0.0, np.float32),
            top_k=_scattered([q.top_k for q in params], row_ids, s, -1),
            top_p=_scattered([q.top_p for q in params], row_ids, s, 1.0, np.float32),
            keys=row_keys,
            counters=_scattered([len(r.generated) + r.inflight for r in ordered], row_ids, s, 0, np.uint32),
            prompt_next_ids=next_ids, from_last=_padded(tok_from_last, t, -1), out_row=np.int32(out_row))
        operands = (self.weights, self.cache, step, sampling, last_tokens)
        if self._compiling is not None and self._compiling[0] == key:  # compiling off-thread: wait for it
            self._take_compiled(wait=True)
        compiled = self._compiled.get(key)
        if compiled is not None:
            tokens, logprobs, prompt_out, self.cache = compiled(*operands)
        else:
            tokens, logprobs, prompt_out, self.cache = self._step(key, *operands)
        if key not in self.shapes and compiled is None:
            self.inline_compiles += 1
        self.shapes.add(key)
        step_tokens = None
        if steps > 1:
            step_tokens, logprobs = logprobs
        return tokens, {"rows": launched, "logprobs": logprobs, "prompt": prompt_out, "token_spans": spans,
                        "step_tokens": step_tokens}, s

    @staticmethod
    def collect(launched: LaunchedStep) -> StepResult:
        """Waits for a launched step and copies its results to the host (one transfer)."""
        if launched.steps > 1:  # one multi-step program: every forward's tokens and log-probs
            (program,) = launched.programs
            tokens, (chosen, top_v, top_i) = jax.device_get((program.step_tokens, program.logprobs))
            n = launched.tokens.shape[0]
            rows = slice(program.out_row, program.out_row + tokens.shape[1])
            out = (np.zeros((launched.steps, n), np.int32), np.zeros((launched.steps, n), np.float32),
                   np.full((launched.steps, n, top_v.shape[2]), -np.inf, np.float32),
                   np.zeros((launched.steps, n, top_i.shape[2]), np.int32))
            for whole, part in zip(out, (tokens, chosen, top_v, top_i)):
                whole[:, rows] = part
            return StepResult(*out, None)
        tokens, outputs = jax.device_get((launched.tokens, [(p.logprobs, p.prompt) for p in launched.programs]))
        k = max(top_v.shape[1] for (_, top_v, _), _ in outputs)
        n = len(tokens)
        chosen = np.zeros(n, np.float32)
        top_values = np.full((n, k), -np.inf, np.float32)
        top_ids = np.zeros((n, k), np.int32)
        prompt_rows = None
        for program, ((c, top_v, top_i), prompt) in zip(launched.programs, outputs):
            rows = slice(program.out_row, program.out_row + len(c))
            chosen[rows], top_values[rows, :top_v.shape[1]], top_ids[rows, :top_i.shape[1]] = c, top_v, top_i
            if prompt is not None:  # per row: its fed tokens' (chosen, top values, top ids)
                prompt_rows = {} if prompt_rows is None else prompt_rows
                for row, (first, count) in program.token_spans.items():
                    prompt_rows[row] = tuple(a[first:first + count] for a in prompt)
        return StepResult(tokens[None], chosen[None], top_values[None], top_ids[None], prompt_rows)


def _scattered(values, rows: list[int], size: int, fill=0, dtype=np.int32) -> np.ndarray:
    """``values`` placed at ``rows`` of an array of ``fill``."""
    out = np.full(size, fill, dtype)
    out[rows] = values
    return out
