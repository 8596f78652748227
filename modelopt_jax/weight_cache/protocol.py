"""Wire format: 4-byte big-endian length, then a UTF-8 JSON object. Never pickle.

Why JSON: a daemon must not execute what a peer sends (pickle would), and every field is small
metadata -- the weights themselves travel through shared memory. Every way a message can be
wrong (oversized, truncated, not UTF-8, not JSON, nested too deep, a number too long to parse,
not an object, a deadline missed) raises :class:`WeightCacheProtocolError`, so the daemon drops
that one connection and keeps serving. The timeout is a deadline for the whole message, not
for each read: a peer trickling one byte at a time cannot hold a connection open past it.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from modelopt_jax.errors import WeightCacheProtocolError

MAX_MESSAGE = 1 << 20  # requests; replies carry the layout and may be larger (see client)
MAX_REPLY = 64 << 20
_LEN = struct.Struct(">I")


def encode(obj: dict) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return _LEN.pack(len(data)) + data


def send(sock: socket.socket, obj: dict | bytes) -> None:
    """Sends ``obj``, or an already :func:`encode`-d message (the daemon encodes its layout once)."""
    try:
        sock.sendall(obj if isinstance(obj, bytes) else encode(obj))
    except OSError as e:
        raise WeightCacheProtocolError(f"cannot send weight-cache message: {e}") from e


def _read_exact(sock: socket.socket, n: int, what: str, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout
                sock.settimeout(left)
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout as e:
            raise WeightCacheProtocolError(f"timed out reading the {what} ({got} of {n} bytes)") from e
        except OSError as e:
            raise WeightCacheProtocolError(f"connection error reading the {what}: {e}") from e
        if not chunk:
            if got == 0 and what == "length prefix":
                raise EOFError("peer closed the connection")
            raise WeightCacheProtocolError(f"truncated message: {what} ended after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket, *, timeout: float | None = 30.0, max_bytes: int = MAX_MESSAGE) -> dict:
    """Reads one message within ``timeout`` seconds in all. Raises EOFError on a clean close between messages."""
    deadline = None if timeout is None else time.monotonic() + timeout
    sock.settimeout(timeout)
    (length,) = _LEN.unpack(_read_exact(sock, _LEN.size, "length prefix", deadline))
    if length > max_bytes:
        raise WeightCacheProtocolError(f"message of {length} bytes exceeds the limit of {max_bytes}")
    body = _read_exact(sock, length, "message body", deadline)
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an integer over Python's digit limit
        raise WeightCacheProtocolError(f"message is not UTF-8 JSON: {e}") from e
    except RecursionError as e:
        raise WeightCacheProtocolError("message is not UTF-8 JSON: nested too deeply") from e
    if not isinstance(obj, dict):
        raise WeightCacheProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    return obj
