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

import json
import time
import uuid

from modelopt_jax.serve.engine_thread import Delta


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


class Choices:
    """Accumulates the deltas of a stream into whole choices (the non-streaming answer)."""

    def __init__(self, n: int):
        self.text = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.finish_reason: list[str | None] = [None] * n
        self.stop_reason: list = [None] * n
        self.prompt_tokens = [0] * n

    def add(self, d: Delta) -> None:
        i = d.index
        self.text[i] += d.text
        self.token_ids[i] += d.token_ids
        self.logprobs[i] += d.logprobs or []
        self.finish_reason[i], self.stop_reason[i], self.prompt_tokens[i] = d.finish_reason, d.stop_reason, \
            d.prompt_tokens

    def usage(self) -> dict:
        return usage(sum(self.prompt_tokens), sum(map(len, self.token_ids)))


def completion(model: str, choices: Choices, texts: TokenTexts, logprobs: int | None) -> dict:
    out = []
    for i, text in enumerate(choices.text):
        lp = None
        if logprobs is not None:
            lp, _ = completion_logprobs(texts, choices.token_ids[i], choices.logprobs[i], 0)
        out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": choices.finish_reason[i],
                    "stop_reason": choices.stop_reason[i]})
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": choices.usage()}


def chat_completion(model: str, choices: Choices, texts: TokenTexts, logprobs: int | None) -> dict:
    lp = None
    if logprobs is not None:
        lp = {"content": chat_logprobs(texts, choices.token_ids[0], choices.logprobs[0], logprobs)}
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": choices.text[0]}, "logprobs": lp,
                         "finish_reason": choices.finish_reason[0], "stop_reason": choices.stop_reason[0]}],
            "usage": choices.usage()}


class CompletionChunks:
    """The chunks of a streamed completion: one per delta that carries text, logprobs or an end."""

    def __init__(self, model: str, n: int, texts: TokenTexts, logprobs: int | None):
        self.head = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model}
        self.texts, self.logprobs = texts, logprobs
        self.offsets = [0] * n

    def chunk(self, d: Delta) -> dict | None:
        lp = None
        if self.logprobs is not None and d.token_ids:
            lp, self.offsets[d.index] = completion_logprobs(self.texts, d.token_ids, d.logprobs, self.offsets[d.index])
        if not d.text and lp is None and d.finish_reason is None:
            return None
        return {**self.head, "choices": [{"index": d.index, "text": d.text, "logprobs": lp,
                                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}

    def first(self) -> list[dict]:
        return []

    def usage(self, totals: dict) -> dict:
        return {**self.head, "choices": [], "usage": totals}


class ChatChunks:
    """The chunks of a streamed chat completion: the assistant role first, then content deltas."""

    def __init__(self, model: str, n: int, texts: TokenTexts, logprobs: int | None):
        self.head = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}
        self.texts, self.logprobs = texts, logprobs

    def first(self) -> list[dict]:
        return [{**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}]

    def chunk(self, d: Delta) -> dict | None:
        lp = None
        if self.logprobs is not None and d.token_ids:
            lp = {"content": chat_logprobs(self.texts, d.token_ids, d.logprobs, self.logprobs)}
        if not d.text and lp is None and d.finish_reason is None:
            return None
        return {**self.head, "choices": [{"index": 0, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}

    def usage(self, totals: dict) -> dict:
        return {**self.head, "choices": [], "usage": totals}
