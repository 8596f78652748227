"""Qwen3, Mistral (sliding window), Qwen3-MoE and Mixtral: real ModelOpt 0.47 exports against
ModelOpt's reference logits, the float64 oracle (routing included), the engine, and broken inputs.

The reference batches of these fixtures were chosen by their generator to hold no FP8 near-tie
(its file-only rebuild matches within 1e-5 under 1e-6 input jitter) and no routing near-tie (the
k-th and (k+1)-th router logits differ by >= 1e-2), so float32 compute must match
``logits_quantized`` to 1e-3 at every position; a failure here is an error, not a rounding.
"""

from __future__ import annotations

import json
import resource
import shutil
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import modelopt_jax
from fixture_paths import fixture_dir
from modelopt_jax import LLM, SamplingParams
from modelopt_jax.errors import (CheckpointError, ConfigError, DtypeMismatchError, MissingTensorError,
                                 ModelOptJaxError)
from modelopt_jax.models.moe import route
from numpy_reference import Reference
from test_broken_checkpoints import copy_fixture, edit_json, read_tensors, write_tensors

FAMILY_FIXTURES = ["qwen3-tiny-fp8", "qwen3-tiny-fp8-pc-pt", "qwen3moe-tiny-fp8", "mixtral-tiny-fp8",
                   "mistral-tiny-fp8-kv"]
MOE_FIXTURES = {"qwen3moe-tiny-fp8": ("mlp", "gate", "gate_proj", "down_proj"),
                "mixtral-tiny-fp8": ("block_sparse_moe", "gate", "w1", "w2")}
TOL = 1e-3


def _ref(name):
    return np.load(fixture_dir(name) / "ref_logits.npz")


@pytest.fixture(scope="module")
def float32_models():
    return {name: modelopt_jax.load(fixture_dir(name), dtype="float32") for name in FAMILY_FIXTURES}


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_float64_oracle_matches_modelopt(name):
    ref = _ref(name)
    err = np.abs(Reference(str(fixture_dir(name))).forward(ref["input_ids"]) - ref["logits_quantized"]).max()
    assert err <= 1e-4, f"{name}: float64 oracle vs ModelOpt {err:.3g}"


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_float32_matches_modelopt_reference(float32_models, name):
    ref = _ref(name)
    out = np.asarray(float32_models[name](jnp.asarray(ref["input_ids"], jnp.int32)))
    assert out.dtype == np.float32 and out.shape == ref["logits_quantized"].shape
    err = np.abs(out - ref["logits_quantized"]).max()
    assert err <= TOL, f"{name}: float32 vs ModelOpt {err:.3g}"
    # and the model is not trivially right: the unquantized logits differ from the reference
    assert np.abs(ref["logits_original"] - ref["logits_quantized"]).max() > 10 * TOL


def _routes(model, ids) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each sparse layer's routing (weights, expert ids) [B, T, k] in a cache-less forward of ``ids``."""
    x = model.embed_tokens(jnp.asarray(ids, jnp.int32))
    t = ids.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), ids.shape)
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    routes = {}
    for i, layer in enumerate(model.layers):
        x = x + layer.self_attn(layer.input_layernorm(x), positions, mask)
        h = layer.post_attention_layernorm(x)
        if hasattr(layer.mlp, "router"):
            weights, experts = route(layer.mlp.router(h), layer.mlp.top_k, layer.mlp.normalize)
            routes[i] = (np.asarray(weights), np.asarray(experts))
        x = x + layer.mlp(h)
    return routes


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_padding_tokens_route_to_no_expert(float32_models, name, monkeypatch):
    """An engine step's padding tokens (``real`` 0) pick no expert: the grouped GEMMs get only the real
    tokens' rows in their groups (the padding's rows sort past the sizes' sum), the real tokens'
    outputs are what they are without padding beside them, and the padding's output is zero."""
    import modelopt_jax.layers as layers

    model = float32_models[name]
    moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "router"))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((10, moe.router.weight.shape[-1])), jnp.float32)
    real = jnp.asarray([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], jnp.int32)
    sizes_seen = []
    grouped = layers.grouped_fp8_gemm

    def spy(x_q, w_q, group_sizes, *a, **k):
        sizes_seen.append(np.asarray(group_sizes))
        return grouped(x_q, w_q, group_sizes, *a, **k)

    monkeypatch.setattr(layers, "grouped_fp8_gemm", spy)
    masked = np.asarray(moe(x, real=real))
    alone = np.asarray(moe(x[np.asarray(real) == 1]))
    assert len(sizes_seen) == 4  # gate_up and down of each call
    assert all(int(s.sum()) == int(real.sum()) * moe.top_k for s in sizes_seen)
    np.testing.assert_allclose(masked[np.asarray(real) == 1], alone, rtol=1e-6, atol=1e-6)
    assert (masked[np.asarray(real) == 0] == 0).all()


