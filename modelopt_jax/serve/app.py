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
import threading
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modelopt_jax.errors import ChatTemplateError, InvalidArgumentError, RequestError
from modelopt_jax.sampling import SamplingParams
from modelopt_jax.serve import protocol, responses
from modelopt_jax.serve.streams import EngineFailure, Stream
from modelopt_jax.serve.engine_thread import EngineThread
from modelopt_jax.serve.metrics import CONTENT_TYPE, ServerMetrics
from modelopt_jax.serve.protocol import ApiError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20   # no request body may be larger (413 before it is parsed)
MIN_BODY_BYTES = 1 << 20    # ... and the limit is never below this
BODY_TIMEOUT_S = 30.0       # a body not received whole by then is refused (408)


def body_limit(prompts) -> int:
    """The largest body worth reading: a prompt holds at most ``max_prompt_chars`` characters, each at
    most 12 bytes of JSON (two \\uXXXX escapes for one astral character); 16 per character leaves
    room for a few such prompts and the other fields. Within [1 MiB, 32 MiB]; 32 MiB where the
    tokenizer gives no character bound."""
    chars = prompts.max_prompt_chars
    return MAX_BODY_BYTES if chars is None else min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, 16 * chars))


async def _body(request: Request, limit: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S):
    async def read() -> list[bytes]:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes (what max_model_len can use)",
                               code="body_too_large")
            chunks.append(chunk)
        return chunks

    try:
        chunks = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:.0f} s", code="body_timeout") from None
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
                 ready=None, log_requests: bool = True):
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
        self.metrics = ServerMetrics(engine)
        self.max_body_bytes, self.body_timeout = body_limit(prompts), BODY_TIMEOUT_S
        self.log_requests = log_requests
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
                                Route("/health", self.health, methods=["GET"]),
                                Route("/metrics", self.metrics_text, methods=["GET"])],
                        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                            ClientDisconnect: _client_gone, Exception: _crash},
                        lifespan=lifespan)
        app.state.server = self
        return app

    # -- routes --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            raise ApiError(503, "the engine is not running", code="engine_dead")
        return Response(status_code=200)

    async def _body(self, request: Request):
        return await _body(request, self.max_body_bytes, self.body_timeout)

    def drain(self, grace: float) -> None:
        """The server is stopping: in ``grace`` seconds every stream still open ends with an error event
        and [DONE] (non-streaming requests get a 500), so no client sees a cut connection."""
        def end_streams():
            if len(self.engine.router):
                log.warning("grace period of %.0f s over: ending %d requests", grace, len(self.engine.router))
            self.engine.router.fail_all(EngineFailure(f"the server is shutting down (the {grace:.0f} s grace "
                                                      f"period for running requests is over)"))

        timer = threading.Timer(grace, end_streams)
        timer.daemon = True
        timer.start()

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "modelopt_jax", "root": self.prompts.path,
             "max_model_len": self.prompts.max_model_len} for name in self.names]})

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        api = protocol.parse_completion(await self._body(request))
        model = self._model(api.model)
        requests = await self._build("prompt", self.prompts.requests, api.prompts, api.params)
        protocol.check_room(api, [len(r.prompt_ids) for r in requests], self.prompts.max_model_len)
        return await self._answer(request, arrival, api, requests, responses.CompletionChunks, responses.completion,
                                  model, echo=api.echo, score_only=api.score_only)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        api = protocol.parse_chat(await self._body(request), self.prompts.max_model_len)
        model = self._model(api.model)
        requests = await self._build("messages", self.prompts.chat_requests, api.messages, api.params,
                                     chat_template=self.chat_template, add_generation_prompt=api.add_generation_prompt)
        protocol.check_room(api, [len(r.prompt_ids) for r in requests], self.prompts.max_model_len)
        return await self._answer(request, arrival, api, requests, responses.ChatChunks, responses.chat_completion,
                                  model)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: the ids a prompt (or a chat) is generated from."""
        body = protocol.parse_tokenize(await self._body(request))
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
        model, tokens = protocol.parse_detokenize(await self._body(request), self.prompts.config.vocab_size)
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

    async def _answer(self, request: Request, arrival: float, api: protocol.ApiRequest, requests, chunks, whole,
                      model: str, **shape):
        prompts = self._prompts(requests, api.samples) if shape.get("echo") or api.prompt_logprobs is not None else None
        stream = self._submit(requests)
        timer = self.metrics.request(len(requests), sum(len(r.prompt_ids) for r in requests[::api.samples]), arrival)
        where = f"{request.method} {request.url.path} from {_peer(request)}"
        if api.stream:
            return EventStream(self._events(stream, chunks(model, len(requests), self.texts, api.logprobs,
                                                           samples=api.samples, prompts=prompts, **shape), api,
                                            timer, where), stream)
        finished, choices = await _unless_disconnected(self._collect(stream, api, timer, where), request.receive,
                                                       stream)
        if not finished:
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        return JSONResponse(whole(model, choices, self.texts, api.logprobs, prompts=prompts,
                                  prompt_logprobs=api.prompt_logprobs, **shape))

    async def _collect(self, stream: Stream, api: protocol.ApiRequest, timer, where: str) -> responses.Choices:
        choices = responses.Choices(len(stream.requests), api.samples, api.n)
        try:
            async for delta in stream:
                timer.delta(delta.index, len(delta.token_ids), delta.finish_reason)
                choices.add(delta)
        except EngineFailure as e:
            self._log(where, timer, f"failed: {e}")
            raise ApiError(500, str(e), code="generation_failed") from None
        self._log(where, timer, "done")
        return choices

    async def _events(self, stream: Stream, chunks, api: protocol.ApiRequest, timer, where: str):
        counts = responses.Choices(len(stream.requests), api.samples, api.n)
        outcome = "client went away"  # unless the loop below ends
        try:
            for chunk in chunks.first():
                yield responses.sse(chunk)
            async for deltas in stream.batches():  # every delta queued so far: one write for all
                events = []
                for delta in deltas:
                    timer.delta(delta.index, len(delta.token_ids), delta.finish_reason)
                    counts.add(delta)
                    events += [responses.sse(chunk) for chunk in chunks.chunks(delta)]
                if events:
                    yield "".join(events)
            if api.include_usage:
                yield responses.sse(chunks.usage(counts.usage()))
            outcome = "done"
        except EngineFailure as e:  # the status line is gone: the error travels as an event
            outcome = f"failed: {e}"
            yield responses.sse(ApiError(500, str(e), code="generation_failed").body())
        finally:
            self._log(where, timer, outcome)
        yield responses.sse("[DONE]")

    def _log(self, where: str, timer, outcome: str) -> None:
        e2e = timer.finished()
        if self.log_requests:
            ttft = "-" if timer.first_token is None else f"{(timer.first_token - timer.arrival) * 1e3:.0f} ms"
            log.info("%s: %s, %d sequence(s), %d tokens generated, ttft %s, e2e %.0f ms", where, outcome,
                     len(timer.last), timer.tokens, ttft, e2e * 1e3)


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "?"


async def _api_error(request: Request, e: ApiError) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, e: HTTPException) -> Response:
    return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                 code="not_found" if e.status_code == 404 else None).body(), status_code=e.status_code)


async def _client_gone(request: Request, e: ClientDisconnect) -> Response:
    log.info("%s %s from %s: the client went away before its request was read", request.method, request.url.path,
             _peer(request))
    return Response(status_code=499)  # nobody reads it


async def _crash(request: Request, e: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").body(),
                        status_code=500)


def build_app(llm, served_model_names: list[str], *, chat_template: str | None = None, ready=None,
              engine=None, log_requests: bool = True) -> Starlette:
    """The ASGI app serving ``llm`` (an :class:`~modelopt_jax.LLM`, or a
    :class:`~modelopt_jax.prompts.PromptProcessor` with ``engine`` given) under ``served_model_names``;
    chat uses ``chat_template`` (Jinja source, a file or a template name) instead of the checkpoint's.
    ``engine`` defaults to the LLM's engine on a thread of this process (while the app runs it owns
    that engine: build another LLM to call ``generate`` meanwhile). The engine starts with the app
    (then ``ready()`` is called) and stops with it; ``app.state.server`` is the :class:`OpenAIServer`.
    ``log_requests``: one log line per generation request (outcome, tokens, latencies)."""
    prompts = getattr(llm, "prompts", llm)
    if engine is None:
        engine = EngineThread(llm.engine, tokenizer=prompts.tokenizer, vocab_size=prompts.config.vocab_size)
    return OpenAIServer(prompts, engine, served_model_names, chat_template=chat_template, ready=ready,
                        log_requests=log_requests).app()
