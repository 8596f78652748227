"""CUTLASS grouped FP8 GEMM on a CUDA GPU (skipped without one): every compiled configuration against a
float64 reference of the same FP8 inputs, for ragged group sizes (empty groups, every row in one group,
rows past the sizes' sum), static and per-token scales, bf16 and fp16 output; invalid sizes poison the
whole output; the op is in the compiled program; a sparse fixture's logits through it.

The output is not aliased to an input (the op has none), so each check first runs a program whose
result is a NaN-filled buffer of the same size and frees it: XLA's allocator hands that memory to the
op's output, so an element the kernels never write stays NaN (or holds a stale value) and fails the
comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax.greedy import jit_forward
from modelopt_jax.ops import native
from modelopt_jax.ops.grouped_gemm import grouped_fp8_gemm, reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not native.has_cuda_handler(), reason="CUDA grouped GEMM handler not built")]

E4M3 = ml_dtypes.float8_e4m3fn


def _names() -> list[str]:
    """This device's grouped configurations; none without a GPU (collection runs everywhere: CI builds
    the CUDA library on a machine with no GPU, where these tests skip)."""
    if not native.has_cuda_handler() or jax.default_backend() != "gpu":
        return []
    return native.grouped_config_names()


def _tiles():
    return list(range(len(_names())))


def _stream_tiles():
    """The weight-streaming grouped configurations ("stream" in the name) of this device's table."""
    return [t for t, name in enumerate(_names()) if "stream" in name]


def _problem(sizes, m, n, k, seed, per_token):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * 60).clip(-448, 448).astype(E4M3)
    w = (rng.standard_normal((len(sizes), n, k)) * 60).clip(-448, 448).astype(E4M3)
    col = rng.uniform(1e-4, 1e-3, (len(sizes), n)).astype(np.float32)
    row = rng.uniform(1e-3, 1e-2, m).astype(np.float32) if per_token else None
    return x, w, np.asarray(sizes, np.int32), col, row


def _poison(m, n, dtype):
    jax.block_until_ready(jax.jit(lambda: jnp.full((m, n), jnp.nan, dtype))()).delete()


def _run(x, w, sizes, col, row, out_dtype, tile):
    f = jax.jit(lambda *a: grouped_fp8_gemm(a[0], a[1], a[2], a[3], row=a[4] if len(a) > 4 else None,
                                            out_dtype=out_dtype, backend="ffi", tile=tile))
    operands = (x, w, sizes, col) + (() if row is None else (row,))
    _poison(x.shape[0], w.shape[1], out_dtype)
    return np.asarray(f(*operands).astype(jnp.float32), np.float64)


SIZES = [
    ([5, 0, 7, 1, 0, 0, 30, 2], 50),       # empty groups, 5 rows past the sum
    ([0, 0, 0, 200, 0, 0, 0, 0], 200),     # every row in one group
    ([1] * 8, 8),                          # one row each (decode)
    ([300, 17, 0, 129, 64, 1, 0, 400], 911),
]


def _check_groups(got, want, sizes, bound, what):
    """Every element written, zeros past the sizes' sum, and each group within ``bound`` of the
    reference on its own (no group hides another)."""
    rows = int(np.sum(sizes))
    assert np.isfinite(got).all(), f"{what}: unwritten (NaN) or non-finite output elements"
    assert (got[rows:] == 0).all(), f"{what}: rows past the group sizes' sum must be zeros"
    for g, (start, size) in enumerate(zip(np.cumsum([0] + list(sizes[:-1])), sizes)):
        if size:
            part, ref = got[start:start + size], want[start:start + size]
            rel = np.linalg.norm(part - ref) / np.linalg.norm(ref)
            assert rel <= bound, f"{what}: group {g} ({size} rows) relative error {rel:.2e}"


@pytest.mark.parametrize("tile", [-1] + _tiles())
@pytest.mark.parametrize("sizes,m", SIZES)
@pytest.mark.parametrize("per_token", [False, True])
def test_every_config_equals_float64_reference(tile, sizes, m, per_token):
    n, k = 384, 512
    x, w, gs, col, row = _problem(sizes, m, n, k, seed=m + len(sizes) + tile, per_token=per_token)
    got = _run(x, w, gs, col, row, jnp.bfloat16, tile)
    _check_groups(got, reference(x, w, gs, col, row), sizes, 1e-2, f"tile {tile}")


# The streaming kernels' edges: more groups than rows (slots = M), groups longer than a CTA's token
# rows (walked in tiles), N not a multiple of any CTA's weight rows (warps wholly past N), K of one
# 16-byte piece and K not a multiple of a warp pass, every group empty.
STREAM_EDGES = [
    ([0, 3, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 2] + [0] * 112, 8, 264, 784),
    ([17, 0, 40, 1, 9], 70, 200, 512),
    ([1, 1, 0, 2], 4, 72, 16),
    ([0, 0, 0, 0], 5, 136, 256),
]