@pytest.mark.parametrize("name", FAMILY_FIXTURES)
def test_bfloat16_compute_is_bounded(float32_models, name):
    """bf16 rounds every activation to 8 bits: bounded like the dense fixtures (tests/test_fixture_logits.py),
    max 1.5 and mean within 1.5x the quantization's own error. For MoE, bf16 may also send a token to
    another expert (the batch keeps router margins >= 1e-2 for float32, not for bf16's ~4e-3 steps):
    the max bound holds at positions before a row's first such reroute, and a reroute must be real."""
    ref = _ref(name)
    ids = ref["input_ids"]
    bf16 = modelopt_jax.load(fixture_dir(name), dtype="bfloat16")
    out = np.asarray(bf16(jnp.asarray(ids, jnp.int32)))
    q, orig = ref["logits_quantized"], ref["logits_original"]
    err = np.abs(out - q).max(-1)  # [rows, positions]
    assert np.isfinite(out).all()
    same = np.ones(err.shape, bool)  # positions routed as float32 routes them, in every earlier token too
    if name in MOE_FIXTURES:
        f32 = _routes(float32_models[name], ids)
        for layer, (_, experts) in _routes(bf16, ids).items():
            differs = (np.sort(experts, -1) != np.sort(f32[layer][1], -1)).any(-1)
            same &= np.cumsum(differs, axis=1) == 0
        print(f"{name}: bf16 reroutes from position {[int(np.argmin(r)) if not r.all() else None for r in same]}")
    assert same.sum() >= 8, "too few positions to bound"
    assert err[same].max() <= 1.5, f"max abs error {err[same].max():.3f}"
    # after a reroute: no larger than the quantization's own reroutes move the logits (MoE: up to ~5)
    assert err.max() <= max(1.5, 2 * np.abs(q - orig).max()), f"max abs error {err.max():.3f}"
    assert np.abs(out - q).mean() <= 1.5 * np.abs(q - orig).mean(), f"mean abs error {np.abs(out - q).mean():.4f}"
    # (no top-1 agreement bound: these random models' top-2 logit margins, 0.02-0.8, are below bf16's
    # own error of ~0.5, so which token wins is noise; the unquantized model agrees on 71-96%)


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_routing_equals_float64_reference(float32_models, name):
    """Which experts each token picks, and the weights, at every sparse layer, against the float64 oracle."""
    ids = _ref(name)["input_ids"]
    oracle = Reference(str(fixture_dir(name)))
    oracle.forward(ids)
    captured = _routes(float32_models[name], ids)
    assert captured, "no sparse layer"
    experts_seen = set()
    for i, (weights, experts) in captured.items():
        for row in range(ids.shape[0]):
            want = oracle.routes[(i, row)]
            np.testing.assert_array_equal(np.asarray(experts[row]), want, err_msg=f"layer {i} row {row}")
            experts_seen |= set(want.reshape(-1).tolist())
        assert np.allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-5)
    num_experts = float32_models[name].config.moe.num_experts
    assert experts_seen == set(range(num_experts)), "the reference batch routes to every expert"


def test_route_matches_numpy_on_random_logits():
    logits = np.random.default_rng(0).normal(0, 3, (64, 8)).astype(np.float32)
    for normalize in (True, False):
        w, ids = route(jnp.asarray(logits), 2, normalize)
        p = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want_ids = np.argsort(-p, -1, kind="stable")[:, :2]
        want_w = np.take_along_axis(p, want_ids, -1)
        if normalize:
            want_w /= want_w.sum(-1, keepdims=True)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)


def test_sliding_window_changes_the_logits_and_is_honoured(float32_models):
    """Mistral's window (8) is shorter than the reference rows (12): positions 8+ differ without it."""
    ref = _ref("mistral-tiny-fp8-kv")
    model = float32_models["mistral-tiny-fp8-kv"]
    assert model.config.sliding_window == 8
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    with_window = np.asarray(model(ids))
    import dataclasses
    model.config = dataclasses.replace(model.config, sliding_window=None)
    try:
        without = np.asarray(model(ids))
    finally:
        model.config = dataclasses.replace(model.config, sliding_window=8)
    np.testing.assert_allclose(with_window[:, :8], without[:, :8], atol=1e-5)  # inside the window: same
    assert np.abs(with_window[:, 8:] - without[:, 8:]).max() > 0.1


