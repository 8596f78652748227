"""Tensor parallelism on CPU virtual devices (conftest.py sets 4): TP=2/4 vs TP=1.

Tolerances: per-tensor FP8 and unquantized models compute the same FP8 codes per shard as TP=1
(activation quantization is elementwise with a static scale); only the row-parallel sum order
changes, so float32 logits agree to 1e-4. FP8_PER_CHANNEL_PER_TOKEN is different by design: a
row-parallel layer's dynamic per-token scale is computed over the device's own K slice (vLLM's
behaviour), which moves some FP8 codes; the bound there is top-1 agreement >= 95% and max <= 1.5.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.errors import ConfigError
from modelopt_jax.parallel import AXIS, make_mesh
from modelopt_jax.synthetic import write_checkpoint

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS host device count)")


def _logits(path, tp, dtype="float32"):
    z = np.load(path / "ref_logits.npz") if (path / "ref_logits.npz").exists() else None
    ids = jnp.asarray(z["input_ids"] if z is not None else np.random.default_rng(0).integers(0, 200, (2, 16)),
                      jnp.int32)
    model = modelopt_jax.load(path, dtype=dtype, mesh=make_mesh(tp) if tp > 1 else None)
    return np.asarray(model(ids))


@pytest.mark.parametrize("name", ["qwen2-bytes-fp8", "qwen2-bytes-bf16", "llama-tiny-fp8-kv", "qwen2-tiny-fp8",
                                  # q/k norm per head, sliding window, experts split by their width
                                  "qwen3-tiny-fp8", "mistral-tiny-fp8-kv", "qwen3moe-tiny-fp8", "mixtral-tiny-fp8"])
def test_tp2_equals_tp1(name):
    d = fixture_dir(name)
    np.testing.assert_allclose(_logits(d, 2), _logits(d, 1), atol=1e-4, rtol=0)


def test_tp2_per_token_scales_are_per_shard():
    d = fixture_dir("qwen2-bytes-fp8-pc-pt")
    tp1, tp2 = _logits(d, 1), _logits(d, 2)
    assert (tp1.argmax(-1) == tp2.argmax(-1)).mean() >= 0.95
    assert np.abs(tp1 - tp2).max() <= 1.5


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """Synthetic exports with 8 heads / 4 KV heads, so TP=4 divides them (the fixtures have 2 KV heads)."""
    out = {}
    for family, algo, kv in [("llama", "FP8", False), ("qwen2", "FP8", True), ("qwen2", None, False)]:
        d = tmp_path_factory.mktemp(f"{family}-{algo}-{kv}")
        write_checkpoint(d, family=family, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=320, quant_algo=algo,
                         kv_cache_fp8=kv, seed=3)
        out[(family, algo, kv)] = d
    return out


def test_tp4_equals_tp1_on_synthetic_exports(wide_checkpoints):
    for key, d in wide_checkpoints.items():
        np.testing.assert_allclose(_logits(d, 4), _logits(d, 1), atol=1e-4, rtol=0, err_msg=str(key))


def test_weights_are_placed_shard_by_shard(wide_checkpoints):
    model = modelopt_jax.load(wide_checkpoints[("llama", "FP8", False)], dtype="bfloat16", mesh=make_mesh(4))
    layer = model.layers[0]
    qkv, o = layer.self_attn.qkv.weight[...], layer.self_attn.o_proj.weight[...]
    assert qkv.sharding.spec == P(AXIS, None) and o.sharding.spec == P(None, AXIS)
    assert {s.data.shape for s in qkv.addressable_shards} == {(qkv.shape[0] // 4, qkv.shape[1])}
    assert {s.device for s in qkv.addressable_shards} == set(jax.devices()[:4])
    assert model.layers[0].mlp.down.weight[...].sharding.spec == P(None, AXIS)
    cache = modelopt_jax.init_cache(model, 2, 32)
    assert cache.keys[0].sharding.spec == P(None, None, AXIS, None)
    assert {s.data.shape[2] for s in cache.keys[0].addressable_shards} == {1}  # 4 KV heads / 4 devices


def test_indivisible_heads_and_too_many_devices_are_clear_errors():
    with pytest.raises(ConfigError, match=r"tensor parallel size 4 does not divide num_key_value_heads 2"):
        modelopt_jax.load(fixture_dir("qwen2-bytes-fp8"), mesh=make_mesh(4))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 but \d+ devices"):
        make_mesh(64)


@pytest.mark.parametrize("name", ["qwen2-bytes-fp8", "qwen2-bytes-fp8-kv"])
def test_greedy_generation_tp2_equals_tp1(name):
    d = fixture_dir(name)
    prompts = [r["input_ids"] for r in json.loads((d / "reference.json").read_text())["results"]][:2]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {tp: [o.token_ids for o in LLM(d, quantization=None, dtype="float32", max_model_len=96,
                                             tensor_parallel_size=tp, compilation_cache_dir=None).generate(prompts, params)]
            for tp in (1, 2)}
    assert outs[1] == outs[2]


def test_each_shard_calls_the_ffi_gemm_on_its_local_block(wide_checkpoints):
    """Lowered for CUDA, the TP=2 forward runs our custom call per shard with local shapes."""
    from modelopt_jax.ops import native

    if not native.has_cuda_handler():
        pytest.skip("CUDA FFI library not built")
    model = modelopt_jax.load(wide_checkpoints[("llama", "FP8", False)], dtype="bfloat16", mesh=make_mesh(2))
    ids = jnp.zeros((1, 8), jnp.int32)
    graph, state = nnx.split(model)
    text = jax.jit(lambda st, i: nnx.merge(graph, st)(i)).trace(state, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @modelopt_fp8_gemm" in line]
    assert len(calls) == 4 * 2  # qkv, o, gate_up, down per layer
    qkv_local = (8 + 2 * 4) * 16 // 2  # (heads + 2 kv heads) * head_dim / tp
    assert any(f"tensor<{qkv_local}x128xf8E4M3FN>" in line for line in calls), calls[0]
    assert "all-reduce" in text or "all_reduce" in text


README_PROMPT = "It is a truth universally acknowledged"


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_on_the_demo_is_the_float64_oracle_up_to_near_ties(tp):
    """Why TP=2 greedy text can differ from TP=1 on the FP8 demo (the README's own prompt diverged at
    its 5th token): per-tensor FP8 activations. TP changes a row-parallel layer's float32 sum order
    (each device sums its K slice, then psum), which moves some activations by ~1e-7 relative; one
    that sits that close to an FP8 rounding midpoint takes the other code, and logits downstream
    move by ~0.01-0.5 -- enough to swap two nearly tied tokens. Neither TP size is wrong: both are
    the float64 oracle with at most a few such near-ties rounded the other way, which this checks
    (decided from the oracle at test time) over the sequence each one generated.
    """
    from numpy_reference import Reference, explain_by_near_tie_flips

    path = modelopt_jax.demo_checkpoint_path()
    llm = LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=tp, compilation_cache_dir=None)
    (out,) = llm.generate(README_PROMPT, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    seq = np.asarray(out.prompt_token_ids + out.token_ids)
    logits = np.asarray(llm.model(jnp.asarray(seq[None], jnp.int32)))[0]
    explain_by_near_tie_flips(Reference(path), seq, logits, tol=2e-3)  # raises unless near-ties explain it
    start = len(out.prompt_token_ids) - 1
    for i, token in enumerate(out.token_ids):  # the engine's greedy token is those logits' top one ...
        top2 = np.sort(logits[start + i])[-2:]
        if top2[1] - top2[0] > 0.5:  # ... unless a near-tie flip in one path and not the other (<= ~0.5) swaps them
            assert token == int(np.argmax(logits[start + i])), i
