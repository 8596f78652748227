"""The generation engine: a paged KV cache, continuous batching, and a host loop around the model.

- :mod:`.pages`: the page pool's bookkeeping (which pages are free, which a sequence owns).
- :mod:`.request`: one request's state and what it returns (:class:`RequestOutput`).
- :mod:`.scheduler`: which requests run in the next step (chunked prefill, decode, preemption).
- :mod:`.runner`: the device side: one jitted step over the model's page pool, bucketed shapes.
- :mod:`.engine`: the loop that ties them together (:class:`Engine`), used by ``LLM.generate``.
"""

from modelopt_jax.engine.engine import Engine, EngineConfig
from modelopt_jax.engine.request import RequestOutput

__all__ = ["Engine", "EngineConfig", "RequestOutput"]
