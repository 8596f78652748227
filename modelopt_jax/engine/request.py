"""One request's state inside the engine, and what it returns to the caller."""

from __future__ import annotations

import dataclasses

import numpy as np

from modelopt_jax.sampling import SamplingParams


@dataclasses.dataclass
class RequestOutput:
    """What one prompt produced. ``logprobs[i]`` maps token id -> log-prob for generated token i
    (the chosen token and the top-k); ``prompt_logprobs[0]`` is None (nothing predicts token 0)."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS / stop token / stop string) or "length"
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS / length)


def logprob_entry(token: int, chosen, top_values, top_ids, k: int | None) -> dict[int, float]:
    """{token: its log-prob} plus the top-``k`` alternatives (the token itself is not repeated)."""
    entry = {token: float(chosen)}
    for j in range(k or 0):
        entry.setdefault(int(top_ids[j]), float(top_values[j]))
    return entry


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt moving through the engine.

    ``tokens`` (prompt + generated) is what the model has seen or will see; ``computed`` of them
    have their keys/values in the pool, in ``pages``. After a preemption ``computed`` drops to 0
    and the pages go back to the pool; the tokens stay, so the request resumes by recomputing them.

    ``inflight`` counts tokens sampled by steps that are launched but not yet collected (0-2: the
    engine schedules the next step while the device runs the current one). They count in
    :attr:`length`, but their values live on the device: ``inflight_row`` is the request's row in
    the last launched step, whose sampled-token array the next step reads its input from.

    ``detokenizer`` (an :class:`~modelopt_jax.detokenizer.IncrementalDetokenizer`, attached by
    ``LLM`` when there are stop strings or a caller streams text) grows the text token by token.
    """

    index: int                      # position in the caller's list: outputs come back in this order
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    budget: int                     # how many tokens it may generate (max_tokens, capped by max_model_len)
    row_key: np.ndarray             # uint32[2] PRNG key of this request; token i uses fold_in(row_key, i)
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    finish_reason: str | None = None
    inflight: int = 0
    inflight_row: int = -1
    stop_reason: int | str | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer, or None: the text is decoded once, at the end

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated) + self.inflight

    @property
    def sampled_all(self) -> bool:
        """Whether the tokens sampled so far (known or in flight) use up the request's budget."""
        return len(self.generated) + self.inflight >= self.budget

    @property
    def pending(self) -> int:
        """Tokens not yet fed to the model."""
        return self.length - self.computed

    def token_at(self, position: int) -> int | None:
        """The token at ``position``; None for a token still in flight (its value is on the device)."""
        n = len(self.prompt_ids)
        if position < n:
            return self.prompt_ids[position]
        return self.generated[position - n] if position - n < len(self.generated) else None

    def accept(self, token: int, chosen, top_v, top_i) -> None:
        """Records a sampled token (the oldest in flight, if any) and decides whether the request is done."""
        self.inflight = max(self.inflight - 1, 0)
        self.generated.append(token)
        self.logprobs.append(logprob_entry(token, chosen, top_v, top_i, self.params.logprobs))
        hit_stop_string = self.detokenizer is not None and self.detokenizer.add(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            self.stop_reason = token if token in self.params.stop_token_ids else None  # None: EOS
        elif hit_stop_string:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_reason
        elif len(self.generated) >= self.budget:
            self.finish_reason = "length"
        if self.finish_reason is not None and self.detokenizer is not None:
            self.detokenizer.finish()

    def output(self, tokenizer) -> RequestOutput:
        prompt_lp = None
        if self.params.prompt_logprobs is not None:
            prompt_lp = [None] + [self.prompt_logprobs.get(p) for p in range(1, len(self.prompt_ids))]
        if self.detokenizer is not None:
            text = self.detokenizer.text
        else:
            text = None if tokenizer is None else tokenizer.decode(self.generated, skip_special_tokens=True)
        return RequestOutput(
            prompt=self.prompt, prompt_token_ids=self.prompt_ids, token_ids=list(self.generated), text=text,
            finish_reason=self.finish_reason,
            cumulative_logprob=float(sum(e[t] for e, t in zip(self.logprobs, self.generated))),
            logprobs=self.logprobs if self.params.logprobs is not None else None, prompt_logprobs=prompt_lp,
            stop_reason=self.stop_reason)
