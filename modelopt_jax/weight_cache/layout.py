"""Where each processed array sits in a store, and which backends the cache can serve.

A daemon's store holds the arrays of its model's state, keyed by state path
(``layers.0.self_attn.qkv.weight``), each at an aligned offset; the attach reply carries this index
beside the :class:`~modelopt_jax.quant.plan.ModelPlan`, which is everything else a client needs to
rebuild the model. Every scheme is served: the plan describes its static parts, the state its arrays.
"""

from __future__ import annotations

from modelopt_jax.errors import UnsupportedForWeightCacheError
from modelopt_jax.ops.alignment import WEIGHT_LAYOUT
from modelopt_jax.ops.gemm import weight_layout


def check_supported(backend: str = "auto") -> None:
    """Raises before any slow work when a GEMM backend consumes another processed-weight layout
    than the one the cache shares (:data:`~modelopt_jax.ops.alignment.WEIGHT_LAYOUT`)."""
    if weight_layout(backend) != WEIGHT_LAYOUT:
        raise UnsupportedForWeightCacheError(
            f"GEMM backend {backend!r} consumes weights in layout {weight_layout(backend)!r}, not the weight "
            f"cache's {WEIGHT_LAYOUT!r}; load it without weight_cache")


def pack(arrays: dict, alignment: int) -> tuple[dict, int]:
    """Where each array goes in a store: ({name: {offset, dtype, shape, nbytes}}, total bytes),
    every offset a multiple of ``alignment`` (both stores lay arrays out this way)."""
    index, offset = {}, 0
    for key, a in arrays.items():
        nbytes = int(a.size) * a.dtype.itemsize
        index[key] = {"offset": offset, "dtype": a.dtype.name, "shape": list(a.shape), "nbytes": nbytes}
        offset += -(-nbytes // alignment) * alignment
    return index, offset
