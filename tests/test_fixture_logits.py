"""Logits of real ModelOpt exports against ModelOpt's own fake-quant reference (ref_logits.npz).

float32 compute must reproduce ``logits_quantized`` to 1e-3 (observed: <= 2e-5). One row of one
fixture is a documented exception: in qwen2-bytes-fp8 row 1 an attention output that feeds the
layer-1 o_proj quantizer sits 8e-6 (relative) from an FP8 rounding midpoint, closer than float32
attention can resolve (any fp32 implementation's error there is ~1e-5 relative). The test proves
that story instead of hiding it: the float64 oracle (tests/numpy_reference.py) reproduces ModelOpt
on that row, positions before the tie match to 1e-3, and the oracle's margin at the tie is tiny.

bfloat16 compute is bounded, not exact: bf16 rounds every activation to 8 significant bits
(relative 2^-9, about 1/16 of an FP8 step), so a few percent of activation FP8 codes move by one
step -- the same kind of change FP8 quantization itself makes. The bound is therefore stated
relative to the quantization error: mean |bf16 - ref| <= 1.5 x mean |ref - unquantized| and
max <= 1.5 logits, with top-1 agreement >= 85%.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import FP8_FIXTURES, fixture_dir
from modelopt_jax.errors import UnsupportedQuantizationError

KNOWN_NEAR_TIES = {("qwen2-bytes-fp8", 1): 4}  # (fixture, row) -> first position past the tie


def _logits(name: str, dtype: str):
    d = fixture_dir(name)
    ref = np.load(d / "ref_logits.npz")
    model = modelopt_jax.load(d, dtype=dtype)
    return np.asarray(model(jnp.asarray(ref["input_ids"], jnp.int32))), ref


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_float32_matches_modelopt_reference(name):
    out, ref = _logits(name, "float32")
    assert out.dtype == np.float32 and out.shape == ref["logits_quantized"].shape
    err = np.abs(out - ref["logits_quantized"]).max(axis=-1)  # [rows, positions]
    for row in range(err.shape[0]):
        tie = KNOWN_NEAR_TIES.get((name, row))
        if tie is None:
            assert err[row].max() <= 1e-3, f"{name} row {row}: max abs error {err[row].max():.3g}"
        else:
            assert err[row, :tie].max() <= 1e-3
            assert err[row].max() > 1e-3, "the documented near-tie no longer flips: update KNOWN_NEAR_TIES"


def test_near_tie_is_a_real_tie():
    """The one exception above is an FP8 rounding tie that float64 resolves and float32 cannot."""
    from numpy_reference import Reference, boundary_margin

    d = fixture_dir("qwen2-bytes-fp8")
    ref = np.load(d / "ref_logits.npz")
    oracle = Reference(str(d))
    row = [r for (n, r) in KNOWN_NEAR_TIES if n == "qwen2-bytes-fp8"][0]
    out = oracle.forward(ref["input_ids"][row:row + 1])
    assert np.abs(out[0] - ref["logits_quantized"][row]).max() < 1e-4  # float64 reproduces ModelOpt
    scaled = dict(oracle.trace)["model.layers.1.self_attn.o_proj"]
    pos = KNOWN_NEAR_TIES[("qwen2-bytes-fp8", row)]
    assert boundary_margin(scaled[pos]).min() < 2e-5


@pytest.mark.parametrize("name", FP8_FIXTURES)
def test_bfloat16_compute_is_bounded(name):
    out, ref = _logits(name, "bfloat16")
    q, orig = ref["logits_quantized"], ref["logits_original"]
    err = np.abs(out - q)
    assert np.isfinite(out).all()
    assert err.max() <= 1.5, f"max abs error {err.max():.3f}"
    assert err.mean() <= 1.5 * np.abs(q - orig).mean(), f"mean abs error {err.mean():.4f}"
    assert (out.argmax(-1) == q.argmax(-1)).mean() >= 0.85


def test_unquantized_checkpoint_matches_transformers():
    out, ref = _logits("qwen2-bytes-bf16", "float32")
    assert np.abs(out - ref["logits_original"]).max() <= 1e-3


def test_nvfp4_is_rejected_with_the_supported_list():
    with pytest.raises(UnsupportedQuantizationError, match="NVFP4.*supported: FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO"):
        modelopt_jax.load(fixture_dir("qwen2-tiny-nvfp4"))