@pytest.mark.parametrize("sizes,m,n,k", STREAM_EDGES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_streaming_configs_cover_every_edge(sizes, m, n, k, per_token, out_dtype):
    tiles = _stream_tiles()
    if not tiles:
        pytest.skip("this device's grouped table has no streaming configuration")
    for tile in tiles:
        x, w, gs, col, row = _problem(sizes, m, n, k, seed=m + n + k + tile, per_token=per_token)
        got = _run(x, w, gs, col, row, out_dtype, tile)
        _check_groups(got, reference(x, w, gs, col, row), sizes, 1e-2, native.grouped_config_names()[tile])


def test_streaming_configs_accumulate_in_float32():
    """Float32 accumulation, as the dense streaming kernels (test_gpu_gemm.py's bound): on 1,536 x 2,048
    expert weights the float16 output's own rounding is the error, not the sum."""
    from test_gpu_gemm import STREAM_ACCUMULATION_BOUND

    tiles = _stream_tiles()
    if not tiles:
        pytest.skip("this device's grouped table has no streaming configuration")
    rng = np.random.default_rng(11)
    sizes = [0] * 16
    for g in rng.choice(16, 8, replace=False):
        sizes[g] = 4
    m, n, k = 32, 1536, 2048
    x = rng.standard_normal((m, k)) * np.where(rng.random(k) < 0.01, 8.0, 1.0)  # a few outlier channels
    x = (x / np.abs(x).max() * 440).astype(np.float32).astype(E4M3)
    w = (rng.standard_normal((16, n, k)) * 100).clip(-440, 440).astype(np.float32).astype(E4M3)
    col = np.full((16, n), 1.0 / (440 * 100), np.float32)
    want = reference(x, w, np.asarray(sizes, np.int32), col, None)
    for tile in tiles:
        got = _run(x, w, np.asarray(sizes, np.int32), col, None, jnp.float16, tile)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= STREAM_ACCUMULATION_BOUND, f"{native.grouped_config_names()[tile]}: relative error {rel:.2e}"


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_real_expert_shapes_and_fp16(out_dtype):
    # Qwen3-30B-A3B gate/up (N 1536, K 2048) for 64 tokens x top-8 over 128 experts, uniform routing
    rng = np.random.default_rng(7)
    picks = np.stack([rng.choice(128, 8, replace=False) for _ in range(64)]).reshape(-1)
    sizes = np.bincount(picks, minlength=128).astype(np.int32)
    x, w, gs, col, row = _problem(list(sizes), len(picks), 1536, 2048, seed=1, per_token=False)
    got = _run(x, w, gs, col, row, out_dtype, -1)
    want = reference(x, w, gs, col, row)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert np.isfinite(got).all() and rel <= 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("tile", [-1] + _tiles())
@pytest.mark.parametrize("sizes", [[3, -1, 2, 0], [3, 3, 3, 3]])  # a negative size; a sum past M = 8
def test_invalid_sizes_fill_the_output_with_nan(sizes, tile):
    x, w, gs, col, _ = _problem([2, 2, 2, 2], 8, 64, 128, seed=5, per_token=False)
    got = _run(x, w, np.asarray(sizes, np.int32), col, None, jnp.bfloat16, tile)
    assert np.isnan(got).all()


def test_auto_compiles_to_the_custom_call():
    x, w, gs, col, _ = _problem([2, 2], 4, 64, 128, seed=2, per_token=False)
    f = jax.jit(lambda *a: grouped_fp8_gemm(*a, out_dtype=jnp.bfloat16))
    assert "modelopt_fp8_grouped_gemm" in f.lower(x, w, gs, col).compile().as_text()


def test_sparse_fixture_logits_through_the_cuda_handler():
    """qwen3moe-tiny-fp8 in bf16 on the GPU: its experts run the grouped custom call, and the logits meet
    the bf16 bound of the dense fixtures (test_gpu_gemm.py: max <= 1.5, mean <= 1.5x the quantization
    error itself) as does the model with every GEMM on XLA's path; the two agree on the top token."""
    path = fixture_dir("qwen3moe-tiny-fp8")
    ref = np.load(path / "ref_logits.npz")
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    quant, orig = ref["logits_quantized"], ref["logits_original"]
    outs = {}
    for backend in ("auto", "xla"):
        forward, state = jit_forward(modelopt_jax.load(path, dtype="bfloat16", backend=backend))
        text = forward.lower(state, ids).compile().as_text()
        assert ("modelopt_fp8_grouped_gemm" in text) == (backend == "auto"), backend
        outs[backend] = np.asarray(forward(state, ids).astype(jnp.float32))
        assert np.isfinite(outs[backend]).all()
    # bf16 through a router: a token whose top-k is near a tie may pick another expert in either path,
    # so the grouped kernel's logits are held to the XLA path's own error (and the dense bound)
    err = {b: np.abs(outs[b] - quant) for b in outs}
    print({b: (float(e.max()), float(e.mean())) for b, e in err.items()}, float(np.abs(quant - orig).mean()))
    assert err["auto"].max() <= max(1.5, 1.25 * err["xla"].max())
    assert err["auto"].mean() <= max(1.5 * np.abs(quant - orig).mean(), 1.25 * err["xla"].mean())
    assert (outs["auto"].argmax(-1) == outs["xla"].argmax(-1)).mean() >= 0.9
