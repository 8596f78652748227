"""Plans: what every layer is, decided from headers and scales; JSON round trips; the epilogue fold."""

from __future__ import annotations

import numpy as np
import pytest

from fixture_paths import fixture_dir
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.errors import WeightCacheError
from modelopt_jax.ops.epilogue import Fp8Epilogue
from modelopt_jax.pipeline import plan_model
from modelopt_jax.quant.plan import COLUMN, ROW, ModelPlan
from modelopt_jax.synthetic import write_checkpoint


@pytest.fixture(scope="module")
def unequal_shards(tmp_path_factory):
    """A synthetic export whose fused shards have unequal weight scales (a column vector in the plan)."""
    d = tmp_path_factory.mktemp("unequal")
    write_checkpoint(d, family="qwen2", hidden_size=64, intermediate_size=36, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100, quant_algo="FP8", seed=5)
    return d


@pytest.mark.parametrize("name,tp", [("qwen2-bytes-fp8", 1), ("qwen2-bytes-fp8-pc-pt", 1), ("qwen2-bytes-fp8-pc-pt", 2),
                                     ("qwen2-tiny-fp8-pb-wo", 1), ("llama-tiny-fp8-kv", 2), ("qwen2-bytes-bf16", 1)])
def test_plan_json_round_trip(name, tp):
    plan = plan_model(Checkpoint.open(fixture_dir(name)), dtype="bfloat16", backend="auto", tensor_parallel=tp)
    text = plan.to_json()
    again = ModelPlan.from_json(text)
    assert again == plan and again.to_json() == text
    assert isinstance(hash(again), int)  # static under jit: hashable by value


def test_plan_round_trip_keeps_static_vectors_bit_exact(unequal_shards):
    plan = plan_model(Checkpoint.open(unequal_shards), dtype="float32", backend="auto")
    vectors = [lp.epilogue.col for _, lp in plan.linears if lp.epilogue is not None and lp.epilogue.col is not None]
    assert vectors, "the fixture was meant to have fused shards with unequal scales"
    again = ModelPlan.from_json(plan.to_json())
    for got, want in zip([lp.epilogue.col for _, lp in again.linears if lp.epilogue and lp.epilogue.col is not None],
                         vectors):
        assert got.array.tobytes() == want.array.tobytes() and got.dtype == np.float32


def test_plan_records_roles_padding_and_tp_data_scales():
    ckpt = Checkpoint.open(fixture_dir("qwen2-bytes-fp8-pc-pt"))
    one = dict(plan_model(ckpt, dtype="float32", backend="auto").linears)
    two = dict(plan_model(ckpt, dtype="float32", backend="auto", tensor_parallel=2).linears)
    qkv1, qkv2 = one["layers.0.self_attn.qkv"], two["layers.0.self_attn.qkv"]
    assert qkv1.role == COLUMN and one["layers.0.self_attn.o_proj"].role == ROW
    assert qkv2.shard_sizes == tuple(n // 2 for n in qkv1.shard_sizes)
    assert qkv1.padded_out % 16 == 0 and qkv1.padded_out >= qkv1.out_features
    # per-channel scales: a constant at TP=1, per-device data for a column-parallel layer at TP=2,
    # and still a constant for a row-parallel one (its output channels are not split)
    assert qkv1.epilogue.col is not None and not qkv1.epilogue.col_is_data
    assert qkv2.epilogue.col is None and qkv2.epilogue.col_is_data and qkv2.epilogue.per_token
    assert two["layers.0.self_attn.o_proj"].epilogue.col is not None
    assert two["layers.0.self_attn.o_proj"].in_features * 2 == one["layers.0.self_attn.o_proj"].in_features


def test_epilogue_fold():
    # static activation x per-tensor weight: one float32 alpha, multiplied in float32
    e = Fp8Epilogue.fold(0.0371, 0.00213)
    assert e.alpha == float(np.float32(np.float32(0.0371) * np.float32(0.00213))) and e.col is None
    assert not e.per_token
    # static activation x weight vector: folded into the column vector, alpha 1
    w = np.asarray([0.5, 0.25, 3.0], np.float32)
    e = Fp8Epilogue.fold(0.1, w)
    assert e.alpha == 1.0 and np.array_equal(e.col.array, w * np.float32(0.1))
    # dynamic per-token activation: the row scale comes at run time; the weight part stays
    e = Fp8Epilogue.fold(None, w)
    assert e.per_token and np.array_equal(e.col.array, w)
    e = Fp8Epilogue.fold(None, 0.5)
    assert e.per_token and e.alpha == 0.5 and e.col is None
    e = Fp8Epilogue.fold(None, None, col_is_data=True)
    assert e.col_is_data and e.col is None and e.alpha == 1.0


@pytest.mark.parametrize("text", ["", "[]", '{"__class__": "ModelPlan"}', '{"__class__": "LinearPlan", "scheme": 1}',
                                  '{"__class__": "Nope"}'])
def test_bad_plan_json_is_a_typed_error(text):
    with pytest.raises(WeightCacheError, match="not a valid model plan"):
        ModelPlan.from_json(text)
