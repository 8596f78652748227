"""Weight cache in CUDA IPC mode: what only a GPU can show (the rest of the protocol runs in
test_weight_cache.py, which exercises CUDA IPC mode too when run on a GPU).

- an attached client spends (almost) no device memory on weights: its allocator grows by far
  less than the cache size, while an ordinary load grows by about the cache size;
- every array is a view into the daemon's one allocation, and a second attach in the same
  process maps the same allocation at the same address;
- the compiled forward still calls our CUTLASS GEMM (the custom call is in the compiled HLO)
  with static scales folded in, and its logits equal the ordinary load's bit for bit;
- ``stop`` never frees the allocation under an attached client (``cuMemFree`` under an importer's
  mapping is undocumented): the daemon keeps it, and serves ``status``, until the client's last
  view is gone, then frees it and exits.
"""

from __future__ import annotations

import gc
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fixture_paths import fixture_dir
from modelopt_jax import load
from modelopt_jax.synthetic import write_checkpoint
from modelopt_jax.weight_cache import cuda_store
from modelopt_jax.weight_cache.client import request
from test_weight_cache import DaemonProcess, _assert_same_arrays, _leaves, _store_offsets

pytestmark = pytest.mark.gpu


def _in_use() -> int:
    return jax.local_devices()[0].memory_stats()["bytes_in_use"]


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    # large enough that "no weight memory" is not lost in allocator noise: ~110 MB of FP8 layers
    # and bf16 embeddings; gate_up N = 2 * 1004 = 2008 needs padding to a multiple of 16 (2016)
    path = tmp_path_factory.mktemp("wc-gpu") / "ckpt"
    write_checkpoint(path, family="llama", hidden_size=2048, intermediate_size=1004, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=1000, quant_algo="FP8")
    return path


def test_attached_client_uses_no_device_memory_for_weights(big_ckpt, tmp_path):
    daemon = DaemonProcess(big_ckpt, tmp_path / "sock", dtype="bfloat16")
    try:
        before = _in_use()
        attached = load(big_ckpt, dtype="bfloat16", weight_cache="require", weight_cache_dir=daemon.dir)
        jax.block_until_ready(_leaves(attached))
        attach_growth = _in_use() - before
        again = load(big_ckpt, dtype="bfloat16", weight_cache="require", weight_cache_dir=daemon.dir)
    finally:
        daemon.stop()
    weight_bytes = sum(leaf.nbytes for leaf in _leaves(attached))
    assert weight_bytes > 100e6
    before = _in_use()
    ordinary = load(big_ckpt, dtype="bfloat16")
    jax.block_until_ready(_leaves(ordinary))
    load_growth = _in_use() - before
    print(f"weights {weight_bytes / 1e6:.1f} MB: attach grew the allocator by {attach_growth / 1e6:.2f} MB, "
          f"an ordinary load by {load_growth / 1e6:.1f} MB")
    assert load_growth >= 0.9 * weight_bytes
    assert attach_growth <= 0.01 * weight_bytes
    (mapping,), (mapping_again,) = attached.info.stores, again.info.stores
    assert isinstance(mapping, cuda_store.Mapping)  # CUDA IPC mode, not shared memory
    assert mapping_again.span()[0] == mapping.span()[0]  # one mapping, same address
    assert _store_offsets(attached) == _store_offsets(again)
    _assert_same_arrays(attached, ordinary)
    gate_up = attached.layers[0].mlp.gate_up
    assert (gate_up.weight.shape[0], gate_up.logical_out) == (2016, 2008)  # padded, logical width restored
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 24)), jnp.int32)
    assert np.array_equal(np.asarray(attached(ids)), np.asarray(ordinary(ids)))


def test_attached_forward_calls_the_cutlass_gemm(tmp_path):
    path = fixture_dir("qwen2-bytes-fp8")
    daemon = DaemonProcess(path, tmp_path / "sock", dtype="bfloat16")
    try:
        model = load(path, dtype="bfloat16", backend="cutlass", weight_cache="auto", weight_cache_dir=daemon.dir)
    finally:
        daemon.stop()
    # the daemon processed with backend "auto": a cutlass client must not attach to it
    assert model.info.weights == "disk"
    daemon = DaemonProcess(path, tmp_path / "sock2", dtype="bfloat16")
    try:
        model = load(path, dtype="bfloat16", weight_cache="require", weight_cache_dir=daemon.dir)
    finally:
        daemon.stop()
    graph, state = nnx.split(model)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graph, state)(ids)

    ids = jnp.asarray([[1, 72, 101, 108, 108, 111]], jnp.int32)
    hlo = forward.lower(state, ids).compile().as_text()
    assert len(re.findall(r'custom_call_target="modelopt_fp8_gemm"', hlo)) >= 2
    ordinary = load(path, dtype="bfloat16")
    assert np.array_equal(np.asarray(forward(state, ids)), np.asarray(ordinary(ids)))


def test_stop_keeps_the_allocation_until_the_last_client_detaches(big_ckpt, tmp_path):
    daemon = DaemonProcess(big_ckpt, tmp_path / "sock", dtype="bfloat16")
    try:
        attached = load(big_ckpt, dtype="bfloat16", weight_cache="require", weight_cache_dir=daemon.dir)
        ids = jnp.asarray(np.random.default_rng(1).integers(0, 1000, (2, 16)), jnp.int32)
        want = np.asarray(attached(ids))
        reply = request("stop", socket_dir=daemon.dir)
        assert reply["draining"] and reply["clients"] == 1, reply
        time.sleep(2)
        assert daemon.proc.poll() is None  # holds the allocation for us
        status = request("status", socket_dir=daemon.dir)
        assert status["stopping"] and status["client_pids"] == [os.getpid()]
        assert load(big_ckpt, dtype="bfloat16", weight_cache="auto", weight_cache_dir=daemon.dir).info.weights \
            == "disk"  # no new client while it stops
        assert np.array_equal(np.asarray(attached(ids)), want)  # still reads the daemon's memory, unchanged
        del attached  # the last view dies: the C deleter closes the lease
        deadline = time.monotonic() + 60
        while daemon.proc.poll() is None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.1)
        assert daemon.proc.returncode == 0, daemon.output()
        assert os.listdir(daemon.dir) == []  # socket and lock removed once it freed the allocation
    finally:
        daemon.stop()
