"""Model architectures, installed as ``modelopt_jax.models`` (see README: package layout).

``FAMILIES`` maps the family named by :class:`modelopt_jax.checkpoint.ModelConfig` to its builder.
Llama and Qwen2 share one implementation; Qwen2's q/k/v bias comes from its config.
"""

from modelopt_jax.models import llama
from modelopt_jax.models.llama import CausalLM

FAMILIES = {"llama": llama.build, "qwen2": llama.build}

__all__ = ["FAMILIES", "CausalLM", "llama"]
