"""Where ModelOpt settings come from, how exclusions match, and which algorithms are refused."""

from __future__ import annotations

import json
import shutil

import pytest

from fixture_paths import fixture_dir
from modelopt_jax.checkpoint.quant_config import SUPPORTED_QUANT_ALGOS, load_quant_config, match_exclusion
from modelopt_jax.errors import ConfigError, UnsupportedQuantizationError


@pytest.mark.parametrize("module, pattern, rule", [
    ("lm_head", "lm_head", "exact"),
    ("model.layers.3.mlp.gate", "*mlp.gate", "wildcard"),
    ("model.layers.3.mlp.gate_proj", "*mlp.gate", None),  # a wildcard must match the whole path
    ("model.layers.0.self_attn", "model.layers.0.self_attn*", "wildcard"),  # path* covers path
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn*", "wildcard"),  # and path.*
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.*", "wildcard"),
    ("model.layers.1.mlp.down_proj", "model.layers.?.mlp.down_proj", "wildcard"),
    ("model.lm_head", "lm_head", "substring"),  # legacy exporters: plain names match as substrings
    ("model.layers.0.mlp.up_proj", "lm_head", None),
    ("model.layers.0.mlp.up_proj", "model.layers.0.mlp.down*", None),
])
def test_exclusion_rules(module, pattern, rule):
    assert match_exclusion(module, pattern) == rule


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(fixture_dir(name), dst)
    return dst


def _edit(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_both_sources_agree_and_are_merged(tmp_path):
    qc = load_quant_config(str(fixture_dir("llama-tiny-fp8-kv")))
    assert (qc.quant_algo, qc.kv_cache_quant_algo) == ("FP8", "FP8")
    assert set(qc.exclude_modules) == {"lm_head", "model.embed_tokens"}
    assert len(qc.sources) == 2 and qc.producer == "modelopt" and qc.producer_version == "0.47.0"


def test_config_json_only_and_lower_case_algo(tmp_path):
    d = _copy(tmp_path, "qwen2-tiny-fp8-pb-wo")
    (d / "hf_quant_config.json").unlink()
    qc = load_quant_config(str(d))
    assert qc.quant_algo == "FP8_PB_WO" and qc.sources == (str(d / "config.json"),)


def test_hf_quant_config_only(tmp_path):
    d = _copy(tmp_path, "llama-tiny-fp8-kv")
    _edit(d / "config.json", lambda c: c.pop("quantization_config"))
    qc = load_quant_config(str(d))
    assert qc.kv_cache_quant_algo == "FP8" and qc.sources == (str(d / "hf_quant_config.json"),)


def test_disagreement_names_both_files_and_field(tmp_path):
    d = _copy(tmp_path, "llama-tiny-fp8")
    _edit(d / "hf_quant_config.json", lambda c: c["quantization"].update(kv_cache_quant_algo="FP8"))
    with pytest.raises(ConfigError, match=r"hf_quant_config.json and .*config.json disagree: kv_cache_quant_algo"):
        load_quant_config(str(d))


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION", "SOMETHING_NEW"])
def test_unsupported_algorithms_list_what_is_supported(tmp_path, algo):
    d = _copy(tmp_path, "qwen2-tiny-fp8")
    _edit(d / "hf_quant_config.json", lambda c: c["quantization"].update(quant_algo=algo))
    _edit(d / "config.json", lambda c: c["quantization_config"].update(quant_algo=algo))
    with pytest.raises(UnsupportedQuantizationError) as e:
        load_quant_config(str(d))
    assert algo in str(e.value) and all(s in str(e.value) for s in SUPPORTED_QUANT_ALGOS)
    assert "hf_quant_config.json" in str(e.value)


def test_unquantized_checkpoint_has_no_algo():
    qc = load_quant_config(str(fixture_dir("qwen2-bytes-bf16")))
    assert qc.quant_algo is None and not qc.is_quantized
