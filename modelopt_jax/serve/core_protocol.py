"""The messages between the server's frontend and its engine core, and their wire encoding.

The frontend sends :class:`Submit` (one HTTP request's engine requests), :class:`Abort` and
:class:`Shutdown`; the core answers with one :class:`StepOutputs` per engine step (every request
that got a token in it, plus the engine's gauges), once :class:`Ready` after loading, and
:class:`CoreFailed` if it cannot go on. msgspec encodes them as MessagePack arrays (field order,
no field names), tagged by type, so a step of 512 requests costs well under a millisecond to
cross. The same structs are used in-process by the engine thread, so both paths hand the
frontend the same values.

The core trusts nothing it decodes beyond its type: the frontend is the only peer (the sockets
live in a directory only this user can enter), but a malformed message is still answered by a
typed error rather than a crash (:func:`decode`).
"""

from __future__ import annotations

import msgspec

from modelopt_jax.errors import ModelOptJaxError


class IpcError(ModelOptJaxError):
    """A message between the frontend and the engine core that cannot be decoded, or a dead peer."""


class CoreRequest(msgspec.Struct, array_like=True):
    """One sequence to generate (one sample of one prompt), as the frontend validated it."""

    id: int                         # frontend-chosen, unique among the live requests
    prompt_ids: list[int]
    params: dict                    # SamplingParams' fields (rebuilt and checked again by the core)
    stop_ids: list[int]             # token ids that end it (stop_token_ids, plus EOS unless ignore_eos)
    budget: int                     # tokens it may generate (max_tokens capped by max_model_len)
    row_key: list[int]              # uint32[2]: its PRNG key (token i samples with fold_in(row_key, i))
    sample_index: int               # which of its prompt's samples (n / best_of)


class Submit(msgspec.Struct, tag=True, array_like=True):
    """Frontend -> core: start these requests."""

    requests: list[CoreRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Frontend -> core: drop these requests (client gone, or a stop string ended them); unknown ids are ignored."""

    ids: list[int]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Frontend -> core: fail what is left and exit."""

    reason: str


class TokenOutput(msgspec.Struct, array_like=True):
    """What one step gave one request."""

    id: int
    token_ids: list[int]            # new tokens, oldest first (usually one)
    chosen_logprobs: list[float]    # the log-prob of each new token (ranks best_of samples)
    logprobs: list[dict[int, float]] | None  # per new token {token: logprob, top-k...}; None unless asked
    finish_reason: str | None       # "stop" (stop token / EOS), "length", "abort"; None while running
    stop_reason: int | None         # the stop token that ended it (None: EOS, or not stopped by a token)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first output only, when asked
    error: str | None = None        # the request failed (its step failed, or the core is going away)


class EngineGauges(msgspec.Struct, array_like=True):
    """The engine's state after a step (what /metrics reports)."""

    running: int                    # requests being generated
    waiting: int                    # requests queued for admission (preempted ones included)
    kv_cache_usage: float           # fraction of KV pages held by requests (cached-but-free pages excluded)
    prefix_cache_hit_tokens: int    # prompt tokens taken from the prefix cache, since start
    preemptions: int                # since start
    programs: int                   # distinct step programs run since start (from the table or compiled in line)
    decodes_while_compiling: int    # steps whose prompt chunks waited for their program to compile, since start


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    """Core -> frontend: the outputs of one step (or of a failure), and the gauges after it."""

    outputs: list[TokenOutput]
    gauges: EngineGauges | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Core -> frontend, once: the model is loaded and the loop runs."""

    pid: int
    load_seconds: float
    max_model_len: int


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """Core -> frontend: the core cannot start or go on (the reason is for the operator's log)."""

    reason: str


ToCore = Submit | Abort | Shutdown
FromCore = StepOutputs | Ready | CoreFailed

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> Submit | Abort | Shutdown:
    try:
        return _to_core.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise IpcError(f"engine core: a message from the frontend does not decode ({e})") from None


def decode_from_core(data: bytes) -> StepOutputs | Ready | CoreFailed:
    try:
        return _from_core.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise IpcError(f"frontend: a message from the engine core does not decode ({e})") from None
