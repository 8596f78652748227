"""The mixture-of-experts block of Qwen3-MoE and Mixtral, held by a decoder layer in place of its MLP.

Routing is ModelOpt's and transformers' (the router is excluded from quantization): float32 router
logits from the unquantized router weight, softmax, top-k, optionally renormalised to sum to 1
(Mixtral always, Qwen3-MoE when ``norm_topk_prob``); the output is each picked expert's SwiGLU
weighted by its probability, summed in ascending order of expert id.

Experts are ordinary (FP8) MLPs, one fused gate/up GEMM and one down GEMM each, so every scheme
the loader knows, the weight cache and tensor parallelism (each expert's intermediate width split
like a dense MLP's) serve them unchanged. This block runs every expert over every token and
weights unpicked ones by an exact zero: the pure-XLA reference, exact but top_k / num_experts as
efficient as routing only the picked tokens to each expert (what a grouped GEMM does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from modelopt_jax.layers import _param
from modelopt_jax.quant.plan import TensorPlan


class Router(nnx.Module):
    """The router's weight [num_experts, hidden] in the checkpoint's dtype (replicated under TP)."""

    def __init__(self, plan: TensorPlan):
        self.weight = _param(plan.shape, plan.dtype, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Float32 router logits [..., num_experts] (neither input nor weight is quantized)."""
        return jax.lax.dot_general(x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
                                   (((x.ndim - 1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [..., k] float32, expert ids [..., k] int32) of each token's ``top_k`` experts."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


class SparseMoE(nnx.Module):
    """``x [..., hidden] -> [..., hidden]``: the routed sum of the picked experts' outputs."""

    def __init__(self, router: Router, experts, *, top_k: int, normalize: bool, dtype):
        self.router = router
        self.experts = nnx.List(experts)
        self.top_k = int(top_k)
        self.normalize = bool(normalize)
        self.dtype = jnp.dtype(dtype)

    def combine_weights(self, x: jax.Array) -> jax.Array:
        """Each token's weight per expert [..., num_experts] (zero for experts it does not pick)."""
        weights, ids = route(self.router(x), self.top_k, self.normalize)
        one_hot = jax.nn.one_hot(ids, len(self.experts), dtype=jnp.float32)  # [..., k, E]
        return jnp.sum(weights[..., None] * one_hot, axis=-2)

    def __call__(self, x: jax.Array) -> jax.Array:
        combine = self.combine_weights(x)
        out = jnp.zeros(x.shape, jnp.float32)
        for e, expert in enumerate(self.experts):
            # as transformers: each expert's output scaled by its weight in the compute dtype, summed
            out = out + (expert(x) * combine[..., e:e + 1].astype(self.dtype)).astype(jnp.float32)
        return out.astype(self.dtype)
