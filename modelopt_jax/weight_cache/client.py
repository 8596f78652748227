"""Load side: attach to a matching daemon, or fall back to an ordinary load (mode ``auto``).

``off`` never touches a socket. ``auto`` attaches if a daemon for the device serves a cache with
this exact fingerprint, else loads from disk and logs why. ``require`` attaches or raises
:class:`WeightCacheError`; while a daemon is still loading (its pid is in the lock file but the
socket is not open yet) it waits up to ``timeout`` seconds. The attached model is built by the
family's ordinary builder over a :class:`~.layout.ReplaySource`: device arrays are zero-copy
views of the daemon's store (its CUDA allocation mapped over IPC on a GPU, its shared memory
elsewhere), static scales are compiled in as constants as usual.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

import jax

from modelopt_jax.errors import WeightCacheError
from modelopt_jax.weight_cache import MODES, fingerprint, host_store, paths, placement, protocol
from modelopt_jax.weight_cache.layout import ReplaySource, check_supported

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT = 60.0


def request(op: str, *, socket_dir=None, device: int = 0, timeout: float = 30.0, **fields) -> dict:
    """One request/reply with the daemon for ``device``; raises WeightCacheError if none answers."""
    directory = paths.resolve_dir(socket_dir)
    path = paths.socket_path(directory, device)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise WeightCacheError(f"no weight-cache daemon serves device {device} at {path} ({e.strerror})") from e
        except OSError as e:
            raise WeightCacheError(f"cannot connect to the weight-cache daemon at {path}: {e}") from e
        protocol.send(sock, {"op": op, **fields})
        try:
            return protocol.recv(sock, timeout=timeout, max_bytes=protocol.MAX_REPLY)
        except EOFError as e:
            raise WeightCacheError(f"the weight-cache daemon at {path} closed the connection") from e
    finally:
        sock.close()


def _attach_reply(fp: dict, *, socket_dir, device: int, mode: str, timeout: float) -> dict:
    directory = paths.resolve_dir(socket_dir)
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = request("attach", socket_dir=directory, device=device, fingerprint=fp)
            break
        except WeightCacheError:
            # still loading? (a live pid in the lock file, no socket yet): only "require" waits
            if mode != "require" or paths.daemon_pid(directory, device) is None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if not reply.get("ok"):
        mismatch = reply.get("mismatch") or []
        raise WeightCacheError(f"weight-cache daemon refused to attach: {reply.get('error')}", mismatch=mismatch)
    return reply


def _attach_rank(ckpt, *, dtype, backend: str, socket_dir, device: int, mode: str, timeout: float, rank: int = 0,
                 tensor_parallel: int = 1):
    """Attaches to the daemon of local device ``device``; returns (ReplaySource, keep-alive, placement)."""
    where = placement.resolve(device)
    fp = fingerprint.compute(ckpt, dtype=dtype.name, backend=backend, device=where.label, rank=rank,
                             tensor_parallel=tensor_parallel)
    reply = _attach_reply(fp, socket_dir=socket_dir, device=device, mode=mode, timeout=timeout)
    try:
        if reply.get("store", "host") != where.store:
            raise WeightCacheError(f"weight-cache daemon keeps a {reply.get('store')!r} store; this process needs "
                                   f"{where.store!r}")
        if where.store == "cuda":
            from modelopt_jax.weight_cache import cuda_store

            keep, arrays = cuda_store.attach(reply["ipc_handle"], reply["alloc_bytes"], reply["index"], where.ordinal)
        else:
            keep, views = host_store.attach(reply["shm_name"], reply["index"])
            # 64-byte aligned host pages: adopted by XLA:CPU as the device buffers, not copied
            arrays = {k: jax.device_put(v, where.jax_device) for k, v in views.items()}
        return ReplaySource(reply["layout"], arrays), keep, where
    except (KeyError, TypeError, ValueError) as e:
        raise WeightCacheError(f"weight-cache daemon sent an inconsistent layout: {e!r}") from e


class _PerDevice:
    """Runs each rank's replay on its own device (the modules a rank rebuilds live there)."""

    def __init__(self, source: ReplaySource, where):
        self.source, self.where = source, where

    def __getattr__(self, name):
        method = getattr(self.source, name)

        def call(*args, **kwargs):
            with self.where.default_device():
                return method(*args, **kwargs)
        return call


