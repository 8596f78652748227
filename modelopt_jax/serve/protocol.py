"""OpenAI request bodies in, validated :class:`SamplingParams` out, or an :class:`ApiError` naming the field.

Pure Python (no web framework), so the rules are testable and readable on their own. Every
sampling field is checked by :class:`~modelopt_jax.sampling.SamplingParams` itself -- built with
that one field, so its typed error is reported under the request's field name -- and the OpenAI
fields this server cannot honour (penalties, ``logit_bias``, ``suffix``, ``tools``, ...) are
refused with a 400 rather than ignored: an answer that silently ignored them would be wrong.
Unknown fields are ignored, as vLLM does (clients add their own).

Defaults are OpenAI's: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions and the
rest of the context for chat. ``n`` samples per prompt (``best_of`` drawn, the n most likely kept;
not with streaming unless equal to n). Completions also take ``echo`` (the prompt before the
completion, with its log-probs when ``logprobs`` is set) and, with ``echo``, ``max_tokens=0``
(score a prompt, generate nothing: what evaluation harnesses send for log-likelihoods).
Extensions (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``add_generation_prompt`` (chat), ``prompt_logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from modelopt_jax.errors import RequestError
from modelopt_jax.sampling import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: alternatives per token a request may ask for


class ApiError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ApiRequest:
    """One validated ``/v1/completions`` or ``/v1/chat/completions`` request."""

    model: str | None                 # None: the served model
    params: SamplingParams
    stream: bool
    include_usage: bool               # stream_options.include_usage: a last chunk with the token counts
    logprobs: int | None              # alternatives per token to report (chat: top_logprobs when logprobs)
    prompts: list | None = None       # completions: prompts in LLM.generate's forms
    messages: list | None = None      # chat: one conversation
    add_generation_prompt: bool = True
    max_tokens_field: str | None = None  # the field that set max_tokens explicitly; None: the default
    n: int = 1                        # choices returned per prompt
    echo: bool = False                # completions: the prompt's text (and log-probs) before each choice's
    score_only: bool = False          # max_tokens=0 (with echo): the one token generated is dropped
    prompt_logprobs: int | None = None  # alternatives per prompt token to report (vLLM's prompt_logprobs)

    @property
    def samples(self) -> int:
        """Engine requests per prompt (``best_of`` when larger than n)."""
        return self.params.best_of or self.params.n


def check_room(api: ApiRequest, prompt_lengths: list[int], max_model_len: int) -> None:
    """An explicit ``max_tokens`` that the context cannot hold after a prompt is a 400 naming the
    field, as OpenAI's API and vLLM's server answer (rather than a shorter answer the client did not
    ask for); the defaults (16 / the rest of the context) are capped at what the context leaves."""
    if api.max_tokens_field is None:
        return
    asked = api.params.max_tokens
    for i, n in enumerate(prompt_lengths):
        if n + asked > max_model_len:
            which = "the prompt" if len(prompt_lengths) == 1 else f"prompt {i}"
            raise ApiError(400, f"{which} has {n} tokens and {api.max_tokens_field}={asked}: {n + asked} tokens "
                                f"exceed max_model_len={max_model_len} (at most {max_model_len - n} can be "
                                f"generated after it)", param=api.max_tokens_field)


# (request field, SamplingParams field) checked by SamplingParams itself
_SAMPLING_FIELDS = [("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                    ("stop", "stop"), ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                    ("include_stop_str_in_output", "include_stop_str_in_output")]
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}
# fields accepted only at their neutral value: (name, what is neutral)
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
            "repetition_penalty": (1, 1.0), "min_tokens": (0,), "logit_bias": ({},), "suffix": ("",), "echo": (False,), "tools": ([],), "functions": ([],), "continue_final_message": (False,),
            "tool_choice": ("none",), "response_format": ({"type": "text"},)}


def check_strings(body: Any) -> None:
    """Every string in ``body`` is valid Unicode text: JSON's ``\\ud800`` escapes can carry a lone
    surrogate, which no tokenizer or UTF-8 encoder takes. A 400 naming the top-level field."""
    stack = [(body, None)]
    while stack:
        value, field = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{field or 'the body'} holds a lone UTF-16 surrogate (not valid Unicode text)",
                               param=field, code="invalid_text") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, field or key))
                stack.append((item, field if field is not None else key))
        elif isinstance(value, list):
            stack.extend((item, field) for item in value)


def _check_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
    return body


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _unsupported(body: dict, names) -> None:
    for name in names:
        value = body.get(name)
        if value is not None and value not in _NEUTRAL[name]:
            raise ApiError(400, f"{name}={value!r} is not supported by this server (only {_NEUTRAL[name][0]!r})",
                           param=name, code="unsupported_parameter")


def _sampling(body: dict, max_tokens_field: str, max_tokens, logprobs: int | None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    fields = {"max_tokens": (max_tokens_field, max_tokens), "logprobs": ("logprobs", logprobs),
              "prompt_logprobs": ("prompt_logprobs", prompt_logprobs)}
    for name in ("n", "best_of"):
        if body.get(name) is not None:
            fields[name] = (name, body[name])
    for api, field in _SAMPLING_FIELDS:
        value = body.get(api, _OPENAI_DEFAULTS.get(api))
        if value is not None:
            fields[field] = (api, value)
    for field, (api, value) in fields.items():  # one at a time: the error names the request's field
        try:
            SamplingParams(**{field: value})
        except RequestError as e:
            message = str(e).removeprefix("SamplingParams: ")
            raise ApiError(400, message if api == field else f"{api}: {message}", param=api) from None
    try:
        return SamplingParams(**{field: value for field, (_, value) in fields.items()})
    except RequestError as e:  # a rule between fields (best_of >= n)
        raise ApiError(400, str(e).removeprefix("SamplingParams: "), param="best_of") from None


def _samples_and_stream(body: dict, stream: bool) -> None:
    """Streaming sends every sample as it grows: best_of (more drawn than returned) cannot stream,
    nor do streamed chunks carry vLLM's prompt_logprobs."""
    n, best_of = body.get("n") or 1, body.get("best_of")
    if stream and best_of is not None and best_of != n:
        raise ApiError(400, f"best_of={best_of!r} with stream=true: only best_of == n can stream", param="best_of")
    if stream and body.get("prompt_logprobs") is not None:
        raise ApiError(400, "prompt_logprobs with stream=true is not supported (use echo with logprobs, or "
                            "stream=false)", param="prompt_logprobs")


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    """A ``/tokenize`` body (vLLM's): a prompt, or chat messages rendered by the chat template."""

    model: str | None
    prompt: str | None
    messages: list | None
    add_special_tokens: bool          # prompt: the tokenizer's special tokens and BOS (default true)
    add_generation_prompt: bool       # messages: end with the assistant's turn opening (default true)
    return_token_strs: bool           # also each token's text


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _check_body(body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ApiError(400, "give exactly one of prompt (a string) or messages (a chat)", param="prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ApiError(400, f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
    if messages is not None and (not isinstance(messages, list) or not messages):
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    if messages is not None:
        _check_roles(messages)
    return TokenizeRequest(model=_model(body), prompt=prompt, messages=messages,
                           add_special_tokens=_bool(body, "add_special_tokens", prompt is not None),
                           add_generation_prompt=_bool(body, "add_generation_prompt", True),
                           return_token_strs=_bool(body, "return_token_strs", False))


def parse_detokenize(body: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """A ``/detokenize`` body: (model, token ids)."""
    body = _check_body(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens must be a list of token ids", param="tokens")
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise ApiError(400, f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return _model(body), tokens


def _logprobs(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ApiError(400, f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", param=name)
    return value


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options must be an object, got {options!r}", param="stream_options")
    return stream, _bool(options, "include_usage", False)


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", param="model")
    return model


def _prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of non-empty "
                        "token-id lists (and not empty)", param="prompt")


def parse_completion(body: Any) -> ApiRequest:
    """A ``/v1/completions`` body."""
    body = _check_body(body)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    _unsupported(body, ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                        "logit_bias", "suffix"))
    logprobs = _logprobs(body.get("logprobs"), "logprobs")
    echo = _bool(body, "echo", False)
    max_tokens = body.get("max_tokens")
    score_only = max_tokens == 0 and not isinstance(max_tokens, bool)
    if score_only and not echo:
        raise ApiError(400, "max_tokens=0 needs echo=true (it returns the prompt and generates nothing)",
                       param="max_tokens")
    prompt_logprobs = _logprobs(body.get("prompt_logprobs"), "prompt_logprobs")
    wanted = max(prompt_logprobs or 0, logprobs or 0) if echo and logprobs is not None else prompt_logprobs
    stream, include_usage = _stream(body)
    _samples_and_stream(body, stream)
    asked = 16 if max_tokens is None else 1 if score_only else max_tokens
    params = _sampling(body, "max_tokens", asked, logprobs, wanted)
    return ApiRequest(model=_model(body), params=params, stream=stream, include_usage=include_usage, logprobs=logprobs,
                      prompts=_prompts(body["prompt"]), max_tokens_field=None if max_tokens is None else "max_tokens",
                      n=params.n, echo=echo, score_only=score_only, prompt_logprobs=prompt_logprobs)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def _check_roles(messages: list) -> None:
    """OpenAI's message rules the template would not enforce: a known role, and content present
    except on an assistant message (which may carry tool calls instead). The rest (types, parts)
    is checked when the conversation is rendered."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if isinstance(role, str) and role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}]['role']={role!r}: one of {', '.join(CHAT_ROLES)}", param="messages")
        if role != "assistant" and m.get("content") is None:
            raise ApiError(400, f"messages[{i}]['content'] is required for a {role!r} message", param="messages")


def parse_chat(body: Any, max_model_len: int) -> ApiRequest:
    """A ``/v1/chat/completions`` body (the messages themselves are checked when rendered);
    ``max_tokens`` defaults to ``max_model_len`` (the engine caps it at what the context leaves; an
    explicit one must fit, see :func:`check_room`)."""
    body = _check_body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    _check_roles(messages)
    _unsupported(body, ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                        "logit_bias", "tools", "functions", "tool_choice", "response_format",
                        "continue_final_message", "echo"))
    want_logprobs = _bool(body, "logprobs", False)
    top = _logprobs(body.get("top_logprobs"), "top_logprobs")
    if top is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field)
    stream, include_usage = _stream(body)
    _samples_and_stream(body, stream)
    prompt_logprobs = _logprobs(body.get("prompt_logprobs"), "prompt_logprobs")
    params = _sampling(body, field, max_model_len if max_tokens is None else max_tokens, logprobs, prompt_logprobs)
    return ApiRequest(model=_model(body), params=params, stream=stream, include_usage=include_usage, logprobs=logprobs,
                      messages=messages, add_generation_prompt=_bool(body, "add_generation_prompt", True),
                      max_tokens_field=None if max_tokens is None else field, n=params.n,
                      prompt_logprobs=prompt_logprobs)
