"""The mixture-of-experts block of Qwen3-MoE and Mixtral, held by a decoder layer in place of its MLP.

Routing is ModelOpt's and transformers' (the router is excluded from quantization): float32 router
logits from the unquantized router weight, softmax, top-k, optionally renormalised to sum to 1
(Mixtral always, Qwen3-MoE when ``norm_topk_prob``); the output is each picked expert's SwiGLU
weighted by its probability, the k weighted outputs of a token added in float32.

The experts of a layer are two stacked layers (:class:`~modelopt_jax.layers.GroupedLinear`): every
expert's fused gate/up [E, 2F, H] and every expert's down [E, H, F]. Each token's k picks become k
rows, sorted by expert, so each expert multiplies only the rows routed to it (one grouped GEMM per
stacked layer, whatever the routing, without recompiling); the rows' outputs, weighted, are added
back to their tokens. Under tensor parallelism each expert's intermediate width is split like a
dense MLP's and the down projection's partial sums are reduced once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from modelopt_jax.layers import Router


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [..., k] float32, expert ids [..., k] int32) of each token's ``top_k`` experts."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


class SparseMoE(nnx.Module):
    """``x [..., hidden] -> [..., hidden]``: the routed, weighted sum of each token's picked experts."""

    def __init__(self, router: Router, gate_up: nnx.Module, down: nnx.Module, intermediate_size: int, *,
                 top_k: int, normalize: bool, dtype):
        self.router = router
        self.gate_up = gate_up  # GroupedLinear: every expert's [gate; up], [E, 2F, H]
        self.down = down        # GroupedLinear: every expert's down, [E, H, F]
        self.intermediate_size = intermediate_size  # F on this device
        self.top_k = int(top_k)
        self.normalize = bool(normalize)
        self.dtype = jnp.dtype(dtype)

    @property
    def num_experts(self) -> int:
        return self.gate_up.weight.shape[0]

    def __call__(self, x: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """``real`` (optional, one entry per token of ``x``): nonzero for tokens to compute; the others
        (an engine step's padding) pick no expert, so the grouped GEMMs neither stream weights for
        them nor compute them (they sort after every group: rows past the sizes' sum are zeros), and
        their output is zero."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = route(self.router(tokens), self.top_k, self.normalize)  # [T, k]
        picks = experts.reshape(-1)                                                 # [T * k]
        if real is not None:  # expert id E: past every group (bincount's length drops it)
            picks = jnp.where(jnp.repeat(real.reshape(-1) != 0, self.top_k), picks, self.num_experts)
        order = jnp.argsort(picks, stable=True)        # rows grouped by expert, ascending
        token_of_row = order // self.top_k
        group_sizes = jnp.bincount(picks, length=self.num_experts).astype(jnp.int32)
        gate_up = self.gate_up(tokens[token_of_row], group_sizes)
        gate, up = gate_up[..., :self.intermediate_size], gate_up[..., self.intermediate_size:]
        act = (jax.nn.silu(gate.astype(jnp.float32)).astype(self.dtype) * up).astype(self.dtype)
        rows = self.down(act, group_sizes)                                           # [T * k, hidden]
        # as transformers: each expert's output scaled by its weight in the compute dtype, then summed
        weighted = (rows * weights.reshape(-1)[order][:, None].astype(self.dtype)).astype(jnp.float32)
        out = jnp.zeros(tokens.shape, jnp.float32).at[token_of_row].add(weighted)
        return out.astype(self.dtype).reshape(shape)
