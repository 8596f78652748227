"""Model architectures, installed as ``modelopt_jax.models`` (see README: package layout).

``FAMILIES`` maps the family named by :class:`modelopt_jax.checkpoint.ModelConfig` to its module,
which provides ``weight_specs(config)`` (what to read) and ``build(config, plan, ...)`` (the
skeleton). Every family shares one decoder (:mod:`~modelopt_jax.models.llama`); what differs (bias,
q/k norm, sliding window, the MoE block) comes from its config.
"""

from modelopt_jax.models import llama
from modelopt_jax.models.llama import CausalLM, LoadInfo

FAMILIES = {"llama": llama, "qwen2": llama, "qwen3": llama, "mistral": llama, "qwen3_moe": llama, "mixtral": llama}

__all__ = ["FAMILIES", "CausalLM", "LoadInfo", "llama"]
