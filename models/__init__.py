"""Model architectures, installed as ``modelopt_jax.models`` (see README: package layout).

``FAMILIES`` maps the family named by :class:`modelopt_jax.checkpoint.ModelConfig` to its module,
which provides ``weight_specs(config)`` (what to read) and ``build(config, plan, ...)`` (the
skeleton). Llama and Qwen2 share one implementation; Qwen2's q/k/v bias comes from its config.
"""

from modelopt_jax.models import llama
from modelopt_jax.models.llama import CausalLM, LoadInfo

FAMILIES = {"llama": llama, "qwen2": llama}

__all__ = ["FAMILIES", "CausalLM", "LoadInfo", "llama"]
