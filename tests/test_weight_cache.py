"""Weight-cache daemon: a daemon subprocess serves processed buffers; clients attach zero-copy.

Every test runs the real daemon (``python -m modelopt_jax weight-cache serve``) with a private
socket directory, and compares against an ordinary load: same greedy tokens, bit-identical arrays.
On a CPU machine (CI) this is host mode (POSIX shared memory); run on a CUDA GPU, the same tests
exercise CUDA IPC mode (one daemon-owned device allocation, DLPack views in the client).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from fixture_paths import fixture_dir
from weight_cache_helpers import REPO, DaemonProcess
from modelopt_jax import LLM, SamplingParams, load
from modelopt_jax.errors import (UnsupportedForWeightCacheError, WeightCacheError, WeightCacheNotServingError,
                                 WeightCacheProtocolError)
from modelopt_jax.synthetic import write_checkpoint
from modelopt_jax.weight_cache import fingerprint, protocol
from modelopt_jax.weight_cache.client import request, stop

PROMPTS = ["It is a truth universally acknowledged", "The weight cache"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _outputs(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _leaves(model):
    return jax.tree_util.tree_leaves(nnx.state(model))


def _store_offsets(model) -> list[int]:
    """Every array's offset inside the daemon's store; asserts each one lies inside it (zero-copy)."""
    base, size = model.info.stores[0].span()
    offsets = []
    for leaf in _leaves(model):
        ptr = leaf.unsafe_buffer_pointer()
        assert base <= ptr and ptr + leaf.nbytes <= base + size
        offsets.append(ptr - base)
    return offsets


def _device_label() -> str:
    return "host" if jax.default_backend() != "gpu" else "GPU-"


def _assert_same_arrays(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


_REFERENCE: dict[str, list] = {}


def _reference(name):
    if name not in _REFERENCE:
        _REFERENCE[name] = _outputs(LLM(str(fixture_dir(name)), dtype="float32"))
    return _REFERENCE[name]


@pytest.fixture(scope="module")
def fp8_daemon(tmp_path_factory):
    d = DaemonProcess(fixture_dir("qwen2-bytes-fp8"), tmp_path_factory.mktemp("wc-fp8"))
    yield d
    d.stop()


@pytest.mark.parametrize("name", ["qwen2-bytes-fp8", "qwen2-bytes-fp8-pc-pt"])
def test_greedy_identical_ordinary_fallback_attach(name, tmp_path, fp8_daemon):
    path = fixture_dir(name)
    daemon = fp8_daemon if name == "qwen2-bytes-fp8" else DaemonProcess(path, tmp_path / "sock")
    try:
        reference = _reference(name)
        fallback = LLM(str(path), quantization="modelopt", dtype="float32", weight_cache="auto",
                       weight_cache_dir=tmp_path / "nobody-here")
        assert fallback.model.info.weights == "disk"
        assert _outputs(fallback) == reference
        ordinary = fallback.model
        for _ in range(2):  # two attachments, never a fallback
            llm = LLM(str(path), quantization="modelopt", dtype="float32", weight_cache="require",
                      weight_cache_dir=daemon.dir)
            assert llm.model.info.weights == "daemon"
            assert _outputs(llm) == reference
            _assert_same_arrays(llm.model, ordinary)
            _store_offsets(llm.model)  # zero-copy: the device buffers are the daemon's store
    finally:
        if daemon is not fp8_daemon:
            daemon.stop()


def test_socket_and_lock_permissions_single_instance(fp8_daemon):
    assert stat.S_IMODE(os.stat(fp8_daemon.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(fp8_daemon.sock).st_mode) == 0o600
    second = DaemonProcess(fixture_dir("qwen2-bytes-fp8"), fp8_daemon.dir, wait=False)
    assert second.proc.wait(60) != 0
    assert "already serves device 0" in second.output()
    assert request("status", socket_dir=fp8_daemon.dir)["ok"]  # the first one is untouched


def test_require_without_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(WeightCacheError, match="no weight-cache daemon serves device 0"):
        load(fixture_dir("qwen2-bytes-fp8"), dtype="float32", weight_cache="require", weight_cache_dir=tmp_path,
             weight_cache_timeout=0.5)
    with pytest.raises(ValueError, match="weight_cache='sometimes' not supported"):
        load(fixture_dir("qwen2-bytes-fp8"), weight_cache="sometimes", weight_cache_dir=tmp_path)


def test_fingerprint_mismatch_refused_with_fields(fp8_daemon):
    path = fixture_dir("qwen2-bytes-fp8")
    with pytest.raises(WeightCacheError, match="fingerprint mismatch in dtype") as info:
        load(path, dtype="bfloat16", weight_cache="require", weight_cache_dir=fp8_daemon.dir)
    assert info.value.mismatch == ["dtype"]
    model = load(path, dtype="bfloat16", weight_cache="auto", weight_cache_dir=fp8_daemon.dir)
    assert model.info.weights == "disk"
    # another checkpoint (different headers and config) against the same daemon
    with pytest.raises(WeightCacheError) as info:
        load(fixture_dir("qwen2-bytes-fp8-pc-pt"), dtype="float32", weight_cache="require",
             weight_cache_dir=fp8_daemon.dir)
    assert "quant_config" in info.value.mismatch and "config.json" in info.value.mismatch
    assert fingerprint.diff({"a": "1", "b": "2"}, {"a": "1", "c": "2"}) == ["b", "c"]


@pytest.mark.parametrize("name", ["qwen2-tiny-fp8-pb-wo", "llama-tiny-fp8-kv"])
def test_block_and_kv_scale_checkpoints_through_the_cache(name, tmp_path):
    """FP8_PB_WO (128x128 block scales in the plan) and an FP8-KV export (k/v scales in the plan):
    attached twice, bit-identical state, identical logits and greedy tokens to an ordinary load."""
    from modelopt_jax.layers import BlockFp8Linear

    path = fixture_dir(name)
    ordinary = load(path, dtype="float32")
    daemon = DaemonProcess(path, tmp_path / "sock")
    try:
        attached = [load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir)
                    for _ in range(2)]
        llm = LLM(str(path), quantization=None, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir,
                  compilation_cache_dir=None)
        assert llm.model.info.weights == "daemon"
        prompts = [[1, 5, 9, 33, 70], [2, 8]]
        ordinary_llm = LLM(str(path), quantization=None, dtype="float32", compilation_cache_dir=None)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
            [o.token_ids for o in ordinary_llm.generate(prompts, GREEDY)]
    finally:
        daemon.stop()
    ids = np.array([[1, 5, 9, 33, 70, 2]], np.int32)
    want = np.asarray(ordinary(ids))
    for model in attached:
        assert model.info.weights == "daemon"
        _assert_same_arrays(model, ordinary)
        assert model.kv_cache == ordinary.kv_cache
        assert np.array_equal(np.asarray(model(ids)), want)
    blocks = [m for _, m in nnx.iter_modules(attached[0]) if isinstance(m, BlockFp8Linear)]
    assert (len(blocks) > 0) == ("pb-wo" in name)
    for got, (_, want_m) in zip(blocks, [(p, m) for p, m in nnx.iter_modules(ordinary) if isinstance(m, BlockFp8Linear)]):
        assert got.block_scales == want_m.block_scales
    assert _store_offsets(attached[0]) == _store_offsets(attached[1])


@pytest.mark.parametrize("name", ["qwen3-tiny-fp8", "mistral-tiny-fp8-kv", "qwen3moe-tiny-fp8", "mixtral-tiny-fp8"])
def test_new_families_through_the_cache(name, tmp_path):
    """Qwen3 (q/k norms), Mistral (window, FP8 KV), Qwen3-MoE and Mixtral (routers, experts): the plan
    carries them all; an attached model's state is bit-identical to an ordinary load, and so are its logits."""
    path = fixture_dir(name)
    ordinary = load(path, dtype="float32")
    daemon = DaemonProcess(path, tmp_path / "sock")
    try:
        attached = load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir)
    finally:
        daemon.stop()
    assert attached.info.weights == "daemon"
    _assert_same_arrays(attached, ordinary)
    ids = np.load(path / "ref_logits.npz")["input_ids"].astype(np.int32)
    assert np.array_equal(np.asarray(attached(ids)), np.asarray(ordinary(ids)))


