"""Load side: the weight cache as a provider of processed arrays (:class:`CacheWeights`).

``load(weight_cache=...)`` picks the provider: ``off`` never touches a socket; ``auto`` attaches if
a daemon for the device serves a cache with this exact fingerprint, else loads from disk and logs
why; ``require`` attaches or raises :class:`WeightCacheError`, and while a daemon is still loading
(its pid is in the lock file but the socket is not open yet) it waits up to the timeout. The
daemon's reply carries its :class:`~modelopt_jax.quant.plan.ModelPlan` and a state path -> offset
index; the model is then built by the same pipeline stage as a disk load, around zero-copy views
of the daemon's store (its CUDA allocation mapped over IPC on a GPU, its shared memory
elsewhere). Static scales come from the plan and are compiled in as constants as usual.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import struct
import time

import jax

from modelopt_jax.errors import ConfigError, WeightCacheError, WeightCacheNotServingError, WeightCachePermissionError
from modelopt_jax.pipeline import check_plan_matches
from modelopt_jax.quant.plan import ModelPlan
from modelopt_jax.weight_cache import fingerprint, host_store, paths, placement, protocol
from modelopt_jax.weight_cache.layout import check_supported

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT = 60.0


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _connect(path: str, directory: str, device: int, deadline: float) -> socket.socket:
    """A connection to the daemon's socket, retried with backoff while its accept backlog is full."""
    delay = 0.01
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            raise WeightCacheNotServingError(f"no weight-cache daemon serves device {device} at {path} "
                                             f"({e.strerror})") from e
        except OSError as e:
            sock.close()
            busy = e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or isinstance(e, socket.timeout)
            if not busy or time.monotonic() + delay > deadline:
                raise WeightCacheError(f"cannot connect to the weight-cache daemon at {path}: {e}") from e
            time.sleep(delay)  # a full backlog: many clients starting at once
            delay = min(delay * 2, 0.5)


def request(op: str, *, socket_dir=None, device: int = 0, timeout: float = 30.0, **fields) -> dict:
    """One request/reply with the daemon for ``device`` within ``timeout`` seconds in all.

    Before sending anything it checks that the socket directory is this user's own and 0700, and
    that the process listening on the socket runs as this user (SO_PEERCRED); raises
    :class:`WeightCachePermissionError` otherwise and WeightCacheError if no daemon answers.
    """
    reply, sock = _exchange(op, socket_dir=socket_dir, device=device, timeout=timeout, fields=fields)
    sock.close()
    return reply


def _exchange(op: str, *, socket_dir, device: int, timeout: float, fields: dict) -> tuple[dict, socket.socket]:
    """:func:`request`, returning the still open connection too (an attach's lease)."""
    directory = paths.resolve_dir(socket_dir)
    path = paths.socket_path(directory, device)
    if not paths.check_private_dir(directory):
        raise WeightCacheNotServingError(f"no weight-cache daemon serves device {device} at {path} "
                                         f"(no directory {directory})")
    deadline = time.monotonic() + timeout
    sock = _connect(path, directory, device, deadline)
    try:
        uid = _peer_uid(sock)
        if uid != os.getuid():
            raise WeightCachePermissionError(f"the process listening on {path} runs as uid {uid}, not as this "
                                             f"process's uid {os.getuid()}; refusing to talk to it")
        protocol.send(sock, {"op": op, **fields})
        try:
            reply = protocol.recv(sock, timeout=max(deadline - time.monotonic(), 0.01), max_bytes=protocol.MAX_REPLY)
        except EOFError as e:
            raise WeightCacheError(f"the weight-cache daemon at {path} closed the connection") from e
    except BaseException:
        sock.close()
        raise
    return reply, sock


def stop(*, socket_dir=None, device: int = 0, timeout: float = 30.0) -> dict:
    """Stops the daemon for ``device``; if it died (SIGKILL), removes its socket, lock and segment."""
    from modelopt_jax.weight_cache.daemon import remove_stale

    directory = paths.resolve_dir(socket_dir)
    try:
        return request("stop", socket_dir=directory, device=device, timeout=timeout)
    except WeightCachePermissionError:
        raise
    except WeightCacheError as e:
        with paths.take_stale_lock(directory, device) as info:
            if info is None:
                if paths.lock_holder(directory, device) is not None:
                    raise WeightCacheError(f"{e}; a daemon holds the lock for device {device} (still loading?)") from e
                if not os.path.exists(paths.socket_path(directory, device)):
                    raise
                info = {}
            removed = remove_stale(directory, device, info)
        return {"ok": True, "stale": True, "removed": removed,
                "message": f"no daemon was running for device {device}; removed what a dead one left: "
                           f"{', '.join(removed) or 'nothing'}"}


