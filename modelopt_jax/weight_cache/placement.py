"""Where a daemon keeps its cache, decided the same way on both ends of the socket.

On a machine whose JAX backend is a CUDA GPU the cache is one daemon-owned device allocation
shared over CUDA IPC (:mod:`.cuda_store`); anywhere else (CPU, TPU hosts) it is POSIX shared
memory (:mod:`.host_store`). The label goes into the fingerprint, so a host-mode daemon never
serves a GPU client (or a cache on another GPU) by mistake: the mismatch is reported as
``device`` and ``auto`` falls back to disk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Placement:
    store: str            # "cuda" or "host"
    label: str            # fingerprint field "device": "GPU-<uuid>" or "host"
    ordinal: int | None   # CUDA device ordinal (cuda store only)
    jax_device: object    # the jax.Device the model's arrays live on

    def default_device(self):
        """Context in which the ordinary loader puts arrays on this placement's device."""
        return jax.default_device(self.jax_device) if self.jax_device is not None else contextlib.nullcontext()


def resolve(device: int) -> Placement:
    if jax.default_backend() == "gpu":
        from modelopt_jax.weight_cache import cuda_store

        dev = cuda_store.cuda_device(device)
        ordinal = int(dev.local_hardware_id)
        return Placement("cuda", cuda_store.device_uuid(ordinal), ordinal, dev)
    local = jax.local_devices()
    return Placement("host", "host", None, local[device] if 0 <= device < len(local) else None)
