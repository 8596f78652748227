"""The model's architecture, read from a Hugging Face ``config.json``.

Only what the decoders need is kept, in a frozen dataclass, so models never touch the raw JSON.
The families differ by options of one decoder: Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm,
Mistral's sliding window, and a mixture-of-experts block (:class:`MoEConfig`) in place of the MLP
for Qwen3-MoE and Mixtral. Older (``rope_theta`` + ``rope_scaling``) and newer (``rope_parameters``) transformers
spellings of RoPE are both accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from modelopt_jax.checkpoint.files import open_regular
from modelopt_jax.errors import ConfigError, UnsupportedModelError

CONFIG_FILE = "config.json"

# architecture name in config.json -> model family implemented in modelopt_jax.models
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# Where each MoE family's checkpoint keeps a sparse layer's router and experts (as ModelOpt exports
# them, hub names): block prefix under model.layers.L, router, then (gate, up, down) per expert.
MOE_LAYOUTS = {
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts block of Qwen3-MoE and Mixtral (the router picks ``top_k`` experts per token)."""

    num_experts: int                  # experts per sparse layer
    top_k: int                        # experts each token is routed to (num_experts_per_tok)
    intermediate_size: int            # each expert's SwiGLU width (Qwen3-MoE: moe_intermediate_size)
    normalize_top_k: bool             # renormalise the top-k router probabilities to sum to 1
    layout: str                       # MOE_LAYOUTS key: where the checkpoint keeps router and experts
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE mlp_only_layers: layers with a dense MLP instead
    sparse_step: int = 1              # Qwen3-MoE decoder_sparse_step: layer i is sparse when (i + 1) % step == 0

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` holds the MoE block (else a dense MLP of intermediate_size)."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder of one of the supported families."""

    family: str  # ARCHITECTURES value: "llama" | "qwen2" | "qwen3" | "mistral" | "qwen3_moe" | "mixtral"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (Qwen2: always True)
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool = False                 # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    sliding_window: int | None = None     # query i attends key j only when i - j < sliding_window
    moe: MoEConfig | None = None          # None: every layer has a dense MLP
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def read_json(path: str) -> dict[str, Any]:
    """Reads a JSON object, turning every failure into a ConfigError that names the file."""
    try:
        with open_regular(path, "r") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _rope_config(raw: dict[str, Any], path: str) -> RopeConfig:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{path}: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{path}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    try:
        rope = RopeConfig(
            theta=float(theta), rope_type=rope_type, factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)))
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{path}: bad RoPE parameters {merged!r}: {e}") from e
    # Each of these divides or scales the inverse frequencies: 0, a negative or a NaN gives NaN logits.
    for key in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
        value = getattr(rope, key)
        if not (math.isfinite(value) and value > 0):
            name = "rope_theta" if key == "theta" else key
            raise ConfigError(f"{path}: RoPE {name} must be a finite number > 0, found {value!r}")
    if rope.original_max_position_embeddings <= 0:
        raise ConfigError(f"{path}: RoPE original_max_position_embeddings must be > 0, found "
                          f"{rope.original_max_position_embeddings}")
    return rope


def _positive_int(raw: dict[str, Any], key: str, path: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{path}: {key} must be a positive integer, found {value!r}")
    return value


def _number(raw: dict[str, Any], key: str, default: float, path: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: {key} must be a number, found {value!r}")
    return float(value)


def _norm_eps(raw: dict[str, Any], path: str) -> float:
    eps = _number(raw, "rms_norm_eps", 1e-6, path)
    if not (math.isfinite(eps) and eps >= 0):  # NaN poisons every norm; a negative one can divide by ~0
        raise ConfigError(f"{path}: rms_norm_eps must be a finite number >= 0, found {eps!r}")
    return eps


def parse_model_config(raw: dict[str, Any], path: str) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        model_type = raw.get("model_type")
        by_type = {v: k for k, v in ARCHITECTURES.items()}
        if model_type in by_type and not archs:
            arch = by_type[model_type]
        else:
            raise UnsupportedModelError(
                f"{path}: architectures {archs} (model_type {model_type!r}) not supported; "
                f"supported: {', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[arch]
    if family in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window"):
        # Qwen's window applies only to layers from max_window_layers on: not implemented
        raise UnsupportedModelError(f"{path}: Qwen sliding-window attention (use_sliding_window=true) is not supported")
    n_heads = _positive_int(raw, "num_attention_heads", path)
    # Optional keys (null or absent means the default, as in transformers) are still type-checked:
    # a string here would otherwise surface as a TypeError deep inside the arithmetic below.
    n_kv = n_heads if raw.get("num_key_value_heads") is None else _positive_int(raw, "num_key_value_heads", path)
    hidden = _positive_int(raw, "hidden_size", path)
    head_dim = hidden // n_heads if raw.get("head_dim") is None else _positive_int(raw, "head_dim", path)
    if n_heads % n_kv:
        raise ConfigError(f"{path}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act {raw.get('hidden_act')!r} not supported (expected 'silu')")
    if head_dim % 2:
        raise ConfigError(f"{path}: head_dim {head_dim} must be even for RoPE")
    # Qwen2 always has a q/k/v bias; Mistral and Mixtral never have one (their code hard-codes it)
    bias = family not in ("mistral", "mixtral") and bool(raw.get("attention_bias", False))
    qkv_bias = True if family == "qwen2" else bias
    num_layers = _positive_int(raw, "num_hidden_layers", path)
    window = None
    if family in ("mistral", "mixtral") and raw.get("sliding_window") is not None:
        window = _positive_int(raw, "sliding_window", path)
    return ModelConfig(
        family=family, architecture=arch,
        vocab_size=_positive_int(raw, "vocab_size", path), hidden_size=hidden,
        intermediate_size=_positive_int(raw, "intermediate_size", path),
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads, num_key_value_heads=int(n_kv), head_dim=int(head_dim),
        rms_norm_eps=_norm_eps(raw, path),
        max_position_embeddings=(4096 if raw.get("max_position_embeddings") is None
                                 else _positive_int(raw, "max_position_embeddings", path)),
        rope=_rope_config(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias, o_proj_bias=family != "qwen2" and bias,
        mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"), sliding_window=window,
        moe=_moe_config(raw, family, path),
        torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"))


def _moe_config(raw: dict[str, Any], family: str, path: str) -> MoEConfig | None:
    """The MoE block of a Qwen3-MoE or Mixtral config (None for dense families), with the real configs'
    field names: the expert count is ``num_experts`` (Qwen3-MoE hub configs) or ``num_local_experts``
    (Mixtral, and transformers' own Qwen3-MoE export)."""
    if family not in MOE_LAYOUTS:
        return None
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = _positive_int(raw, key, path)
    top_k = _positive_int(raw, "num_experts_per_tok", path)
    if top_k > experts:
        raise ConfigError(f"{path}: num_experts_per_tok {top_k} exceeds {key} {experts}")
    if family == "mixtral":
        return MoEConfig(experts, top_k, _positive_int(raw, "intermediate_size", path), True, family)
    step = 1 if raw.get("decoder_sparse_step") is None else _positive_int(raw, "decoder_sparse_step", path)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{path}: mlp_only_layers must be a list of layer indices, found {dense!r}")
    normalize = raw.get("norm_topk_prob", False)
    if not isinstance(normalize, bool):
        raise ConfigError(f"{path}: norm_topk_prob must be true or false, found {normalize!r}")
    return MoEConfig(experts, top_k, _positive_int(raw, "moe_intermediate_size", path), normalize, family,
                     tuple(sorted(set(dense))), step)


def load_model_config(directory: str) -> tuple[ModelConfig, dict[str, Any]]:
    path = os.path.join(directory, CONFIG_FILE)
    raw = read_json(path)
    return parse_model_config(raw, path), raw


def eos_ids(checkpoint_dir: str) -> list[int]:
    """EOS ids from generation_config.json, else config.json (either may hold an int or a list).

    Read at the checkpoint, with the other configs: ``generation_config.json`` is a checkpoint file.
    """
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(checkpoint_dir, name)
        if os.path.exists(path):
            with open_regular(path, "r") as f:
                value = json.load(f).get("eos_token_id")
            if value is not None:
                return list(value) if isinstance(value, list) else [int(value)]
    return []
