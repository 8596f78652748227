"""Architecture pieces: RoPE scaling, batching and padding invariance, input validation."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax.checkpoint import RopeConfig
from modelopt_jax.models.rope import apply_rope, inverse_frequencies


def test_llama3_rope_scaling_piecewise():
    rope = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    base = inverse_frequencies(RopeConfig(theta=500000.0), 128).astype(np.float64)
    got = inverse_frequencies(rope, 128).astype(np.float64)
    wavelen = 2 * math.pi / base
    high, low = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    np.testing.assert_allclose(got[high], base[high], rtol=1e-6)  # short wavelengths untouched
    np.testing.assert_allclose(got[low], base[low] / 8.0, rtol=1e-6)  # long ones slowed by factor
    mid = ~high & ~low
    assert mid.any()
    smooth = (8192 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    np.testing.assert_allclose(got[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid], rtol=1e-6)


def test_linear_rope_scaling_equals_scaled_positions():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 6, 2, 16)).astype(np.float32))
    pos = jnp.arange(6)[None]
    scaled = apply_rope(x, pos, inverse_frequencies(RopeConfig(theta=1e4, rope_type="linear", factor=4.0), 16))
    direct = apply_rope(x, pos.astype(jnp.float32) / 4.0, inverse_frequencies(RopeConfig(theta=1e4), 16))
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(direct), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def trained():
    return modelopt_jax.load(fixture_dir("qwen2-bytes-fp8"), dtype="float32")


def test_rows_are_independent_and_left_padding_is_invisible(trained):
    rng = np.random.default_rng(7)
    a = [256] + list(rng.integers(32, 127, 11))
    b = [256] + list(rng.integers(32, 127, 6))
    alone_a = np.asarray(trained(jnp.asarray([a], jnp.int32)))[0]
    alone_b = np.asarray(trained(jnp.asarray([b], jnp.int32)))[0]
    pad = len(a) - len(b)
    ids = jnp.asarray([a, [258] * pad + b], jnp.int32)
    mask = jnp.asarray([[1] * len(a), [0] * pad + [1] * len(b)], jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = np.asarray(trained(ids, positions=positions, attention_mask=mask))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0], alone_a, atol=2e-5)
    np.testing.assert_allclose(out[1, pad:], alone_b, atol=2e-5)


def test_bad_input_shape(trained):
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        trained(jnp.asarray([1, 2, 3], jnp.int32))


def test_bad_dtype_and_backend():
    from modelopt_jax.errors import BackendUnavailableError, ConfigError
    from modelopt_jax.ops import available_backends

    with pytest.raises(ConfigError, match="float64"):
        modelopt_jax.load(fixture_dir("llama-tiny-fp8"), dtype="float64")
    # With the native FFI library built (pip install, Bazel), "cutlass" exists on every platform
    # (the C++ reference handler on CPU); without it, asking for it is the error.
    missing = "no-such-backend" if "cutlass" in available_backends() else "cutlass"
    with pytest.raises(BackendUnavailableError, match=missing):
        modelopt_jax.load(fixture_dir("llama-tiny-fp8"), backend=missing)
