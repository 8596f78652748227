"""Cache-less greedy continuation: the smallest honest way to turn logits into text.

Each step runs the full forward over a fixed-length, right-padded window (causal attention makes
the padding invisible to real positions), so one compiled program serves every step. This is
O(T^2) per token and exists for reference checks (teacher forcing); KV-cached generation is
:class:`modelopt_jax.LLM` and :func:`modelopt_jax.make_cached_forward`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def jit_forward(model: nnx.Module):
    """``f(state, input_ids) -> logits`` compiled once per input shape; weights are the only arguments.

    Returns ``(f, state)``: static scales stay in the graph definition and compile in as constants.
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, input_ids):
        return nnx.merge(graphdef, state)(input_ids)

    return forward, state


def greedy_continue(model: nnx.Module, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    pad_id: int = 0, stop_ids: Sequence[int] = (), window: int | None = None) -> list[int]:
    """Greedy new token ids after ``prompt_ids`` (stops early at any of ``stop_ids``)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. the BOS id)")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    need = len(prompt_ids) + max_new_tokens
    window = window or -(-need // 64) * 64  # one compiled shape per 64 tokens of total length
    limit = model.config.max_position_embeddings
    if need > limit:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    forward, state = jit_forward(model)
    ids = np.full((1, window), pad_id, np.int32)
    ids[0, :len(prompt_ids)] = prompt_ids
    n, out = len(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = forward(state, jnp.asarray(ids))
        token = int(jnp.argmax(logits[0, n - 1]))
        out.append(token)
        if token in stop_ids:
            break
        ids[0, n] = token
        n += 1
    return out
