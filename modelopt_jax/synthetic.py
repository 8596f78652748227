"""Synthetic ModelOpt FP8 checkpoints, laid out exactly as NVIDIA ModelOpt exports them.

Why this exists: tests and benchmarks need checkpoints of any size and every format variant
(per-tensor FP8, per-channel/per-token FP8, FP8 KV cache, plain bf16, tied embeddings, sharded),
but the real exports we have are tiny and cannot be regenerated here (that needs torch,
transformers and nvidia-modelopt). So this module writes checkpoints that a loader cannot tell
apart from ``modelopt.torch.export.export_hf_checkpoint`` output (ModelOpt 0.47.0,
transformers 5.14.1, safetensors 0.8.0):

* tensor names, dtypes and shapes as the exporter writes them: F8_E4M3 Linear weights, F32 scalar
  ``weight_scale`` / ``input_scale`` (quant_algo ``FP8``) or F32 ``[N]`` ``weight_scale`` and no
  ``input_scale`` (``FP8_PER_CHANNEL_PER_TOKEN``), F32 scalar ``self_attn.k_proj.k_scale`` and
  ``self_attn.v_proj.v_scale`` for an FP8 KV cache, BF16 embeddings / lm_head / norms / biases
  (Qwen2 q/k/v), no ``lm_head.weight`` when embeddings are tied;
* safetensors files byte-compatible with the ``safetensors`` library (tensors sorted by dtype
  then name, compact JSON header padded with spaces to 8 bytes, ``{"format": "pt"}`` metadata);
  above ``max_shard_bytes`` the Hugging Face sharding (``model-0000i-of-0000n.safetensors``,
  shards filled in state-dict order, ``model.safetensors.index.json``);
* ``config.json`` (transformers' sorted keys, then ModelOpt's ``quantization_config`` block with
  ``quant_method: modelopt``, ``ignore`` and ``kv_cache_scheme``, indent 4),
  ``hf_quant_config.json`` (``producer``, ``quantization``: ``quant_algo``,
  ``kv_cache_quant_algo``, ``exclude_modules``) and ``generation_config.json``.

Weights are random but realistic, so that the numbers mean what they mean in a real export: a
Linear's FP8 codes are a normal sample scaled so that the clip point ``c`` (the expected max of
``|z|`` over the tensor, or row) maps to 448, and ``weight_scale = amax / 448`` with
``amax = c * sigma``; ``input_scale`` is a typical activation amax / 448 (about 0.01-0.02);
norms are ``1 + 0.1 z``; embeddings and lm_head have std ``1/sqrt(hidden)``. The model then
produces finite, O(1) logits. Every tensor comes from its own ``numpy`` Generator seeded by
``(seed, sha256(name))``, so contents are deterministic and independent of write order, shard
layout or chunking.

Checkpoints of many GB are written with one tensor (in fact one chunk of at most
``CHUNK_ELEMENTS`` elements) in memory at a time: the safetensors header is computed from the
shapes first, then each tensor's bytes are generated and streamed to the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from statistics import NormalDist
from typing import Callable, Iterator, Sequence

import ml_dtypes
import numpy as np

__all__ = ["write_checkpoint", "write_safetensors", "plan_tensors", "TensorSpec", "SyntheticCheckpoint",
           "QUANT_ALGOS"]

QUANT_ALGOS = (None, "FP8", "FP8_PER_CHANNEL_PER_TOKEN")
FAMILIES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "mistral": ("MistralForCausalLM", "mistral"), "mixtral": ("MixtralForCausalLM", "mixtral")}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
MODELOPT_VERSION = "0.47.0"  # what the fixtures in shared/fixtures were exported with
TRANSFORMERS_VERSION = "5.14.1"
EXCLUDE_MODULES = ["lm_head", "model.embed_tokens"]  # ModelOpt's FP8 default config leaves these bf16
FP8_MAX = 448.0
CHUNK_ELEMENTS = 1 << 22  # elements generated at once (16 MiB of float32 scratch)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors dtype tag -> (numpy dtype, itemsize). Files list tensors by decreasing dtype (the
# library's Dtype enum order: F32 > BF16 > F8_E4M3), then by name.
_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
_DTYPE_RANK = {"F8_E4M3": 7, "BF16": 12, "F32": 15}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: header fields plus a generator of its contents, in row-major chunks."""

    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[np.ndarray]] = dataclasses.field(repr=False, compare=False)
    is_parameter: bool = True  # counted in the index's total_parameters (scales are buffers)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _DTYPES[self.dtype].itemsize


