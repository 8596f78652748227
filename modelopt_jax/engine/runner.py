"""The device side of the engine: the model's page pool and one jitted step over it.

A step feeds each row a chunk of tokens (a prompt chunk, or the one token a decode feeds), writes
their keys/values into the pool, and samples each row's next token from its last position, on the
device. Shapes are bucketed -- rows and tokens per row to powers of two, the block tables to a
power of two of pages -- so a workload compiles a handful of programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.engine.request import Request
from modelopt_jax.sampling import sample, token_logprobs


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


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
    attention reads only the pages in use (the CUDA kernel), so the width costs nothing and never
    adds a program; otherwise (prompt steps, or no kernel) the width is bucketed to the step's
    longest row, since XLA's attention gathers the whole width.
    """

    def __init__(self, model, num_pages: int, page_size: int, pad_id: int = 0, fixed_table_width: int | None = None):
        from flax import nnx

        self.page_size = page_size
        self.pad_id = pad_id
        self.fixed_table_width = fixed_table_width
        self.cache = model.init_paged_cache(num_pages, page_size)
        graphdef, self.state = nnx.split(model)

        def forward(state, *args):
            return nnx.merge(graphdef, state).forward_packed(*args)

        self._forward = forward
        self._step = jax.jit(self._step_fn, static_argnums=(0, 1), donate_argnums=(3,))
        self.shapes: set[tuple[int, ...]] = set()  # (tokens, rows, table width, logprobs...) compiled so far

    def _step_fn(self, num_logprobs, prompt_logprobs, state, cache, ids, positions, slots, token_rows, block_tables,
                 row_tokens, last, next_ids, temps, top_k, top_p, row_keys, counters):
        if prompt_logprobs is None:
            logits, cache = self._forward(state, ids, positions, cache, slots, token_rows, block_tables, row_tokens,
                                          last)
            prompt = None
        else:
            all_logits, cache = self._forward(state, ids, positions, cache, slots, token_rows, block_tables,
                                              row_tokens)
            logits = all_logits[last]
            prompt = token_logprobs(all_logits, next_ids, prompt_logprobs)
        keys = jax.vmap(jax.random.fold_in)(row_keys, counters)
        tokens = sample(logits, temps, top_k, top_p, keys)
        return tokens, token_logprobs(logits, tokens, num_logprobs), prompt, cache

    def step(self, batch: list[tuple[Request, int]]) -> StepResult:
        """Runs one step for ``batch`` rows of (request, tokens to feed).

        Shapes are bucketed so a workload compiles a handful of programs (each a whole-model
        compile): tokens to powers of two (at least 16), rows to powers of two (at least 8 in a
        decode step: a GEMM costs the same for M 1..8), block tables to a power of two of pages
        (at least 8) unless fixed.
        """
        page = self.page_size
        total = sum(n for _, n in batch)
        decode = total == len(batch)
        tokens_b = bucket(total, 16)
        # Prompt steps: rows unpadded (to a power of two); each costs XLA's prompt attention a
        # [row width x S] block.
        rows = bucket(len(batch), 8 if decode else 1)
        longest = max(len(r.pages) for r, _ in batch)
        row_width = 1 if decode else bucket(max(n for _, n in batch), 16)  # tokens per row, prompt steps
        width = self.fixed_table_width if decode and self.fixed_table_width is not None else bucket(longest, 8)
        ids = np.full(tokens_b, self.pad_id, np.int32)
        positions = np.zeros(tokens_b, np.int32)
        slots = np.zeros(tokens_b, np.int32)  # padding tokens write to the scratch page 0
        token_rows = np.zeros(tokens_b, np.int32)
        next_ids = np.zeros(tokens_b, np.int32)
        tables = np.zeros((rows, width), np.int32)
        row_tokens = np.full((rows, row_width), tokens_b, np.int32)  # tokens_b: padding
        last = np.zeros(rows, np.int32)
        temps = np.zeros(rows, np.float32)
        top_k = np.full(rows, -1, np.int32)
        top_p = np.ones(rows, np.float32)
        row_keys = np.zeros((rows, 2), np.uint32)
        counters = np.zeros(rows, np.uint32)
        prompt_k = None
        offset = 0
        for b, (r, n) in enumerate(batch):
            start = r.computed
            pos = np.arange(start, start + n)
            span = slice(offset, offset + n)
            ids[span] = r.token_at(start) if n == 1 else [r.token_at(p) for p in pos]
            positions[span] = pos
            table = np.asarray(r.pages, np.int32)
            tables[b, :len(table)] = table
            slots[span] = table[pos // page] * page + pos % page
            token_rows[span] = b
            row_tokens[b, :n] = np.arange(offset, offset + n)
            last[b] = offset + n - 1
            temps[b], top_k[b], top_p[b] = r.params.temperature, r.params.top_k, r.params.top_p
            row_keys[b] = r.row_key
            counters[b] = len(r.generated)
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                prompt_k = max(prompt_k or 0, r.params.prompt_logprobs)
                nxt = pos + 1
                inside = nxt < len(r.prompt_ids)
                next_ids[span][inside] = [r.prompt_ids[p] for p in nxt[inside]]
            offset += n
        num_logprobs = max((r.params.logprobs or 0) for r, _ in batch)
        self.shapes.add((tokens_b, rows, width, row_width, num_logprobs, prompt_k))
        tokens, (chosen, top_v, top_i), prompt, self.cache = self._step(
            num_logprobs, prompt_k, self.state, self.cache, ids, positions, slots, token_rows, tables, row_tokens, last,
            next_ids, temps, top_k, top_p, row_keys, counters)
        tokens, chosen, top_v, top_i, prompt = jax.device_get((tokens, chosen, top_v, top_i, prompt))
        if prompt is not None:  # per row: its tokens' (chosen, top values, top ids)
            starts = np.concatenate([[0], np.cumsum([n for _, n in batch])])
            prompt = [tuple(a[starts[b]:starts[b + 1]] for a in prompt) for b in range(len(batch))]
        return StepResult(tokens, chosen, top_v, top_i, prompt)
