"""The model's architecture, read from a Hugging Face ``config.json``.

Only what the Llama/Qwen2 decoders need is kept, in a frozen dataclass, so models never touch the
raw JSON. Older (``rope_theta`` + ``rope_scaling``) and newer (``rope_parameters``) transformers
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
class ModelConfig:
    """Architecture hyper-parameters of a Llama/Qwen2-family decoder."""

    family: str  # "llama" | "qwen2"
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
    if family == "qwen2" and raw.get("use_sliding_window"):
        raise UnsupportedModelError(f"{path}: Qwen2 sliding-window attention (use_sliding_window=true) is not supported")
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
    qkv_bias = True if family == "qwen2" else bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=family, architecture=arch,
        vocab_size=_positive_int(raw, "vocab_size", path), hidden_size=hidden,
        intermediate_size=_positive_int(raw, "intermediate_size", path),
        num_hidden_layers=_positive_int(raw, "num_hidden_layers", path),
        num_attention_heads=n_heads, num_key_value_heads=int(n_kv), head_dim=int(head_dim),
        rms_norm_eps=_norm_eps(raw, path),
        max_position_embeddings=(4096 if raw.get("max_position_embeddings") is None
                                 else _positive_int(raw, "max_position_embeddings", path)),
        rope=_rope_config(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias, o_proj_bias=family == "llama" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"))


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