@dataclasses.dataclass(frozen=True)
class SyntheticCheckpoint:
    directory: str
    files: tuple[str, ...]  # safetensors file names, in the directory
    tensor_bytes: int  # sum of tensor data bytes (the index's total_size)
    num_tensors: int


# ---------------------------------------------------------------------------------------------
# Contents


def _rng(seed: int, key: str) -> np.random.Generator:
    digest = hashlib.sha256(key.encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


def _normal_chunks(numel: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """float32 N(0, 1) in chunks; numpy draws the same stream whatever the chunk sizes."""
    done = 0
    while done < numel:
        n = min(CHUNK_ELEMENTS, numel - done)
        yield rng.standard_normal(n, dtype=np.float32)
        done += n


def _clip_point(n: int) -> float:
    """Expected max |z| of n standard normals (about one exceedance): the calibrated amax in sigmas."""
    return NormalDist().inv_cdf(1.0 - 1.0 / max(n, 4))


def _fp8_codes(seed: int, name: str, shape: tuple[int, ...], clip: float) -> Callable[[], Iterator[np.ndarray]]:
    def gen():
        mult = np.float32(FP8_MAX / clip)
        for z in _normal_chunks(math.prod(shape), _rng(seed, name)):
            z *= mult
            np.clip(z, -FP8_MAX, FP8_MAX, out=z)
            yield z.astype(ml_dtypes.float8_e4m3fn)
    return gen


def _bf16_normal(seed: int, name: str, numel: int, std: float, mean: float = 0.0):
    def gen():
        for z in _normal_chunks(numel, _rng(seed, name)):
            z *= np.float32(std)
            z += np.float32(mean)
            yield z.astype(ml_dtypes.bfloat16)
    return gen


def _f32_const(values: np.ndarray) -> Callable[[], Iterator[np.ndarray]]:
    values = np.ascontiguousarray(values, dtype=np.float32)
    return lambda: iter([values])


# typical activation amax / 448 at each quantized input (normed hidden states are ~unit variance
# with amax ~5; attention outputs are averages, smaller; silu(gate) * up has heavier tails)
_INPUT_SCALE = {"qkv": 0.012, "o": 0.008, "gate_up": 0.012, "down": 0.02}
_KV_SCALE = 0.015  # amax of roped keys / values (~unit variance) / 448


def _jitter(rng: np.random.Generator) -> float:
    return float(np.exp(rng.uniform(np.log(0.8), np.log(1.25))))


def plan_tensors(*, family: str, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, vocab_size: int, head_dim: int | None = None,
                 quant_algo: str | None = "FP8", kv_cache_fp8: bool = False, tie_word_embeddings: bool = False,
                 seed: int = 0, num_experts: int = 0, num_experts_per_tok: int = 0,
                 moe_intermediate_size: int = 0) -> list[TensorSpec]:
    """The checkpoint's tensors in the exporter's state-dict order (the order shards are filled in).

    Qwen3 adds per-head ``q_norm``/``k_norm``; Qwen3-MoE (``num_experts`` > 0) has, in every layer,
    a bf16 router ``mlp.gate`` [E, hidden] and experts ``mlp.experts.e.{gate,up,down}_proj``
    (Mixtral: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.e.{w1,w3,w2}``), each
    FP8 with its own weight scale (gate and up share it, as the export of the fused gate_up
    parameter gives) and the layer's one input scale per projection (ModelOpt's shared quantizer).
    """
    hd = head_dim or hidden_size // num_attention_heads
    q_size, kv_size = num_attention_heads * hd, num_key_value_heads * hd
    specs: list[TensorSpec] = []

    def bf16(name, shape, std, mean=0.0):
        specs.append(TensorSpec(name, "BF16", tuple(shape), _bf16_normal(seed, name, math.prod(shape), std, mean)))

    def f32(name, value, parameter=False):
        value = np.asarray(value, np.float32)
        specs.append(TensorSpec(name, "F32", value.shape, _f32_const(value), is_parameter=parameter))

    def linear(prefix, n, k, bias, group, extra_scale=None):
        sigma = 1.0 / math.sqrt(k)
        if quant_algo is None:
            bf16(f"{prefix}.weight", (n, k), sigma)
        elif quant_algo == "FP8":
            clip = _clip_point(n * k)
            specs.append(TensorSpec(f"{prefix}.weight", "F8_E4M3", (n, k),
                                    _fp8_codes(seed, f"{prefix}.weight", (n, k), clip)))
        else:  # FP8_PER_CHANNEL_PER_TOKEN: the same code distribution in every row, scale per row
            clip = _clip_point(k)
            specs.append(TensorSpec(f"{prefix}.weight", "F8_E4M3", (n, k),
                                    _fp8_codes(seed, f"{prefix}.weight", (n, k), clip)))
        if bias:
            bf16(f"{prefix}.bias", (n,), 0.05)
        if quant_algo == "FP8":
            f32(f"{prefix}.weight_scale", clip * sigma * _jitter(_rng(seed, f"{prefix}.weight_scale")) / FP8_MAX)
            # q/k/v (and gate/up) read the same activation; ModelOpt's export unifies their input scales
            group_key = f"{prefix.rsplit('.', 2)[0]}.{group}.input_scale"
            f32(f"{prefix}.input_scale", _INPUT_SCALE[group] * _jitter(_rng(seed, group_key)))
        elif quant_algo == "FP8_PER_CHANNEL_PER_TOKEN":
            row_sigma = sigma * np.exp(0.5 * _rng(seed, f"{prefix}.weight_scale").standard_normal(n))
            f32(f"{prefix}.weight_scale", clip * row_sigma / FP8_MAX)
        if extra_scale:
            f32(f"{prefix}.{extra_scale}", _KV_SCALE * _jitter(_rng(seed, f"{prefix}.{extra_scale}")))

    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def experts(p):  # one shared input scale per projection, one weight scale per expert (gate = up)
        bf16(f"{p}.gate.weight", (num_experts, hidden_size), 1.0 / math.sqrt(hidden_size))
        for e in range(num_experts):
            x = f"{p}.experts.{e}"
            for name, n, k, group in ((names[0], moe_intermediate_size, hidden_size, "gate_up"),
                                      (names[1], moe_intermediate_size, hidden_size, "gate_up"),
                                      (names[2], hidden_size, moe_intermediate_size, "down")):
                sigma = 1.0 / math.sqrt(k)
                if quant_algo is None:
                    bf16(f"{x}.{name}.weight", (n, k), sigma)
                    continue
                clip = _clip_point(n * k)
                specs.append(TensorSpec(f"{x}.{name}.weight", "F8_E4M3", (n, k),
                                        _fp8_codes(seed, f"{x}.{name}.weight", (n, k), clip)))
                if quant_algo == "FP8":
                    scale_key = f"{x}.{'gate_up' if group == 'gate_up' else 'down'}.weight_scale"
                    f32(f"{x}.{name}.weight_scale", clip * sigma * _jitter(_rng(seed, scale_key)) / FP8_MAX)
                    f32(f"{x}.{name}.input_scale", _INPUT_SCALE[group] * _jitter(_rng(seed, f"{p}.{group}.input_scale")))
                else:
                    row_sigma = sigma * np.exp(0.5 * _rng(seed, f"{x}.{name}.weight_scale").standard_normal(n))
                    f32(f"{x}.{name}.weight_scale", clip * row_sigma / FP8_MAX)

    bf16("model.embed_tokens.weight", (vocab_size, hidden_size), 1.0 / math.sqrt(hidden_size))
    qkv_bias = family == "qwen2"
    for i in range(num_hidden_layers):
        p = f"model.layers.{i}"
        linear(f"{p}.self_attn.q_proj", q_size, hidden_size, qkv_bias, "qkv")
        linear(f"{p}.self_attn.k_proj", kv_size, hidden_size, qkv_bias, "qkv", "k_scale" if kv_cache_fp8 else None)
        linear(f"{p}.self_attn.v_proj", kv_size, hidden_size, qkv_bias, "qkv", "v_scale" if kv_cache_fp8 else None)
        linear(f"{p}.self_attn.o_proj", hidden_size, q_size, False, "o")
        if family in ("qwen3", "qwen3_moe"):
            bf16(f"{p}.self_attn.q_norm.weight", (hd,), 0.1, 1.0)
            bf16(f"{p}.self_attn.k_norm.weight", (hd,), 0.1, 1.0)
        if num_experts:
            experts(f"{p}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}")
        else:
            linear(f"{p}.mlp.gate_proj", intermediate_size, hidden_size, False, "gate_up")
            linear(f"{p}.mlp.up_proj", intermediate_size, hidden_size, False, "gate_up")
            linear(f"{p}.mlp.down_proj", hidden_size, intermediate_size, False, "down")
        bf16(f"{p}.input_layernorm.weight", (hidden_size,), 0.1, 1.0)
        bf16(f"{p}.post_attention_layernorm.weight", (hidden_size,), 0.1, 1.0)
    bf16("model.norm.weight", (hidden_size,), 0.1, 1.0)
    if not tie_word_embeddings:  # tied: save_pretrained drops the duplicate lm_head.weight
        bf16("lm_head.weight", (vocab_size, hidden_size), 1.0 / math.sqrt(hidden_size))
    return specs


# ---------------------------------------------------------------------------------------------
# safetensors


def _file_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    return sorted(specs, key=lambda s: (-_DTYPE_RANK[s.dtype], s.name))


def _data_layout(specs: Sequence[TensorSpec]) -> list[tuple[TensorSpec, int]]:
    """The tensors in file order, each with its offset in the data section (after the header)."""
    layout, offset = [], 0
    for s in _file_order(specs):
        layout.append((s, offset))
        offset += s.nbytes
    return layout


def safetensors_header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header the safetensors library writes for these tensors."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    for s, offset in _data_layout(specs):
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: str | os.PathLike, specs: Sequence[TensorSpec],
                      metadata: dict[str, str] | None = None) -> int:
    """Streams ``specs`` into a safetensors file; holds one chunk of one tensor at a time.

    Returns the number of tensor data bytes written. Raises if a generator yields the wrong amount.
    """
    header = safetensors_header(specs, metadata)
    with open(path, "wb") as f:
        f.write(header)
        f.flush()
        return sum(_write_tensor(f.fileno(), s, len(header) + offset) for s, offset in _data_layout(specs))


def _write_tensor(fd: int, spec: TensorSpec, offset: int) -> int:
    """Writes one tensor's generated bytes at ``offset`` of the open file ``fd``; returns their count."""
    want_dtype, written = _DTYPES[spec.dtype], 0
    for chunk in spec.chunks():
        if chunk.dtype != want_dtype:
            raise TypeError(f"{spec.name}: generator yielded {chunk.dtype}, expected {want_dtype}")
        data = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        while data:
            n = os.pwrite(fd, data, offset + written)
            data, written = data[n:], written + n
    if written != spec.nbytes:
        raise RuntimeError(f"{spec.name}: generated {written} bytes, header says {spec.nbytes}")
    return written


# Parallel writes. Each worker process plans the same tensors from the same arguments (plan_tensors
# is deterministic and cheap: its generators are lazy) and fills the byte ranges the header gives
# them, so the files are byte-identical to a serial write whatever the number of workers.
_worker_specs: dict[str, TensorSpec] = {}


def _init_worker(plan_kwargs: dict) -> None:
    global _worker_specs
    _worker_specs = {s.name: s for s in plan_tensors(**plan_kwargs)}


def _worker_write(path: str, name: str, offset: int) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        return _write_tensor(fd, _worker_specs[name], offset)
    finally:
        os.close(fd)


def _write_files_parallel(paths: Sequence[str], shards: Sequence[Sequence[TensorSpec]], metadata: dict[str, str],
                          plan_kwargs: dict, workers: int) -> int:
    """``write_safetensors`` for every (path, shard) with the tensors spread over ``workers`` processes."""
    import concurrent.futures
    import multiprocessing

    jobs = []
    for path, shard in zip(paths, shards):
        header = safetensors_header(shard, metadata)
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(s.nbytes for s in shard))
        jobs += [(s.nbytes, path, s.name, len(header) + offset) for s, offset in _data_layout(shard)]
    jobs.sort(key=lambda job: -job[0])  # largest first: the pool ends together
    # spawn, not fork: the caller may hold JAX's threads, which a fork would copy mid-flight
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker, initargs=(plan_kwargs,)) as pool:
        futures = [pool.submit(_worker_write, path, name, offset) for _, path, name, offset in jobs]
        return sum(f.result() for f in futures)