# one fixture per kind of layer (q/k norm with per-token scales, experts, window with FP8 KV): each
# is an LLM with its own compiles, the slowest test of this file
@pytest.mark.parametrize("name", ["qwen3-tiny-fp8-pc-pt", "qwen3moe-tiny-fp8", "mistral-tiny-fp8-kv"])
def test_engine_greedy_equals_cacheless_argmax(name):
    """The engine (paged steps, prompt chunks beside decode rows) and the cache-less forward pick the
    same greedy tokens; Mistral's rows run past its sliding window (8).

    Teacher-forced, as tests/test_generation.py checks per-token scales: the engine's tokens are fed
    to the cache-less forward, and wherever its top-1 leads the top-2 by more than 0.5 the engine's
    token must be that top-1 (one FP8 activation code rounding the other way in a different XLA
    summation order moves logits by ~0.1-0.4; these random models have many near-ties).
    """
    ref = _ref(name)
    new_tokens = 12
    llm = LLM(str(fixture_dir(name)), dtype="float32", max_model_len=64, compilation_cache_dir=None,
              max_num_batched_tokens=16)
    prompts = [list(map(int, row)) for row in ref["input_ids"]] + [list(map(int, ref["input_ids"][0][:5]))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    assert llm.last_stats["mixed_steps"] > 0  # decode rows and prompt chunks shared steps
    _assert_decisive_tokens_match(llm, prompts, outs, new_tokens, name)


def _assert_decisive_tokens_match(llm, prompts, outs, new_tokens, name):
    decisive = 0
    for prompt, out in zip(prompts, outs, strict=True):
        seq = prompt + out.token_ids
        logits = np.asarray(llm.model(jnp.asarray([seq], jnp.int32)))[0, len(prompt) - 1:-1]
        top = np.sort(logits, -1)
        sure = top[:, -1] - top[:, -2] > 0.5
        np.testing.assert_array_equal(np.asarray(out.token_ids)[sure], logits.argmax(-1)[sure], err_msg=name)
        decisive += int(sure.sum())
    assert decisive >= len(prompts) * new_tokens // 4, f"only {decisive} decisive positions"


def test_engine_gives_back_pages_outside_the_sliding_window():
    """Mistral (window 8, pages of 16): rows generating far past the window hold and gather only the
    pages their window still sees -- the engine gives the earlier ones back to the pool and the step's
    block tables start at the first live page -- and still pick the cache-less forward's tokens."""
    name, new_tokens = "mistral-tiny-fp8-kv", 150
    ref = _ref(name)
    llm = LLM(str(fixture_dir(name)), dtype="float32", max_model_len=256, compilation_cache_dir=None,
              max_num_batched_tokens=32)
    # the last prompt repeats the first: its full prompt pages come from the prefix cache, shared with a
    # row that gives them back as it moves on (reference counts, not the other row's pages, drop)
    prompts = [list(map(int, row)) for row in ref["input_ids"]]
    prompts += [prompts[0] + prompts[1]] * 2  # 24 tokens: one full page to share
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    assert llm.last_stats["prefix_cache_hit_tokens"] >= 16
    assert outs[-1].token_ids == outs[-2].token_ids
    # each row ends past position 150: all but its last two or three pages went back
    assert llm.last_stats["window_released_pages"] >= len(prompts) * 8
    # without giving pages back the longest row would need 11 pages (a 16-wide table); now at most 3
    assert max(program.shape.table_width for program in llm.engine.runner.shapes) == 8
    llm.engine.pool.check()
    assert llm.engine.pool.held == 0
    _assert_decisive_tokens_match(llm, prompts, outs, new_tokens, name)


# ------------------------------------------------------------------------------------ broken inputs

def _edit_config(d, **fields):
    edit_json(d, "config.json", lambda c: c.update(fields))


@pytest.mark.parametrize("field,value,error,match", [
    ("num_hidden_layers", 10**9, MissingTensorError, "num_hidden_layers is 1000000000.*layer 2"),
    ("num_local_experts", 10**9, MissingTensorError, "expert count is 1000000000.*4 experts"),
    ("intermediate_size", 10**9, ModelOptJaxError, r"experts\.0\.w1\.weight"),
    ("vocab_size", 10**12, ModelOptJaxError, r"embed_tokens\.weight"),
])
def test_absurd_sizes_fail_fast_with_bounded_memory(tmp_path, field, value, error, match):
    d = copy_fixture("mixtral-tiny-fp8", tmp_path)
    _edit_config(d, **{field: value})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(error, match=match) as caught:
        modelopt_jax.load(d, dtype="float32")
    assert isinstance(caught.value, ModelOptJaxError)
    assert time.monotonic() - start < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: < 200 MB grown


def test_absurd_layer_count_in_a_dense_family(tmp_path):
    d = copy_fixture("qwen3-tiny-fp8", tmp_path)
    _edit_config(d, num_hidden_layers=10**9)
    with pytest.raises(MissingTensorError, match=r"config.json: num_hidden_layers is 1000000000.*model\.layers\.3"):
        modelopt_jax.load(d)


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_missing_expert_names_it(tmp_path, name):
    block, _, gate, _ = MOE_FIXTURES[name]
    d = copy_fixture(name, tmp_path)
    tensors = read_tensors(d)
    gone = f"model.layers.1.{block}.experts.2.{gate}.weight"
    del tensors[gone]
    write_tensors(d, tensors)
    with pytest.raises(MissingTensorError, match=gone.replace(".", r"\.")):
        modelopt_jax.load(d)


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_expert_input_scale_must_be_the_layers(tmp_path, name):
    block, _, gate, down = MOE_FIXTURES[name]
    d = copy_fixture(name, tmp_path)
    tensors = read_tensors(d)
    key = f"model.layers.1.{block}.experts.3.{down}.input_scale"
    tensors[key] = np.array(tensors[key] * 1.5, dtype=tensors[key].dtype)
    write_tensors(d, tensors)
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down: the experts have different input scales.*experts\.3"):
        modelopt_jax.load(d)


def test_gate_and_up_input_scales_may_not_silently_differ(tmp_path):
    """An expert whose gate and up disagree on the input scale: one grouped GEMM quantizes their shared
    input once, so the checkpoint is refused (ModelOpt calibrates one input quantizer for both)."""
    d = copy_fixture("mixtral-tiny-fp8", tmp_path)
    tensors = read_tensors(d)
    key = "model.layers.0.block_sparse_moe.experts.1.w3.input_scale"
    tensors[key] = np.array(tensors[key] * 2, dtype=tensors[key].dtype)
    write_tensors(d, tensors)
    with pytest.raises(CheckpointError, match=r"experts\.1\.w1 and .*experts\.1\.w3 have different input scales"):
        modelopt_jax.load(d)


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_router_quantized_by_mistake(tmp_path, name):
    block, router, _, _ = MOE_FIXTURES[name]
    d = copy_fixture(name, tmp_path)
    tensors = read_tensors(d)
    key = f"model.layers.1.{block}.{router}.weight"
    tensors[key] = np.asarray(tensors[key], np.float32).astype(ml_dtypes.float8_e4m3fn)
    tensors[key.replace(".weight", ".weight_scale")] = np.array(1.0, np.float32)
    write_tensors(d, tensors)
    with pytest.raises(DtypeMismatchError, match=key.replace(".", r"\.")):
        modelopt_jax.load(d)


def test_top_k_above_expert_count(tmp_path):
    d = copy_fixture("qwen3moe-tiny-fp8", tmp_path)
    _edit_config(d, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 exceeds num_local_experts 8"):
        modelopt_jax.load(d)


def test_qwen3_moe_reads_num_experts_as_hub_configs_spell_it(tmp_path):
    d = copy_fixture("qwen3moe-tiny-fp8", tmp_path)
    shutil.copyfile(fixture_dir("qwen3moe-tiny-fp8") / "ref_logits.npz", d / "ref_logits.npz")

    def rename(c):
        c["num_experts"] = c.pop("num_local_experts")
    edit_json(d, "config.json", rename)
    ref = _ref("qwen3moe-tiny-fp8")
    out = np.asarray(modelopt_jax.load(d, dtype="float32")(jnp.asarray(ref["input_ids"], jnp.int32)))
    assert np.abs(out - ref["logits_quantized"]).max() <= TOL
    assert json.loads((d / "config.json").read_text())["num_experts"] == 8


def test_paged_attention_window_mask_on_the_xla_path():
    """The engine's XLA attention with a window equals a dense masked reference at the window edges."""
    from modelopt_jax.ops.attention import step_attention
    from modelopt_jax.ops.paged_step import AttentionConfig
    from modelopt_jax.engine.runner import Runner  # noqa: F401  (the engine builds steps this way)

    rng = np.random.default_rng(1)
    page, window, length = 4, 5, 11
    heads, kv, d = 4, 2, 8
    q = rng.normal(size=(length, heads, d)).astype(np.float32)
    k = rng.normal(size=(length, kv, d)).astype(np.float32)
    v = rng.normal(size=(length, kv, d)).astype(np.float32)
    pages = [1, 2, 3]
    slots = np.array([pages[p // page] * page + p % page for p in range(length)], np.int32)
    from modelopt_jax.ops.paged_step import dense_rows_step
    config = AttentionConfig(page, sliding_window=window)
    step = dense_rows_step(np.zeros((1, length), np.int32), np.arange(length, dtype=np.int32)[None], slots[None],
                           np.array([pages], np.int32), config, None)
    pool = jnp.zeros((4 * page, kv, d), jnp.float32)
    out, _, _ = step_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pool, pool, k_scale=None,
                               v_scale=None, step=step, dtype=jnp.float32)
    kk, vv = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    s = np.einsum("thd,shd->hts", q.astype(np.float64), kk) / np.sqrt(d)
    i, j = np.arange(length)[:, None], np.arange(length)[None]
    s = np.where((j <= i) & (i - j < window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv).reshape(length, heads * d)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


def test_inspect_warns_about_an_absurd_layer_count(tmp_path, capsys):
    from modelopt_jax.__main__ import main

    d = copy_fixture("mixtral-tiny-fp8", tmp_path)
    _edit_config(d, num_hidden_layers=10**9)
    start = time.monotonic()
    main(["inspect", str(d)])
    out = capsys.readouterr().out
    assert time.monotonic() - start < 2.0
    assert "warnings:    none" not in out
    assert "num_hidden_layers is 1000000000 but the checkpoint holds no tensor of layer 2" in out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mistral", "mixtral"])
@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", None])
def test_synthetic_exports_of_the_new_families_match_the_oracle(tmp_path, family, algo):
    """modelopt_jax.synthetic writes Qwen3 and Qwen3-MoE exports (benchmarks need large ones); loaded,
    they equal the float64 oracle, and per-channel MoE scales survive tensor parallelism (each
    device's experts get their own slice of every expert's channel scales)."""
    from modelopt_jax.parallel import make_mesh
    from modelopt_jax.synthetic import write_checkpoint

    moe = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32) if family in ("qwen3_moe",
                                                                                            "mixtral") else {}
    if family in ("mistral", "mixtral"):
        moe["sliding_window"] = 6  # shorter than the 10-token rows
    write_checkpoint(tmp_path, family=family, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128, quant_algo=algo,
                     seed=5, **moe)
    ids = np.random.default_rng(0).integers(0, 128, (2, 10))
    out = np.asarray(modelopt_jax.load(tmp_path, dtype="float32")(jnp.asarray(ids, jnp.int32)))
    assert np.abs(out - Reference(str(tmp_path)).forward(ids)).max() <= TOL
    if family == "qwen3_moe" and len(jax.devices()) >= 2:
        model = modelopt_jax.load(tmp_path, dtype="float32", mesh=make_mesh(2))
        tp2 = np.asarray(model(jnp.asarray(ids, jnp.int32)))
        if algo != "FP8_PER_CHANNEL_PER_TOKEN":
            np.testing.assert_allclose(tp2, out, atol=1e-4, rtol=0)
        else:
            # per-token scales of the row-parallel down projection are each device's own (its slice
            # of the input), as for dense layers (test_tensor_parallel.py): logits close, not equal.
            # The column-parallel gate/up's per-expert channel scales are device data: device r holds
            # rows [r*F/2, (r+1)*F/2) of every expert's gate scales, then the same of its up scales.
            tensors = read_tensors(tmp_path)
            gate_up = model.layers[0].mlp.gate_up.col_scale[...]
            half = 16
            for shard in gate_up.addressable_shards:
                r = shard.index[1].start // (2 * half)
                want = np.stack([np.concatenate([tensors[f"model.layers.0.mlp.experts.{e}.{n}.weight_scale"]
                                                 [r * half:(r + 1) * half] for n in ("gate_proj", "up_proj")])
                                 for e in range(16)])
                np.testing.assert_array_equal(np.asarray(shard.data), want)
            assert np.abs(tp2 - out).max() <= 1.5


def test_moe_forward_runs_the_grouped_custom_call_on_cpu(float32_models):
    """Where the native CPU library is built, the experts run our grouped FFI op (not XLA's ragged_dot)."""
    from flax import nnx
    from modelopt_jax.ops import native

    if not native.has_cpu_handler():
        pytest.skip("native CPU library with the grouped GEMM handler not built")
    model = float32_models["mixtral-tiny-fp8"]
    graph, state = nnx.split(model)
    ids = jnp.asarray(_ref("mixtral-tiny-fp8")["input_ids"], jnp.int32)
    text = jax.jit(lambda st, i: nnx.merge(graph, st)(i)).lower(state, ids).as_text()
    assert text.count("modelopt_fp8_grouped_gemm") >= 2 * model.config.num_hidden_layers  # gate/up and down
