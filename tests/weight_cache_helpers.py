"""The weight-cache daemon as a test subprocess (shared by the weight-cache test files)."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import threading
import time

from modelopt_jax.errors import WeightCacheError
from modelopt_jax.weight_cache import paths
from modelopt_jax.weight_cache.client import request

REPO = pathlib.Path(__file__).resolve().parent.parent
STARTED: list["DaemonProcess"] = []  # every daemon a test started (conftest checks what each left behind)


class DaemonProcess:
    """``python -m modelopt_jax weight-cache serve`` as a subprocess; ``prefix`` runs it under a
    wrapper (``unshare --pid --fork``), where its pid is not ``proc.pid``."""

    def __init__(self, model, socket_dir, *, dtype="float32", device=0, env=None, wait=True, tp=1, prefix=(),
                 extra=()):
        self.dir = str(socket_dir)
        self.device = device
        self.sock = os.path.join(self.dir, f"device-{device}.sock")
        self.prefix = tuple(prefix)
        cmd = [*self.prefix, sys.executable, "-m", "modelopt_jax", "weight-cache", "serve", "--model", str(model),
               "--dtype", dtype, "--device", str(device), "--socket-dir", self.dir, "--tensor-parallel", str(tp),
               *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.segments: set[str] = set()  # host shared-memory segments it named (read from its lock file)
        STARTED.append(self)
        # Drain the daemon's log as it comes: a pipe nobody reads fills at 64 KB, and a daemon that
        # logs (every refused or malformed request does) then blocks in write() and stops answering.
        self._log: list[str] = []
        self._drain = threading.Thread(target=lambda: self._log.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self._drain.start()
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.proc.kill()  # never leave an orphaned daemon behind a failed test
                self.proc.wait()
                raise

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:  # a stale socket of a killed daemon may exist: wait until *this* one answers
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.output()}")
            try:
                reply = request("status", socket_dir=self.dir, device=self.device, timeout=5)
                if reply.get("pid") == self.proc.pid or (self.prefix and reply.get("ok")):
                    self.note_segment()
                    return
            except WeightCacheError:
                pass
            assert time.monotonic() < deadline, "daemon did not open its socket"
            time.sleep(0.05)

    def stop(self):
        """Stops the daemon and waits for it to exit, except when it reports ``draining``: a CUDA
        store outlives ``stop`` while a client (e.g. a model this test still holds on purpose) views
        it. Such a daemon gets a few seconds for models this process has dropped to release their
        views, and is then left to exit when its last client detaches (at the latest with this process)."""
        gc.collect()  # models the test no longer references release their leases now
        if self.proc.poll() is None:
            reply = {}
            try:
                reply = request("stop", socket_dir=self.dir, device=self.device)
                if not reply.get("ok"):
                    self.proc.terminate()  # e.g. the uid test: SIGTERM must clean up as well
            except WeightCacheError:
                self.proc.terminate()
            try:
                self.proc.wait(5 if reply.get("draining") else 20)
            except subprocess.TimeoutExpired:
                if reply.get("draining"):
                    return self.output()
                self.proc.kill()
                self.proc.wait()
        return self.output()

    def note_segment(self) -> None:
        """Records the segment the daemon names in its lock file (a host store's; none for CUDA)."""
        try:
            fd = os.open(paths.lock_path(self.dir, self.device), os.O_RDONLY)
        except OSError:
            return
        try:
            name = paths.read_lock_info(fd).get("segment")
        finally:
            os.close(fd)
        if isinstance(name, str) and name.startswith("mojwc_"):
            self.segments.add(name)

    def leftovers(self) -> list[str]:
        """The segments of this daemon still in /dev/shm after it exited: a leak (a killed daemon's
        is removed by ``weight-cache stop``, as a user would). Empty while it still runs."""
        if self.proc.poll() is None:
            return []
        return sorted(name for name in self.segments if os.path.exists(f"/dev/shm/{name}"))

    def output(self) -> str:
        """The daemon's log so far (all of it once the process has exited)."""
        if self.proc.poll() is not None:
            self._drain.join(timeout=10)
        return "".join(self._log)