def _shards(specs: Sequence[TensorSpec], max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """huggingface_hub's split_state_dict_into_shards: fill in order, oversized tensors alone."""
    if max_shard_bytes is None:
        return [list(specs)]
    shards, current, size = [], [], 0
    for s in specs:
        if s.nbytes > max_shard_bytes:
            shards.append([s])
            continue
        if size + s.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    if current:
        shards.append(current)
    return [s for s in shards if s]


# ---------------------------------------------------------------------------------------------
# JSON files


def _rope_parameters(rope_scaling: dict | None) -> dict:
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    if rope_scaling:
        extra = dict(rope_scaling)
        if "type" in extra:  # old transformers spelling
            extra.setdefault("rope_type", extra.pop("type"))
        params.update(extra)
    return dict(sorted(params.items()))


def _hf_config(family, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
               num_key_value_heads, vocab_size, head_dim, tie_word_embeddings, rope_scaling,
               max_position_embeddings, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
               sliding_window=None) -> dict:
    arch, model_type = FAMILIES[family]
    cfg = {
        "architectures": [arch], "attention_dropout": 0.0, "dtype": "bfloat16", "hidden_act": "silu",
        "hidden_size": hidden_size, "initializer_range": 0.02, "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings, "model_type": model_type,
        "num_attention_heads": num_attention_heads, "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads, "pad_token_id": None, "rms_norm_eps": 1e-06,
        "rope_parameters": _rope_parameters(rope_scaling), "tie_word_embeddings": tie_word_embeddings,
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": vocab_size,
    }
    if family == "llama":
        cfg.update({"attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "mlp_bias": False,
                    "pretraining_tp": 1, "head_dim": head_dim or hidden_size // num_attention_heads})
    elif family == "qwen2":
        cfg.update({"bos_token_id": None, "eos_token_id": None, "layer_types": ["full_attention"] * num_hidden_layers,
                    "max_window_layers": 28, "sliding_window": None, "use_sliding_window": False})
        if head_dim and head_dim != hidden_size // num_attention_heads:
            cfg["head_dim"] = head_dim  # Qwen2Config has no head_dim field; written only when it differs
    elif family in ("mistral", "mixtral"):  # no biases; the experts' width is Mixtral's intermediate_size
        cfg.update({"bos_token_id": 1, "eos_token_id": 2, "head_dim": head_dim or hidden_size // num_attention_heads,
                    "sliding_window": sliding_window})
        if family == "mixtral":
            cfg.update({"intermediate_size": moe_intermediate_size, "num_experts_per_tok": num_experts_per_tok,
                        "num_local_experts": num_experts, "output_router_logits": False,
                        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0})
    else:  # Qwen3 / Qwen3-MoE: head_dim always written, no q/k/v bias
        cfg.update({"attention_bias": False, "bos_token_id": None, "eos_token_id": None,
                    "head_dim": head_dim or hidden_size // num_attention_heads, "max_window_layers": 28,
                    "sliding_window": None, "use_sliding_window": False})
        if family == "qwen3":
            cfg["layer_types"] = ["full_attention"] * num_hidden_layers
        else:  # hub configs spell the expert count num_experts
            cfg.update({"decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": moe_intermediate_size,
                        "norm_topk_prob": True, "num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
                        "output_router_logits": False, "router_aux_loss_coef": 0.001})
    return dict(sorted(cfg.items()))  # PretrainedConfig.to_json_string(sort_keys=True)


def _quantization_config(quant_algo: str, kv_cache_fp8: bool, routers: Sequence[str] = ()) -> dict:
    qc: dict = {}
    if quant_algo == "FP8":
        static = {"dynamic": False, "num_bits": 8, "type": "float"}
        qc["config_groups"] = {"group_0": {"input_activations": dict(static), "weights": dict(static),
                                           "targets": ["Linear"]}}
    qc["ignore"] = list(EXCLUDE_MODULES) + list(routers)  # ModelOpt never quantizes an MoE router
    qc["quant_algo"] = quant_algo
    if kv_cache_fp8:
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    qc["producer"] = {"name": "modelopt", "version": MODELOPT_VERSION}
    qc["quant_method"] = "modelopt"
    return qc


def _hf_quant_config(quant_algo: str, kv_cache_fp8: bool, routers: Sequence[str] = ()) -> dict:
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None,
                             "exclude_modules": list(EXCLUDE_MODULES) + list(routers)}}


def _write_json(path: str, data: dict, *, modelopt: bool) -> None:
    # ModelOpt rewrites its files with json.dump(indent=4) (no trailing newline); transformers
    # writes sorted keys, indent 2, and a trailing newline.
    text = json.dumps(data, indent=4) if modelopt else json.dumps(data, indent=2, sort_keys=True) + "\n"
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------------


def write_checkpoint(directory: str | os.PathLike, *, family: str = "llama", hidden_size: int,
                     intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                     num_key_value_heads: int, vocab_size: int, head_dim: int | None = None,
                     quant_algo: str | None = "FP8", kv_cache_fp8: bool = False, tie_word_embeddings: bool = False,
                     max_shard_bytes: int | None = None, seed: int = 0, rope_scaling: dict | None = None,
                     max_position_embeddings: int = 4096, workers: int = 1, num_experts: int = 0,
                     num_experts_per_tok: int = 0, moe_intermediate_size: int = 0,
                     sliding_window: int | None = None) -> SyntheticCheckpoint:
    """Writes a synthetic Llama/Qwen2 checkpoint in ModelOpt's export layout (see the module doc).

    ``quant_algo``: ``"FP8"`` (per-tensor static), ``"FP8_PER_CHANNEL_PER_TOKEN"`` or ``None``
    (a plain bf16 ``save_pretrained`` checkpoint, no quantization config). ``kv_cache_fp8`` adds
    the FP8 KV-cache scales and config. ``max_shard_bytes``: shard like Hugging Face when the
    tensor bytes exceed it. ``rope_scaling``: extra ``rope_parameters`` entries (e.g.
    ``{"rope_type": "llama3", "factor": 8.0, ...}``). Existing ``model*.safetensors`` files and
    index in ``directory`` are replaced. ``workers``: processes that generate tensors at once (an
    8B checkpoint takes minutes on one core); the bytes do not depend on it.
    """
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} not supported; choose one of {', '.join(FAMILIES)}")
    moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
               moe_intermediate_size=moe_intermediate_size)
    if (family in MOE_FAMILIES) != (num_experts > 0) or (num_experts and not 0 < num_experts_per_tok <= num_experts) \
            or (num_experts and moe_intermediate_size <= 0):
        raise ValueError(f"family {family!r} with {moe}: {' and '.join(MOE_FAMILIES)} need num_experts > 0, "
                         f"0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0; the other families "
                         f"take none")
    if sliding_window is not None and family not in ("mistral", "mixtral"):
        raise ValueError(f"sliding_window: only mistral and mixtral checkpoints have one here, not {family!r}")
    quant_algo = quant_algo.upper() if isinstance(quant_algo, str) else quant_algo
    if quant_algo not in QUANT_ALGOS:
        raise ValueError(f"quant_algo {quant_algo!r} not supported; choose one of {QUANT_ALGOS}")
    if kv_cache_fp8 and quant_algo is None:
        raise ValueError("kv_cache_fp8 needs a quantized checkpoint (quant_algo FP8 or FP8_PER_CHANNEL_PER_TOKEN)")
    dims = dict(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                vocab_size=vocab_size)
    for key, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {num_key_value_heads}")
    if head_dim is None and hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}; "
                         f"pass head_dim")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # like save_pretrained: no stale weights from an earlier write
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(name):
            os.remove(os.path.join(directory, name))

    plan_kwargs = dict(family=family, head_dim=head_dim, quant_algo=quant_algo, kv_cache_fp8=kv_cache_fp8,
                       tie_word_embeddings=tie_word_embeddings, seed=seed, **dims, **moe)
    specs = plan_tensors(**plan_kwargs)
    metadata = {"format": "pt"}
    shards = _shards(specs, max_shard_bytes)
    if len(shards) == 1:
        files = (SINGLE_FILE,)
    else:
        files = tuple(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards)))
    paths = [os.path.join(directory, file) for file in files]
    if workers > 1:
        total = _write_files_parallel(paths, shards, metadata, plan_kwargs, workers)
    else:
        total = sum(write_safetensors(path, shard, metadata) for path, shard in zip(paths, shards))
    if len(shards) > 1:
        weight_map = {s.name: file for file, shard in zip(files, shards) for s in shard}
        index = {"metadata": {"total_parameters": sum(s.numel for s in specs if s.is_parameter),
                              "total_size": total},
                 "weight_map": weight_map}
        _write_json(os.path.join(directory, INDEX_FILE), index, modelopt=False)

    config = _hf_config(family, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                        num_key_value_heads, vocab_size, head_dim, tie_word_embeddings, rope_scaling,
                        max_position_embeddings, **moe, sliding_window=sliding_window)
    generation = {"_from_model_config": True, "output_attentions": False, "output_hidden_states": False,
                  "transformers_version": TRANSFORMERS_VERSION, "use_cache": True}
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            generation[key] = config[key]
    _write_json(os.path.join(directory, "generation_config.json"), generation, modelopt=False)
    hq_path = os.path.join(directory, "hf_quant_config.json")
    if quant_algo is None:
        _write_json(os.path.join(directory, "config.json"), config, modelopt=False)
        if os.path.exists(hq_path):
            os.remove(hq_path)
    else:
        block = "block_sparse_moe" if family == "mixtral" else "mlp"
        routers = [f"model.layers.{i}.{block}.gate" for i in range(num_hidden_layers)] if num_experts else []
        config["quantization_config"] = _quantization_config(quant_algo, kv_cache_fp8, routers)
        _write_json(os.path.join(directory, "config.json"), config, modelopt=True)
        _write_json(hq_path, _hf_quant_config(quant_algo, kv_cache_fp8, routers), modelopt=True)
    return SyntheticCheckpoint(directory, files, total, len(specs))
