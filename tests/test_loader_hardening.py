"""The loader against hostile or broken checkpoint directories (issue 13, items 11-14): special
files, shards outside the directory, duplicate header names, values that would give NaN logits."""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from modelopt_jax import load
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.checkpoint.safetensors_index import SafetensorsIndex
from modelopt_jax.errors import CheckpointError, ConfigError, NonFiniteTensorError
from modelopt_jax.synthetic import write_checkpoint

REPO = pathlib.Path(__file__).resolve().parent.parent
SMALL = dict(family="qwen2", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)


@pytest.fixture
def ckpt(tmp_path):
    write_checkpoint(tmp_path / "ckpt", **SMALL)
    return tmp_path / "ckpt"


def _run(code: str, timeout=120):
    """In a subprocess, so that a hang (the bug) fails the test instead of stalling the run."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)


# ---- 11 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_fifo_refused_not_waited_on(ckpt, victim):
    os.unlink(ckpt / victim)
    os.mkfifo(ckpt / victim)
    for code in (f"from modelopt_jax import load; load({str(ckpt)!r})",
                 f"from modelopt_jax.__main__ import main; raise SystemExit(main(['inspect', {str(ckpt)!r}]))"):
        out = _run(code)
        assert out.returncode != 0
        assert f"{ckpt / victim}: not a regular file (a FIFO)" in out.stderr + out.stdout


# ---- 12 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["../outside/x.safetensors", "ABSOLUTE", "sub/../../x.safetensors"])
def test_index_shards_must_stay_inside_the_checkpoint(ckpt, tmp_path, where):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(ckpt / "model.safetensors", outside / "x.safetensors")
    target = str(outside / "x.safetensors") if where == "ABSOLUTE" else where
    shard = outside / "x.safetensors"
    if where.startswith("sub/"):  # resolves to the checkpoint's parent
        shard = shard.rename(tmp_path / "x.safetensors")
    header = json.loads(_header_bytes(shard))
    weight_map = {n: target for n in header if n != "__metadata__"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"shard {target!r} .* is not a file name inside the checkpoint "
                                              f"directory {ckpt}"):
        load(ckpt)


def _header_bytes(path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


# ---- 13 ----------------------------------------------------------------------------------------------
def test_duplicate_tensor_name_in_header_refused(tmp_path):
    a = np.arange(4, dtype=np.float32)
    header = ('{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
              '"x": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}').encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + a.tobytes() + (a + 1).tobytes())
    with pytest.raises(CheckpointError, match=f"{path}: duplicate tensor name 'x' in the safetensors header"):
        SafetensorsIndex(str(tmp_path))


# ---- 14 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"rope_theta": 0}, "RoPE rope_theta must be a finite number > 0, found 0.0"),
    ({"rope_theta": -10000.0}, "RoPE rope_theta must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "RoPE factor must be a finite number > 0, found 0.0"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number >= 0, found nan"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number >= 0"),
])
def test_config_values_that_give_nan_logits_refused(ckpt, change, message):
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in change or "rope_theta" in change else None
    config.update(change)
    (ckpt / "config.json").write_text(json.dumps(config))  # json writes NaN as NaN, which json reads back
    with pytest.raises(ConfigError, match=f"{ckpt / 'config.json'}: {message}"):
        Checkpoint.open(ckpt)


def _poke(ckpt, name, offset_elems, raw: bytes):
    info = Checkpoint.open(ckpt).info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.begin + offset_elems * len(raw))
        f.write(raw)
    return info


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_fp8_nan_code_in_a_weight_refused(ckpt, code, scan_path):
    name = "model.layers.1.mlp.up_proj.weight"
    info = _poke(ckpt, name, 37, bytes([code]))
    with pytest.raises(NonFiniteTensorError, match=f"tensor '{name}' \\(F8_E4M3\\) holds 1 non-finite value"
                                                   f".*at index \\[{37 // info.shape[1]}, {37 % info.shape[1]}\\]"):
        load(ckpt)


def test_inf_in_a_bf16_norm_weight_refused(ckpt, scan_path):
    name = "model.layers.0.post_attention_layernorm.weight"
    assert Checkpoint.open(ckpt).info(name).dtype == "BF16"
    _poke(ckpt, name, 5, struct.pack("<H", 0x7F80))  # bf16 +inf
    with pytest.raises(NonFiniteTensorError, match=f"tensor '{name}' \\(BF16\\) holds 1 non-finite value\\(s\\) "
                                                   f"\\(NaN or inf\\), e.g. inf at index \\[5\\]"):
        load(ckpt)


def test_finite_checkpoint_still_loads(ckpt, scan_path):
    assert np.isfinite(np.asarray(load(ckpt, dtype="float32")(np.array([[1, 2, 3]], np.int32)))).all()


def test_shard_truncated_after_open_is_a_typed_error(ckpt, scan_path):
    """The header was checked when the checkpoint was opened; the file shrinks before its tensors are read."""
    opened = Checkpoint.open(ckpt)
    name = "model.layers.1.mlp.up_proj.weight"
    info = opened.info(name)
    os.truncate(info.file, info.begin + 10)
    with pytest.raises(CheckpointError, match=f"{info.file}: tensor '{name}': expected {info.nbytes} bytes, read 10; "
                                              f"file truncated"):
        opened.read(name)
