"""The grouped FP8 GEMM of a sparse layer's experts (modelopt_jax.ops.grouped_gemm): the FFI op's CPU
handler and the XLA path against a float64 reference, for ragged group sizes (empty groups, all rows
in one group, rows past the sizes' sum), static and per-token scales; the op in the lowered program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from modelopt_jax.ops import native
from modelopt_jax.ops.grouped_gemm import grouped_fp8_gemm, reference

# The CPU handler's tests: on a GPU machine JAX's default device is the GPU, where backend "ffi"
# is the CUDA handler (tests/test_gpu_grouped_gemm.py) with its own operand rules.
needs_handler = pytest.mark.skipif(not native.has_cpu_handler() or jax.default_backend() != "cpu",
                                   reason="the CPU grouped handler runs where JAX's default backend is the CPU")


def _problem(sizes, m, n=40, k=72, seed=0, per_token=False):
    rng = np.random.default_rng(seed)
    groups = len(sizes)
    x = rng.normal(0, 60, (m, k)).astype(ml_dtypes.float8_e4m3fn)    # codes spread over the e4m3 range
    w = rng.normal(0, 60, (groups, n, k)).astype(ml_dtypes.float8_e4m3fn)
    col = rng.uniform(1e-4, 3e-3, (groups, n)).astype(np.float32)
    row = rng.uniform(0.5, 2.0, m).astype(np.float32) if per_token else None
    return x, w, np.asarray(sizes, np.int32), col, row


SIZES = [
    ([5, 0, 7, 1], 13),       # an empty group
    ([0, 0, 9, 0], 9),        # every row in one group
    ([3, 4, 0, 2], 12),       # rows past the sum (3 here): zeros
    ([1, 1, 1, 1, 1, 1, 1, 1], 8),
]


@pytest.mark.parametrize("backend", ["xla", pytest.param("ffi", marks=needs_handler)])
@pytest.mark.parametrize("sizes,m", SIZES)
@pytest.mark.parametrize("per_token", [False, True])
def test_equals_float64_reference(backend, sizes, m, per_token):
    x, w, gs, col, row = _problem(sizes, m, per_token=per_token, seed=len(sizes) + m)
    want = reference(x, w, gs, col, row)
    got = jax.jit(lambda *a: grouped_fp8_gemm(*a[:4], row=a[4] if per_token else None, out_dtype=jnp.float32,
                                              backend=backend))(x, w, gs, col, row if per_token else 0)
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (got[sum(sizes):] == 0).all()


@needs_handler
def test_ffi_and_xla_agree_in_bfloat16():
    x, w, gs, col, _ = _problem([6, 0, 3, 7], 16, seed=3)
    out = {b: np.asarray(grouped_fp8_gemm(x, w, gs, col, out_dtype=jnp.bfloat16, backend=b), np.float32)
           for b in ("xla", "ffi")}
    np.testing.assert_allclose(out["ffi"], out["xla"], rtol=2 ** -7)


@needs_handler
def test_auto_lowers_to_the_custom_call_on_cpu():
    x, w, gs, col, _ = _problem([2, 2], 4)
    text = jax.jit(lambda *a: grouped_fp8_gemm(*a, out_dtype=jnp.float32)).lower(x, w, gs, col).as_text()
    assert "modelopt_fp8_grouped_gemm" in text


@needs_handler
def test_group_sizes_past_the_rows_are_refused():
    x, w, _, col, _ = _problem([2, 2], 4)
    with pytest.raises(Exception, match="group_sizes must be >= 0 and sum to at most M = 4; group 1 has 3"):
        np.asarray(grouped_fp8_gemm(x, w, np.asarray([2, 3], np.int32), col, out_dtype=jnp.float32, backend="ffi"))


def test_shape_errors_name_the_operand():
    x, w, gs, col, _ = _problem([2, 2], 4)
    with pytest.raises(ValueError, match=r"col has shape \(2, 39\), expected \(2, 40\)"):
        grouped_fp8_gemm(x, w, gs, col[:, :39])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        grouped_fp8_gemm(x.astype(np.float32), w, gs, col)


@needs_handler
def test_a_negative_tile_is_refused_by_the_shared_parser():
    x, w, gs, col, _ = _problem([2, 2], 4)
    with pytest.raises(Exception, match="tile must be -1"):
        np.asarray(grouped_fp8_gemm(x, w, gs, col, out_dtype=jnp.float32, backend="ffi", tile=-2))
