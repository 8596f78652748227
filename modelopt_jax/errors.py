"""Typed errors for everything that can be wrong with a checkpoint or a request.

Every error raised while reading a checkpoint names the file, the tensor (when there is one) and
what was expected versus what was found, so a user can fix the checkpoint without a debugger.
All of them derive from :class:`ModelOptJaxError`; the ones about bad input also derive from
``ValueError`` so generic ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class ModelOptJaxError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointError(ModelOptJaxError, ValueError):
    """The checkpoint directory or one of its files is unreadable or malformed."""


class ConfigError(CheckpointError):
    """config.json / hf_quant_config.json is malformed, inconsistent or unsupported."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model needs is not in the checkpoint (or a shard named by the index is missing)."""

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class InvalidScaleError(CheckpointError):
    """A quantization scale is NaN, infinite, zero or negative."""


class NonFiniteTensorError(CheckpointError):
    """A weight holds NaN or infinity (an FP8 NaN code, ``inf`` in a bf16 norm weight, ...)."""


class ShapeMismatchError(CheckpointError):
    """A tensor's shape does not match what config.json implies."""


class DtypeMismatchError(CheckpointError):
    """A tensor's dtype is not the one its role requires (e.g. a weight that should be F8_E4M3)."""


class UnsupportedQuantizationError(ModelOptJaxError, NotImplementedError):
    """The checkpoint uses a quantization algorithm this package does not run."""


class UnsupportedModelError(ConfigError):
    """The architecture (or one of its options) is not implemented."""


class InvalidArgumentError(ModelOptJaxError, ValueError):
    """An argument of ``LLM(...)``, ``load(...)`` or the CLI is out of range or names nothing usable."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type or is not a known keyword."""


class RequestError(InvalidArgumentError):
    """A generation request is malformed: a prompt, a sampling parameter or a generate() argument.

    Raised when the request object is built (``SamplingParams(...)``) or when ``generate`` reads
    its arguments, before any work starts; the message names the argument.
    """


class RequestTypeError(RequestError, ArgumentTypeError):
    """A request argument has the wrong type (e.g. ``seed="abc"``, ``generate(None)``)."""


class ChatTemplateError(RequestError):
    """A chat cannot be rendered: the checkpoint has no chat template (and none was passed), the
    template does not parse, or it raised (``raise_exception``, e.g. roles that do not alternate)."""


class MissingDependencyError(ModelOptJaxError, ImportError):
    """An optional feature's package is not installed (the message names the extra that brings it)."""


class BackendUnavailableError(ModelOptJaxError, RuntimeError):
    """The requested GEMM backend cannot run here (not built, or no device for it)."""


class WeightCacheError(ModelOptJaxError, RuntimeError):
    """The weight-cache daemon is absent, refused a request, or spoke an invalid message.

    ``mismatch`` lists the fingerprint fields that differ when the daemon serves another
    processing of the checkpoint (empty otherwise), so callers can tell "wrong daemon" apart.
    """

    def __init__(self, message: str, *, mismatch: list[str] | None = None):
        super().__init__(message)
        self.mismatch = list(mismatch or [])


class WeightCachePermissionError(WeightCacheError):
    """A weight-cache directory, socket peer or shared-memory segment is not this user's own.

    Raised before anything is mapped: another user could otherwise serve poisoned weights.
    """


class WeightCacheNotServingError(WeightCacheError):
    """No daemon listens on the socket (no directory, no socket file, or the connection was refused).

    Unlike a daemon that died mid-reply, this is what a daemon still loading looks like, so
    ``weight_cache="require"`` waits on it while the daemon holds its lock.
    """


class WeightCacheProtocolError(WeightCacheError):
    """A malformed, oversized or truncated weight-cache message (or a timeout while reading one)."""


class UnsupportedForWeightCacheError(WeightCacheError, NotImplementedError):
    """The checkpoint's quantization cannot be served from processed buffers (e.g. FP8_PB_WO)."""


class EngineCoreError(ModelOptJaxError, RuntimeError):
    """The server's engine-core process could not start, or stopped (the reason names why)."""
