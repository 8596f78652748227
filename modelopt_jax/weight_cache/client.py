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

import logging
import os
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


def attach(path, *, dtype, backend: str, socket_dir=None, device: int = 0, mode: str = "require",
           timeout: float = DEFAULT_TIMEOUT, ckpt=None):
    """Builds the model around the daemon's buffers; raises WeightCacheError when it cannot."""
    from modelopt_jax.checkpoint import Checkpoint
    from modelopt_jax.models import FAMILIES

    ckpt = ckpt or Checkpoint.open(path)
    check_supported(ckpt.quant_config)
    where = placement.resolve(device)
    fp = fingerprint.compute(ckpt, dtype=dtype.name, backend=backend, device=where.label)
    reply = _attach_reply(fp, socket_dir=socket_dir, device=device, mode=mode, timeout=timeout)
    shm = mapping = None
    try:
        if reply.get("store", "host") != where.store:
            raise WeightCacheError(f"weight-cache daemon keeps a {reply.get('store')!r} store; this process needs "
                                   f"{where.store!r}")
        if where.store == "cuda":
            from modelopt_jax.weight_cache import cuda_store

            mapping, arrays = cuda_store.attach(reply["ipc_handle"], reply["alloc_bytes"], reply["index"],
                                                where.ordinal)
        else:
            shm, views = host_store.attach(reply["shm_name"], reply["index"])
            arrays = {k: jax.device_put(v) for k, v in views.items()}  # 64-byte aligned: adopted, not copied
        source = ReplaySource(reply["layout"], arrays)
        with where.default_device():
            model = FAMILIES[ckpt.model_config.family](ckpt.model_config, source, dtype=dtype)
        source.finish()
    except (KeyError, TypeError, ValueError) as e:
        raise WeightCacheError(f"weight-cache daemon sent an inconsistent layout: {e!r}") from e
    model.quant_config = ckpt.quant_config
    model.checkpoint_dir = ckpt.directory
    model.weight_cache_shm = shm  # host store: the mapping must outlive the arrays that view it
    model.weight_cache_mapping = mapping  # cuda store: the IPC mapping, closed once no array views it
    model.weight_cache_source = "daemon"
    return model


def load_with_cache(path, *, dtype, backend: str, mode: str, socket_dir=None, device: int = 0,
                    timeout: float | None = None, ordinary_load):
    """``load(weight_cache=mode)``: attach, or fall back to ``ordinary_load()`` in ``auto`` mode."""
    from modelopt_jax.checkpoint import Checkpoint

    if mode not in MODES:
        raise ValueError(f"weight_cache={mode!r} not supported; use one of {', '.join(MODES)}")
    ckpt = Checkpoint.open(path)
    check_supported(ckpt.quant_config)  # before any slow work, in every mode but off
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    try:
        model = attach(path, dtype=dtype, backend=backend, socket_dir=socket_dir, device=device, mode=mode,
                       timeout=timeout, ckpt=ckpt)
    except WeightCacheError as e:
        if mode == "require":
            raise
        log.warning("weight cache: %s; loading %s from disk", e, ckpt.directory)
        model = ordinary_load()
        model.weight_cache_source = "disk"
        return model
    log.info("weight cache: attached %s from the daemon for device %d", ckpt.directory, device)
    return model
