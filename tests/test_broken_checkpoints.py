"""A corpus of broken checkpoints: each must fail ``load`` with the right typed error and a useful message.

Every case copies a real ModelOpt fixture into ``tmp_path``, breaks one thing, and checks that
``modelopt_jax.load`` raises exactly the documented error class (not a subclass, not a crash, never
a silent success) and that the message names the file or directory, the tensor when there is one,
and what was expected versus found. The table below has one row per kind of damage.

Two positive controls prove the helpers themselves do not break checkpoints: a plain rewrite of
each fixture still loads, and a sharded copy (two shards + index) gives the original's logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import modelopt_jax
from modelopt_jax.checkpoint import SafetensorsIndex
from modelopt_jax.checkpoint.safetensors_index import NUMPY_DTYPES
from modelopt_jax.errors import (CheckpointError, ConfigError, DtypeMismatchError, InvalidScaleError,
                                 MissingTensorError, ModelOptJaxError, ShapeMismatchError,
                                 UnsupportedQuantizationError)
from fixture_paths import fixture_dir

ST = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
V = "model.layers.0.self_attn.v_proj"
TAGS = {dtype: tag for tag, dtype in NUMPY_DTYPES.items()}  # numpy dtype -> safetensors dtype tag
SMALL_FIXTURES = ["llama-tiny-fp8", "qwen2-tiny-fp8", "llama-tiny-fp8-kv", "qwen2-tiny-fp8-pc-pt",
                  "qwen2-tiny-fp8-pb-wo"]


# --------------------------------------------------------------------------------------------- helpers

def copy_fixture(name: str, dest: Path) -> Path:
    """Copies a fixture's files (not their read-only permissions) so the copy can be edited."""
    src = fixture_dir(name)
    out = dest / name
    out.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "ref_logits.npz":
            shutil.copyfile(f, out / f.name)
    return out


def read_tensors(d: Path) -> dict[str, np.ndarray]:
    index = SafetensorsIndex(str(d))
    return {n: index.read(n) for n in index}


