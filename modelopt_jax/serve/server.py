"""Runs the app under uvicorn on a socket bound here, so ``--port 0`` works and the real address is known."""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket

from modelopt_jax.errors import InvalidArgumentError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port), IPv4 or IPv6 as ``host`` resolves."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        # checked here: getaddrinfo takes the port modulo 65536, so 99999 would listen on 34463
        raise InvalidArgumentError(f"--port {port!r}: expected an integer in 0-65535 (0: any free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise InvalidArgumentError(f"--host {host!r}: cannot resolve it ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InvalidArgumentError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


class _Stop(BaseException):
    """SIGINT / SIGTERM, as uvicorn re-raises them after its graceful shutdown."""


def _stop(signum, frame):
    raise _Stop(signum)


HEADER_TIMEOUT_S = 10.0     # a connection that has not sent a whole request head by then is closed
DEFAULT_GRACE_S = 10.0      # SIGTERM: running requests may finish for this long, then their streams end
FD_MARGIN = 64              # descriptors kept for the process itself (files, the engine core's sockets)


def _http_protocol(header_timeout: float):
    """uvicorn's HTTP protocol (httptools where installed, else h11, as uvicorn picks) with a deadline
    on request heads: uvicorn has none, so a client trickling its headers would hold a connection
    forever. The deadline is armed when a connection opens and again when data starts a new
    request after a finished one; it closes the connection unless a request has begun by then.
    (Idle kept-alive connections are uvicorn's own timeout_keep_alive; bodies are the app's.)"""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class HeaderDeadline(base):
        _head_timer = None
        _armed_for = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            between = self.cycle is None or self.cycle.response_complete
            if between and (self._head_timer is None or self._armed_for is not self.cycle):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._armed_for = self.cycle
            self._head_timer = self.loop.call_later(header_timeout, self._deadline)

        def _deadline(self) -> None:
            self._head_timer = None
            waiting = self.cycle is self._armed_for and (self.cycle is None or self.cycle.response_complete)
            if waiting and not self.transport.is_closing():
                logging.getLogger(__name__).info("closing the connection from %s: no whole request head in %.0f s",
                                                 "%s:%s" % self.client if self.client else "?", header_timeout)
                self.transport.close()

    return HeaderDeadline


def connection_limit(requested: int | None = None) -> int:
    """How many connections (and their tasks) uvicorn may hold before answering 503: below what the
    descriptor limit allows (raised to its hard limit first), so an accept never fails for want of
    descriptors and /health keeps answering."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
            soft = max(soft, target)
        except (ValueError, OSError):
            pass
    ceiling = max(soft - FD_MARGIN, 16)
    return ceiling if requested is None else min(requested, ceiling)


class _Server:
    """uvicorn.Server that calls ``on_exit()`` at the first SIGINT / SIGTERM (the drain's start)."""

    def __new__(cls, config, on_exit):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                first = not self.should_exit
                super().handle_exit(sig, frame)
                if first and on_exit is not None:
                    on_exit()

        return Server(config)


def uvicorn_config(app, *, log_level: str = "info", access_log: bool = False, grace: float = DEFAULT_GRACE_S,
                   header_timeout: float = HEADER_TIMEOUT_S, limit_concurrency: int | None = None):
    """The uvicorn configuration the server runs with (tests start servers from it too)."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=access_log or log_level == "debug",
                          http=_http_protocol(header_timeout), limit_concurrency=connection_limit(limit_concurrency),
                          timeout_graceful_shutdown=int(grace) + 5)  # the app ends its streams at grace


def serve(app, sock: socket.socket, *, log_level: str = "info", access_log: bool = False,
          grace: float = DEFAULT_GRACE_S, header_timeout: float = HEADER_TIMEOUT_S,
          limit_concurrency: int | None = None) -> None:
    """Serves ``app`` on ``sock`` until SIGINT or SIGTERM (from the main thread), then drains: no new
    connections, running requests may finish for ``grace`` seconds, then each stream still open
    ends with an error event and ``[DONE]`` (``app.state.server.drain``); the app stops its engine
    and this returns.

    uvicorn re-raises the signal it handled once it has shut down, which would end the process
    by that signal (exit status -2 / -15) after a shutdown that went well: the handlers installed
    here turn it into a normal return, so the command exits 0.
    """
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s: %(message)s")
    config = uvicorn_config(app, log_level=log_level, access_log=access_log, grace=grace,
                            header_timeout=header_timeout, limit_concurrency=limit_concurrency)
    openai = getattr(getattr(app, "state", None), "server", None)
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _Server(config, on_exit=None if openai is None else lambda: openai.drain(grace)).run(sockets=[sock])
    except _Stop:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
