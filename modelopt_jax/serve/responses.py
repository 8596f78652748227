"""The JSON shapes of OpenAI responses and stream chunks, built from engine deltas.

Kept apart from the HTTP code so the shapes read in one place: completions (``text_completion``,
logprobs as parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists)
and chat (``chat.completion`` / ``chat.completion.chunk``, logprobs as ``content`` entries with
``token``, ``logprob``, ``bytes`` and ``top_logprobs``). A token's text is its own decode
(special tokens included), which for a byte-level token inside a multi-byte character is U+FFFD,
as in vLLM. ``stop_reason`` (vLLM's extension) is the stop string or stop token id that ended a
choice.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from modelopt_jax.serve.streams import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data) -> str:
    """One server-sent event carrying ``data`` as JSON (or the literal ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class TokenTexts:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self._tokenizer.decode([token], skip_special_tokens=False)
        return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])


def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, float]],
                        offset: int) -> tuple[dict, int]:
    """(the completions ``logprobs`` object for these tokens, the text offset after them)."""
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
            "top_logprobs": [{texts(i): v for i, v in _ranked(e)} for e in entries], "text_offset": offsets}, offset


def chat_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[dict[int, float]], top: int) -> list[dict]:
    """Chat ``logprobs.content`` entries; ``top`` alternatives each, best first."""
    out = []
    for t, e in zip(token_ids, entries):
        token = texts(t)
        out.append({"token": token, "logprob": e[t], "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [{"token": texts(i), "logprob": v, "bytes": list(texts(i).encode("utf-8"))}
                                     for i, v in _ranked(e)[:top]]})
    return out


@dataclasses.dataclass(frozen=True)
class Prompt:
    """What a response shows of one prompt: its text (``echo``) and token ids (their log-probs)."""

    text: str                       # the prompt as given, or its tokens decoded when given as ids
    token_ids: list[int]


class Choices:
    """Accumulates the deltas of a stream into whole choices (the non-streaming answer).

    The stream's requests are ``samples`` per prompt, prompt-major: request i is sample
    ``i % samples`` of prompt ``i // samples``. :meth:`ranked` gives, per prompt, the ``n`` samples
    returned (all of them, or the n of highest cumulative log-prob when best_of drew more)."""

    def __init__(self, count: int, samples: int = 1, n: int = 1):
        self.samples, self.n = samples, n
        self.text = [""] * count
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[dict]] = [[] for _ in range(count)]
        self.finish_reason: list[str | None] = [None] * count
        self.stop_reason: list = [None] * count
        self.prompt_tokens = [0] * count
        self.cumulative = [0.0] * count
        self.prompt_logprobs: list = [None] * count

    def add(self, d: Delta) -> None:
        i = d.index
        self.text[i] += d.text
        self.token_ids[i] += d.token_ids
        self.logprobs[i] += d.logprobs or []
        self.finish_reason[i], self.stop_reason[i], self.prompt_tokens[i] = d.finish_reason, d.stop_reason, \
            d.prompt_tokens
        self.cumulative[i] = d.cumulative_logprob
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[i] = d.prompt_logprobs

    def ranked(self) -> list[list[int]]:
        """Per prompt, the requests returned as its choices, in choice order."""
        out = []
        for first in range(0, len(self.text), self.samples):
            group = list(range(first, first + self.samples))
            if self.samples > self.n:
                group = sorted(group, key=lambda i: -self.cumulative[i])[:self.n]
            out.append(group)
        return out

    def usage(self) -> dict:
        """Prompt tokens once per prompt; completion tokens of every sample generated (best_of's too)."""
        return usage(sum(self.prompt_tokens[::self.samples]), sum(map(len, self.token_ids)))


