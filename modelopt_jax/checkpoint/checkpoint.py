"""A checkpoint directory opened and checked: configs, quantization settings, tensor index.

Opening reads only JSON and safetensors headers; tensors are read later, one at a time, through
:meth:`Checkpoint.read`, which also records what the model consumed so that leftovers (a bias the
architecture does not have, a stray scale) are reported instead of silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np

from modelopt_jax.checkpoint.hf_config import ModelConfig, load_model_config
from modelopt_jax.checkpoint.quant_config import QuantConfig, load_quant_config
from modelopt_jax.checkpoint.safetensors_index import SafetensorsIndex, TensorInfo
from modelopt_jax.errors import CheckpointError, MissingTensorError


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclasses.dataclass
class Checkpoint:
    directory: str
    model_config: ModelConfig
    raw_config: dict[str, Any]
    quant_config: QuantConfig
    tensors: SafetensorsIndex
    consumed: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def open(cls, path: str | os.PathLike, *, check_quantization: bool = True) -> "Checkpoint":
        directory = os.path.abspath(os.fspath(path))
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory (expected a Hugging Face checkpoint directory)")
        model_config, raw = load_model_config(directory)
        quant_config = load_quant_config(directory, raw, check=check_quantization)
        return cls(directory, model_config, raw, quant_config, SafetensorsIndex(directory))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        return self.tensors.info(name)

    def read(self, name: str) -> np.ndarray:
        """Reads a tensor the model consumes; float tensors must be finite (NonFiniteTensorError)."""
        self.consumed.add(name)
        # scales get read_scale's own check (finite and > 0) and its message
        return self.tensors.read(name, check_finite=not name.endswith("_scale"))

    def check_counts(self) -> None:
        """Layer and expert counts from config.json must be backed by tensors this checkpoint holds.

        Checked against the tensor names before any per-layer plan is built, so an absurd count
        (``num_hidden_layers: 10**9``) is a MissingTensorError at once, not memory growing with the count.
        """
        config = self.model_config
        where = os.path.join(self.directory, "config.json")
        layers, experts = set(), set()
        for name in self.tensors:
            if (m := _LAYER.match(name)) is not None:
                layers.add(int(m.group(1)))
            if (m := _EXPERT.search(name)) is not None:
                experts.add(int(m.group(1)))
        missing = [i for i in range(min(config.num_hidden_layers, len(layers) + 1)) if i not in layers]
        if missing or config.num_hidden_layers > len(layers):
            first = missing[0] if missing else len(layers)
            raise MissingTensorError(f"{where}: num_hidden_layers is {config.num_hidden_layers} but the checkpoint "
                                     f"holds no tensor of layer {first} (model.layers.{first}.*; it has "
                                     f"{len(layers)} layers)")
        if config.moe is not None and config.moe.num_experts > len(experts):
            raise MissingTensorError(f"{where}: the expert count is {config.moe.num_experts} but the checkpoint "
                                     f"holds tensors of {len(experts)} experts (.experts.E.*)")

    def unconsumed(self) -> list[str]:
        return sorted(set(self.tensors) - self.consumed)
