"""``python -m modelopt_jax inspect PATH``: what a checkpoint is, before anyone loads it.

Reads only JSON, safetensors headers and the (small) scale tensors. Works on checkpoints this
package cannot run (e.g. NVFP4) and on broken ones: problems become warnings in the report
rather than exceptions, so the report is the first tool to reach for when a load fails.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import numpy as np

from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.checkpoint.quant_config import check_supported
from modelopt_jax.errors import ModelOptJaxError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
SCALE_KINDS = ("weight_scale", "input_scale", "k_scale", "v_scale", "kv_scale", "weight_scale_2")


def _scheme(ckpt: Checkpoint, module: str) -> str:
    qc = ckpt.quant_config
    if not qc.is_quantized:
        return "unquantized"
    rule = qc.exclusion_rule(module)
    return f"excluded ({rule})" if rule else qc.quant_algo


def _layer_ranges(indices: list[int]) -> str:
    runs, start = [], None
    for i, idx in enumerate(indices):
        if start is None:
            start = idx
        if i + 1 == len(indices) or indices[i + 1] != idx + 1:
            runs.append(f"{start}" if start == idx else f"{start}-{idx}")
            start = None
    return ",".join(runs)


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """A JSON-serialisable description of the checkpoint at ``path`` (raises only if unreadable)."""
    ckpt = Checkpoint.open(path, check_quantization=False)
    qc, mc = ckpt.quant_config, ckpt.model_config
    warnings: list[str] = []
    try:
        check_supported(qc)
    except ModelOptJaxError as e:
        warnings.append(f"cannot be loaded by modelopt_jax: {e}")
    try:  # layer / expert counts in config.json backed by tensors (load checks this first too)
        ckpt.check_counts()
    except ModelOptJaxError as e:
        warnings.append(f"cannot be loaded by modelopt_jax: {e}")

    tensors = ckpt.tensors.tensors
    bytes_by_dtype: dict[str, int] = collections.Counter()
    for info in tensors.values():
        bytes_by_dtype[info.dtype] += info.nbytes

    modules = sorted(n[:-len(".weight")] for n, i in tensors.items() if n.endswith(".weight") and len(i.shape) == 2
                     and not n.startswith("model.embed_tokens"))
    per_layer: dict[str, list[int]] = collections.defaultdict(list)
    outside: dict[str, str] = {}
    for module in modules:
        desc = f"{_scheme(ckpt, module)} [{tensors[module + '.weight'].dtype}]"
        m = _LAYER.match(module)
        if m:
            per_layer[f"{m.group(2)}: {desc}"].append(int(m.group(1)))
        else:
            outside[module] = desc
        rule = qc.exclusion_rule(module) if qc.is_quantized else None
        if rule and "substring" in rule:
            warnings.append(f"{module} is excluded only by the legacy substring rule {rule}")
    schemes = {f"layers {_layer_ranges(sorted(set(v)))} {k.split(':')[0]}": k.split(": ", 1)[1]
               for k, v in sorted(per_layer.items(), key=lambda kv: (kv[0].split(":")[0]))}
    schemes.update(outside)

    scale_ranges: dict[str, dict[str, Any]] = {}
    scale_values: dict[str, np.ndarray] = {}  # every scale tensor, read once
    for kind in SCALE_KINDS:
        names = [n for n in tensors if n.endswith("." + kind)]
        values = []
        for n in names:
            try:
                scale_values[n] = ckpt.tensors.read(n).astype(np.float32).ravel()
                values.append(scale_values[n])
            except ModelOptJaxError as e:
                warnings.append(str(e))
        if values:
            v = np.concatenate(values)
            bad = int((~np.isfinite(v) | (v <= 0)).sum())
            scale_ranges[kind] = {"tensors": len(names), "min": float(np.nanmin(v)) if v.size else None,
                                  "max": float(np.nanmax(v)) if v.size else None, "non_positive_or_nan": bad}
            if bad and kind != "weight_scale_2":
                warnings.append(f"{bad} {kind} values are NaN, infinite, zero or negative")

    input_scales = collections.defaultdict(dict)
    for n in tensors:
        m = re.match(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.input_scale$", n)
        if m and n in scale_values and scale_values[n].size:
            group = "qkv" if m.group(2) in ("q_proj", "k_proj", "v_proj") else "gate_up"
            input_scales[(m.group(1), group)][m.group(2)] = float(scale_values[n][0])
    for (parent, group), scales in sorted(input_scales.items()):
        if len(set(scales.values())) > 1:
            warnings.append(f"{parent} {group}: shards have different input scales {scales}; they will run "
                            f"as separate GEMMs to keep FP8 codes exact")
    if qc.kv_cache_quant_algo and "k_scale" not in scale_ranges and "kv_scale" not in scale_ranges:
        warnings.append("kv_cache_quant_algo is FP8 but no k_scale/v_scale tensors were found")

    return {
        "path": ckpt.directory,
        "architecture": mc.architecture,
        "dims": {"hidden": mc.hidden_size, "intermediate": mc.intermediate_size, "layers": mc.num_hidden_layers,
                 "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
                 "vocab": mc.vocab_size, "tie_word_embeddings": mc.tie_word_embeddings,
                 "rope": f"{mc.rope.rope_type} theta={mc.rope.theta:g}"},
        "producer": f"{qc.producer or '?'} {qc.producer_version or ''}".strip() if qc.is_quantized else None,
        "quant_algo": qc.quant_algo,
        "kv_cache_quant_algo": qc.kv_cache_quant_algo,
        "config_sources": list(qc.sources),
        "exclude_modules": list(qc.exclude_modules),
        "schemes": schemes,
        "scale_ranges": scale_ranges,
        "files": [f.rsplit("/", 1)[-1] for f in ckpt.tensors.files],
        "tensors": len(tensors),
        "tensor_bytes": dict(bytes_by_dtype),
        "total_bytes": int(sum(bytes_by_dtype.values())),
        "warnings": warnings,
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_report(r: dict[str, Any]) -> str:
    lines = [f"checkpoint   {r['path']}",
             f"architecture {r['architecture']}  " + " ".join(f"{k}={v}" for k, v in r["dims"].items()),
             f"producer     {r['producer'] or '(none: unquantized checkpoint)'}",
             f"quant_algo   {r['quant_algo']}",
             f"kv_cache     {r['kv_cache_quant_algo'] or 'not quantized'}",
             f"config from  {', '.join(r['config_sources']) or '-'}",
             f"excluded     {', '.join(r['exclude_modules']) or '-'}",
             "schemes:"]
    width = max((len(k) for k in r["schemes"]), default=0)
    lines += [f"  {k.ljust(width)}  {v}" for k, v in r["schemes"].items()]
    if r["scale_ranges"]:
        lines.append("scales:")
        for kind, s in r["scale_ranges"].items():
            lines.append(f"  {kind:<14} {s['tensors']:>4} tensors  min {s['min']:.6g}  max {s['max']:.6g}")
    lines.append(f"tensors      {r['tensors']} in {', '.join(r['files'])}: {_mb(r['total_bytes'])} ("
                 + ", ".join(f"{k} {_mb(v)}" for k, v in sorted(r["tensor_bytes"].items())) + ")")
    lines.append("warnings:" if r["warnings"] else "warnings:    none")
    lines += [f"  - {w}" for w in r["warnings"]]
    return "\n".join(lines)