def test_backend_with_another_weight_layout_rejected_up_front(tmp_path):
    """A GEMM backend declares the processed-weight layout it consumes; the cache shares only its own."""
    from modelopt_jax.ops import gemm

    gemm.register_backend("pretransposed", gemm._BACKENDS["xla"], weight_layout="fp8-KN")
    try:
        with pytest.raises(UnsupportedForWeightCacheError, match="'pretransposed' consumes weights in layout 'fp8-KN'"):
            load(fixture_dir("qwen2-bytes-fp8"), dtype="float32", backend="pretransposed", weight_cache="auto",
                 weight_cache_dir=tmp_path)
    finally:
        gemm._BACKENDS.pop("pretransposed")
        gemm._WEIGHT_LAYOUTS.pop("pretransposed")
    assert gemm.weight_layout("auto") == gemm.WEIGHT_LAYOUT


def _raw(sock_path, payload: bytes, *, read=True):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path)
    s.sendall(payload)
    if not read:
        s.close()
        return None
    s.shutdown(socket.SHUT_WR)
    try:
        return protocol.recv(s, timeout=10, max_bytes=protocol.MAX_REPLY)
    except EOFError:
        return None
    finally:
        s.close()


def test_malformed_messages_do_not_kill_the_daemon(fp8_daemon):
    sock = fp8_daemon.sock
    assert "exceeds the limit" in _raw(sock, struct.pack(">I", protocol.MAX_MESSAGE + 1))["error"]
    assert "truncated" in _raw(sock, struct.pack(">I", 100) + b'{"op":')["error"]
    assert "not UTF-8 JSON" in _raw(sock, struct.pack(">I", 4) + b"\xff\xfe{}")["error"]
    assert "JSON object" in _raw(sock, struct.pack(">I", 2) + b"[]")["error"]
    assert "unknown op" in _raw(sock, protocol.encode({"op": "pickle.loads"}))["error"]
    assert _raw(sock, b"\x00\x00", read=True) is not None  # truncated length prefix
    _raw(sock, b"", read=False)  # connect and vanish (a crashed client)
    _raw(sock, struct.pack(">I", 50) + b"{", read=False)
    status = request("status", socket_dir=fp8_daemon.dir)
    assert status["ok"] and fp8_daemon.proc.poll() is None
    model = load(fixture_dir("qwen2-bytes-fp8"), dtype="float32", weight_cache="require",
                 weight_cache_dir=fp8_daemon.dir)
    assert model.info.weights == "daemon"


