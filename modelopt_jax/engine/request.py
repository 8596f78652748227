"""One request's state inside the engine, and what it returns to the caller."""

from __future__ import annotations

import dataclasses

import numpy as np

from modelopt_jax.sampling import SamplingParams


@dataclasses.dataclass
class CompletionOutput:
    """One sampled sequence of a prompt (vLLM's shape). ``logprobs[i]`` maps token id -> log-prob
    for generated token i (the chosen token and the top-k)."""

    index: int                      # which of the prompt's n samples (0..n-1)
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str              # "stop" (EOS / stop token / stop string), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS / length)


@dataclasses.dataclass
class RequestOutput:
    """What one prompt produced: its ``outputs`` (``SamplingParams.n`` of them). ``text``,
    ``token_ids``, ``finish_reason``, ``stop_reason``, ``cumulative_logprob`` and ``logprobs`` are
    those of ``outputs[0]`` (scripts written for n = 1 keep working). ``prompt_logprobs[0]`` is
    None (nothing predicts token 0)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def cumulative_logprob(self) -> float:
        return self.outputs[0].cumulative_logprob

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


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
    dropped: int = 0                # leading pages given back as they left a sliding window (0 entries in pages)
    computed: int = 0
    finish_reason: str | None = None
    inflight: int = 0
    inflight_row: int = -1
    stop_reason: int | str | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer, or None: the text is decoded once, at the end
    sample_index: int = 0           # which of its prompt's samples (SamplingParams.n / best_of) this is
    page_keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix-cache keys of its full, known pages
    registered: int = 0             # leading pages already offered to the prefix cache
    cached_tokens: int = 0          # prompt tokens whose keys/values came from the prefix cache (last admission)

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

    def known_tokens(self) -> list[int]:
        """Prompt and generated tokens whose values the host has (not those in flight)."""
        return self.prompt_ids + self.generated if self.generated else self.prompt_ids

    def prompt_logprobs_list(self) -> list[dict[int, float] | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        return [None] + [self.prompt_logprobs.get(p) for p in range(1, len(self.prompt_ids))]

    def completion(self, tokenizer, index: int | None = None) -> CompletionOutput:
        if self.detokenizer is not None:
            text = self.detokenizer.text
        else:
            text = None if tokenizer is None else tokenizer.decode(self.generated, skip_special_tokens=True)
        return CompletionOutput(
            index=self.sample_index if index is None else index, text=text, token_ids=list(self.generated),
            cumulative_logprob=float(sum(e[t] for e, t in zip(self.logprobs, self.generated))),
            logprobs=self.logprobs if self.params.logprobs is not None else None, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)

    def output(self, tokenizer) -> RequestOutput:
        """This request alone as an output (n = 1)."""
        return RequestOutput(prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                             outputs=[self.completion(tokenizer)], prompt_logprobs=self.prompt_logprobs_list())


def group_outputs(requests: list[Request], tokenizer) -> list[RequestOutput]:
    """One output per prompt from requests that may hold several samples of it (``sample_index``),
    in prompt order. With ``best_of`` > n the n samples of highest cumulative log-prob are kept,
    best first (vLLM's rule); otherwise samples keep their order."""
    by_prompt: dict[int, list[Request]] = {}
    for r in sorted(requests, key=lambda r: (r.index, r.sample_index)):
        by_prompt.setdefault(r.index, []).append(r)
    outputs = []
    for samples in by_prompt.values():
        first = samples[0]
        completions = [r.completion(tokenizer) for r in samples]
        n = first.params.n
        if len(completions) > n:
            completions = sorted(completions, key=lambda c: -c.cumulative_logprob)[:n]
            for i, c in enumerate(completions):
                c.index = i
        outputs.append(RequestOutput(prompt=first.prompt, prompt_token_ids=first.prompt_ids, outputs=completions,
                                     prompt_logprobs=first.prompt_logprobs_list()))
    return outputs