def _prompt_entries(texts: TokenTexts, prompt: Prompt, entries: list | None) -> tuple[list, list, list]:
    """(token texts, token log-probs, top log-probs) of a prompt in the completions shape: the first
    token has no log-prob (nothing precedes it), None there."""
    tokens = [texts(t) for t in prompt.token_ids]
    if entries is None:
        return tokens, [None] * len(tokens), [None] * len(tokens)
    chosen = [None if e is None else e[t] for t, e in zip(prompt.token_ids, entries)]
    tops = [None if e is None else {texts(i): v for i, v in _ranked(e)} for e in entries]
    return tokens, chosen, tops


def echoed_logprobs(texts: TokenTexts, prompt: Prompt, prompt_entries: list | None, token_ids: list[int],
                    entries: list[dict[int, float]]) -> tuple[dict, int]:
    """The completions ``logprobs`` object of an echoed choice: the prompt's tokens, then the
    generated ones; text offsets run over both."""
    tokens, chosen, tops = _prompt_entries(texts, prompt, prompt_entries)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    generated, offset = completion_logprobs(texts, token_ids, entries, offset)
    return {"tokens": tokens + generated["tokens"], "token_logprobs": chosen + generated["token_logprobs"],
            "top_logprobs": tops + generated["top_logprobs"],
            "text_offset": offsets + generated["text_offset"]}, offset


