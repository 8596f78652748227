"""The frontend's handle on the engine-core process (:mod:`.core`): start it, talk to it, notice its end.

:meth:`CoreClient.launch` binds two ZeroMQ sockets in a fresh directory only this user may enter
(``ipc://``: Unix sockets, so no other user can connect), starts ``python -m
modelopt_jax.serve.core`` with the LLM options on its stdin, and waits until it says ``Ready``
(or why it could not load, raised as :class:`~modelopt_jax.errors.EngineCoreError`).

While serving, the event loop sends :class:`~.core_protocol.Submit` and ``Abort`` messages, and a
reader thread receives one ``StepOutputs`` per engine step and hands it to the
:class:`~.streams.StreamRouter` (which wakes the streams' event loop). The reader also watches the
process: if the core dies, every open stream fails at once, later requests get 503, and
``on_death`` is called (the CLI stops the server and exits with the core's status).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from modelopt_jax.engine.request import Request
from modelopt_jax.errors import EngineCoreError
from modelopt_jax.serve.core_protocol import (Abort, CoreFailed, EngineGauges, IpcError, Ready, Shutdown, StepOutputs,
                                              Submit, decode_from_core, encode)
from modelopt_jax.serve.streams import EngineFailure, Stream, StreamRouter

log = logging.getLogger(__name__)

POLL_MS = 200   # how often the reader looks at the core process while no message arrives


def socket_base() -> str:
    """Where the socket directories go: the temp directory, unless its path is so long that a Unix
    socket's (at most 107 bytes) would not fit, as under some sandboxes; then /tmp."""
    base = tempfile.gettempdir()
    return base if len(base) <= 60 or not os.path.isdir("/tmp") else "/tmp"


class CoreClient:
    """The engine core as the app sees it (the same methods as :class:`~.engine_thread.EngineThread`).

    ``options``: ``LLM`` keyword arguments (``model`` included) plus ``quiet``; ``tokenizer``: the
    frontend's tokenizer, for the streams' text."""

    def __init__(self, options: dict, *, tokenizer, on_death=None):
        self.options, self.on_death = dict(options), on_death
        self.router = StreamRouter(tokenizer, self._abort)
        self.gauges: EngineGauges | None = None   # after the core's last step
        self.ready: Ready | None = None
        self.death: str | None = None             # why the core is gone, once it is
        self._lock = threading.Lock()             # one sender at a time on the outgoing socket
        self._stopping = False                    # the reader should end
        self._exit_expected = False               # the core was told to exit: its end is no death
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._dir = tempfile.mkdtemp(prefix="modelopt_jax-core-", dir=socket_base())  # mode 0700
        self._context = zmq.Context()
        self._to_core, self._from_core = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        for sock in (self._to_core, self._from_core):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._to_core.bind(f"ipc://{self._dir}/to_core")
        self._from_core.bind(f"ipc://{self._dir}/from_core")

    @property
    def stats(self) -> dict:
        return {}

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # -- start-up ------------------------------------------------------------------------------

    def launch(self, timeout: float | None = None) -> Ready:
        """Starts the core and waits until it has loaded the model (``timeout`` seconds at most)."""
        self._proc = subprocess.Popen([sys.executable, "-m", "modelopt_jax.serve.core", self._dir],
                                      stdin=subprocess.PIPE, stdout=sys.stderr.fileno())
        self._proc.stdin.write(json.dumps(self.options).encode())
        self._proc.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._from_core.poll(POLL_MS):
                message = decode_from_core(self._from_core.recv())
                if isinstance(message, Ready):
                    self.ready = message
                    return message
                if isinstance(message, CoreFailed):
                    self._proc.wait(30)
                    self.close()
                    raise EngineCoreError(f"the engine core could not load {self.options.get('model')}: "
                                          f"{message.reason}")
            status = self._proc.poll()
            if status is not None:
                self.close()
                raise EngineCoreError(f"the engine core exited with status {status} while loading "
                                      f"{self.options.get('model')} (its log is above)")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise EngineCoreError(f"the engine core did not load {self.options.get('model')} in {timeout} s")

    def start(self) -> None:
        """Starts the reader (after :meth:`launch`)."""
        if self.ready is None:
            raise EngineCoreError("CoreClient.start before launch")
        self._reader = threading.Thread(target=self._read, name="modelopt_jax-core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.death is None and self._proc is not None and self._proc.poll() is None

    # -- requests ------------------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> Stream:
        if not self.alive:
            raise EngineFailure(f"the engine core is not running ({self.death or 'not started'})")
        stream, core_requests = self.router.open(requests)
        self._send(Submit(core_requests))
        return stream

    def _abort(self, ids: list[int]) -> None:
        if self.alive:
            self._send(Abort(ids))

    def _send(self, message) -> None:
        with self._lock:
            self._to_core.send(encode(message))

    # -- the reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        while not self._stopping:
            try:
                if self._from_core.poll(POLL_MS):
                    message = decode_from_core(self._from_core.recv())
                    if isinstance(message, StepOutputs):
                        if message.gauges is not None:
                            self.gauges = message.gauges
                        self.router.deliver(message.outputs)
                    elif isinstance(message, CoreFailed):
                        log.error("the engine core failed: %s", message.reason)
                    continue
            except (zmq.ZMQError, IpcError) as e:
                if self._stopping:
                    return
                log.error("reading from the engine core: %s", e)
            status = self._proc.poll()
            if status is not None:
                if not self._exit_expected:
                    self._died(f"the engine core exited with status {status}")
                return

    def _died(self, reason: str) -> None:
        self.death = reason
        log.error("%s; failing %d open requests", reason, len(self.router))
        self.router.fail_all(EngineFailure(reason))
        if self.on_death is not None:
            self.on_death(reason)

    # -- shutdown ------------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Tells the core to fail what is left and exit; waits for it (kills it after ``timeout``)."""
        self._exit_expected = True
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._send(Shutdown("the server stops"))
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + timeout
            while self._proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the reader delivers the core's last outputs meanwhile
        self._stopping = True
        if self._reader is not None:
            self._reader.join(5)
        if self.death is None:
            self.death = "the server stopped"
        self.router.fail_all(EngineFailure("the server is shutting down"))
        self.close()

    def close(self) -> None:
        """Ends the process (if still there), closes the sockets and removes their directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        if not self._context.closed:
            self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
