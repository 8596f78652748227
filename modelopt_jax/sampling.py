"""Sampling parameters and the on-device sampler (greedy, temperature, top-k, top-p, seeded).

All rows of a batch are sampled in one jitted call; per-row settings are arrays, so requests with
different parameters share a decode step. Greedy (temperature 0) is an exact argmax. Log-probs are
those of the model's raw distribution (log-softmax of the logits, before temperature/top-k/top-p),
which is what scoring text needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from modelopt_jax.errors import RequestError, RequestTypeError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM-compatible names).

    ``temperature`` 0 means greedy. ``top_k`` <= 0 disables top-k; ``top_p`` 1.0 disables top-p.
    ``seed`` makes sampling reproducible per request. Generation stops at any EOS id of the
    checkpoint (unless ``ignore_eos``), at ``stop_token_ids``, at any of the ``stop`` strings (the
    output text is cut before it, unless ``include_stop_str_in_output``; the token ids keep the
    token that completed it, as in vLLM), or after ``max_tokens``.
    ``logprobs=k`` returns, per generated token, its log-prob and the top-k alternatives;
    ``prompt_logprobs=k`` does the same for every prompt token after the first.
    ``n`` samples are returned per prompt, each its own sequence with its own random stream (sample
    0's is the request's, so n=1 and sample 0 of n>1 draw the same tokens for one seed); the prompt
    is computed once and its pages shared. ``best_of`` (>= n) samples are drawn and the n of highest
    cumulative log-prob returned.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: str | Sequence[str] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self):
        """Every field checked here, so a bad value fails when the request is built, naming the field."""
        _integer("n", self.n, low=1, high=MAX_SAMPLES)
        if self.best_of is not None:
            _integer("best_of", self.best_of, low=1, high=MAX_SAMPLES)
            if self.best_of < self.n:
                raise RequestError(f"SamplingParams: best_of={self.best_of} must be >= n={self.n}")
        _integer("max_tokens", self.max_tokens, low=1)
        _real("temperature", self.temperature)
        if not self.temperature >= 0:
            raise RequestError(f"SamplingParams: temperature must be >= 0, got {self.temperature!r}")
        _integer("top_k", self.top_k, low=-(1 << 31), high=(1 << 31) - 1)  # an int32 on the device
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _integer("seed", self.seed, low=-(1 << 63), high=(1 << 64) - 1)
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise RequestTypeError(f"SamplingParams: stop_token_ids must be a sequence of token ids, "
                                   f"got {type(self.stop_token_ids).__name__}")
        stop = tuple(self.stop_token_ids)
        for t in stop:
            _integer("stop_token_ids[...]", t, low=0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        for name in ("include_stop_str_in_output", "ignore_eos"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise RequestTypeError(f"SamplingParams: {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value, low=0, high=MAX_LOGPROBS)


MAX_LOGPROBS = 1024  # alternatives per position at most (the vocabulary bounds it further, at generate)
MAX_SAMPLES = 1024  # n / best_of at most: each sample is a sequence of its own in the engine


def _integer(name: str, value, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise RequestTypeError(f"SamplingParams: {name} must be an integer, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = ("a positive integer" if low == 1 else f">= {low}") if high is None else f"in [{low}, {high}]"
        raise RequestError(f"SamplingParams: {name} must be {bounds}, got {value!r}")


def _stop_strings(stop) -> tuple[str, ...]:
    """``stop``: one string or a sequence of them (vLLM's ``str | list[str] | None``), as a tuple."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, bytes) or not isinstance(stop, Iterable):
        raise RequestTypeError(f"SamplingParams: stop must be a string or a sequence of strings, "
                               f"got {type(stop).__name__}")
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str):
            raise RequestTypeError(f"SamplingParams: stop must hold strings, got {s!r} ({type(s).__name__})")
        if not s:
            raise RequestError("SamplingParams: stop strings must not be empty (an empty string would match at once)")
    return stop


def _real(name: str, value) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise RequestTypeError(f"SamplingParams: {name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise RequestError(f"SamplingParams: {name} must be finite, got {value!r}")


def _tempered(logits, temperature):
    """The logits a row draws from (shared by the samplers: "tempered" must draw what "truncated" does)."""
    return logits / jnp.maximum(temperature, 1e-6)


def _sample_row(logits, temperature, top_k, top_p, key):
    """One row: argmax when temperature == 0, else a draw from the truncated, tempered distribution."""
    vocab = logits.shape[-1]
    scaled = _tempered(logits, temperature)
    sorted_desc = jnp.sort(scaled)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = sorted_desc[k - 1]
    # top-p acts on the top-k-truncated, renormalized distribution, as in vLLM and HF transformers
    # (top-k first, then top-p). Computing it on the full distribution kept too many tokens: with
    # probs (.4, .25, ...), top_k=3, top_p=.45 it kept 2 tokens where vLLM keeps 1.
    in_top_k = jnp.arange(vocab) < k
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf))
    cum = jnp.cumsum(probs)
    # smallest prefix whose mass reaches top_p: keep tokens whose preceding mass is < top_p
    # (top_p 1 keeps everything: the float32 cumsum can reach 1.0 before the tail's last tokens);
    # the most likely token always stays (a top_p under float32's range arrives here as 0)
    keep_sorted = in_top_k & ((top_p >= 1) | ((cum - probs) < top_p) | (jnp.arange(vocab) == 0))
    p_threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf))
    masked = jnp.where((scaled >= kth) & (scaled >= p_threshold), scaled, -jnp.inf)
    drawn = jax.random.categorical(key, masked)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


SAMPLERS = ("greedy", "tempered", "truncated")


def sampler_for(params: Iterable[SamplingParams]) -> str:
    """The cheapest of :data:`SAMPLERS` that is exact for every row of ``params``.

    "greedy" when no row samples (argmax only); "tempered" when rows sample but none truncates its
    distribution (one categorical draw per row); else "truncated" (a sort of each row's logits for
    top-k/top-p). The sort is what a step must not pay for without need: at batch 64 over Llama-3's
    128k vocabulary it took 0.95 ms of an 8.5 ms decode step on the H200, for greedy rows that
    ignore it.
    """
    sampler = "greedy"
    for p in params:
        if p.temperature > 0:
            if p.top_k > 0 or p.top_p < 1:
                return "truncated"
            sampler = "tempered"
    return sampler


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           keys: jax.Array, sampler: str = "truncated") -> jax.Array:
    """``logits`` [B, V] float32 -> token ids [B]; per-row ``temperature``/``top_k``/``top_p``/``keys``.

    ``sampler`` (static, from :func:`sampler_for`) picks a cheaper program where it is exact: every
    sampler gives a row the token "truncated" gives it, as long as the rows fit the sampler.
    """
    if sampler == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampler == "tempered":
        drawn = jax.vmap(lambda row, t, key: jax.random.categorical(key, _tempered(row, t)))(logits, temperature, keys)
        return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    if sampler != "truncated":
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    return jax.vmap(_sample_row)(logits, temperature, top_k, top_p, keys)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    """(log-prob of ``tokens`` [B], top-``k`` log-probs [B, k], their ids [B, k]) of the raw logits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if k == 0:
        return chosen, jnp.zeros(tokens.shape + (0,), jnp.float32), jnp.zeros(tokens.shape + (0,), jnp.int32)
    top_vals, top_ids = jax.lax.top_k(logp, k)
    return chosen, top_vals, top_ids
