"""Real one-layer checkpoints for unit tests of the schemes: tensors written with safetensors, read
back through the package's own checked reader, then planned, processed and built like a model's layer.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from modelopt_jax.checkpoint import Checkpoint, QuantConfig, SafetensorsIndex
from modelopt_jax.pipeline import load_linear
from modelopt_jax.quant.schemes import LinearSpec


def layer_checkpoint(directory: pathlib.Path, tensors: dict[str, np.ndarray], quant_algo: str | None) -> Checkpoint:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return Checkpoint(str(directory), None, {}, QuantConfig(quant_algo, None, ()), SafetensorsIndex(str(directory)))


def fp8_shards(directory, shards, quant_algo: str, *, dtype=jnp.float32, backend="xla", k=None):
    """A (fused) layer from shards ``(weight [N,K] e4m3, bias or None, weight_scale, input_scale or None)``."""
    tensors = {}
    for i, (w, b, ws, xs) in enumerate(shards):
        tensors[f"p{i}.weight"] = w
        tensors[f"p{i}.weight_scale"] = np.asarray(ws, np.float32)
        if xs is not None:
            tensors[f"p{i}.input_scale"] = np.asarray(xs, np.float32)
        if b is not None:
            tensors[f"p{i}.bias"] = b
    ckpt = layer_checkpoint(pathlib.Path(directory), tensors, quant_algo)
    spec = LinearSpec("layer", tuple(f"p{i}" for i in range(len(shards))), k or shards[0][0].shape[1],
                      tuple(s[0].shape[0] for s in shards), shards[0][1] is not None)
    return load_linear(ckpt, spec, dtype=dtype, backend=backend)
