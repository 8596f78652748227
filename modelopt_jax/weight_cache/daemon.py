"""The weight-cache daemon: one per device, serving one processed checkpoint.

Order of events, and why: take the per-device lock (fcntl.flock, so exactly one daemon per
device and the lock dies with the process), write our pid into it (clients use it to tell "still
loading" from "absent"), check the GEMM backend's weight layout is shareable (before any slow work), run the load
pipeline's stages (:mod:`modelopt_jax.pipeline`: plan, process, check leftovers), copy the arrays into the
store (one CUDA allocation exported over IPC on a GPU, POSIX shared memory elsewhere; see
:mod:`.placement`), and only then bind the socket -- so a socket that exists always serves a
complete cache.
Each connection gets a thread; peers are checked with SO_PEERCRED (only our own uid is served);
a bad message, a crashed client or a failed ``accept`` (e.g. out of file descriptors) only ends
that connection. The lock file names the store's shared-memory segment, so the next holder of the
lock (a new daemon, or ``weight-cache stop``) removes what a SIGKILLed daemon left behind.

Leases, and why: a client keeps its attach connection open for as long as any of its arrays views
the store (it closes when the last view dies, or with the process), and ``status`` lists them.
``stop`` (or SIGTERM/SIGINT) refuses new attaches at once. A store whose memory may be released
under its clients (shared memory: unlinking keeps their mappings) is freed right away and the
daemon exits; a CUDA allocation is freed only after the last lease has closed, because what an
importer sees after the exporter's ``cuMemFree`` is undocumented. Until then the daemon keeps its
socket (answering ``status``; ``attach`` gets a "stopping" refusal, so ``auto`` loads from disk)
and its lock, then removes both and exits.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import signal
import socket
import struct
import threading
import time

import jax

from modelopt_jax import pipeline
from modelopt_jax.checkpoint import Checkpoint
from modelopt_jax.dtypes import compute_dtype
from modelopt_jax.errors import ConfigError, WeightCacheError, WeightCacheProtocolError
from modelopt_jax.ops.gemm import check_backend
from modelopt_jax.weight_cache import fingerprint, host_store, paths, placement, protocol
from modelopt_jax.weight_cache.layout import check_supported

log = logging.getLogger(__name__)
MESSAGE_TIMEOUT = 60.0  # seconds a peer has to send one whole message
LOCK_WAIT = 1.0  # clients probing the lock hold it shared for microseconds: retry this long before giving up


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's (pid, uid) from the kernel (struct ucred {pid, uid, gid})."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def process(ckpt, *, dtype, backend: str, where: placement.Placement | None = None, rank: int = 0,
            tensor_parallel: int = 1):
    """The load pipeline's stages for one rank: plan, read and process onto ``where``'s device, check
    leftovers. Returns (plan, {state path: device array}) -- exactly what ``load`` would build from.
    """
    plan = pipeline.plan_model(ckpt, dtype=dtype, backend=backend, tensor_parallel=tensor_parallel)
    device = where.jax_device if where is not None else None
    (arrays,) = pipeline.DiskWeights(ckpt).arrays(plan, [(rank, device)])
    pipeline.check_leftovers(ckpt)
    return plan, arrays


def remove_stale(directory: str, device: int, info: dict) -> list[str]:
    """Removes what a dead daemon left (its segment, socket, lock); call only while holding its lock."""
    removed = []
    name = info.get("segment")
    if isinstance(name, str) and host_store.remove_stale(name):
        removed.append(f"/dev/shm/{name}")
    for path in (paths.socket_path(directory, device), paths.lock_path(directory, device)):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


class Daemon:
    def __init__(self, model_path, *, device: int = 0, socket_dir=None, dtype="bfloat16", backend: str = "auto",
                 tensor_parallel: int = 1, message_timeout: float = MESSAGE_TIMEOUT):
        self.model_path = os.path.abspath(os.fspath(model_path))
        self.device = int(device)
        # Under tensor parallelism the daemon of device i serves shard i of load(mesh=make_mesh(tp)),
        # whose mesh is the first tp devices: device index and rank coincide.
        self.tensor_parallel = int(tensor_parallel)
        if self.tensor_parallel < 1 or self.device >= self.tensor_parallel > 1:
            raise ConfigError(f"--device {self.device} is not a rank of a tensor-parallel split of size "
                              f"{self.tensor_parallel} (ranks are devices 0..{self.tensor_parallel - 1})")
        self.dir = paths.ensure_private_dir(paths.resolve_dir(socket_dir))
        self.dtype = compute_dtype(dtype)
        self.backend = backend
        check_backend(backend)
        self.socket_path = paths.socket_path(self.dir, self.device)
        self.lock_path = paths.lock_path(self.dir, self.device)
        self.allowed_uid = os.getuid()
        self.message_timeout = float(message_timeout)
        self.stop_event = threading.Event()
        self.lock_fd = None
        self.store = None  # host_store.Segment or cuda_store.Slab
        self.listener = None
        self.attaches = 0
        self.started = time.time()
        self.leases: dict[int, int] = {}  # open attach connections (id -> the client's pid)
        self.lease_lock = threading.Lock()  # orders an attach's lease against stop (see done)

    # ---- lifecycle ------------------------------------------------------------------------------
    def _lock(self) -> None:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise paths.os_error(e, f"cannot create the weight-cache lock file {self.lock_path}") from e
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                info = paths.read_lock_info(fd)
                os.close(fd)
                raise WeightCacheError(f"another weight-cache daemon already serves device {self.device} "
                                       f"(pid {info.get('pid')}, lock {self.lock_path})") from None
        previous = paths.read_lock_info(fd)
        if previous.get("segment"):  # we hold the lock, so the daemon that wrote this is gone
            if host_store.remove_stale(str(previous["segment"])):
                log.info("removed /dev/shm/%s left by a dead daemon (pid %s)", previous["segment"], previous.get("pid"))
        self.lock_info = {"pid": os.getpid(), "segment": None}
        paths.write_lock_info(fd, self.lock_info)
        self.lock_fd = fd

    def prepare(self) -> None:
        """Lock, load, process, publish into shared memory. Does not open the socket yet."""
        self._lock()
        if os.path.exists(self.socket_path):  # left by a killed daemon: we hold the lock, so it is stale
            os.unlink(self.socket_path)
        check_supported(self.backend)
        ckpt = Checkpoint.open(self.model_path)
        self.placement = placement.resolve(self.device)
        t0 = time.perf_counter()
        rank = self.device if self.tensor_parallel > 1 else 0

        def fp():
            return fingerprint.compute(ckpt, dtype=self.dtype.name, backend=self.backend, device=self.placement.label,
                                       rank=rank, tensor_parallel=self.tensor_parallel)

        before = fp()
        with self.placement.default_device():
            plan, arrays = process(ckpt, dtype=self.dtype, backend=self.backend, where=self.placement, rank=rank,
                                   tensor_parallel=self.tensor_parallel)
        self.fingerprint = fp()
        moved = fingerprint.diff(before, self.fingerprint)
        if moved:  # the fingerprint must describe the bytes we processed
            raise WeightCacheError(f"{self.model_path} changed on disk while the daemon read it ({', '.join(moved)}); "
                                   f"start the daemon again once the checkpoint is complete")
        self.family = ckpt.model_config.family
        self.plan = plan
        if self.placement.store == "cuda":
            from modelopt_jax.weight_cache import cuda_store

            self.store, self.index = cuda_store.create(arrays, self.placement.ordinal)
        else:
            name = host_store.new_name(self.device)
            self.lock_info["segment"] = name  # named before it exists: a SIGKILL from here on leaves a trace
            paths.write_lock_info(self.lock_fd, self.lock_info)
            self.store, self.index = host_store.create(arrays, name)
        self.nbytes = sum(e["nbytes"] for e in self.index.values())
        # Encoded once: the plan is the bulk of every attach reply and never changes.
        self.attach_reply = protocol.encode({"ok": True, **self.store.fields, "family": self.family,
                                             "plan": plan.to_json(), "index": self.index,
                                             "fingerprint": self.fingerprint})
        if len(self.attach_reply) > protocol.MAX_REPLY:
            raise WeightCacheError(f"the plan of {self.model_path} encodes to {len(self.attach_reply)} bytes, over "
                                   f"the protocol's {protocol.MAX_REPLY}-byte reply limit")
        del arrays, plan, ckpt  # the store is the cache now
        gc.collect()  # processing leaves reference cycles holding buffers as large as the cache
        log.info("processed %s in %.1f s: %d arrays, %d bytes in %s", self.model_path,
                 time.perf_counter() - t0, len(self.index), self.nbytes, self.store.where)

    def listen(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600, never briefly wider
        try:
            listener.bind(self.socket_path)
        except OSError as e:
            listener.close()
            raise paths.os_error(e, f"cannot create the weight-cache socket {self.socket_path}") from e
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        listener.listen(socket.SOMAXCONN)  # many clients start at once; they also retry a full backlog
        listener.settimeout(0.2)
        self.listener = listener

    def done(self) -> bool:
        """Stopping, and no lease the store must wait for. An attach checks ``stop_event`` and
        registers its lease in one critical section of ``lease_lock``, and this reads the leases
        under that lock after seeing the event set: so it either sees the lease, or the attach sees
        the event and is refused. (The event itself is set without the lock: signal handlers set it.)"""
        if not self.stop_event.is_set():
            return False
        with self.lease_lock:
            return not self.leases or not self.store.free_waits_for_clients

    def serve_forever(self) -> None:
        failures, last_logged, reported = 0, 0.0, None
        while not self.done():
            if self.stop_event.is_set():
                with self.lease_lock:
                    pids = sorted(self.leases.values())
                if reported != pids:
                    reported = pids
                    log.info("stopping: waiting for %d attached client(s) (pids %s) to detach before freeing the %s",
                             len(pids), pids, self.store.where)
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.listener is None:
                    break
                # EMFILE/ENFILE/ENOBUFS/ENOMEM/ECONNABORTED: this connection is lost, the daemon is not.
                # Logged at most once a second: a full fd table fails every 50 ms until it drains.
                failures += 1
                if time.monotonic() - last_logged >= 1.0:
                    log.warning("accept failed (%s, %d time(s) since the last report); still serving",
                                errno.errorcode.get(e.errno, e), failures)
                    failures, last_logged = 0, time.monotonic()
                time.sleep(0.05)
                continue
            try:
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
            except RuntimeError:  # cannot start a thread: drop this connection, keep serving
                log.warning("cannot start a thread for a connection; dropped it")
                conn.close()

    def shutdown(self) -> None:
        self.stop_event.set()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.lock_fd is not None:  # only the lock holder owns the socket and lock paths
            for path in (self.socket_path, self.lock_path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.store is not None:
            self.store.free()
            self.store = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None

    # ---- requests -------------------------------------------------------------------------------
    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                pid, uid = peer_credentials(conn)
                if uid != self.allowed_uid:
                    log.warning("refused a connection from uid %d", uid)
                    protocol.send(conn, {"ok": False, "error": f"peer uid {uid} is not allowed by this daemon "
                                                               f"(uid {self.allowed_uid} only)", "refused": "uid"})
                    return
                while True:
                    try:
                        request = protocol.recv(conn, timeout=self.message_timeout)
                    except EOFError:
                        return
                    op = request.get("op")
                    if op == "attach":
                        if self._attach(conn, request, pid):
                            return  # the connection was a lease, and has ended
                    elif op == "stop":
                        protocol.send(conn, self._stop_reply())
                        self.stop_event.set()  # after the reply: a daemon with nothing to wait for exits at once
                        return
                    else:
                        protocol.send(conn, self._reply(request))
            except WeightCacheProtocolError as e:
                log.warning("dropping a connection: %s", e)
                try:
                    protocol.send(conn, {"ok": False, "error": f"protocol error: {e}"})
                except WeightCacheError:
                    pass
            except Exception:  # never let one connection take the daemon down
                log.exception("error while serving a weight-cache connection")

    def _attach(self, conn: socket.socket, request: dict, pid: int) -> bool:
        """Answers an attach; if granted, holds the connection as the client's lease until the
        client closes it (or dies) and returns True. The lease is registered before the reply goes
        out, so a stop never misses a client that got the store (see :meth:`done`)."""
        mismatch = fingerprint.diff(self.fingerprint, request.get("fingerprint"))
        if mismatch:
            protocol.send(conn, {"ok": False, "error": f"fingerprint mismatch in {', '.join(mismatch)}",
                                 "mismatch": mismatch})
            return False
        with self.lease_lock:
            if self.stop_event.is_set():
                refusal = {"ok": False, "stopping": True, "error": f"the daemon of device {self.device} is stopping "
                           f"(waiting for {len(self.leases)} attached client(s) to detach); start a new one once it "
                           f"has exited"}
            else:
                refusal = None
                self.leases[id(conn)] = pid
                self.attaches += 1
        if refusal is not None:
            protocol.send(conn, refusal)
            return False
        try:
            protocol.send(conn, self.attach_reply)
            conn.settimeout(None)  # a lease lasts as long as the client uses the store
            conn.recv(1)  # EOF: the client closed it or died; a byte: nothing is expected, so also the end
        except (OSError, WeightCacheProtocolError):
            pass
        finally:
            with self.lease_lock:
                del self.leases[id(conn)]
        return True

    def _stop_reply(self) -> dict:
        with self.lease_lock:
            clients = len(self.leases)
        waits = clients > 0 and self.store.free_waits_for_clients
        return {"ok": True, "stopping": True, "clients": clients, "draining": waits,
                "message": f"freeing the {self.store.where} once {clients} attached client(s) detach" if waits else
                f"stopped; {clients} attached client(s) keep their mapping"}

    def _status(self) -> dict:
        with self.lease_lock:
            client_pids = sorted(self.leases.values())
        return {"ok": True, "pid": os.getpid(), "model": self.model_path, "device": self.device,
                "family": self.family, "fingerprint": self.fingerprint, **self.store.fields,
                "tensor_parallel": self.tensor_parallel,
                "nbytes": self.nbytes, "arrays": len(self.index), "attaches": self.attaches,
                "clients": len(client_pids), "client_pids": client_pids, "stopping": self.stop_event.is_set(),
                "uptime_s": time.time() - self.started}

    def _reply(self, request: dict) -> dict:
        op = request.get("op")
        if op == "status":
            return self._status()
        return {"ok": False, "error": f"unknown op {op!r}; expected attach, status or stop"}


def serve(model_path, *, device: int = 0, socket_dir=None, dtype="bfloat16", backend: str = "auto",
          tensor_parallel: int = 1, message_timeout: float = MESSAGE_TIMEOUT, ready=None) -> None:
    """Runs a daemon until ``stop`` or SIGTERM/SIGINT; cleans up segment, socket and lock on the way out."""
    daemon = Daemon(model_path, device=device, socket_dir=socket_dir, dtype=dtype, backend=backend,
                    tensor_parallel=tensor_parallel, message_timeout=message_timeout)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: daemon.stop_event.set())
    try:
        daemon.prepare()
        daemon.listen()
        if ready is not None:
            ready(daemon)
        daemon.serve_forever()
    finally:
        daemon.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
