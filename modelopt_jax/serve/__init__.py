"""``python -m modelopt_jax serve``: an OpenAI-compatible HTTP server on the generation engine.

- :mod:`.protocol`: request bodies -> validated :class:`~modelopt_jax.SamplingParams` (or a 4xx naming the field);
- :mod:`.streams`: per-request streams of token deltas (text and stop strings are made here);
- :mod:`.core_protocol`: the typed messages between the frontend and the engine core (msgspec);
- :mod:`.core_loop`: the engine core's work (requests in, one step, outputs out), apart from transport;
- :mod:`.core` / :mod:`.core_client`: the engine-core process and the frontend's handle on it (ZeroMQ);
- :mod:`.engine_thread`: the same loop on a thread of this process (``build_app(llm)``);
- :mod:`.responses`: the JSON of answers and stream chunks;
- :mod:`.app`: the Starlette routes; :mod:`.server`: uvicorn on a bound socket.

The web stack is the optional ``[serve]`` extra (``pip install ".[serve]"``); importing this
package needs none of it, and :func:`require` says what is missing.
"""

from __future__ import annotations

from modelopt_jax.errors import MissingDependencyError

EXTRA = "[serve]"


def require() -> None:
    """Raises :class:`MissingDependencyError` naming the extra when the server's packages are missing."""
    missing = []
    for module in ("starlette", "uvicorn", "jinja2", "zmq", "msgspec", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingDependencyError(f"the server needs {', '.join(missing)}: pip install \".{EXTRA}\" from a source "
                                     f"checkout (or pip install 'modelopt-jax{EXTRA}')")
