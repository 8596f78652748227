"""Static scales are compiled in as constants: never jit arguments, visible in the lowered program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax.greedy import jit_forward
from modelopt_jax.layers import Fp8Linear
from modelopt_jax.ops.quantize import reciprocal


def _hlo_constants(text: str) -> np.ndarray:
    """Every float32 value that appears in a stablehlo.constant (scalar, list or hex payload)."""
    values = []
    for body, dtype in re.findall(r"stablehlo\.constant dense<(.+?)> : tensor<[^>]*?x?(f32)>", text):
        if body.startswith('"0x'):
            values.append(np.frombuffer(bytes.fromhex(body[3:-1]), np.float32))
        else:
            items = [v.strip() for v in body.strip("[]").split(",")]
            values.append(np.asarray([np.uint32(int(v, 16)).view(np.float32) if v.startswith("0x") else float(v)
                                      for v in items], np.float32))
    return np.concatenate(values)


def _gemm_alphas(text: str) -> np.ndarray:
    """The ``alpha`` attribute of every modelopt_fp8_gemm custom call (decimal, or hex when MLIR
    cannot print the value exactly in decimal)."""
    found = re.findall(r"alpha = ([-+0-9.eEx]+) : f32", text)
    return np.asarray([np.uint32(int(v, 16)).view(np.float32) if v.startswith("0x") else np.float32(v) for v in found],
                      np.float32)


@pytest.mark.parametrize("backend", ["xla", "auto"])
@pytest.mark.parametrize("name", ["llama-tiny-fp8", "qwen2-tiny-fp8-pc-pt"])
def test_only_weights_and_inputs_are_arguments_and_scales_are_constants(name, backend):
    """With "xla" the GEMM is a dot and alpha an HLO constant; with "auto" on CPU (our handler for
    these 8 rows, when the library is built) every FP8 layer is our custom call and alpha its
    attribute. Either way no scale is an argument."""
    from modelopt_jax.ops import native

    model = modelopt_jax.load(fixture_dir(name), dtype="float32", backend=backend)
    forward, state = jit_forward(model)
    text = forward.lower(state, jnp.zeros((1, 8), jnp.int32)).as_text()
    custom_calls = len(re.findall(r"custom_call @modelopt_fp8_gemm", text))
    args = re.findall(r"%arg\d+: tensor<([^>]*)>", text.split("\n", 2)[1])
    leaves = jax.tree_util.tree_leaves(state)
    # Arguments: one per weight array (FP8 weights, bf16 norms/embeddings/biases) plus input_ids.
    assert len(args) == len(leaves) + 1
    assert args[-1] == "1x8xi32"
    assert not any(a.endswith("xf32") or a == "f32" for a in args), args  # no float32 scale argument
    fp8_args = sum(a.endswith("f8E4M3FN") for a in args)
    fp8_layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Fp8Linear)]
    assert fp8_args == len(fp8_layers) > 0

    ours = backend == "auto" and native.has_cpu_handler()
    assert custom_calls == (len(fp8_layers) if ours else 0)
    consts = np.concatenate([_hlo_constants(text), _gemm_alphas(text)])
    for layer in fp8_layers:
        epilogue = layer.epilogue
        if epilogue.col is not None:  # per-channel / unequal fused shards: a vector
            vec = epilogue.col.array
            assert any(np.array_equal(vec, consts[i:i + vec.size]) for i in np.flatnonzero(consts == vec[0])), \
                "weight-scale vector not found as a constant"
        else:  # per-tensor: alpha = input_scale * weight_scale, and 1/input_scale for quantization
            assert epilogue.alpha != 1.0 and np.float32(epilogue.alpha) in consts
        if layer.input_scale is not None:
            assert np.float32(reciprocal(layer.input_scale)) in consts