def write_tensors(d: Path, tensors: dict[str, np.ndarray], file: str = ST, *, by_hand: bool = False) -> None:
    """Writes a safetensors file with safetensors' numpy API, or by hand where that lacks float8."""
    # np.array(order="C"), not np.ascontiguousarray: the latter turns 0-d scales into shape [1].
    arrays = {n: np.array(t, order="C") for n, t in tensors.items()}
    if not by_hand:
        try:
            save_file(arrays, str(d / file), metadata={"format": "pt"})
            return
        except (KeyError, TypeError, ValueError):  # older safetensors: numpy backend without float8
            pass
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, a in arrays.items():
        header[n] = {"dtype": TAGS[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    write_raw(d / file, header, b"".join(a.tobytes() for a in arrays.values()))


def edit_tensors(fn: Callable[[dict[str, np.ndarray]], object]):
    """A mutation that edits the tensor dict in place and rewrites model.safetensors."""
    def mutate(d: Path):
        tensors = read_tensors(d)
        extra = fn(tensors)
        write_tensors(d, tensors)
        return extra
    return mutate


def edit_json(d: Path, file: str, fn: Callable[[dict], None]) -> None:
    path = d / file
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


def edit_quant(hf: Callable[[dict], None] | None = None, config: Callable[[dict], None] | None = None):
    """Edits hf_quant_config.json's ``quantization`` and/or config.json's ``quantization_config``."""
    def mutate(d: Path):
        if hf:
            edit_json(d, "hf_quant_config.json", lambda j: hf(j["quantization"]))
        if config:
            edit_json(d, "config.json", lambda j: config(j["quantization_config"]))
    return mutate


def set_quant_algo(value):
    """Sets quant_algo in both files, so they agree with each other (and not with the tensors)."""
    def set_algo(q):
        q["quant_algo"] = value
    return edit_quant(hf=set_algo, config=set_algo)


def read_raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    """Writes a safetensors file by hand (8-byte length, JSON header, data), lies included."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def write_sharded(d: Path, tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """Splits ``tensors`` over two shards plus an index (replacing model.safetensors); returns the map."""
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {n: SHARDS[0] if i < half else SHARDS[1] for i, n in enumerate(names)}
    for shard in SHARDS:
        write_tensors(d, {n: tensors[n] for n in names if weight_map[n] == shard}, shard)
    total = sum(t.nbytes for t in tensors.values())
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (d / ST).unlink(missing_ok=True)
    return weight_map


def fp8_to_bf16(tensors: dict[str, np.ndarray], prefix: str) -> None:
    """Dequantizes one Linear's FP8 weight to BF16 (what an exporter that skipped it would write)."""
    w = tensors[f"{prefix}.weight"].astype(np.float32) * tensors[f"{prefix}.weight_scale"].astype(np.float32)
    tensors[f"{prefix}.weight"] = w.astype(ml_dtypes.bfloat16)


def f32(value) -> np.ndarray:
    return np.asarray(value, np.float32)


# ------------------------------------------------------------------------------------------- mutations

def drop(*names: str):
    def fn(t):
        for n in names:
            del t[n]
    return edit_tensors(fn)


def set_tensor(name: str, value: Callable[[np.ndarray], np.ndarray]):
    return edit_tensors(lambda t: t.__setitem__(name, value(t[name])))


def negative_channel(t):
    scale = t["model.layers.0.mlp.gate_proj.weight_scale"].copy()
    scale[5] = -0.5
    t["model.layers.0.mlp.gate_proj.weight_scale"] = scale


# Excludes k_proj alone, in both files (so they agree with each other), leaving its tensors FP8.
exclude_k_only = edit_quant(hf=lambda q: q["exclude_modules"].append(K), config=lambda q: q["ignore"].append(K))


def exclude_k_and_store_bf16(d: Path):
    """As exclude_k_only, and k_proj stored exactly as ModelOpt writes an excluded layer (BF16, no scales)."""
    exclude_k_only(d)

    def excluded_k(t):
        fp8_to_bf16(t, K)
        del t[f"{K}.weight_scale"], t[f"{K}.input_scale"]
    edit_tensors(excluded_k)(d)


def truncate_data(d: Path):
    """Cuts the file in the middle of the last tensor's data; returns that tensor's name."""
    header, data = read_raw_header(d / ST)
    last = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    raw = (d / ST).read_bytes()
    (d / ST).write_bytes(raw[:len(raw) - len(data) + (begin + end) // 2])
    return {"tensor": last}


def truncate_header(d: Path):
    raw = (d / ST).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    (d / ST).write_bytes(raw[:8 + n // 2])
    return {"claimed": str(n), "size": str(8 + n // 2)}


def cut_to(size: int):
    def mutate(d: Path):
        (d / ST).write_bytes((d / ST).read_bytes()[:size])
    return mutate


def header_not_json(d: Path):
    raw = bytearray((d / ST).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8:8 + n] = b"{not json" + b" " * (n - 9)
    (d / ST).write_bytes(bytes(raw))


def overlapping_offsets(d: Path):
    """k_proj's weight_scale header entry points at q_proj's 4 bytes (the bytes it owned become a hole)."""
    header, data = read_raw_header(d / ST)
    header[f"{K}.weight_scale"]["data_offsets"] = header[f"{Q}.weight_scale"]["data_offsets"]
    write_raw(d / ST, header, data)


def bad_json(file: str):
    def mutate(d: Path):
        text = (d / file).read_text()
        (d / file).write_text(text[:len(text) // 2])
    return mutate


def sharded(edit: Callable[[Path, dict[str, str]], dict | None]):
    def mutate(d: Path):
        weight_map = write_sharded(d, read_tensors(d))
        return edit(d, weight_map)
    return mutate


def delete_second_shard(d: Path, weight_map):
    (d / SHARDS[1]).unlink()
    return {"tensor": sorted(n for n, f in weight_map.items() if f == SHARDS[1])[0]}


def map_to_wrong_shard(d: Path, weight_map):
    name = sorted(n for n, f in weight_map.items() if f == SHARDS[1])[0]
    edit_json(d, INDEX, lambda j: j["weight_map"].__setitem__(name, SHARDS[0]))
    return {"tensor": name}


def remove(file: str):
    return lambda d: (d / file).unlink()


# ----------------------------------------------------------------------------------------------- table

@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    fixture: str
    mutate: Callable[[Path], dict | None]
    error: type[ModelOptJaxError]
    expect: tuple[str, ...]  # substrings; may use {dir} {st} {config} {hfq} {index} and what mutate returns


SUPPORTED = "supported: FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO"
CASES = [
    # --- tensors: missing, invalid values, wrong dtype/shape
    Case("missing-weight-scale", "llama-tiny-fp8", drop(f"{Q}.weight_scale"), MissingTensorError,
         ("{dir}: missing tensor", f"'{Q}.weight_scale'", "per-tensor weight scale", "expected F32[]")),
    Case("missing-input-scale", "qwen2-tiny-fp8", drop("model.layers.1.mlp.down_proj.input_scale"),
         MissingTensorError, ("{dir}: missing tensor", "'model.layers.1.mlp.down_proj.input_scale'",
                              "static activation scale", "expected F32[]")),
    Case("nan-weight-scale", "llama-tiny-fp8", set_tensor(f"{Q}.weight_scale", lambda s: f32(np.nan)),
         InvalidScaleError, ("{st}:", f"'{Q}.weight_scale'", "must be finite and > 0", "found nan")),
    Case("inf-input-scale", "llama-tiny-fp8",
         set_tensor("model.layers.1.self_attn.o_proj.input_scale", lambda s: f32(np.inf)), InvalidScaleError,
         ("{st}:", "'model.layers.1.self_attn.o_proj.input_scale'", "must be finite and > 0", "found inf")),
    Case("zero-input-scale", "qwen2-tiny-fp8", set_tensor(f"{Q}.input_scale", lambda s: f32(0.0)),
         InvalidScaleError, ("{st}:", f"'{Q}.input_scale'", "must be finite and > 0", "found 0.0")),
    Case("negative-per-channel-scale", "qwen2-tiny-fp8-pc-pt", edit_tensors(negative_channel), InvalidScaleError,
         ("{st}:", "'model.layers.0.mlp.gate_proj.weight_scale'", "must be finite and > 0",
          "found -0.5 at index [5]", "1 bad of 128")),
    Case("nan-kv-scale", "llama-tiny-fp8-kv", set_tensor(f"{V}.v_scale", lambda s: f32(np.nan)), InvalidScaleError,
         ("{st}:", f"'{V}.v_scale'", "FP8 KV-cache v scale", "found nan")),
    Case("per-channel-scale-wrong-shape", "qwen2-tiny-fp8-pc-pt", set_tensor(f"{Q}.weight_scale", lambda s: s[:32]),
         ShapeMismatchError, ("{st}:", f"'{Q}.weight_scale'", "has shape [32]", "expected [64] or [64, 1]")),
    Case("per-tensor-scale-is-a-vector", "llama-tiny-fp8",
         set_tensor(f"{Q}.weight_scale", lambda s: np.full(64, s, np.float32)), ShapeMismatchError,
         ("{st}:", f"'{Q}.weight_scale'", "has shape [64]", "expected [] or [1]")),
    Case("block-scale-wrong-grid", "qwen2-tiny-fp8-pb-wo",
         set_tensor(f"{Q}.weight_scale", lambda s: s.reshape(2, 2)[:1]), ShapeMismatchError,
         ("{st}:", f"'{Q}.weight_scale'", "has shape [1, 2]", "expected [2, 1, 2, 1] or [2, 2]")),
    Case("scale-stored-as-int", "llama-tiny-fp8",
         set_tensor(f"{Q}.input_scale", lambda s: np.asarray(1, np.int32)), DtypeMismatchError,
         ("{st}:", f"'{Q}.input_scale'", "has dtype I32", "expected F32 or BF16 or F16")),
    Case("fp8-weight-stored-as-bf16", "qwen2-tiny-fp8", edit_tensors(lambda t: fp8_to_bf16(t, K)),
         DtypeMismatchError, ("{st}:", f"'{K}.weight'", "FP8 weight", "has dtype BF16", "expected F8_E4M3")),
    Case("excluded-lm-head-stored-as-fp8", "llama-tiny-fp8",
         set_tensor("lm_head.weight", lambda w: w.astype(ml_dtypes.float8_e4m3fn)), DtypeMismatchError,
         ("{st}:", "'lm_head.weight'", "excluded from quantization by 'lm_head'", "has dtype F8_E4M3",
          "expected BF16 or F16 or F32")),
    Case("scale-on-excluded-layer", "llama-tiny-fp8",
         edit_tensors(lambda t: t.__setitem__("lm_head.weight_scale", f32(1.0))), CheckpointError,
         ("{st}:", "lm_head.weight_scale exists", "excluded from quantization", "disagree")),
    Case("input-scale-with-per-token-activations", "qwen2-tiny-fp8-pc-pt",
         edit_tensors(lambda t: t.__setitem__(f"{Q}.input_scale", f32(0.1))), CheckpointError,
         ("{st}:", f"{Q}.input_scale is present", "FP8_PER_CHANNEL_PER_TOKEN")),
    Case("config-hidden-size-changed", "llama-tiny-fp8",
         lambda d: edit_json(d, "config.json", lambda c: c.__setitem__("hidden_size", 96)), ShapeMismatchError,
         ("{st}:", "'model.embed_tokens.weight'", "has shape [256, 64]", "expected [256, 96] (from config.json)")),
    Case("transposed-weight", "qwen2-tiny-fp8",
         set_tensor("model.layers.1.mlp.gate_proj.weight", lambda w: w.T), ShapeMismatchError,
         ("{st}:", "'model.layers.1.mlp.gate_proj.weight'", "has shape [64, 128]", "expected [128, 64]")),
    Case("missing-k-scale-fp8-kv", "llama-tiny-fp8-kv", drop(f"{K}.k_scale"), MissingTensorError,
         ("{dir}:", "kv_cache_quant_algo is FP8", "model.layers.0.self_attn has no k_scale",
          f"looked for {K}.k_scale")),
    Case("unexpected-o-proj-bias", "llama-tiny-fp8",
         edit_tensors(lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias",
                                              np.zeros(64, ml_dtypes.bfloat16))), CheckpointError,
         ("{dir}:", "model.layers.0.self_attn.o_proj.bias", "not used by LlamaForCausalLM",
          "does not match its config")),
    # --- safetensors container damage
    Case("truncated-in-data", "llama-tiny-fp8", truncate_data, CheckpointError,
         ("{st}:", "tensor '{tensor}'", "run past the end of the file", "truncated")),
    Case("truncated-in-header", "qwen2-tiny-fp8", truncate_header, CheckpointError,
         ("{st}:", "truncated", "header claims {claimed} bytes", "file has {size} bytes")),
    Case("truncated-before-header-length", "llama-tiny-fp8", cut_to(3), CheckpointError,
         ("{st}:", "truncated", "3 bytes, no header length")),
    Case("header-not-json", "llama-tiny-fp8", header_not_json, CheckpointError,
         ("{st}:", "header is not valid JSON")),
    Case("overlapping-data-offsets", "llama-tiny-fp8", overlapping_offsets, CheckpointError,
         ("{st}:", f"'{Q}.weight_scale'", f"'{K}.weight_scale'", "overlap")),
    Case("no-safetensors-file", "llama-tiny-fp8", remove(ST), CheckpointError,
         ("{dir}:", "no model.safetensors or model.safetensors.index.json found")),
    # --- sharded checkpoints
    Case("index-names-missing-shard", "llama-tiny-fp8", sharded(delete_second_shard), MissingTensorError,
         ("{index}:", f"shard '{SHARDS[1]}'", "'{tensor}'", "does not exist in {dir}")),
    Case("index-maps-tensor-to-wrong-shard", "qwen2-tiny-fp8", sharded(map_to_wrong_shard), MissingTensorError,
         ("{index}:", "'{tensor}'", f"mapped to '{SHARDS[0]}'", "does not contain it", f"it is in '{SHARDS[1]}'")),
    Case("index-not-json", "llama-tiny-fp8", sharded(lambda d, m: bad_json(INDEX)(d)), CheckpointError,
         ("{index}:", "not a valid safetensors index")),
    Case("index-shard-name-not-a-string", "llama-tiny-fp8",
         sharded(lambda d, m: edit_json(d, INDEX, lambda j: j["weight_map"].__setitem__("lm_head.weight", 1))),
         CheckpointError, ("{index}:", "not a valid safetensors index", "maps 'lm_head.weight' to 1",
                           "expected a shard file name")),
    # --- config.json / hf_quant_config.json
    Case("config-json-bad-json", "llama-tiny-fp8", bad_json("config.json"), ConfigError,
         ("{config}:", "not valid JSON")),
    Case("config-json-missing", "llama-tiny-fp8", remove("config.json"), ConfigError, ("{config}:", "not found")),
    Case("config-kv-heads-not-int", "llama-tiny-fp8",
         lambda d: edit_json(d, "config.json", lambda c: c.__setitem__("num_key_value_heads", "2")), ConfigError,
         ("{config}:", "num_key_value_heads must be a positive integer", "found '2'")),
    Case("config-rms-norm-eps-not-a-number", "qwen2-tiny-fp8",
         lambda d: edit_json(d, "config.json", lambda c: c.__setitem__("rms_norm_eps", "1e-6")), ConfigError,
         ("{config}:", "rms_norm_eps must be a number", "found '1e-6'")),
    Case("hf-quant-config-bad-json", "qwen2-tiny-fp8", bad_json("hf_quant_config.json"), ConfigError,
         ("{hfq}:", "not valid JSON")),
    Case("unknown-quant-algo", "llama-tiny-fp8", set_quant_algo("FP9"),
         UnsupportedQuantizationError, ("{hfq}", "{config}", "quant_algo 'FP9' is unknown", SUPPORTED)),
    Case("nvfp4-checkpoint", "qwen2-tiny-nvfp4", lambda d: None, UnsupportedQuantizationError,
         ("{hfq}", "{config}", "quant_algo 'NVFP4'", "does not run", SUPPORTED)),
    Case("unknown-kv-cache-algo", "llama-tiny-fp8-kv",
         edit_quant(hf=lambda q: q.__setitem__("kv_cache_quant_algo", "INT8"),
                    config=lambda q: q.__setitem__("kv_cache_scheme", {"type": "int", "num_bits": 8})),
         UnsupportedQuantizationError, ("{hfq}", "{config}", "kv_cache_quant_algo 'INT8'", "supported: FP8")),
    Case("quant-method-not-modelopt", "llama-tiny-fp8",
         edit_quant(config=lambda q: q.__setitem__("quant_method", "fp8")), UnsupportedQuantizationError,
         ("{config}:", "quant_method is 'fp8'", "quant_method 'modelopt'")),
    Case("quant-algo-disagreement", "llama-tiny-fp8",
         edit_quant(hf=lambda q: q.__setitem__("quant_algo", "FP8_PER_CHANNEL_PER_TOKEN")), ConfigError,
         ("{hfq} and {config} disagree",
          "quant_algo: 'FP8_PER_CHANNEL_PER_TOKEN' in hf_quant_config.json vs 'FP8' in config.json")),
    Case("exclude-list-disagreement", "qwen2-tiny-fp8",
         edit_quant(config=lambda q: q["ignore"].append("model.layers.1.mlp.down_proj")), ConfigError,
         ("{hfq} and {config} disagree", "exclude_modules ['lm_head', 'model.embed_tokens'] in hf_quant_config.json",
          "ignore ['lm_head', 'model.embed_tokens', 'model.layers.1.mlp.down_proj'] in config.json")),
    Case("kv-algo-disagreement", "llama-tiny-fp8-kv", edit_quant(config=lambda q: q.pop("kv_cache_scheme")),
         ConfigError, ("{hfq} and {config} disagree",
                       "kv_cache_quant_algo: 'FP8' in hf_quant_config.json vs None in config.json")),
    Case("mixed-exclusion-in-fused-qkv", "llama-tiny-fp8", exclude_k_and_store_bf16, ConfigError,
         ("{hfq} and {config}", f"fused layer made of {Q}, {K}, {V}", "mixes excluded and quantized",
          f"{K}: excluded by '{K}' (exact)", f"{Q}: quantized")),
    Case("mixed-exclusion-in-fused-qkv-tensors-fp8", "qwen2-tiny-fp8", exclude_k_only, ConfigError,
         ("{hfq} and {config}", f"fused layer made of {Q}, {K}, {V}", "mixes excluded and quantized",
          f"{K}: excluded by '{K}' (exact)", f"{V}: quantized")),
    Case("missing-quant-algo-hf-quant-config", "llama-tiny-fp8", edit_quant(hf=lambda q: q.pop("quant_algo")),
         ConfigError, ("{hfq}:", "'quantization' has no quant_algo")),
    Case("missing-quant-algo-config-json", "qwen2-tiny-fp8", edit_quant(config=lambda q: q.pop("quant_algo")),
         ConfigError, ("{config}:", "quantization_config has no quant_algo")),
    Case("quant-algo-null-but-fp8-weights", "llama-tiny-fp8", set_quant_algo(None),
         DtypeMismatchError, ("{st}:", "'model.layers.0.self_attn.q_proj.weight'", "not quantized",
                              "has dtype F8_E4M3", "expected BF16 or F16 or F32")),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_broken_checkpoint(case: Case, tmp_path):
    d = copy_fixture(case.fixture, tmp_path)
    extra = case.mutate(d) or {}
    paths = {"dir": str(d), "st": str(d / ST), "config": str(d / "config.json"),
             "hfq": str(d / "hf_quant_config.json"), "index": str(d / INDEX), **extra}

    # Anything that is not a ModelOptJaxError (a crash) propagates and fails the test; so does success.
    with pytest.raises(ModelOptJaxError) as info:
        modelopt_jax.load(d, dtype="float32")

    message = str(info.value)
    assert type(info.value) is case.error, f"expected {case.error.__name__}, got {type(info.value).__name__}: {message}"
    missing = [s.format(**paths) for s in case.expect if s.format(**paths) not in message]
    assert not missing, f"message lacks {missing}:\n{message}"


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 18
    assert len({c.id for c in CASES}) == len(CASES)


# ------------------------------------------------------------------------------------ positive controls

@pytest.mark.parametrize("by_hand", [False, True], ids=["save_file", "by-hand"])
@pytest.mark.parametrize("fixture", SMALL_FIXTURES)
def test_rewritten_copy_loads(fixture, by_hand, tmp_path):
    """A copy rewritten by the helpers (no damage) loads, so each broken case fails for its damage alone."""
    d = copy_fixture(fixture, tmp_path)
    before = SafetensorsIndex(str(d))
    tensors = read_tensors(d)
    write_tensors(d, tensors, by_hand=by_hand)
    after = SafetensorsIndex(str(d))
    for n in before:  # same names, dtype tags, shapes (0-d scales stay 0-d) and bytes
        assert (after.info(n).dtype, after.info(n).shape) == (before.info(n).dtype, before.info(n).shape), n
        assert after.read(n).tobytes() == tensors[n].tobytes(), n
    assert len(after) == len(before)
    modelopt_jax.load(d, dtype="float32")


def test_sharded_copy_matches_single_file(tmp_path):
    """Two shards + index load to the same logits as the single-file original (the sharding helper is sound)."""
    src = fixture_dir("llama-tiny-fp8-kv")
    d = copy_fixture("llama-tiny-fp8-kv", tmp_path)
    weight_map = write_sharded(d, read_tensors(d))
    assert not (d / ST).exists() and set(weight_map.values()) == set(SHARDS)

    ids = jnp.asarray(np.load(src / "ref_logits.npz")["input_ids"], jnp.int32)
    sharded_model = modelopt_jax.load(d, dtype="float32")
    single_model = modelopt_jax.load(src, dtype="float32")
    np.testing.assert_allclose(np.asarray(sharded_model(ids)), np.asarray(single_model(ids)), rtol=0, atol=1e-6)
