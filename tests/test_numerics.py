"""FP8 quantization and the XLA GEMM path against float64 numpy, on fresh random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from modelopt_jax.layers import Fp8Linear
from modelopt_jax.ops import PER_TOKEN_MIN_SCALE, fp8_gemm, quantize_per_token, quantize_static
from layer_checkpoint import fp8_shards

E4M3 = ml_dtypes.float8_e4m3fn


def _rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _fp8(rng, shape, spread=100.0):
    return (rng.standard_normal(shape) * spread).clip(-448, 448).astype(np.float32).astype(E4M3)


def test_quantize_static_rounds_to_nearest_even_and_saturates(request):
    rng = _rng(request)
    scale = 0.0123
    codes = _fp8(rng, 4096).astype(np.float32)
    # Midpoints between neighbouring codes (ties before scaling), plus far out-of-range values.
    grid = np.sort(np.unique(np.abs(codes)))
    ties = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    x = np.concatenate([rng.standard_normal(4096) * 200, ties, -ties, [1e6, -1e6, 449, -500]]).astype(np.float32)
    x_scaled_back = (x * np.float32(scale)).astype(np.float32)
    got = np.asarray(quantize_static(jnp.asarray(x_scaled_back), scale)).astype(np.float32)
    inv = np.float32(1) / np.float32(scale)
    want = np.clip(x_scaled_back * inv, -448, 448).astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got).max() == 448 and not np.isnan(got).any()
    # RNE on exact ties (scale 1 so the tie is exact): 17 -> 16, 19 -> 20 in e4m3.
    np.testing.assert_array_equal(np.asarray(quantize_static(jnp.asarray([17.0, 19.0, -17.0]), 1.0)).astype(np.float32),
                                  [16.0, 20.0, -16.0])


def test_quantize_per_token_scales(request):
    rng = _rng(request)
    x = rng.standard_normal((5, 7, 64)).astype(np.float32) * rng.uniform(0.01, 10, (5, 7, 1)).astype(np.float32)
    x[0, 0] = 0.0  # all-zero row: floor 1/(448*512)
    q, s = quantize_per_token(jnp.asarray(x))
    amax = np.abs(x.astype(np.float64)).max(-1)
    np.testing.assert_allclose(np.asarray(s), np.maximum(amax / 448, PER_TOKEN_MIN_SCALE), rtol=2.5e-7)  # 2 f32 ulps
    assert float(s[0, 0]) == pytest.approx(PER_TOKEN_MIN_SCALE)
    want = np.clip(x / np.asarray(s)[..., None], -448, 448).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want.astype(np.float32))
    assert np.abs(np.asarray(q).astype(np.float32)).max(-1)[1:].min() == 448  # the row max maps to 448


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("variant", ["scalar", "vector", "per_token", "per_token_bias", "scalar_bias"])
def test_fp8_gemm_matches_float64(request, m, variant):
    rng = _rng(request)
    n, k = 48, 80
    x_q, w_q = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    x_scale = rng.uniform(1e-3, 1e-1, m).astype(np.float32) if "per_token" in variant else 0.0371
    w_scale = rng.uniform(1e-4, 1e-2, n).astype(np.float32) if variant in ("vector", "per_token", "per_token_bias") else 0.00213
    bias = rng.standard_normal(n).astype(np.float32) if "bias" in variant else None
    y = fp8_gemm(jnp.asarray(x_q), jnp.asarray(w_q), x_scale=jnp.asarray(x_scale) if "per_token" in variant else x_scale,
                 w_scale=w_scale, bias=None if bias is None else jnp.asarray(bias), out_dtype=jnp.float32, backend="xla")
    acc = x_q.astype(np.float64) @ w_q.astype(np.float64).T
    want = np.asarray(x_scale, np.float64).reshape(-1, 1) * (np.asarray(w_scale, np.float64) * acc)
    if bias is not None:
        want = want + bias
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-6, atol=1e-6 * np.abs(want).max())


def test_fp8_gemm_batch_dims_and_bf16_output(request):
    rng = _rng(request)
    x_q, w_q = _fp8(rng, (2, 5, 32)), _fp8(rng, (16, 32))
    y = fp8_gemm(jnp.asarray(x_q), jnp.asarray(w_q), x_scale=0.01, w_scale=0.02, out_dtype=jnp.bfloat16)
    assert y.shape == (2, 5, 16) and y.dtype == jnp.bfloat16
    want = 0.01 * 0.02 * np.einsum("bmk,nk->bmn", x_q.astype(np.float64), w_q.astype(np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2 ** -8)


def test_fp8_gemm_rejects_bad_operands(request):
    rng = _rng(request)
    w = jnp.asarray(_fp8(rng, (16, 32)))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemm(jnp.ones((2, 32)), w, x_scale=1.0, w_scale=1.0)
    with pytest.raises(ValueError, match="K=31"):
        fp8_gemm(jnp.asarray(_fp8(rng, (2, 31))), w, x_scale=1.0, w_scale=1.0)
    with pytest.raises(ValueError, match=r"expected \(16,\)"):
        fp8_gemm(jnp.asarray(_fp8(rng, (2, 32))), w, x_scale=1.0, w_scale=np.ones(15, np.float32))
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda s: fp8_gemm(jnp.asarray(_fp8(rng, (2, 32))), w, x_scale=1.0, w_scale=s))(1.0)


def test_fusing_shards_with_unequal_scales_keeps_codes_and_outputs(request, tmp_path):
    """Fused q/k/v with different weight scales == three separate layers; FP8 codes untouched."""
    rng = _rng(request)
    k, sizes = 64, (64, 32, 32)
    shards = [(_fp8(rng, (n, k)), rng.standard_normal(n).astype(np.float32), np.float32(rng.uniform(1e-3, 5e-3)),
               np.float32(0.0173)) for n in sizes]
    fused = fp8_shards(tmp_path / "fused", shards, "FP8")
    separate = [fp8_shards(tmp_path / str(i), [s], "FP8") for i, s in enumerate(shards)]
    assert isinstance(fused, Fp8Linear) and fused.epilogue.col is not None  # one vector, not three GEMMs
    np.testing.assert_array_equal(np.asarray(fused.weight[...]).view(np.uint8),
                                  np.concatenate([s[0] for s in shards]).view(np.uint8))
    x = jnp.asarray(rng.standard_normal((7, k)).astype(np.float32))
    want = np.concatenate([np.asarray(layer(x)) for layer in separate], axis=-1)
    np.testing.assert_allclose(np.asarray(fused(x)), want, rtol=1e-6, atol=1e-6)


def test_shards_with_different_input_scales_stay_separate(request, tmp_path):
    rng = _rng(request)
    shards = [(_fp8(rng, (16, 32)), None, np.float32(0.01), np.float32(s)) for s in (0.02, 0.03)]
    layer = fp8_shards(tmp_path / "fused", shards, "FP8")
    x = jnp.asarray(rng.standard_normal((3, 32)).astype(np.float32))
    parts = [fp8_shards(tmp_path / str(i), [s], "FP8")(x) for i, s in enumerate(shards)]
    assert len(layer.parts) == 2
    np.testing.assert_array_equal(np.asarray(layer(x)), np.concatenate([np.asarray(p) for p in parts], -1))


@pytest.mark.parametrize("scheme_name", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_unaligned_output_width_is_padded_once_and_sliced(request, tmp_path, scheme_name):
    rng = _rng(request)
    n, k = 20, 32
    w = _fp8(rng, (n, k))
    ws = np.float32(0.004) if scheme_name == "FP8" else rng.uniform(1e-3, 5e-3, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    layer = fp8_shards(tmp_path, [(w, bias, ws, np.float32(0.02) if scheme_name == "FP8" else None)], scheme_name)
    assert layer.weight.shape == (32, k) and layer.out_features == n
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(layer(jnp.asarray(x)))
    assert y.shape == (3, n)
    if scheme_name == "FP8":
        xq = np.clip(x / np.float32(0.02), -448, 448).astype(E4M3).astype(np.float64) * 0.02
        want = xq @ (w.astype(np.float64) * 0.004).T + bias
    else:
        s = np.maximum(np.abs(x).max(-1, keepdims=True) / 448, 1 / (448 * 512))
        xq = np.clip(x / s, -448, 448).astype(E4M3).astype(np.float64) * s
        want = xq @ (w.astype(np.float64) * ws[:, None]).T + bias
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