def test_protocol_errors_are_typed():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 10) + b"{}")
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(WeightCacheProtocolError, match="truncated"):
            protocol.recv(a, timeout=5)
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(WeightCacheProtocolError, match="timed out"):
            protocol.recv(a, timeout=0.1)


_CLIENT = """
import os, sys, time
import numpy as np
from modelopt_jax import load
path, sock, out, go = sys.argv[1:5]
open(out + ".ready", "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
m = load(path, dtype="float32", weight_cache="require", weight_cache_dir=sock)
np.save(out, np.asarray(m(np.array([[1, 72, 101, 108, 108, 111]], np.int32))))
print(m.info.weights)
"""


def _concurrent_processes(daemon, n, tmp_path):
    """``n`` client processes released at once; each attaches and computes logits."""
    path = fixture_dir("qwen2-bytes-fp8")
    reference = np.asarray(load(path, dtype="float32")(np.array([[1, 72, 101, 108, 108, 111]], np.int32)))
    before = request("status", socket_dir=daemon.dir)["attaches"]
    go = tmp_path / "go"
    outs = [tmp_path / f"logits{i}.npy" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(path), daemon.dir, str(o), str(go)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for o in outs]
    try:
        deadline = time.monotonic() + 300
        while not all(pathlib.Path(f"{o}.ready").exists() for o in outs):  # every process imported JAX
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        go.touch()
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0 and stdout.strip() == "daemon", stderr
    for o in outs:
        assert np.array_equal(np.load(o), reference)
    assert request("status", socket_dir=daemon.dir)["attaches"] == before + n


