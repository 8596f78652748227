"""The modelopt_fp8_gemm FFI op: C++ CPU handler vs float64, and CUDA lowering checked on CPU.

The CPU handler implements the same op as the CUTLASS kernel (same operands, attributes,
validation and epilogue order), so these tests exercise registration, attribute and buffer
plumbing and the Python-side scale folding on any machine.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax.greedy import jit_forward
from modelopt_jax.ops import fp8_gemm, native
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm

E4M3 = ml_dtypes.float8_e4m3fn
pytestmark = pytest.mark.skipif(not native.has_cpu_handler(), reason="native CPU FFI library not built")


def _rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture
def on_cpu():
    """Runs the op on the CPU device (the C++ handler) even on a machine with a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _fp8(rng, shape):
    return (rng.standard_normal(shape) * 80).clip(-448, 448).astype(np.float32).astype(E4M3)


VARIANTS = ["scalar", "scalar_bias", "col", "col_static_x", "row", "row_col", "row_col_bias"]


def _case(rng, variant, m, n):
    x_scale = rng.uniform(1e-3, 1e-1, m).astype(np.float32) if variant.startswith("row") else 0.0371
    w_scale = (rng.uniform(1e-4, 1e-2, n).astype(np.float32) if ("col" in variant) else 0.00213)
    bias = rng.standard_normal(n).astype(np.float32) if variant.endswith("bias") else None
    return x_scale, w_scale, bias


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 48), (33, 24, 80), (5, 19, 13)])
def test_cpu_handler_matches_float64(request, variant, m, n, k, out_dtype, on_cpu):
    rng = _rng(request)
    x_q, w_q = _fp8(rng, (m, k)), _fp8(rng, (n, k))
    x_scale, w_scale, bias = _case(rng, variant, m, n)
    y = fp8_gemm(jnp.asarray(x_q), jnp.asarray(w_q), x_scale=jnp.asarray(x_scale) if isinstance(x_scale, np.ndarray) else x_scale,
                 w_scale=w_scale, bias=None if bias is None else jnp.asarray(bias), out_dtype=out_dtype,
                 backend="cutlass")
    acc = x_q.astype(np.float64) @ w_q.astype(np.float64).T
    want = np.asarray(x_scale, np.float64).reshape(-1, 1) * np.asarray(w_scale, np.float64) * acc
    if bias is not None:
        want = want + bias
    got = np.asarray(y, np.float64)
    assert y.dtype == out_dtype and y.shape == (m, n)
    tol = {jnp.float32: 2e-6, jnp.bfloat16: 2 ** -8, jnp.float16: 2 ** -11}[out_dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    # The XLA backend computes the same function.
    xla = fp8_gemm(jnp.asarray(x_q), jnp.asarray(w_q), x_scale=jnp.asarray(x_scale) if isinstance(x_scale, np.ndarray) else x_scale,
                   w_scale=w_scale, bias=None if bias is None else jnp.asarray(bias), out_dtype=out_dtype, backend="xla")
    np.testing.assert_allclose(got, np.asarray(xla, np.float64), rtol=tol, atol=tol * np.abs(want).max())


def test_every_fp8_code_decodes_exactly(on_cpu):
    """Each of the 254 finite e4m3fn codes (subnormals included: XLA's threads flush denormal floats
    to zero, so the handler must never build one) times 1.0, through the vectorised decode (blocks of
    16) and the table for the tail; the two NaN codes poison exactly their outputs."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    k = codes.size  # 254: 15 blocks of 16 and a tail of 14
    x = codes.view(E4M3).reshape(1, k)
    w = np.zeros((k, k), E4M3)
    np.fill_diagonal(w, 1.0)
    y = np.asarray(fp8_gemm(jnp.asarray(x), jnp.asarray(w), x_scale=1.0, w_scale=1.0, out_dtype=jnp.float32,
                            backend="cutlass"))
    np.testing.assert_array_equal(y[0], codes.view(E4M3).astype(np.float32))
    for nan in (0x7F, 0xFF):
        xn = np.full((1, 32), 0x38, np.uint8)  # 1.0
        xn[0, 20] = nan
        wn = np.ones((3, 32), E4M3)
        wn[1, 20] = 0.0  # NaN * 0 is still NaN
        y = np.asarray(fp8_gemm(jnp.asarray(xn.view(E4M3)), jnp.asarray(wn), x_scale=1.0, w_scale=1.0,
                                out_dtype=jnp.float32, backend="cutlass"))
        assert np.isnan(y).all(), (hex(nan), y)


def test_auto_on_cpu_runs_our_handler_for_few_rows_and_xla_beyond(request, on_cpu):
    """"auto" on CPU: our handler up to CPU_HANDLER_MAX_ROWS rows (where it is faster than XLA:CPU,
    which converts the whole weight on every call), XLA's dot beyond; the HLO says which, and each
    gives the bits of the backend it names."""
    from modelopt_jax.ops.gemm import CPU_HANDLER_MAX_ROWS

    if not native.has_cpu_handler():
        pytest.skip(f"{native.CPU_LIB} predates the blocked CPU handler")
    rng = _rng(request)
    w_q = jnp.asarray(_fp8(rng, (40, 96)))
    for m in (1, CPU_HANDLER_MAX_ROWS, CPU_HANDLER_MAX_ROWS + 1):
        x_q = jnp.asarray(_fp8(rng, (m, 96)))

        def gemm(a, b, backend="auto"):
            return fp8_gemm(a, b, x_scale=0.125, w_scale=np.linspace(0.5, 1, 40, dtype=np.float32),
                            out_dtype=jnp.bfloat16, backend=backend)

        text = jax.jit(gemm).lower(x_q, w_q).as_text()
        ours = m <= CPU_HANDLER_MAX_ROWS
        assert ("custom_call @modelopt_fp8_gemm" in text) == ours and ("dot_general" in text) != ours, m
        want = gemm(x_q, w_q, "cutlass" if ours else "xla")
        np.testing.assert_array_equal(np.asarray(gemm(x_q, w_q), np.float32), np.asarray(want, np.float32))


def test_every_element_is_written(request, on_cpu):
    rng = _rng(request)
    x_q, w_q = jnp.asarray(_fp8(rng, (9, 32))), jnp.asarray(_fp8(rng, (24, 32)))
    poison = jnp.full((9, 24), jnp.nan, jnp.bfloat16)
    y = jax.jit(lambda a, b, o: ffi_fp8_gemm(a, b, x_scale=0.5, w_scale=0.25, bias=None, out_dtype=jnp.bfloat16,
                                             out_init=o))(x_q, w_q, poison)
    assert np.isfinite(np.asarray(y, np.float32)).all()


KERNEL_CHOICE = dict(tile=np.int32(-1), swizzle=np.int32(1), raster=np.int32(0))


def test_handler_rejects_bad_operands_with_a_python_error(request, on_cpu):
    rng = _rng(request)
    x_q, w_q = jnp.asarray(_fp8(rng, (4, 32))), jnp.asarray(_fp8(rng, (16, 32)))
    call = jax.ffi.ffi_call(native.TARGET, jax.ShapeDtypeStruct((4, 16), jnp.bfloat16))
    with pytest.raises(Exception, match="col_scale must be float32 \\[16\\]"):
        call(x_q, w_q, jnp.ones(15, jnp.float32), alpha=np.float32(1), has_row_scale=False, has_col_scale=True,
             has_bias=False, has_out_init=False, **KERNEL_CHOICE).block_until_ready()
    with pytest.raises(Exception, match="K mismatch"):
        jax.ffi.ffi_call(native.TARGET, jax.ShapeDtypeStruct((4, 16), jnp.bfloat16))(
            x_q, jnp.asarray(_fp8(rng, (16, 48))), alpha=np.float32(1), has_row_scale=False, has_col_scale=False,
            has_bias=False, has_out_init=False, **KERNEL_CHOICE).block_until_ready()


@pytest.mark.parametrize("choice,message", [
    (dict(swizzle=3), "swizzle must be 1, 2, 4 or 8, got 3"),
    (dict(swizzle=16), "swizzle must be 1, 2, 4 or 8, got 16"),
    (dict(raster=3), "raster must be 0 \\(heuristic\\), 1 \\(along M\\) or 2 \\(along N\\), got 3"),
    (dict(raster=-1), "raster must be .*, got -1"),
    (dict(tile=-2), "tile must be -1 \\(choose by M\\) or a configuration index, got -2"),
])
def test_handler_validates_the_kernel_choice(request, choice, message, on_cpu):
    """tile, swizzle and raster are validated by the shared parser, so the CPU handler rejects them too."""
    rng = _rng(request)
    x_q, w_q = jnp.asarray(_fp8(rng, (4, 32))), jnp.asarray(_fp8(rng, (16, 32)))
    with pytest.raises(Exception, match=message):
        ffi_fp8_gemm(x_q, w_q, x_scale=0.5, w_scale=0.25, bias=None, out_dtype=jnp.bfloat16,
                     **choice).block_until_ready()


def test_handler_accepts_every_valid_scheduler_option(request, on_cpu):
    rng = _rng(request)
    x_q, w_q = jnp.asarray(_fp8(rng, (4, 32))), jnp.asarray(_fp8(rng, (16, 32)))
    want = ffi_fp8_gemm(x_q, w_q, x_scale=0.5, w_scale=0.25, bias=None, out_dtype=jnp.float32)
    for swizzle in (1, 2, 4, 8):
        for raster in (0, 1, 2):
            got = ffi_fp8_gemm(x_q, w_q, x_scale=0.5, w_scale=0.25, bias=None, out_dtype=jnp.float32, tile=0,
                               swizzle=swizzle, raster=raster)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


cuda_lib = pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA FFI library not built (nvcc absent)")


def _lower_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@cuda_lib
def test_auto_lowers_to_our_custom_call_for_cuda_with_static_alpha(request):
    rng = _rng(request)
    x_q, w_q = jnp.asarray(_fp8(rng, (8, 64))), jnp.asarray(_fp8(rng, (32, 64)))
    text = _lower_cuda(lambda a, b: fp8_gemm(a, b, x_scale=0.125, w_scale=0.5, out_dtype=jnp.bfloat16), x_q, w_q)
    call = re.search(r'stablehlo.custom_call @modelopt_fp8_gemm\(([^)]*)\).*', text)
    assert call, text
    assert "alpha = 6.250000e-02 : f32" in call.group(0) and "has_row_scale = false" in call.group(0)
    assert all(a in call.group(0) for a in ("tile = -1 : i32", "swizzle = 1 : i32", "raster = 0 : i32"))
    assert len(call.group(1).split(",")) == 2  # only a and b: the scales are attributes, not buffers
    # Lowering the same call for the CPU picks the CPU rule (see test_auto_on_cpu_...).
    cpu = jax.jit(lambda a, b: fp8_gemm(a, b, x_scale=0.125, w_scale=0.5, out_dtype=jnp.bfloat16)).trace(
        x_q, w_q).lower(lowering_platforms=("cpu",)).as_text()
    assert ("modelopt_fp8_gemm" in cpu) == native.has_cpu_handler() and ("dot_general" in cpu) != \
        native.has_cpu_handler()


@cuda_lib
@pytest.mark.parametrize("name", ["qwen2-bytes-fp8", "qwen2-bytes-fp8-pc-pt"])
def test_whole_model_lowers_every_fp8_layer_to_the_custom_call(name):
    model = modelopt_jax.load(fixture_dir(name), dtype="bfloat16")
    forward, state = jit_forward(model)
    text = forward.trace(state, jnp.zeros((1, 16), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @modelopt_fp8_gemm", text)
    layers = model.config.num_hidden_layers
    assert len(calls) == 4 * layers  # fused qkv, o_proj, fused gate_up, down_proj per layer
    assert "dot_general" in text  # lm_head stays bf16 (excluded)