def _attach_reply(fp: dict, *, socket_dir, device: int, mode: str, timeout: float) -> tuple[dict, int]:
    """The daemon's attach reply and the connection's file descriptor, which stays open as the
    client's lease on the store (see :mod:`.daemon`): whoever maps the store takes it over."""
    directory = paths.resolve_dir(socket_dir)
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply, sock = _exchange("attach", socket_dir=directory, device=device, fields={"fingerprint": fp},
                                    timeout=max(deadline - time.monotonic(), 0.05))
            break
        except WeightCacheNotServingError:
            # still loading? (a daemon holds the lock, no socket yet): only "require" waits. A daemon
            # that dies mid-reply is not retried: its error (closed, reset) is the one to report.
            if mode != "require" or paths.lock_holder(directory, device) is None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    if not reply.get("ok"):
        sock.close()
        mismatch = reply.get("mismatch") or []
        raise WeightCacheError(f"weight-cache daemon refused to attach: {reply.get('error')}", mismatch=mismatch)
    return reply, sock.detach()  # a bare descriptor: no socket object may close it behind the store's back


def _attach_rank(ckpt, *, dtype, backend: str, options, device: int, rank: int = 0, tensor_parallel: int = 1):
    """Attaches to the daemon of local device ``device``: (plan JSON, {state path: array}, keep-alive)."""
    where = placement.resolve(device)
    fp = fingerprint.compute(ckpt, dtype=dtype.name, backend=backend, device=where.label, rank=rank,
                             tensor_parallel=tensor_parallel)
    timeout = DEFAULT_TIMEOUT if options.timeout is None else float(options.timeout)
    reply, lease = _attach_reply(fp, socket_dir=options.socket_dir, device=device, mode=options.mode,
                                 timeout=timeout)
    try:  # everything that can be wrong with the reply, before a store takes the lease over
        if reply.get("store", "host") != where.store:
            raise WeightCacheError(f"weight-cache daemon keeps a {reply.get('store')!r} store; this process needs "
                                   f"{where.store!r}")
        plan, index = ModelPlan.from_json(reply["plan"]), reply["index"]
        where_fields = (reply["ipc_handle"], reply["alloc_bytes"]) if where.store == "cuda" else (reply["shm_name"],)
    except BaseException as e:
        os.close(lease)
        if isinstance(e, (KeyError, TypeError, ValueError)):
            raise WeightCacheError(f"weight-cache daemon sent an inconsistent reply: {e!r}") from e
        raise
    try:
        if where.store == "cuda":
            from modelopt_jax.weight_cache import cuda_store

            keep, arrays = cuda_store.attach(*where_fields, index, where.ordinal, lease)
        else:
            device = where.jax_device if where.jax_device is not None else jax.local_devices()[0]
            keep, arrays = host_store.attach(*where_fields, index, device.local_hardware_id or 0, lease)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightCacheError(f"weight-cache daemon sent an inconsistent reply: {e!r}") from e
    return plan, arrays, keep


@dataclasses.dataclass
class CacheWeights:
    """The weight cache as a provider of processed arrays: the daemons' plan and zero-copy views.

    ``per_device`` holds one ``{state path: array}`` per local mesh device (mesh order), ``stores``
    one mapping per attached daemon, which must outlive the arrays that view it.
    """

    plan: ModelPlan
    per_device: list[dict]
    stores: list

    source = "daemon"

    @staticmethod
    def attach(ckpt, options, *, dtype, backend: str, mesh=None) -> "CacheWeights":
        """Attaches to the daemon of every local device the model needs; raises WeightCacheError when it cannot.

        Without ``mesh``: the daemon of local device ``options.device``. With a tensor-parallel
        ``mesh``: the daemon of every local mesh device (rank i = mesh device i).
        """
        check_supported(backend)  # before any socket work
        if mesh is None:
            ranks = [(0, 1, options.device)]
        else:
            local = jax.local_devices()
            tp = mesh.devices.size
            ranks = [(i, tp, local.index(d)) for i, d in enumerate(mesh.devices.flat)
                     if d.process_index == jax.process_index()]
        attached = [_attach_rank(ckpt, dtype=dtype, backend=backend, options=options, device=dev, rank=rank,
                                 tensor_parallel=tp) for rank, tp, dev in ranks]
        plan = attached[0][0]
        if any(p != plan for p, _, _ in attached[1:]):
            raise WeightCacheError("the tensor-parallel ranks' daemons serve different plans")
        try:
            check_plan_matches(plan, ckpt.model_config, dtype=dtype, backend=backend, tensor_parallel=ranks[0][1],
                               where="weight-cache daemon")
        except ConfigError as e:
            raise WeightCacheError(str(e)) from e
        log.info("weight cache: attached %s from the daemon%s", ckpt.directory,
                 f" for device {options.device}" if mesh is None else f"s of {mesh.devices.size} tensor-parallel devices")
        return CacheWeights(plan, [arrays for _, arrays, _ in attached], [keep for _, _, keep in attached])