def test_concurrent_client_processes_attach_and_agree(fp8_daemon, tmp_path):
    _concurrent_processes(fp8_daemon, 16, tmp_path)


@pytest.mark.slow
def test_32_concurrent_client_processes(fp8_daemon, tmp_path):
    _concurrent_processes(fp8_daemon, 32, tmp_path)


_OTHER_USER = """
import json, os, socket, struct, sys
os.setgid(65534)
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES")
    sys.exit(0)
msg = json.dumps({"op": "stop"}).encode()
try:
    s.sendall(struct.pack(">I", len(msg)) + msg)
except BrokenPipeError:  # the daemon refuses before reading: its reply is already waiting
    pass
n = struct.unpack(">I", s.recv(4))[0]
print(s.recv(n).decode())
"""


def _can_be_nobody() -> bool:
    code = "import os; os.setgid(65534); os.setuid(65534)"
    return os.getuid() == 0 and subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_be_nobody(), reason="needs root and a uid 65534 to switch to (a second user)")
def test_peer_uid_refused(tmp_path):
    """A real second user (uid 65534): stopped by the 0700 directory; with the directory and socket
    opened up on purpose, refused by the daemon's SO_PEERCRED check, which is the last line."""
    import shutil
    import tempfile

    path = fixture_dir("qwen2-bytes-fp8")
    base = tempfile.mkdtemp(prefix="wc-uid-", dir="/tmp")  # pytest's tmp_path is closed to other users
    os.chmod(base, 0o755)
    daemon = DaemonProcess(path, os.path.join(base, "sock"))
    try:
        def as_nobody():
            out = subprocess.run([sys.executable, "-c", _OTHER_USER, daemon.sock], capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        assert as_nobody() == "EACCES"
        os.chmod(daemon.dir, 0o711)
        os.chmod(daemon.sock, 0o666)
        reply = json.loads(as_nobody())
        assert reply == {"ok": False, "error": "peer uid 65534 is not allowed by this daemon (uid 0 only)",
                         "refused": "uid"}
        # our own client refuses a directory others can enter, before it connects
        with pytest.raises(WeightCacheError, match="has mode 0711, expected 0700"):
            load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir)
        os.chmod(daemon.dir, 0o700)
        assert load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir).info.weights \
            == "daemon"
        assert daemon.proc.poll() is None  # the other user's "stop" was refused
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert daemon.proc.returncode == 0


def test_daemon_sigkilled_during_attach(tmp_path, monkeypatch):
    """The daemon dies while a client waits for its attach reply: a prompt error, or the disk."""
    path = fixture_dir("qwen2-bytes-fp8")
    daemon = DaemonProcess(path, tmp_path / "sock")
    pid = request("status", socket_dir=daemon.dir)["pid"]
    os.kill(pid, signal.SIGSTOP)  # holds the attach between connect and reply
    results = {}
    waiting = threading.Semaphore(0)  # released by each client as it starts waiting for its reply
    recv = protocol.recv

    def counting_recv(*args, **kwargs):
        waiting.release()
        return recv(*args, **kwargs)

    monkeypatch.setattr(protocol, "recv", counting_recv)

    def attach(mode):
        try:
            results[mode] = load(path, dtype="float32", weight_cache=mode, weight_cache_dir=daemon.dir,
                                 weight_cache_timeout=60).info.weights
        except WeightCacheError as e:
            results[mode] = e

    threads = [threading.Thread(target=attach, args=(m,)) for m in ("require", "auto")]
    for t in threads:
        t.start()
    for _ in threads:  # both have sent their attach and wait for the reply (however loaded the machine is)
        assert waiting.acquire(timeout=120)
    assert all(t.is_alive() for t in threads)
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    for t in threads:
        t.join(60)
    assert time.monotonic() - t0 < 30
    assert isinstance(results["require"], WeightCacheError)
    assert not isinstance(results["require"], WeightCacheNotServingError)  # the death is reported, not retried
    assert "closed the connection" in str(results["require"]) or "reset by peer" in str(results["require"])
    assert results["auto"] == "disk"
    cleaned = stop(socket_dir=daemon.dir)  # what a user runs after a SIGKILL: the segment goes too
    assert cleaned["stale"] and any(r.startswith("/dev/shm/mojwc_") for r in cleaned["removed"]), cleaned


