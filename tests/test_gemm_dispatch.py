"""The GEMM dispatch table "auto" reads on a GPU (modelopt_jax.ops.gemm_dispatch): lookup, checks, use."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from modelopt_jax.ops import gemm_dispatch, native
from modelopt_jax.ops.gemm import fp8_gemm
from modelopt_jax.ops.gemm_dispatch import CUTLASS, XLA, DispatchTableError, choose, parse_table

TABLES = {"NVIDIA H200": {"measured": "test", "shapes": {(4096, 4096): ((128, CUTLASS), (256, XLA), (2048, CUTLASS)),
                                                         (6144, 4096): ((16, XLA),)}}}


@pytest.mark.parametrize("m,want", [(1, CUTLASS), (128, CUTLASS), (129, XLA), (256, XLA), (257, CUTLASS),
                                    (2048, CUTLASS), (10_000, CUTLASS)])
def test_m_buckets_choose_the_measured_path(m, want):
    assert choose("NVIDIA H200", m, 4096, 4096, TABLES) == want


def test_past_the_last_bucket_the_last_path_holds_and_unknown_shapes_or_devices_run_ours():
    assert choose("NVIDIA H200", 4096, 6144, 4096, TABLES) == XLA
    assert choose("NVIDIA H200", 16, 1024, 4096, TABLES) == CUTLASS   # no entry for this (N, K)
    assert choose("NVIDIA H100 80GB HBM3", 200, 4096, 4096, TABLES) == CUTLASS  # no table for this kind
    assert choose(None, 200, 4096, 4096, TABLES) == CUTLASS           # no GPU


@pytest.mark.parametrize("shapes,message", [
    ({(4096,): ((1, CUTLASS),)}, r"key must be \(N, K\)"),
    ({(4096, 4096): ()}, "no M buckets"),
    ({(4096, 4096): ((16, "cublas"),)}, r"bucket \(16, 'cublas'\) must be"),
    ({(4096, 4096): ((0, XLA),)}, "must be"),
    ({(4096, 4096): ((64, XLA), (16, CUTLASS))}, "strictly ascending"),
])
def test_a_malformed_table_is_a_typed_error_naming_device_and_shape(shapes, message):
    with pytest.raises(DispatchTableError, match=message) as caught:
        parse_table("NVIDIA H200", shapes)
    assert "NVIDIA H200" in str(caught.value)


def test_the_packaged_tables_parse():
    from modelopt_jax.ops.gemm_dispatch_tables import TABLES as packaged

    for kind, table in packaged.items():
        assert table["measured"]
        parse_table(kind, table["shapes"])


def test_the_tuner_merges_measured_choices_into_buckets():
    got = gemm_dispatch.merge_buckets([(1, CUTLASS), (16, CUTLASS), (64, XLA), (256, XLA), (1024, CUTLASS)])
    assert got == ((16, CUTLASS), (256, XLA), (1024, CUTLASS))
    parse_table("x", {(8, 8): got})


@pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA FFI library not built (nvcc absent)")
def test_auto_lowers_for_cuda_to_the_path_the_table_names(monkeypatch):
    monkeypatch.setattr(gemm_dispatch, "gpu_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(gemm_dispatch, "_packaged_rules",
                        lambda kind: parse_table(kind, TABLES[kind]["shapes"]) if kind in TABLES else {})
    rng = np.random.default_rng(0)
    w_q = jnp.asarray(rng.standard_normal((4096, 4096)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn))

    def lowered(m):
        x_q = jnp.asarray(rng.standard_normal((m, 4096)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn))
        fn = jax.jit(lambda a, b: fp8_gemm(a, b, x_scale=0.5, w_scale=0.25, out_dtype=jnp.bfloat16))
        return fn.trace(x_q, w_q).lower(lowering_platforms=("cuda",)).as_text()

    assert re.search(r"custom_call @modelopt_fp8_gemm", lowered(64))
    xla = lowered(200)
    assert "modelopt_fp8_gemm" not in xla and "dot_general" in xla
