"""The public, jit-compatible cached forward, for users who write their own generation loops.

    forward, state = modelopt_jax.make_cached_forward(model)
    cache = modelopt_jax.init_cache(model, batch=1, max_len=256)  # = model.init_cache(1, 256)
    logits, cache = forward(state, ids, positions, cache)          # prefill: ids [B, T]
    logits, cache = forward(state, next_ids, next_positions, cache)  # decode: ids [B, 1]

``forward`` is a pure function of (weights, ids, positions, cache) and can be called inside any
``jax.jit``; ``make_cached_forward(model, jit=True)`` returns it already jitted with the cache
donated (updated in place). Weights are its only array arguments besides the inputs: scales are
compiled in as constants. See examples/jit_generate.py.
"""

from __future__ import annotations

import jax
from flax import nnx

from modelopt_jax.kv_cache import KVCache, init_cache


def make_cached_forward(model: nnx.Module, *, jit: bool = False):
    """``(forward, state)`` with ``forward(state, ids, positions, cache, logit_positions=None)``.

    ``positions`` [B, T] are absolute token positions (< cache.max_len); ``logit_positions`` [B]
    optionally selects one token per row to compute logits for. Returns ``(logits, cache)``. A
    model loaded over a mesh runs under ``shard_map`` inside (its ``forward_cached`` does that).
    """
    graphdef, state = nnx.split(model)

    def forward(state, ids, positions, cache: KVCache, logit_positions=None):
        return nnx.merge(graphdef, state).forward_cached(ids, positions, cache, logit_positions)

    if jit:
        forward = jax.jit(forward, donate_argnums=(3,))
    return forward, state


__all__ = ["make_cached_forward", "init_cache", "KVCache"]