def vllm_prompt_logprobs(texts: TokenTexts, prompt: Prompt, entries: list | None, k: int) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token and its ``k`` most likely alternatives. ``rank`` (1 = most
    likely) is null for a prompt token outside the top k (its rank is not computed)."""
    if entries is None:
        return None
    out = []
    for t, e in zip(prompt.token_ids, entries):
        if e is None:
            out.append(None)
            continue
        in_top = len(e) <= k  # the token was one of the top k (logprob_entry did not add it again)
        ranked = [(i, v) for i, v in _ranked(e) if in_top or i != t]
        line = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": texts(i)} for r, (i, v) in enumerate(ranked)}
        if not in_top:
            line[str(t)] = {"logprob": e[t], "rank": None, "decoded_token": texts(t)}
        out.append(line)
    return out


def completion(model: str, choices: Choices, texts: TokenTexts, logprobs: int | None,
               prompts: list[Prompt] | None = None, echo: bool = False, score_only: bool = False,
               prompt_logprobs: int | None = None) -> dict:
    out = []
    for p, group in enumerate(choices.ranked()):
        first = p * choices.samples  # the prompt's sample 0: the one that computed its log-probs
        for j, i in enumerate(group):
            token_ids = [] if score_only else choices.token_ids[i]
            entries = [] if score_only else choices.logprobs[i]
            text = "" if score_only else choices.text[i]
            lp = None
            if echo:
                text = prompts[p].text + text
                if logprobs is not None:
                    lp, _ = echoed_logprobs(texts, prompts[p], choices.prompt_logprobs[first], token_ids, entries)
            elif logprobs is not None:
                lp, _ = completion_logprobs(texts, token_ids, entries, 0)
            choice = {"index": p * choices.n + j, "text": text, "logprobs": lp,
                      "finish_reason": choices.finish_reason[i], "stop_reason": choices.stop_reason[i]}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(texts, prompts[p], choices.prompt_logprobs[first],
                                                                 prompt_logprobs)
            out.append(choice)
    totals = choices.usage()
    if score_only:
        totals = usage(totals["prompt_tokens"], 0)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": totals}


def chat_completion(model: str, choices: Choices, texts: TokenTexts, logprobs: int | None,
                    prompts: list[Prompt] | None = None, prompt_logprobs: int | None = None) -> dict:
    out = []
    for j, i in enumerate(choices.ranked()[0]):
        lp = None
        if logprobs is not None:
            lp = {"content": chat_logprobs(texts, choices.token_ids[i], choices.logprobs[i], logprobs)}
        out.append({"index": j, "message": {"role": "assistant", "content": choices.text[i]}, "logprobs": lp,
                    "finish_reason": choices.finish_reason[i], "stop_reason": choices.stop_reason[i]})
    answer = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
              "choices": out, "usage": choices.usage()}
    if prompt_logprobs is not None:
        answer["prompt_logprobs"] = vllm_prompt_logprobs(texts, prompts[0], choices.prompt_logprobs[0],
                                                         prompt_logprobs)
    return answer


class CompletionChunks:
    """The chunks of a streamed completion: one per delta, so one per generated token (its text
    may be empty: a byte-level token inside a multi-byte character), and the end.
    A stream's request i is choice i (streams never draw more samples than they return). With
    ``echo`` a choice's first chunk starts with its prompt (and the prompt's log-probs)."""

    def __init__(self, model: str, n: int, texts: TokenTexts, logprobs: int | None, *, samples: int = 1,
                 prompts: list[Prompt] | None = None, echo: bool = False, score_only: bool = False):
        self.head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}
        self.texts, self.logprobs = texts, logprobs
        self.offsets = [0] * n
        self.samples, self.prompts, self.echo, self.score_only = samples, prompts, echo, score_only
        self._prompt_entries: dict[int, list | None] = {}  # prompt -> its log-probs (from its sample 0's delta)
        self._held: dict[int, list[Delta]] = {}  # prompt -> deltas of other samples that came first
        self._started = [False] * n

    def chunks(self, d: Delta) -> list[dict]:
        """The chunks ``d`` gives (none, one, or, when it brings a prompt's log-probs, those held
        for the prompt's other samples too: an echoed choice starts with its prompt's log-probs,
        which only the prompt's sample 0 computes)."""
        p = d.index // self.samples
        if d.prompt_logprobs is not None:
            self._prompt_entries[p] = d.prompt_logprobs
        if self.echo and self.logprobs is not None and p not in self._prompt_entries:
            self._held.setdefault(p, []).append(d)
            return []
        out = [c for held in self._held.pop(p, []) + [d] for c in [self._chunk(held)] if c is not None]
        return out

    def _chunk(self, d: Delta) -> dict | None:
        i, p = d.index, d.index // self.samples
        token_ids, entries, text = ([], [], "") if self.score_only else (d.token_ids, d.logprobs, d.text)
        lp = None
        if self.echo and not self._started[i]:
            self._started[i] = True
            text = self.prompts[p].text + text
            if self.logprobs is not None:
                lp, self.offsets[i] = echoed_logprobs(self.texts, self.prompts[p], self._prompt_entries.get(p),
                                                      token_ids, entries or [])
        elif self.logprobs is not None and token_ids:
            lp, self.offsets[i] = completion_logprobs(self.texts, token_ids, entries, self.offsets[i])
        if not token_ids and not text and lp is None and d.finish_reason is None:
            return None  # (score_only: the one dropped token; its finishing delta still sends the end)
        return {**self.head, "choices": [{"index": i, "text": text, "logprobs": lp,
                                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}

    def first(self) -> list[dict]:
        return []

    def usage(self, totals: dict) -> dict:
        if self.score_only:
            totals = usage(totals["prompt_tokens"], 0)
        return {**self.head, "choices": [], "usage": totals}


class ChatChunks:
    """The chunks of a streamed chat completion: each choice's assistant role first, then one
    content delta per generated token (possibly empty), and the end."""

    def __init__(self, model: str, n: int, texts: TokenTexts, logprobs: int | None, **_):
        self.head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}
        self.texts, self.logprobs, self.n = texts, logprobs, n

    def first(self) -> list[dict]:
        return [{**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for i in range(self.n)]

    def chunks(self, d: Delta) -> list[dict]:
        lp = None
        if self.logprobs is not None and d.token_ids:
            lp = {"content": chat_logprobs(self.texts, d.token_ids, d.logprobs, self.logprobs)}
        if not d.token_ids and not d.text and lp is None and d.finish_reason is None:
            return []
        delta = {"content": d.text} if d.text or d.token_ids else {}
        return [{**self.head, "choices": [{"index": d.index, "delta": delta, "logprobs": lp,
                                           "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}]

    def usage(self, totals: dict) -> dict:
        return {**self.head, "choices": [], "usage": totals}
