"""The OpenAI-compatible HTTP API (FastAPI) over the server's RequestLifecycle (serving/requests.py).

    POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with ``stream``),
    GET /v1/models, /health, /version, /metrics

Both front ends share one ``RequestLifecycle``: its engine, its --max-queue (counted over HTTP and gRPC
calls together), its in-flight table (drained on SIGTERM) and its Prometheus metrics. Errors are OpenAI's
error object: 400 naming the field, 401 without the API key (when one is set: every path but /health), 404
for an unknown model, 413 for a body over --max-message-bytes, 429 when the queue is full, 503 while the
server is starting, stopping or restarting its engine (calls in flight when it died included), 500 when the
engine fails under one request. --max-prompt-bytes bounds prompts and chat messages as over gRPC. A client
that disconnects (streaming or not) cancels its handler; the engine stream's clean-up aborts the request
and frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import jaxpage
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams
from serving import openai_protocol as oai
from serving.http_guard import HttpGuard
from serving.limits import check_prompt_bytes
from serving.openai_outputs import ChatRendering, CompletionRendering, Rendering, usage
from serving.requests import (DuplicateRequestError, EngineDiedError, EngineFailedError, InvalidRequestError,
                              NotServingError, QueueFullError, RequestError, RequestLifecycle)
from serving.structured import from_openai

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}
# the metrics' error codes are gRPC's names, so that both front ends count in the same series
METRIC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
                429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE"}
# the lifecycle's errors (but InvalidRequestError, a 400 naming the field) as (HTTP status, OpenAI error code)
STATUSES = {NotServingError: (503, "not_serving"), QueueFullError: (429, "queue_full"),
            DuplicateRequestError: (400, None), EngineDiedError: (503, "engine_restarting"),
            EngineFailedError: (500, "engine_error")}
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> oai.ErrorResponse:
        return oai.ErrorResponse(error=oai.ErrorInfo(message=self.message, type=ERROR_TYPES[self.status],
                                                     param=self.param, code=self.code))


def _invalid(message: str, default_param: str) -> OpenAIError:
    """A ValueError's message of SamplingParams or the engine as a 400 naming the field."""
    named = re.match(r"SamplingParams\.(\w+)", message)
    return OpenAIError(400, message.replace("SamplingParams.", ""), named.group(1) if named else default_param)


def _openai_error(e: RequestError, prompt_field: str) -> OpenAIError:
    if isinstance(e, InvalidRequestError):
        return _invalid(e.message, prompt_field)
    status, code = STATUSES[type(e)]
    return OpenAIError(status, e.message, code=code)


