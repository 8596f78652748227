"""What a cache was processed from and how: a flat dict of short hashes/values, compared field by field.

Two processes may share processed buffers only if they would have produced identical ones: same
tensor headers (names, dtypes, shapes, offsets), same bytes, same config and quantization config,
same processing options (compute dtype, GEMM backend, layout version), same library version and
device, same shard of the same tensor-parallel split. A mismatch is reported as the list of
differing field names so a user sees *why* the daemon refused.

What "same bytes" means, and what it costs a client (cheap by design -- the point of the cache
is not to read the checkpoint):

- ``file:<shard>``: the shard's identity, ``st_dev:st_ino:st_size:st_mtime_ns:st_ctime_ns``. Another
  copy, another checkpoint, or any write to the file (which moves ``ctime``, which no user can set
  back) changes it. One ``stat`` per shard.
- ``sample:<shard>``: BLAKE2b of the header and of 16 evenly spaced 4 KiB windows of the data
  region, so two checkpoints of equal shapes but other values differ even if they were copied with
  their times preserved. About 64 KiB read per shard.

The daemon computes the fingerprint before and after it reads the checkpoint and refuses to
serve if it moved in between, so the fields describe the bytes it actually processed. This
detects accidents (a rewritten, replaced or different checkpoint); it does not defend against a
process of the same uid, which can rewrite the daemon's memory anyway.
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


SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 4096


def file_identity(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "absent"
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_sample(path: str, data_start: int) -> str:
    """BLAKE2b of the bytes before ``data_start`` and of evenly spaced windows after it."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(os.pread(f.fileno(), data_start, 0))
            span = max(size - data_start - SAMPLE_BYTES, 0)
            for i in range(SAMPLE_WINDOWS):
                offset = data_start + span * i // (SAMPLE_WINDOWS - 1)
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, offset))
    except OSError:
        return "absent"
    return h.hexdigest()


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
    data_start = {}
    for name in ckpt.tensors:
        info = ckpt.info(name)
        data_start[info.file] = min(data_start.get(info.file, info.begin), info.begin)
    for file, entries in sorted(by_file.items()):
        fields[f"safetensors:{file}"] = _h(json.dumps(sorted(entries)).encode())
    for path in sorted(data_start):
        fields[f"file:{os.path.basename(path)}"] = file_identity(path)
        fields[f"sample:{os.path.basename(path)}"] = file_sample(path, data_start[path])
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
