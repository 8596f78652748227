"""The ASGI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, and
vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``.

Starlette, not FastAPI: the bodies are validated by :mod:`.protocol` (so errors name the field in
OpenAI's format rather than FastAPI's 422), which leaves FastAPI nothing to add but pydantic.

A handler parses the body, builds the engine requests (tokenizing, rendering the chat template)
in a worker thread, submits them to the :class:`~.engine_thread.EngineThread` and either streams
server-sent events (``data: {...}`` per chunk, ``data: [DONE]`` last) or waits for the whole
answer. Either way it also watches the connection: a client that goes away aborts its requests,
which frees their pages in the engine's next turn. Every error is OpenAI's JSON shape: 400 for a
bad field (named in ``param``), 404 for an unknown model or route, 413 for an oversized body,
500 when generation failed, 503 once the engine is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelopt_jax.errors import ChatTemplateError, InvalidArgumentError, RequestError
from modelopt_jax.sampling import SamplingParams
from modelopt_jax.serve import protocol, responses
from modelopt_jax.serve.streams import EngineFailure, Stream
from modelopt_jax.serve.engine_thread import EngineThread
from modelopt_jax.serve.protocol import ApiError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20   # a request body larger than this is refused (413) before it is parsed


async def _body(request: Request):
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    except ValueError as e:  # e.g. an integer longer than Python's int parsing limit
        raise ApiError(400, f"the request body holds a value that cannot be read: {e}", code="invalid_json") from None
    protocol.check_strings(body)
    return body


async def _disconnected(receive) -> None:
    """Returns once the client has gone (after the body, receive() yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work, receive, stream: Stream):
    """``await work`` unless the client disconnects first; then the stream's requests are aborted.
    Returns (finished, result)."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        stream.abort()  # a no-op once every request finished
    if not task.done() or task.cancelled():
        return False, None
    return True, task.result()


class EventStream:
    """An ASGI response sending server-sent events from an async iterator of strings, aborting the
    engine requests when the client disconnects (checked by listening, not only when a send fails)."""

    def __init__(self, events, stream: Stream):
        self.events, self.stream = events, stream

    async def __call__(self, scope, receive, send) -> None:
        async def produce():
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await _unless_disconnected(produce(), receive, self.stream)


class OpenAIServer:
    """The routes over ``prompts`` (a :class:`~modelopt_jax.prompts.PromptProcessor`: tokenizer, chat
    templates, request checks) and ``engine`` (an :class:`~.engine_thread.EngineThread` or a
    :class:`~.core_client.CoreClient`: ``start``, ``stop``, ``alive``, ``submit``, ``gauges``);
    ``served_model_names[0]`` is the name answers carry.
    """

    def __init__(self, prompts, engine, served_model_names: list[str], *, chat_template: str | None = None,
                 ready=None):
        if prompts.tokenizer is None:
            raise InvalidArgumentError(f"serving needs a tokenizer and {prompts.path} has no tokenizer.json: "
                                       f"pass --tokenizer")
        if not served_model_names:
            raise InvalidArgumentError("served_model_names: at least one name")
        self.prompts, self.names = prompts, list(served_model_names)
        self.chat_template = chat_template
        if chat_template is not None:
            prompts.get_chat_template(chat_template)  # a template that does not parse fails now, not per request
        self.engine = engine
        self.texts = responses.TokenTexts(prompts.tokenizer)
        self.created = int(time.time())
        self.ready = ready

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            await run_in_threadpool(self.engine.start)
            log.info("serving %s as %s", self.prompts.path, self.names)
            if self.ready is not None:
                self.ready()
            try:
                yield
            finally:
                await run_in_threadpool(self.engine.stop)

        app = Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                                Route("/v1/models", self.models, methods=["GET"]),
                                Route("/tokenize", self.tokenize, methods=["POST"]),
                                Route("/detokenize", self.detokenize, methods=["POST"]),
                                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                                Route("/health", self.health, methods=["GET"])],
                        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _crash},
                        lifespan=lifespan)
        app.state.server = self
        return app

    # -- routes --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            raise ApiError(503, "the engine is not running", code="engine_dead")
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "modelopt_jax", "root": self.prompts.path,
             "max_model_len": self.prompts.max_model_len} for name in self.names]})

    async def completions(self, request: Request) -> Response:
        api = protocol.parse_completion(await _body(request))
        model = self._model(api.model)
        requests = await self._build("prompt", self.prompts.requests, api.prompts, api.params)
        protocol.check_room(api, [len(r.prompt_ids) for r in requests], self.prompts.max_model_len)
        return await self._answer(request, api, requests, responses.CompletionChunks, responses.completion, model,
                                  echo=api.echo, score_only=api.score_only)

    async def chat_completions(self, request: Request) -> Response:
        api = protocol.parse_chat(await _body(request), self.prompts.max_model_len)
        model = self._model(api.model)
        requests = await self._build("messages", self.prompts.chat_requests, api.messages, api.params,
                                     chat_template=self.chat_template, add_generation_prompt=api.add_generation_prompt)
        protocol.check_room(api, [len(r.prompt_ids) for r in requests], self.prompts.max_model_len)
        return await self._answer(request, api, requests, responses.ChatChunks, responses.chat_completion, model)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: the ids a prompt (or a chat) is generated from."""
        body = protocol.parse_tokenize(await _body(request))
        self._model(body.model)
        if body.prompt is not None:
            ids = await self._build("prompt", self.prompts.tokenize, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            requests = await self._build("messages", self.prompts.chat_requests, body.messages, SamplingParams(max_tokens=1),
                                         chat_template=self.chat_template,
                                         add_generation_prompt=body.add_generation_prompt)
            ids = requests[0].prompt_ids
        return JSONResponse({"count": len(ids), "max_model_len": self.prompts.max_model_len, "tokens": ids,
                             "token_strs": [self.texts(t) for t in ids] if body.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: the text of token ids (special tokens included)."""
        model, tokens = protocol.parse_detokenize(await _body(request), self.prompts.config.vocab_size)
        self._model(model)
        text = await run_in_threadpool(self.prompts.tokenizer.decode, tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does."""
        try:
            source = self.prompts.get_chat_template(self.chat_template).source
        except (ChatTemplateError, RequestError):
            source = None
        special = self.prompts.special_tokens()
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": self.prompts.max_model_len,
                             "vocab_size": self.prompts.config.vocab_size, "chat_template": source,
                             "bos_token_id": self.prompts.config.bos_token_id,
                             "eos_token_ids": sorted(self.prompts.eos_token_ids),
                             **{name: value for name, value in special.items()}})

    # -- shared --------------------------------------------------------------------------------

    def _model(self, model: str | None) -> str:
        if model is not None and model not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves {self.names})",
                           param="model", code="model_not_found")
        return model or self.names[0]

    async def _build(self, param: str, build, *args, **kwargs):
        """Engine requests, built off the event loop (tokenizing a long prompt takes a while)."""
        try:
            return await run_in_threadpool(build, *args, **kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param=param, code="chat_template_error") from None
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None

    def _submit(self, requests) -> Stream:
        try:
            return self.engine.submit(requests)
        except EngineFailure as e:
            raise ApiError(503, str(e), code="engine_dead") from None

    def _prompts(self, requests, samples: int) -> list[responses.Prompt]:
        """One per prompt (its sample 0 among ``requests``): the text echoed, the ids scored."""
        return [responses.Prompt(r.prompt if isinstance(r.prompt, str) else
                                 self.prompts.tokenizer.decode(r.prompt_ids, skip_special_tokens=False), r.prompt_ids)
                for r in requests[::samples]]

    async def _answer(self, request: Request, api: protocol.ApiRequest, requests, chunks, whole, model: str, **shape):
        prompts = self._prompts(requests, api.samples) if shape.get("echo") or api.prompt_logprobs is not None else None
        stream = self._submit(requests)
        if api.stream:
            return EventStream(self._events(stream, chunks(model, len(requests), self.texts, api.logprobs,
                                                           samples=api.samples, prompts=prompts, **shape), api),
                               stream)
        finished, choices = await _unless_disconnected(self._collect(stream, api), request.receive, stream)
        if not finished:
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        return JSONResponse(whole(model, choices, self.texts, api.logprobs, prompts=prompts,
                                  prompt_logprobs=api.prompt_logprobs, **shape))

    async def _collect(self, stream: Stream, api: protocol.ApiRequest) -> responses.Choices:
        choices = responses.Choices(len(stream.requests), api.samples, api.n)
        try:
            async for delta in stream:
                choices.add(delta)
        except EngineFailure as e:
            raise ApiError(500, str(e), code="generation_failed") from None
        return choices

    async def _events(self, stream: Stream, chunks, api: protocol.ApiRequest):
        counts = responses.Choices(len(stream.requests), api.samples, api.n)
        try:
            for chunk in chunks.first():
                yield responses.sse(chunk)
            async for delta in stream:
                counts.add(delta)
                for chunk in chunks.chunks(delta):
                    yield responses.sse(chunk)
            if api.include_usage:
                yield responses.sse(chunks.usage(counts.usage()))
        except EngineFailure as e:  # the status line is gone: the error travels as an event
            yield responses.sse(ApiError(500, str(e), code="generation_failed").body())
        yield responses.sse("[DONE]")


async def _api_error(request: Request, e: ApiError) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException) -> Response:
    return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                 code="not_found" if e.status_code == 404 else None).body(), status_code=e.status_code)


async def _crash(request: Request, e: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").body(),
                        status_code=500)


def build_app(llm, served_model_names: list[str], *, chat_template: str | None = None, ready=None,
              engine=None) -> Starlette:
    """The ASGI app serving ``llm`` (an :class:`~modelopt_jax.LLM`, or a
    :class:`~modelopt_jax.prompts.PromptProcessor` with ``engine`` given) under ``served_model_names``;
    chat uses ``chat_template`` (Jinja source, a file or a template name) instead of the checkpoint's.
    ``engine`` defaults to the LLM's engine on a thread of this process (while the app runs it owns
    that engine: build another LLM to call ``generate`` meanwhile). The engine starts with the app
    (then ``ready()`` is called) and stops with it; ``app.state.server`` is the :class:`OpenAIServer`."""
    prompts = getattr(llm, "prompts", llm)
    if engine is None:
        engine = EngineThread(llm.engine, tokenizer=prompts.tokenizer, vocab_size=prompts.config.vocab_size)
    return OpenAIServer(prompts, engine, served_model_names, chat_template=chat_template, ready=ready).app()