def test_sigkilled_daemon_auto_falls_back(tmp_path):
    path = fixture_dir("qwen2-bytes-fp8")
    daemon = DaemonProcess(path, tmp_path / "sock")
    attached = LLM(str(path), dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir)
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    reference = _reference("qwen2-bytes-fp8")
    assert _outputs(attached) == reference  # an attached client keeps its mapping
    llm = LLM(str(path), dtype="float32", weight_cache="auto", weight_cache_dir=daemon.dir)
    assert llm.model.info.weights == "disk"
    assert _outputs(llm) == reference
    with pytest.raises(WeightCacheError):
        load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir, weight_cache_timeout=0.2)
    # a new daemon replaces the stale socket and serves again
    again = DaemonProcess(path, daemon.dir)
    try:
        assert load(path, dtype="float32", weight_cache="require",
                    weight_cache_dir=daemon.dir).info.weights == "daemon"
    finally:
        again.stop()


def test_require_waits_for_a_loading_daemon(tmp_path):
    path = fixture_dir("qwen2-bytes-fp8")
    daemon = DaemonProcess(path, tmp_path / "sock", wait=False)
    try:
        deadline = time.monotonic() + 30
        lock = pathlib.Path(daemon.dir, "device-0.lock")
        while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.01)
        model = load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir,
                     weight_cache_timeout=60)
        assert model.info.weights == "daemon"
        shm_name = request("status", socket_dir=daemon.dir).get("shm_name")  # None with a CUDA store
        del model  # a CUDA store outlives stop while a client views it
    finally:
        out = daemon.stop()
    assert daemon.proc.returncode == 0, out
    assert os.listdir(daemon.dir) == []  # socket and lock removed
    assert shm_name is None or not os.path.exists(f"/dev/shm/{shm_name}")


