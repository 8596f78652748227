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
    prompt: tuple[np.ndarray, ...] | None   # per-position (chosen, top values, top ids) when asked


class Runner:
    def __init__(self, model, num_pages: int, page_size: int, pad_id: int = 0):
        from flax import nnx

        self.page_size = page_size
        self.pad_id = pad_id
        self.cache = model.init_paged_cache(num_pages, page_size)
        graphdef, self.state = nnx.split(model)

        def forward(state, *args):
            return nnx.merge(graphdef, state).forward_paged(*args)

        self._forward = forward
        self._step = jax.jit(self._step_fn, static_argnums=(0, 1), donate_argnums=(3,))

    def _step_fn(self, num_logprobs, prompt_logprobs, state, cache, ids, positions, slots, block_tables, last,
                 next_ids, temps, top_k, top_p, row_keys, counters):
        if prompt_logprobs is None:
            logits, cache = self._forward(state, ids, positions, cache, slots, block_tables, last)
            logits, prompt = logits[:, 0], None
        else:
            all_logits, cache = self._forward(state, ids, positions, cache, slots, block_tables)
            logits = jnp.take_along_axis(all_logits, last[:, None, None], axis=1)[:, 0]
            b, t, v = all_logits.shape
            prompt = token_logprobs(all_logits.reshape(b * t, v), next_ids.reshape(b * t), prompt_logprobs)
            prompt = jax.tree_util.tree_map(lambda a: a.reshape((b, t) + a.shape[1:]), prompt)
        keys = jax.vmap(jax.random.fold_in)(row_keys, counters)
        tokens = sample(logits, temps, top_k, top_p, keys)
        return tokens, token_logprobs(logits, tokens, num_logprobs), prompt, cache

    def step(self, batch: list[tuple[Request, int]]) -> StepResult:
        """Runs one step for ``batch`` rows of (request, tokens to feed)."""
        # Coarse buckets keep the number of compiled programs small (each is a whole-model compile):
        # decode rows in powers of two from 8 (a GEMM costs the same for M 1..8), block tables in
        # powers of two from 8 pages.
        decode = all(n == 1 for _, n in batch)
        rows = bucket(len(batch), 8 if decode else 1)
        width = 1 if decode else bucket(max(n for _, n in batch), 16)
        pages = bucket(max(len(r.pages) for r, _ in batch), 8)
        page = self.page_size
        ids = np.full((rows, width), self.pad_id, np.int32)
        positions = np.zeros((rows, width), np.int32)
        slots = np.zeros((rows, width), np.int32)  # padding writes go to the scratch page 0
        tables = np.zeros((rows, pages), np.int32)
        last = np.zeros(rows, np.int32)
        next_ids = np.zeros((rows, width), np.int32)
        temps = np.zeros(rows, np.float32)
        top_k = np.full(rows, -1, np.int32)
        top_p = np.ones(rows, np.float32)
        row_keys = np.zeros((rows, 2), np.uint32)
        counters = np.zeros(rows, np.uint32)
        prompt_k = None
        for b, (r, n) in enumerate(batch):
            start = r.computed
            pos = np.arange(start, start + n)
            ids[b, :n] = [r.token_at(p) for p in pos]
            positions[b, :n] = pos
            table = np.asarray(r.pages, np.int32)
            tables[b, :len(table)] = table
            slots[b, :n] = table[pos // page] * page + pos % page
            last[b] = n - 1
            temps[b], top_k[b], top_p[b] = r.params.temperature, r.params.top_k, r.params.top_p
            row_keys[b] = r.row_key
            counters[b] = len(r.generated)
            if r.params.prompt_logprobs is not None and start + 1 < len(r.prompt_ids):
                prompt_k = max(prompt_k or 0, r.params.prompt_logprobs)
                nxt = pos + 1
                inside = nxt < len(r.prompt_ids)
                next_ids[b, :n][inside] = [r.prompt_ids[p] for p in nxt[inside]]
        num_logprobs = max((r.params.logprobs or 0) for r, _ in batch)
        tokens, (chosen, top_v, top_i), prompt, self.cache = self._step(
            num_logprobs, prompt_k, self.state, self.cache, ids, positions, slots, tables, last, next_ids, temps,
            top_k, top_p, row_keys, counters)
        tokens, chosen, top_v, top_i, prompt = jax.device_get((tokens, chosen, top_v, top_i, prompt))
        return StepResult(tokens, chosen, top_v, top_i, prompt)
