"""The OpenAI-compatible HTTP API (FastAPI) over the server's RequestLifecycle (serving/requests.py).

    POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, Anthropic's POST /v1/messages (streamed
    as server-sent events with ``stream``) and POST /v1/messages/count_tokens, POST /v1/embeddings (a pooling
    model's), GET /v1/models, /health, /version, /metrics; vLLM's POST /pooling, /score, /rerank, /tokenize and /detokenize

The Responses and Messages APIs run on the chat path (serving/responses_api.py, serving/anthropic_messages.py: the
chat request each means); errors on the Messages paths are Anthropic's error object.

A completion of a batch of prompts (``prompt`` a list of strings or of token-id lists) is one engine request
per prompt, run together: prompt i's choices are indexed i * n + their own index, as OpenAI's.
Completions with ``echo`` and ``logprobs`` carry the prompt's tokens and log-probabilities (the engine's
prompt_logprobs) before the output's; ``max_tokens`` 0 with ``echo``: the prompt alone, as vLLM's.

Both front ends share one ``RequestLifecycle``: its engine, its --max-queue (counted over HTTP and gRPC
calls together), its in-flight table (drained on SIGTERM) and its Prometheus metrics. Errors are OpenAI's
error object: 400 naming the field, 401 without the API key (when one is set: every path but /health), 404
for an unknown model, 413 for a body over --max-message-bytes, 429 when the queue is full, 503 while the
server is starting, stopping or restarting its engine (calls in flight when it died included), 500 when the
engine fails under one request; unknown paths (404), wrong methods (405) and unexpected failures (500) too.
--max-prompt-bytes bounds prompts and chat messages as over gRPC. A client that disconnects (streaming or not)
cancels its handler; the engine streams' clean-up aborts the requests and frees their KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import uuid
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import jaxpage
from jaxpage.entrypoints.score_utils import score_pairs
from jaxpage.outputs import RequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import SamplingParams
from serving import anthropic_protocol as ap
from serving import openai_protocol as oai
from serving import pooling_protocol as pp
from serving import responses_protocol as rp
from serving.anthropic_messages import MessageRendering, error_body, is_messages_path, messages_param
from serving.anthropic_messages import chat_request as anthropic_chat_request
from serving.chat_options import ChatOptions, FieldError
from serving.chat_template import chat_prompt, chat_texts, render_chat, template_messages
from serving.http_guard import HttpGuard
from serving.limits import check_prompt_bytes
from serving.openai_outputs import ChatRendering, CompletionRendering, Rendering, usage
from serving.openapi_document import install as install_openapi_document
from serving.pooling_outputs import embedding_response, pooling_prompts, pooling_response
from serving.requests import (DuplicateRequestError, EngineDiedError, EngineFailedError, InvalidRequestError,
                              NotServingError, QueueFullError, RequestError, RequestLifecycle)
from serving.responses_api import ResponseRendering, chat_request, responses_param
from serving.scoring import pair_scores
from serving.serving_models import ServedModel, ServingModels, UnknownModelError
from serving.structured import from_openai
from serving.tool_choice import ToolPlan, plan_tools

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}
# the metrics' error codes are gRPC's names, so that both front ends count in the same series
METRIC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
                413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
                503: "UNAVAILABLE"}
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
    named = re.match(r"(?:Sampling|Pooling)Params\.(\w+)", message)
    message = message.replace("SamplingParams.", "").replace("PoolingParams.", "")
    return OpenAIError(400, message, named.group(1) if named else default_param)


def _openai_error(e: RequestError, prompt_field: str) -> OpenAIError:
    if isinstance(e, InvalidRequestError):
        return _invalid(e.message, prompt_field)
    status, code = STATUSES[type(e)]
    return OpenAIError(status, e.message, code=code)


def sampling_params(body: oai.SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; prompt_logprobs: the engine's (default: the body's vLLM field)."""
    if body.prompt_logprobs is not None and body.stream:
        raise OpenAIError(400, "prompt_logprobs are not available with stream (as in vLLM)", "prompt_logprobs")
    kw = {name: getattr(body, name) for name in _OPTIONAL if getattr(body, name) is not None}
    kw["logit_bias"] = logit_bias(body.logit_bias)
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
            prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            output_kind="delta" if body.stream and streamable else "final_only", **kw)
    except ValueError as e:
        raise _invalid(str(e), "") from None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) as SamplingParams takes it (which checks the biases)."""
    if not bias:
        return None
    bad = next((key for key in bias if not re.fullmatch(r"[0-9]{1,12}", key)), None)
    if bad is not None:
        raise OpenAIError(400, f"logit_bias: the key {bad!r} is not a token id", "logit_bias")
    return {int(key): value for key, value in bias.items()}


def completion_prompts(prompt) -> list[str | dict]:
    """The prompts as the engine takes them (text, or token ids): a list of strings or of token-id lists is a
    batch, a string or a token-id list one prompt."""
    if prompt == []:
        raise OpenAIError(400, "prompt: an empty list", "prompt")
    batch = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in batch]


class OpenAIServing:
    def __init__(self, requests: RequestLifecycle, served_model_names: list[str] | None = None,
                 chat: ChatOptions | None = None, models: ServingModels | None = None):
        self.requests = requests
        self.serving_models = models or ServingModels(requests, served_model_names)  # the base model, the adapters
        self.chat = chat or ChatOptions()

    # --- state ----------------------------------------------------------------------------------------
    def _engine(self):
        try:
            return self.requests.require_engine()
        except NotServingError as e:
            raise _openai_error(e, "") from None

    def model_names(self) -> list[str]:
        """The base model's names."""
        self._engine()
        return self.serving_models.base_names()

    def _decode(self, token: int) -> str:
        return self._engine().engine.tokenizer.decode([token])

    def _check_model(self, model: str | None) -> ServedModel:
        """What the request's model names (the base model, or a LoRA adapter); 404 for another model."""
        self._engine()
        try:
            return self.serving_models.resolve(model)
        except UnknownModelError as e:
            raise OpenAIError(404, e.message, "model", "model_not_found") from None

    def _check(self, body: oai.SamplingRequest) -> ServedModel:
        """What the request runs on (its name the response carries); 404 for another model, 400 for a field
        jaxpage cannot honour."""
        model = self._check_model(body.model)
        field = body.unsupported()
        if field is not None:
            raise OpenAIError(400, f"{field} is not supported by jaxpage", field)
        return model

    def _check_prompt_bytes(self, texts: list[str], field: str) -> None:
        try:
            check_prompt_bytes(texts, self.requests.max_prompt_bytes, field)
        except ValueError as e:
            raise OpenAIError(400, str(e), field) from None

    # --- one request's life ---------------------------------------------------------------------------
    async def _outputs(self, request_id: str, prompt, params: SamplingParams, priority: int,
                       prompt_field: str, model: ServedModel | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs from the lifecycle (on model's adapter, if any); its failures as OpenAIErrors."""
        outputs = self.requests.generate(request_id, lambda engine: (prompt, params), priority,
                                         lora_request=model.lora_request if model is not None else None)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        except RequestError as e:
            raise _openai_error(e, prompt_field) from None

    async def _respond(self, raw: Request, streams: list[AsyncIterator[RequestOutput]], stream: bool,
                       renders: list, include_usage: bool, n: int = 1, events=None) -> Response:
        """The response to one prompt's outputs, or a batch's (prompt i's choices indexed i * n + their own);
        events: how a stream's outputs become its events (default: the chat and completion chunks)."""
        outputs = _merged(streams, lambda: self._count_error(499))  # 499: the client left
        if stream:  # each prompt's first output before the headers: admission errors are still an HTTP status
            read = await _unless_disconnected(raw, _firsts(outputs, len(streams)))
            if read is None:
                return Response(status_code=499)
            replayed = _replay(read, outputs)
            sse = self._events(replayed, renders, include_usage, n) if events is None else events(replayed, *renders)
            return StreamingResponse(sse, media_type="text/event-stream")
        finals = await _unless_disconnected(raw, _finals(outputs, len(streams)))
        return Response(status_code=499) if finals is None else JSONResponse(
            _merged_response([r.final(out) for r, out in zip(renders, finals)], n).model_dump())

    async def _events(self, outputs: AsyncIterator[tuple[int, RequestOutput]], renders: list[Rendering],
                      include_usage: bool, n: int) -> AsyncIterator[str]:
        """The stream as server-sent events; an engine failure ends it with an error event."""
        finished: set[tuple[int, int]] = set()  # (prompt, choice)
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        try:
            async with contextlib.aclosing(outputs):
                async for i, out in outputs:
                    prompt_tokens[i] = len(out.prompt_token_ids)
                    choices = []
                    for c in out.outputs:
                        reason = c.finish_reason if c.finish_reason and (i, c.index) not in finished else None
                        if reason:
                            finished.add((i, c.index))
                        if c.token_ids or c.text or reason:
                            choices.append((c, reason))
                            completion_tokens += len(c.token_ids)
                    if choices:
                        yield _event(_shifted(renders[i].chunk(choices), i * n))
            if include_usage:
                yield _event(renders[0].usage_chunk(usage(sum(prompt_tokens.values()), completion_tokens)))
        except OpenAIError as e:
            self._count_error(e.status)
            yield _event(e.body())
        yield "data: [DONE]\n\n"

    def _count_error(self, status: int) -> None:
        self.requests.count_error(METRIC_CODES.get(status, str(status)))

    # --- the endpoints --------------------------------------------------------------------------------
    async def completions(self, body: oai.CompletionRequest, raw: Request) -> Response:
        model = self._check(body)
        prompts = completion_prompts(body.prompt)
        self._check_prompt_bytes([p for p in prompts if isinstance(p, str)], "prompt")
        echo_only = body.echo and body.max_tokens == 0  # vLLM's: the prompt alone (a token is made, not sent)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the prompt's logprobs go out with its echo
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        params = sampling_params(body, 1 if echo_only else body.max_tokens, body.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        renders = [self._completion_rendering(request_id, model.name, body, prompt) for prompt in prompts]
        for render in renders[1:]:
            render.created = renders[0].created
        # a batch: one engine request per prompt, "<id>-<prompt index>" (vLLM's)
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [self._outputs(i, prompt, params, body.priority, "prompt", model) for i, prompt in zip(ids, prompts)]
        if body.echo:
            streams = [_echoed(stream, render, echo_only) for stream, render in zip(streams, renders)]
        return await self._respond(raw, streams, body.stream, renders, _include_usage(body), body.n)

    def _completion_rendering(self, request_id: str, model: str, body: oai.CompletionRequest,
                              prompt: str | dict) -> CompletionRendering:
        """How one prompt's choices are rendered."""
        echo = None
        if body.echo and isinstance(prompt, str):
            echo = prompt
        elif body.echo:  # decoded here, before the engine checks the ids: a tokenizer raises on a negative one
            engine, ids = self._engine().engine, prompt["prompt_token_ids"]
            try:
                engine.check_token_ids(ids)
            except ValueError as e:
                raise OpenAIError(400, f"prompt: {e}", "prompt") from None
            echo = engine.tokenizer.decode(ids)
        return CompletionRendering(request_id, model, self._decode, body.logprobs, body.return_token_ids,
                                   body.prompt_logprobs, echo=echo)

    def _chat(self, body: oai.ChatCompletionRequest) -> tuple[ServedModel, ToolPlan, str]:
        """A chat request's model, tools and prompt."""
        model = self._check(body)
        engine = self._engine().engine
        self._check_prompt_bytes(chat_texts(body.messages), "messages")
        try:
            tools = plan_tools(body, self.chat)
            prompt = chat_prompt(engine.tokenizer, body, self.chat.chat_template, tools.tools, tools.mode != "none")
        except FieldError as e:
            raise OpenAIError(400, str(e), e.param) from None
        return model, tools, prompt

    async def chat_completions(self, body: oai.ChatCompletionRequest, raw: Request) -> Response:
        model, tools, prompt = self._chat(body)
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = tools.sampling_params(sampling_params(body, body.max_completion_tokens or body.max_tokens, k))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        render = ChatRendering(request_id, model.name, self._decode, k, body.return_token_ids, body.prompt_logprobs,
                               parser=tools.message_parser(self.chat.reasoning_parser, prompt),
                               calls_finish=tools.calls_finish)
        outputs = self._outputs(request_id, prompt, params, body.priority, "messages", model)
        return await self._respond(raw, [outputs], body.stream, [render], _include_usage(body))

    async def responses(self, body: rp.ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API: the chat request it means (serving/responses_api.py), its errors naming the
        Responses fields."""
        try:
            try:
                chat = chat_request(body)
            except FieldError as e:
                raise OpenAIError(400, str(e), e.param) from None
            model, tools, prompt = self._chat(chat)
            params = tools.sampling_params(sampling_params(chat, chat.max_completion_tokens, None))
            request_id = f"resp_{uuid.uuid4().hex}"
            render = ResponseRendering(request_id, model.name, body,
                                       tools.message_parser(self.chat.reasoning_parser, prompt))
            outputs = self._outputs(request_id, prompt, params, chat.priority, "input", model)
            return await self._respond(raw, [outputs], body.stream, [render], False, events=self._response_events)
        except OpenAIError as e:
            raise _renamed(e, responses_param) from None

    async def _response_events(self, outputs: AsyncIterator[tuple[int, RequestOutput]],
                               render: ResponseRendering) -> AsyncIterator[str]:
        """The Responses stream's events; a failure ends it with an error event."""
        for event in render.start():
            yield event
        try:
            async with contextlib.aclosing(outputs):
                async for _, out in outputs:
                    for event in render.push(out):
                        yield event
            for event in render.done():
                yield event
        except OpenAIError as e:
            self._count_error(e.status)
            yield render.error(e.message, e.param, e.code)

    def _anthropic_chat(self, body: ap.AnthropicCountTokensRequest) -> tuple[oai.ChatCompletionRequest, ServedModel,
                                                                             ToolPlan, str]:
        """The chat request a Messages request means, with its model, tools and prompt."""
        try:
            chat = anthropic_chat_request(body)
        except FieldError as e:
            raise OpenAIError(400, str(e), e.param) from None
        return chat, *self._chat(chat)

    async def messages(self, body: ap.AnthropicMessagesRequest, raw: Request) -> Response:
        """Anthropic's Messages API: the chat request it means (serving/anthropic_messages.py), its errors naming
        the Messages fields."""
        try:
            chat, model, tools, prompt = self._anthropic_chat(body)
            params = tools.sampling_params(sampling_params(chat, chat.max_completion_tokens, None))
            request_id = f"msg_{uuid.uuid4().hex}"
            render = MessageRendering(request_id, model.name, tools.message_parser(self.chat.reasoning_parser, prompt))
            outputs = self._outputs(request_id, prompt, params, chat.priority, "messages", model)
            return await self._respond(raw, [outputs], body.stream, [render], False, events=self._message_events)
        except OpenAIError as e:
            raise _renamed(e, messages_param) from None

    async def _message_events(self, outputs: AsyncIterator[tuple[int, RequestOutput]],
                              render: MessageRendering) -> AsyncIterator[str]:
        """Anthropic's stream: message_start (with the first output), the blocks' events, message_delta and
        message_stop; a failure ends it with an error event."""
        started = False
        try:
            async with contextlib.aclosing(outputs):
                async for _, out in outputs:
                    for event in ([] if started else render.start(out)) + render.push(out):
                        yield event
                    started = True
            for event in render.done():
                yield event
        except OpenAIError as e:
            self._count_error(e.status)
            yield render.error(e.status, e.message)

    async def count_tokens(self, body: ap.AnthropicCountTokensRequest) -> ap.AnthropicCountTokensResponse:
        """Anthropic's count_tokens: the token count of the prompt that the same Messages request gives the
        engine."""
        try:
            _, _, _, prompt = self._anthropic_chat(body)
            try:
                ids = await self._engine().tokenize(prompt)
            except ValueError as e:
                raise OpenAIError(400, str(e), "messages") from None
        except OpenAIError as e:
            raise _renamed(e, messages_param) from None
        return ap.AnthropicCountTokensResponse(input_tokens=len(ids))

    async def embeddings(self, body: pp.EmbeddingRequest, raw: Request) -> Response:
        """OpenAI's embeddings, on a pooling model: one engine request per input, run together."""
        try:
            params = PoolingParams(task="embed", dimensions=body.dimensions, normalize=body.normalize)
        except ValueError as e:
            raise _invalid(str(e), "dimensions") from None
        return await self._pool(raw, body, params, "embd", embedding_response)

    async def pooling(self, body: pp.PoolingRequest, raw: Request) -> Response:
        """vLLM's /pooling: each input's pooler output as it is (not normalized)."""
        return await self._pool(raw, body, PoolingParams(task="encode"), "pool", pooling_response)

    async def _pool(self, raw: Request, body, params: PoolingParams, prefix: str, respond) -> Response:
        model = self._pooling_model(body.model, raw)
        prompts = pooling_prompts(body.input)
        if prompts is None:
            raise OpenAIError(400, "input: empty", "input")
        self._check_prompt_bytes([p for p in prompts if isinstance(p, str)], "input")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        finals = await self._pooled(raw, request_id, prompts, params, body.priority, model, "input")
        if finals is None:
            return Response(status_code=499)
        return JSONResponse(respond(request_id, model.name, finals, body.encoding_format).model_dump())

    def _pooling_model(self, name: str | None, raw: Request) -> ServedModel:
        model = self._check_model(name)
        if self._engine().engine.config.runner != "pooling":
            raise OpenAIError(400, f"{raw.url.path} needs a pooling model: this one generates (serve an embedding "
                                   "model, or this one with --runner pooling)", "model")
        return model

    async def _pooled(self, raw: Request, request_id: str, prompts: list, params: PoolingParams, priority: int,
                      model: ServedModel, field: str) -> list | None:
        """Each prompt's pooling output (one engine request each, run together); None if the client left."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [self._outputs(i, prompt, params, priority, field, model) for i, prompt in zip(ids, prompts)]
        outputs = _merged(streams, lambda: self._count_error(499))
        return await _unless_disconnected(raw, _finals(outputs, len(streams)))

    async def score(self, body: pp.ScoreRequest, raw: Request) -> Response:
        """vLLM's /score: each pair's score (a cross-encoder's sigmoid, or the cosine of two embeddings)."""
        model = self._pooling_model(body.model, raw)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except FieldError as e:
            raise OpenAIError(400, str(e), e.param) from None
        request_id = f"score-{uuid.uuid4().hex}"
        scored = await self._scores(raw, request_id, pairs, body.priority, model, "text_1")
        if scored is None:
            return Response(status_code=499)
        scores, tokens = scored
        return JSONResponse(pp.ScoreResponse(id=request_id, model=model.name, usage=pp.PoolingUsage(
            prompt_tokens=tokens, total_tokens=tokens), data=[pp.ScoreData(index=i, score=score)
                                                           for i, score in enumerate(scores)]).model_dump())

    async def rerank(self, body: pp.RerankRequest, raw: Request) -> Response:
        """vLLM's /rerank: the documents by relevance to the query, the top_n first (0: all)."""
        model = self._pooling_model(body.model, raw)
        request_id = f"rerank-{uuid.uuid4().hex}"
        scored = await self._scores(raw, request_id, [(body.query, d) for d in body.documents], body.priority,
                                    model, "documents")
        if scored is None:
            return Response(status_code=499)
        scores, tokens = scored
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        return JSONResponse(pp.RerankResponse(id=request_id, model=model.name, usage=pp.RerankUsage(
            total_tokens=tokens), results=[pp.RerankResult(index=i, document=pp.RerankDocument(
                text=body.documents[i]), relevance_score=scores[i]) for i in order]).model_dump())

    async def _scores(self, raw: Request, request_id: str, pairs: list[tuple[str, str]], priority: int,
                      model: ServedModel, field: str) -> tuple[list[float], int] | None:
        """Each pair's score and the prompt tokens computed (serving/scoring.py); None if the client left."""
        self._check_prompt_bytes([t for pair in pairs for t in pair], field)

        async def run(prompts: list, params: PoolingParams) -> list | None:
            return await self._pooled(raw, request_id, prompts, params, priority, model, field)
        try:
            return await pair_scores(self._engine().engine, pairs, run)
        except ValueError as e:  # no tokenizer to encode a pair with
            raise OpenAIError(400, str(e), field) from None

    async def models(self) -> oai.ModelList:
        """The base model under each of its names, then each LoRA adapter with the base as its parent (vLLM's)."""
        cfg = self._engine().engine.config
        common = {"max_model_len": cfg.scheduler.max_model_len, "kv_cache_dtype": cfg.cache.kv_cache_dtype,
                  **cfg.model.weights_scheme()}
        base = [oai.ModelCard(id=name, **common) for name in self.model_names()]
        models = self.serving_models
        return oai.ModelList(data=base + [
            oai.ModelCard(id=name, root=adapter.lora_request.lora_path, parent=models.parent(adapter), **common)
            for name, adapter in list(models.adapters.items())])

    async def load_lora_adapter(self, body: oai.LoadLoRAAdapterRequest) -> Response:
        """vLLM's: serves the adapter at lora_path as lora_name (checked first: a bad one is a 400 naming the
        file and field)."""
        self._engine()
        try:
            await self.serving_models.load(body.lora_name, body.lora_path)
        except InvalidRequestError as e:
            field = "lora_path" if e.message.startswith("lora_path") else "lora_name"
            raise OpenAIError(400, e.message, field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: oai.UnloadLoRAAdapterRequest) -> Response:
        """vLLM's: lora_name is served no more (requests running with it finish with it); 404 if not loaded."""
        try:
            await self.serving_models.unload(body.lora_name)
        except UnknownModelError as e:
            raise OpenAIError(404, e.message, "lora_name", "model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def tokenize(self, body: oai.TokenizeRequest) -> oai.TokenizeResponse:
        """vLLM's /tokenize: the token ids of a prompt, or of chat messages through the chat template (the
        server's --chat-template, else the model's)."""
        self._check_model(body.model)
        engine = self._engine()
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give either prompt or messages", "prompt")
        special = body.add_special_tokens
        if body.messages is not None:
            self._check_prompt_bytes(chat_texts(body.messages), "messages")
            try:
                text = render_chat(engine.engine.tokenizer, template_messages(body.messages),
                                   self.chat.chat_template, add_generation_prompt=body.add_generation_prompt)
            except FieldError as e:
                raise OpenAIError(400, str(e), e.param) from None
            special = bool(special)
        else:
            self._check_prompt_bytes([body.prompt], "prompt")
            text, special = body.prompt, special is not False
        try:
            ids = await engine.tokenize(text, special)
        except ValueError as e:
            raise OpenAIError(400, str(e), "prompt") from None
        strs = engine.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        max_model_len = engine.engine.config.scheduler.max_model_len
        return oai.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                    token_strs=strs)

    async def detokenize(self, body: oai.DetokenizeRequest) -> oai.DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids."""
        self._check_model(body.model)
        engine = self._engine().engine
        vocab = engine.config.model.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise OpenAIError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
        if engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", "tokens")
        return oai.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    async def health(self) -> Response:
        return Response(status_code=200 if self.requests.serving else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.requests.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- errors ---------------------------------------------------------------------------------------
    def error_response(self, e: OpenAIError, path: str = "") -> JSONResponse:
        """OpenAI's error object; on the Messages API's paths, Anthropic's."""
        self._count_error(e.status)
        body = error_body(e.status, e.message) if is_messages_path(path) else e.body().model_dump()
        return JSONResponse(body, status_code=e.status)

    async def openai_error(self, request: Request, e: OpenAIError) -> JSONResponse:
        return self.error_response(e, request.url.path)

    async def http_error(self, request: Request, e: HTTPException) -> JSONResponse:
        """Starlette's own errors (an unknown path, a wrong method) as OpenAI's error object."""
        if e.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        else:
            message = e.detail
        status = e.status_code if e.status_code in ERROR_TYPES else 400
        response = self.error_response(OpenAIError(status, message), request.url.path)
        response.headers.update(e.headers or {})
        return response

    async def unexpected_error(self, request: Request, e: Exception) -> JSONResponse:
        return self.error_response(OpenAIError(500, f"internal error: {e!r}", code="internal_error"), request.url.path)

    async def validation_error(self, request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return await self.openai_error(request, OpenAIError(400, f"the body is not JSON: {first['msg']}"))
        param = ".".join(str(part) for part in first["loc"][1:]) or None  # loc[0] is "body"
        return await self.openai_error(request, OpenAIError(400, f"{param}: {first['msg']}", param))


def _renamed(e: OpenAIError, rename: Callable[[str | None], str | None]) -> OpenAIError:
    """A chat request's error as the Responses (or Messages) request's: the field as the client named it."""
    param = rename(e.param)
    if param != e.param:
        e.message, e.param = e.message.replace(e.param, param, 1), param
    return e


def _include_usage(body: oai.SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _merged(streams: list[AsyncIterator[RequestOutput]], on_cancel) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a request's prompts (one engine request each) as they come, as (prompt index, output).

    Each stream runs in a task of its own, the one the lifecycle's in-flight table holds (the watcher cancels it
    when the engine dies: an EngineDiedError). A prompt's failure is raised here; leaving early (the client
    went: on_cancel() is called; a prompt failed) cancels every stream, whose clean-up aborts its engine request
    and frees its blocks."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - an OpenAIError (or a bug), raised by the reader
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    except asyncio.CancelledError:
        on_cancel()
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _echoed(outputs: AsyncIterator[RequestOutput], render: CompletionRendering,
                  echo_only: bool) -> AsyncIterator[RequestOutput]:
    """A completion's outputs with echo, each noted by its render (the prompt's logprobs come with the first);
    echo_only (max_tokens 0): without the token generated, as vLLM's (which makes one too)."""
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            render.note(out)
            if echo_only:
                out = dataclasses.replace(out, outputs=[
                    dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=0.0,
                                        logprobs=None if c.logprobs is None else []) for c in out.outputs])
            yield out


async def _firsts(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[tuple[int, RequestOutput]]:
    """What outputs gives until each of its count prompts has given one output."""
    read, seen = [], set()
    async for i, out in outputs:
        read.append((i, out))
        seen.add(i)
        if len(seen) == count:
            break
    return read


async def _replay(read: list, outputs: AsyncIterator):
    """read's items, then the rest of outputs."""
    for item in read:
        yield item
    async with contextlib.aclosing(outputs):
        async for item in outputs:
            yield item


async def _finals(outputs: AsyncIterator[tuple[int, RequestOutput]], count: int) -> list[RequestOutput]:
    """Each prompt's last output."""
    finals = [None] * count
    async with contextlib.aclosing(outputs):
        async for i, out in outputs:
            finals[i] = out
    return finals


def _shifted(response, offset: int):
    """response with its choices' indexes moved by offset (prompt i of a batch: i * n)."""
    for choice in response.choices:
        choice.index += offset
    return response


def _merged_response(responses: list, n: int):
    """The response of a batch: each prompt's (from its Rendering.final) choices, indexed as OpenAI's, the usage
    summed, and each choice with its prompt's token ids when they are asked for (vLLM's place in a batch)."""
    if len(responses) == 1:
        return responses[0]
    merged = responses[0].model_copy()
    merged.choices = []
    for i, response in enumerate(responses):
        for choice in _shifted(response, i * n).choices:
            choice.prompt_token_ids = response.prompt_token_ids
            merged.choices.append(choice)
    merged.usage = usage(sum(r.usage.prompt_tokens for r in responses),
                         sum(r.usage.completion_tokens for r in responses))
    merged.prompt_token_ids = None
    return merged


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
              max_body_bytes: int | None = None, chat: ChatOptions | None = None, models: ServingModels | None = None,
              runtime_lora_updating: bool = False) -> FastAPI:
    """The API; with api_key every path but /health needs ``Authorization: Bearer <api_key>``; chat: the chat
    endpoint's template, tool-call and reasoning parsers; models: the base model's names and the LoRA adapters
    (default: served_model_names alone); runtime_lora_updating: vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter (unknown paths otherwise, as vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    app = FastAPI(title="jaxpage", version=jaxpage.__version__, docs_url=None, redoc_url=None)
    api = OpenAIServing(requests, served_model_names, chat, models)
    app.add_middleware(HttpGuard, key=api_key, max_body_bytes=max_body_bytes,
                       reject=lambda status, message, code, path: api.error_response(
                           OpenAIError(status, message, code=code), path))
    app.add_exception_handler(OpenAIError, api.openai_error)
    app.add_exception_handler(RequestValidationError, api.validation_error)
    app.add_exception_handler(HTTPException, api.http_error)
    app.add_exception_handler(Exception, api.unexpected_error)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/responses")(api.responses)
    app.post("/v1/messages")(api.messages)
    app.post("/v1/messages/count_tokens")(api.count_tokens)
    app.post("/v1/embeddings")(api.embeddings)
    app.post("/pooling")(api.pooling)
    for path in ("/score", "/v1/score"):
        app.post(path)(api.score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(api.rerank)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/v1/models")(api.models)
    if runtime_lora_updating:
        app.post("/v1/load_lora_adapter")(api.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(api.unload_lora_adapter)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    app.get("/version")(lambda: {"version": jaxpage.__version__})
    install_openapi_document(app)
    return app