@pytest.mark.parametrize("quant_algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("intermediate", [36, 48], ids=["padded", "aligned"])
def test_fused_layers_attached_twice(quant_algo, intermediate, tmp_path):
    """Fused q/k/v and gate/up, per-tensor and per-channel scales, aligned and padded widths."""
    ckpt = tmp_path / "ckpt"
    # gate_up = 2 * 36 = 72 (pads to 80) or 2 * 48 = 96 (aligned); q/k/v = 64 + 32 + 32 = 128;
    # lm_head = 100 rows pads to 112
    write_checkpoint(ckpt, family="qwen2", hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100, quant_algo=quant_algo)
    ordinary = load(ckpt, dtype="float32")
    padded = -(-2 * intermediate // 16) * 16
    assert ordinary.layers[0].mlp.gate_up.weight.shape[0] == padded  # the case under test really (un)pads
    daemon = DaemonProcess(ckpt, tmp_path / "sock")
    try:
        attached = [load(ckpt, dtype="float32", weight_cache="require", weight_cache_dir=daemon.dir)
                    for _ in range(2)]
    finally:
        daemon.stop()
    x = jax.random.normal(jax.random.key(intermediate), (3, 64), np.float32)
    for model in attached:
        assert model.info.weights == "daemon"
        _assert_same_arrays(model, ordinary)  # bit-identical: nothing re-transposed, re-quantized or re-padded
        for name in ("qkv", "gate_up"):
            want = ordinary.layers[0].self_attn.qkv if name == "qkv" else ordinary.layers[0].mlp.gate_up
            got = model.layers[0].self_attn.qkv if name == "qkv" else model.layers[0].mlp.gate_up
            assert (got.weight.shape, got.logical_out, tuple(got.shard_sizes)) == \
                (want.weight.shape, want.logical_out, tuple(want.shard_sizes))
            assert got.epilogue == want.epilogue and got.input_scale == want.input_scale
            assert np.array_equal(np.asarray(got(x)), np.asarray(want(x)))
        assert model.lm_head.out_features == 100
    # both attachments view the same bytes of the daemon's store (same offsets, same store)
    assert _store_offsets(attached[0]) == _store_offsets(attached[1])
    ids = np.array([[1, 5, 9, 33, 70]], np.int32)
    out = np.asarray(attached[1](ids))
    assert out.shape == (1, 5, 100)
    assert np.array_equal(out, np.asarray(ordinary(ids)))


def test_cli_status(fp8_daemon):
    import json

    out = subprocess.run([sys.executable, "-m", "modelopt_jax", "weight-cache", "status", "--socket-dir",
                          fp8_daemon.dir], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["ok"] and status["pid"] == fp8_daemon.proc.pid
    assert status["fingerprint"]["device"].startswith(_device_label())
    assert status["store"] == ("cuda" if jax.default_backend() == "gpu" else "host")


def _shard_in_store(leaf, device, store) -> bool:
    shard = next(s for s in leaf.addressable_shards if s.device == device)
    base, size = store.span()
    ptr = shard.data.unsafe_buffer_pointer()
    return base <= ptr and ptr + shard.data.nbytes <= base + size


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_tensor_parallel_one_daemon_per_device(tmp_path):
    """TP=2: daemons for devices 0 and 1 each serve their shard; the client stitches them zero-copy."""
    from modelopt_jax.parallel import make_mesh

    path = fixture_dir("qwen2-bytes-fp8-pc-pt")  # per-channel scales: column shards carry ScaleVector data
    sock = tmp_path / "sock"
    with pytest.raises(AssertionError, match="is not a rank of a tensor-parallel split of size 2"):
        DaemonProcess(path, sock, device=2, env={}, tp=2)
    daemons = [DaemonProcess(path, sock, device=i, tp=2) for i in range(2)]
    try:
        ordinary = LLM(str(path), dtype="float32", tensor_parallel_size=2)
        reference = _outputs(ordinary)
        for _ in range(2):
            llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, weight_cache="require",
                      weight_cache_dir=daemons[0].dir)
            assert llm.model.info.weights == "daemon"
            assert _outputs(llm) == reference
            la = jax.tree_util.tree_leaves(nnx.state(llm.model))
            lb = jax.tree_util.tree_leaves(nnx.state(ordinary.model))
            assert len(la) == len(lb)
            for x, y in zip(la, lb):
                assert x.sharding == y.sharding
                assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
                for rank, device in enumerate(llm.model.mesh.devices.flat):
                    assert _shard_in_store(x, device, llm.model.info.stores[rank])
        # a single-device client is refused by the TP daemon, naming the field
        with pytest.raises(WeightCacheError) as info:
            load(path, dtype="float32", weight_cache="require", weight_cache_dir=daemons[0].dir)
        assert info.value.mismatch == ["tensor_parallel"]
        # TP=2 with only rank 0's daemon: "auto" loads from disk (both ranks), "require" raises
        daemons[1].stop()
        fallback = load(path, dtype="float32", mesh=make_mesh(2), weight_cache="auto", weight_cache_dir=daemons[0].dir)
        assert fallback.info.weights == "disk"
        with pytest.raises(WeightCacheError, match="device 1"):
            load(path, dtype="float32", mesh=make_mesh(2), weight_cache="require", weight_cache_dir=daemons[0].dir,
                 weight_cache_timeout=0.2)
    finally:
        for d in daemons:
            d.stop()
