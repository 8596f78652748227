"""Each request's PRNG key, computed on the host in numpy.

Why not ``jax.random``: a request's key is ``fold_in(PRNGKey(seed low 32 bits), seed high 32 bits)``,
and its s-th sample's ``fold_in(that, s)``. Through JAX that is two or three dispatched ops per
request; for 1000 prompts of n = 8 it cost about a second of host time before the first step (the
same on every machine, a GPU's included). These are the same Threefry-2x32 functions JAX's default
PRNG runs, vectorised over all requests at once, and a test holds them bit for bit equal to
``jax.random``.
"""

from __future__ import annotations

import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: np.ndarray, bits: int) -> np.ndarray:
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def threefry_2x32(k1: np.ndarray, k2: np.ndarray, x1: np.ndarray, x2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 (20 rounds) of the counter pairs ``(x1, x2)`` under the keys ``(k1, k2)``,
    elementwise over uint32 arrays of one shape, as ``jax.random``'s threefry2x32 primitive."""
    ks = [k1, k2, k1 ^ k2 ^ _PARITY]
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ _rotate_left(x[1], r)
        x = [x[0] + ks[(i + 1) % 3], x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)]
    return x[0], x[1]


def fold_in(keys: np.ndarray, data: np.ndarray) -> np.ndarray:
    """``jax.random.fold_in`` of raw keys [N, 2] uint32 with ``data`` [N] (taken as uint32)."""
    keys = np.asarray(keys, np.uint32)
    data = np.asarray(data).astype(np.uint32)
    with np.errstate(over="ignore"):
        a, b = threefry_2x32(keys[:, 0], keys[:, 1], np.zeros_like(data), data)
    return np.stack([a, b], axis=1)


def seed_keys(seeds) -> np.ndarray:
    """Raw keys [N, 2] uint32 of non-negative integer ``seeds`` (up to 64 bits): ``PRNGKey`` of the low
    32 bits folded with the high 32 bits, so seeds that differ only above bit 31 stay distinct."""
    seeds = [int(s) for s in seeds]
    low = np.array([s & 0xFFFFFFFF for s in seeds], np.uint32)
    high = np.array([(s >> 32) & 0xFFFFFFFF for s in seeds], np.uint32)
    return fold_in(np.stack([np.zeros_like(low), low], axis=1), high)


def sample_keys(request_keys: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Each sample's key: its request's key for sample 0, that key folded with s for sample s > 0."""
    samples = np.asarray(samples)
    return np.where((samples == 0)[:, None], request_keys, fold_in(request_keys, samples))
