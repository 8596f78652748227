"""What a cache was processed from and how: a flat dict of short hashes/values, compared field by field.

Two processes may share processed buffers only if they would have produced identical ones: same
tensor headers (names, dtypes, shapes, offsets -- not the bytes, which would mean reading the
whole checkpoint just to ask), same config and quantization config, same processing options
(compute dtype, GEMM backend, layout version), same library version and device, same shard of
the same tensor-parallel split. A mismatch is
reported as the list of differing field names so a user sees *why* the daemon refused.
"""

from __future__ import annotations

import hashlib
import json
import os

from modelopt_jax.checkpoint import Checkpoint

# Bump whenever the processed form of any array changes (fusing, padding, scale layout, ...).
LAYOUT_VERSION = 4  # 2: static scale vectors as base64 bytes; 3: tensor-parallel ranks; 4: plan + state paths


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _file_hash(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return _h(f.read())
    except OSError:
        return "absent"


def compute(ckpt: Checkpoint, *, dtype, backend: str, device: str = "host", rank: int = 0,
            tensor_parallel: int = 1) -> dict[str, str]:
    """The fields; ``rank``/``tensor_parallel``: which shard of a TP split the cache holds."""
    from modelopt_jax._version import __version__

    fields: dict[str, str] = {}
    by_file: dict[str, list] = {}
    for name in ckpt.tensors:
        info = ckpt.info(name)
        by_file.setdefault(os.path.basename(info.file), []).append(
            [name, info.dtype, list(info.shape), info.begin, info.end])
    for file, entries in sorted(by_file.items()):
        fields[f"safetensors:{file}"] = _h(json.dumps(sorted(entries)).encode())
    fields["config.json"] = _file_hash(os.path.join(ckpt.directory, "config.json"))
    qc = ckpt.quant_config
    fields["quant_config"] = _h(json.dumps([qc.quant_algo, qc.kv_cache_quant_algo, list(qc.exclude_modules),
                                            _file_hash(os.path.join(ckpt.directory, "hf_quant_config.json"))]).encode())
    fields["dtype"] = str(dtype)
    from modelopt_jax.ops.gemm import weight_layout

    fields["backend"] = str(backend)
    fields["weight_layout"] = weight_layout(backend)
    fields["layout_version"] = str(LAYOUT_VERSION)
    fields["library_version"] = __version__
    fields["device"] = str(device)
    fields["tensor_parallel"] = f"rank {int(rank)} of {int(tensor_parallel)}"
    return fields


def diff(a: dict, b: dict) -> list[str]:
    """Names of the fields that differ (or exist on one side only), sorted."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return ["<fingerprint>"]
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
