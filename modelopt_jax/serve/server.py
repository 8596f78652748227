"""Runs the app under uvicorn on a socket bound here, so ``--port 0`` works and the real address is known."""

from __future__ import annotations

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


def serve(app, sock: socket.socket, *, log_level: str = "info") -> None:
    """Serves ``app`` on ``sock`` until SIGINT or SIGTERM (from the main thread), then shuts down
    gracefully (open streams get up to 10 s; the app stops its engine thread) and returns.

    uvicorn re-raises the signal it handled once it has shut down, which would end the process
    by that signal (exit status -2 / -15) after a shutdown that went well: the handlers installed
    here turn it into a normal return, so the command exits 0.
    """
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s: %(message)s")
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, access_log=log_level == "debug")
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except _Stop:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