def sampling_params(body: oai.SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kw = {name: getattr(body, name) for name in _OPTIONAL if getattr(body, name) is not None}
    best_of = body.best_of or body.n
    streamable = best_of == body.n  # else the best n are known only at the end: one chunk then
    try:
        kw["structured_outputs"] = from_openai(body.response_format, body.structured_outputs)
    except ValueError as e:
        raise OpenAIError(400, str(e), "structured_outputs" if body.structured_outputs else "response_format") from None
    try:
        return SamplingParams(
            n=body.n, best_of=best_of, max_tokens=max_tokens, seed=body.seed, stop=body.stop,
            stop_token_ids=body.stop_token_ids, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
            output_kind="delta" if body.stream and streamable else "final_only", **kw)
    except ValueError as e:
        raise _invalid(str(e), "") from None


def completion_prompt(prompt) -> str | dict:
    """One prompt as the engine takes it: text, or token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(400, f"prompt: a batch of {len(prompt)} prompts; jaxpage takes one prompt per "
                                   "request (send them as concurrent requests)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    return prompt


class OpenAIServing:
    def __init__(self, requests: RequestLifecycle, served_model_names: list[str] | None = None):
        self.requests = requests
        self.served_model_names = served_model_names

    # --- state ----------------------------------------------------------------------------------------
    def _engine(self):
        try:
            return self.requests.require_engine()
        except NotServingError as e:
            raise _openai_error(e, "") from None

    def model_names(self) -> list[str]:
        return self.served_model_names or [self._engine().engine.model_name]

    def _decode(self, token: int) -> str:
        return self._engine().engine.tokenizer.decode([token])

    def _check(self, body: oai.SamplingRequest) -> str:
        """The model name the response carries; 404 for another model, 400 for a field jaxpage cannot honour."""
        names = self.model_names()
        if body.model is not None and body.model not in names:
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this server serves "
                                   f"{', '.join(map(repr, names))}", "model", "model_not_found")
        field = body.unsupported()
        if field is not None:
            raise OpenAIError(400, f"{field} is not supported by jaxpage", field)
        return body.model or names[0]

    def _check_prompt_bytes(self, texts: list[str], field: str) -> None:
        try:
            check_prompt_bytes(texts, self.requests.max_prompt_bytes, field)
        except ValueError as e:
            raise OpenAIError(400, str(e), field) from None

    # --- one request's life ---------------------------------------------------------------------------
    async def _outputs(self, request_id: str, prompt, params: SamplingParams, priority: int,
                       prompt_field: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the lifecycle; its failures as OpenAIErrors."""
        outputs = self.requests.generate(request_id, lambda engine: (prompt, params), priority)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        except RequestError as e:
            raise _openai_error(e, prompt_field) from None
        except asyncio.CancelledError:
            self._count_error(499)  # the client left
            raise

    async def _respond(self, raw: Request, outputs: AsyncIterator[RequestOutput], stream: bool,
                       render: Rendering, include_usage: bool) -> Response:
        if stream:  # the first output before the headers: admission errors are still an HTTP status
            first = await _unless_disconnected(raw, anext(outputs))
            return Response(status_code=499) if first is None else StreamingResponse(
                self._events(first, outputs, render, include_usage), media_type="text/event-stream")
        final = await _unless_disconnected(raw, _last(outputs))
        return Response(status_code=499) if final is None else JSONResponse(render.final(final).model_dump())

    async def _events(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput], render: Rendering,
                      include_usage: bool) -> AsyncIterator[str]:
        """The stream as server-sent events; an engine failure ends it with an error event."""
        finished: set[int] = set()
        completion_tokens = 0
        try:
            async with contextlib.aclosing(outputs):
                out = first
                while True:
                    choices = []
                    for c in out.outputs:
                        reason = c.finish_reason if c.finish_reason and c.index not in finished else None
                        if reason:
                            finished.add(c.index)
                        if c.token_ids or c.text or reason:
                            choices.append((c, reason))
                            completion_tokens += len(c.token_ids)
                    if choices:
                        yield _event(render.chunk(choices))
                    if out.finished:
                        break
                    out = await anext(outputs)
            if include_usage:
                yield _event(render.usage_chunk(usage(len(first.prompt_token_ids), completion_tokens)))
        except OpenAIError as e:
            self._count_error(e.status)
            yield _event(e.body())
        yield "data: [DONE]\n\n"

    def _count_error(self, status: int) -> None:
        self.requests.count_error(METRIC_CODES.get(status, str(status)))

    # --- the endpoints --------------------------------------------------------------------------------
    async def completions(self, body: oai.CompletionRequest, raw: Request) -> Response:
        model = self._check(body)
        if body.echo and body.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs needs the prompt's logprobs, which jaxpage does not "
                                   "compute", "echo")
        prompt = completion_prompt(body.prompt)
        if isinstance(prompt, str):
            self._check_prompt_bytes([prompt], "prompt")
        params = sampling_params(body, body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else self._engine().engine.tokenizer.decode(
                prompt["prompt_token_ids"])
        render = CompletionRendering(request_id, model, self._decode, body.logprobs, body.return_token_ids,
                                     echo=echo)
        outputs = self._outputs(request_id, prompt, params, body.priority, "prompt")
        return await self._respond(raw, outputs, body.stream, render, _include_usage(body))

    async def chat_completions(self, body: oai.ChatCompletionRequest, raw: Request) -> Response:
        model = self._check(body)
        engine = self._engine().engine
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self._check_prompt_bytes([text for m in messages for text in m.values()], "messages")
        try:
            prompt = engine.apply_chat_template(messages)
        except ValueError as e:
            raise OpenAIError(400, f"messages: {e}", "messages") from None
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens, k)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        render = ChatRendering(request_id, model, self._decode, k, body.return_token_ids)
        outputs = self._outputs(request_id, prompt, params, body.priority, "messages")
        return await self._respond(raw, outputs, body.stream, render, _include_usage(body))

    async def models(self) -> oai.ModelList:
        cfg = self._engine().engine.config
        return oai.ModelList(data=[oai.ModelCard(id=name, max_model_len=cfg.max_model_len,
                                                 kv_cache_dtype=cfg.kv_cache_dtype,
                                                 quantization=cfg.model.quantization)
                                   for name in self.model_names()])

    async def health(self) -> Response:
        return Response(status_code=200 if self.requests.serving else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.requests.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- errors ---------------------------------------------------------------------------------------
    def error_response(self, e: OpenAIError) -> JSONResponse:
        self._count_error(e.status)
        return JSONResponse(e.body().model_dump(), status_code=e.status)

    async def openai_error(self, request: Request, e: OpenAIError) -> JSONResponse:
        return self.error_response(e)

    async def validation_error(self, request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return await self.openai_error(request, OpenAIError(400, f"the body is not JSON: {first['msg']}"))
        param = ".".join(str(part) for part in first["loc"][1:]) or None  # loc[0] is "body"
        return await self.openai_error(request, OpenAIError(400, f"{param}: {first['msg']}", param))


def _include_usage(body: oai.SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async with contextlib.aclosing(outputs):
        async for final in outputs:
            pass
    return final


async def _unless_disconnected(raw: Request, work) -> RequestOutput | None:
    """Awaits work (an awaitable) unless the client disconnects first: then cancels it and returns None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(raw))
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def build_app(requests: RequestLifecycle, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_body_bytes: int | None = None) -> FastAPI:
    """The API; with api_key every path but /health needs ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="jaxpage", version=jaxpage.__version__, docs_url=None, redoc_url=None)
    api = OpenAIServing(requests, served_model_names)
    app.add_middleware(HttpGuard, key=api_key, max_body_bytes=max_body_bytes,
                       reject=lambda status, message, code: api.error_response(OpenAIError(status, message,
                                                                                           code=code)))
    app.add_exception_handler(OpenAIError, api.openai_error)
    app.add_exception_handler(RequestValidationError, api.validation_error)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/version")(lambda: {"version": jaxpage.__version__})
    return app