def attach(path, *, dtype, backend: str, socket_dir=None, device: int = 0, mode: str = "require",
           timeout: float = DEFAULT_TIMEOUT, ckpt=None, mesh=None):
    """Builds the model around the daemons' buffers; raises WeightCacheError when it cannot.

    Without ``mesh``: the daemon of local device ``device``. With a tensor-parallel ``mesh``: the
    daemon of every local mesh device (rank i = mesh device i), whose per-device modules are
    stitched into global arrays exactly as ``load(mesh=...)`` would place them.
    """
    from modelopt_jax.checkpoint import Checkpoint
    from modelopt_jax.loader import finish_model, model_config_for
    from modelopt_jax.models import FAMILIES

    ckpt = ckpt or Checkpoint.open(path)
    check_supported(ckpt.quant_config, backend)
    kw = dict(dtype=dtype, backend=backend, socket_dir=socket_dir, mode=mode, timeout=timeout)
    if mesh is None:
        ranks = [(0, 1, device)]
    else:
        local = jax.local_devices()
        tp = mesh.devices.size
        ranks = [(i, tp, local.index(d)) for i, d in enumerate(mesh.devices.flat)
                 if d.process_index == jax.process_index()]
    attached = [_attach_rank(ckpt, device=dev, rank=rank, tensor_parallel=tp, **kw) for rank, tp, dev in ranks]
    sources = [_PerDevice(source, where) for source, _, where in attached]
    if mesh is not None:
        from modelopt_jax import parallel

        sources = [parallel.StitchingSource(sources, mesh)]
    # single device: anything the builder makes besides weights goes to that device too
    on_device = attached[0][2].default_device() if mesh is None else contextlib.nullcontext()
    try:
        with on_device:
            model = FAMILIES[ckpt.model_config.family](model_config_for(ckpt, mesh), sources[0], dtype=dtype)
        for source, _, _ in attached:
            source.finish()
    except (KeyError, TypeError, ValueError) as e:
        raise WeightCacheError(f"weight-cache daemon sent an inconsistent layout: {e!r}") from e
    model = finish_model(model, ckpt, mesh)
    # One store per attached daemon (rank order), each with span() -> (address, bytes). They must
    # outlive the arrays that view them (host: shared memory; cuda: the IPC mapping).
    model.weight_cache_stores = [store for _, store, _ in attached]
    model.weight_cache_source = "daemon"
    return model


def load_with_cache(path, *, dtype, backend: str, mode: str, socket_dir=None, device: int = 0,
                    timeout: float | None = None, ordinary_load, mesh=None):
    """``load(weight_cache=mode)``: attach, or fall back to ``ordinary_load()`` in ``auto`` mode."""
    from modelopt_jax.checkpoint import Checkpoint

    if mode not in MODES:
        raise ValueError(f"weight_cache={mode!r} not supported; use one of {', '.join(MODES)}")
    ckpt = Checkpoint.open(path)
    check_supported(ckpt.quant_config, backend)  # before any slow work, in every mode but off
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    try:
        model = attach(path, dtype=dtype, backend=backend, socket_dir=socket_dir, device=device, mode=mode,
                       timeout=timeout, ckpt=ckpt, mesh=mesh)
    except WeightCacheError as e:
        if mode == "require":
            raise
        log.warning("weight cache: %s; loading %s from disk", e, ckpt.directory)
        model = ordinary_load()
        model.weight_cache_source = "disk"
        return model
    log.info("weight cache: attached %s from the daemon%s", ckpt.directory,
             f" for device {device}" if mesh is None else f"s of {mesh.devices.size} tensor-parallel devices")
    return model
