"""Reading and checking Hugging Face / ModelOpt checkpoint directories."""

from modelopt_jax.checkpoint.checkpoint import Checkpoint
from modelopt_jax.checkpoint.hf_config import ModelConfig, MoEConfig, RopeConfig
from modelopt_jax.checkpoint.quant_config import (SUPPORTED_KV_ALGOS, SUPPORTED_QUANT_ALGOS, QuantConfig,
                                                  match_exclusion)
from modelopt_jax.checkpoint.safetensors_index import SafetensorsIndex, TensorInfo

__all__ = ["Checkpoint", "ModelConfig", "MoEConfig", "RopeConfig", "QuantConfig", "SafetensorsIndex", "TensorInfo",
           "match_exclusion", "SUPPORTED_QUANT_ALGOS", "SUPPORTED_KV_ALGOS"]
