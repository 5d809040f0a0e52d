"""The gRPC front end: jaxpage.v1.Generation over the server's RequestLifecycle (serving/requests.py).

Requests are parsed leniently (a message protobuf cannot parse is INVALID_ARGUMENT, not UNKNOWN); the
lifecycle's errors become status codes: UNAVAILABLE while no engine takes calls or when it dies under one,
RESOURCE_EXHAUSTED for a full queue or a request that can never fit, ALREADY_EXISTS for a request id in flight,
INVALID_ARGUMENT naming ``sampling.<field>``, INTERNAL when the engine fails one request. Every error status a
call ends with is counted in request_errors_total by code, rejections included.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from typing import AsyncIterator, Callable

import grpc

from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from serving.limits import check_prompt_bytes
from serving.requests import (DuplicateRequestError, EngineDiedError, EngineFailedError, InvalidRequestError,
                              NotServingError, QueueFullError, RequestError, RequestLifecycle, RequestTooLargeError)
from serving.serving_models import ServingModels, UnknownModelError

log = logging.getLogger("jaxpage.serve")

# The server's deadline starts when the call arrives, later than the client's, so a client whose own deadline
# fired cancels the stream with a little time still left here; that much left still counts as an expiry.
DEADLINE_SLACK_S = 0.5
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxpage.v1.Generation"

# the lifecycle's errors as status codes (the first class of an error's MRO found here)
STATUS_CODES = {UnknownModelError: grpc.StatusCode.NOT_FOUND, NotServingError: grpc.StatusCode.UNAVAILABLE,
                QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
                DuplicateRequestError: grpc.StatusCode.ALREADY_EXISTS,
                RequestTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
                InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT, EngineDiedError: grpc.StatusCode.UNAVAILABLE,
                EngineFailedError: grpc.StatusCode.INTERNAL}

# SamplingParams fields whose proto field has presence: absent means "the engine's default".
_OPTIONAL = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "length_penalty",
             "skip_special_tokens", "prompt_logprobs")
_PLAIN = ("ignore_eos", "use_beam_search", "include_stop_str_in_output")


@dataclasses.dataclass
class UndecodableRequest:
    """A request message protobuf could not parse (corrupt bytes, invalid UTF-8 in a string field)."""
    error: str


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """A deserializer that hands the handler an UndecodableRequest instead of raising: grpc would answer
    UNKNOWN (and log a traceback); the handler answers INVALID_ARGUMENT."""
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or anything else parsing raises
            return UndecodableRequest(f"the request message cannot be parsed ({type(e).__name__}: {e}); "
                                      "string fields must be valid UTF-8")
    return deserialize


def _client_names(message: str) -> str:
    """Field names as the client wrote them: the engine's ``SamplingParams.n`` is the request's ``sampling.n``,
    ``PoolingParams.dimensions`` an EmbedRequest's ``dimensions``."""
    return message.replace("SamplingParams.", "sampling.").replace("PoolingParams.", "")


def sampling_params(msg: pb.SamplingParams, output_kind: str):
    """The engine's SamplingParams from the proto; ValueError (naming ``sampling.<field>``) on bad values."""
    from jaxpage.sampling_params import SamplingParams
    from serving.structured import from_proto

    kw = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    kw.update({name: getattr(msg, name) for name in _PLAIN})
    kw["stop"] = list(msg.stop)
    kw["stop_token_ids"] = list(msg.stop_token_ids)
    kw["logit_bias"] = dict(msg.logit_bias) or None  # checked by SamplingParams (and the vocabulary by the engine)
    if msg.HasField("structured_outputs"):
        kw["structured_outputs"] = from_proto(msg.structured_outputs)
    n, best_of = kw.get("n", 1), kw.get("best_of", kw.get("n", 1))
    if output_kind == "delta" and (msg.use_beam_search or best_of != n):
        output_kind = "final_only"  # the best n are known only at the end: one response then
    try:
        return SamplingParams(**kw, output_kind=output_kind)
    except ValueError as e:
        raise ValueError(_client_names(str(e))) from None


def check_prompt_size(request: pb.GenerateRequest, max_bytes: int | None) -> None:
    texts = [request.prompt, *(text for m in request.messages for text in (m.role, m.content))]
    check_prompt_bytes(texts, max_bytes, "prompt")


def engine_prompt(request: pb.GenerateRequest, engine, chat_template: str | None = None) -> str | dict:
    """The prompt as the engine takes it; exactly one of prompt, prompt_token_ids and messages (through
    chat_template, the server's --chat-template, else the model's)."""
    from serving.chat_template import render_chat

    given = [name for name, present in (("prompt", bool(request.prompt)),
                                        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
                                        ("messages", len(request.messages) > 0)) if present]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids and messages"
                         + (f" (got {' and '.join(given)})" if given else " (all are empty)"))
    if request.prompt:
        return request.prompt
    if request.prompt_token_ids:
        return {"prompt_token_ids": list(request.prompt_token_ids)}
    for i, m in enumerate(request.messages):
        if not m.role:
            raise ValueError(f"messages[{i}].role is empty")
    return render_chat(engine.tokenizer, [{"role": m.role, "content": m.content} for m in request.messages],
                       chat_template)


def _embed_prompt(i: int, given: pb.EmbedInput) -> str | dict:
    if bool(given.text) == bool(given.token_ids):
        raise ValueError(f"inputs[{i}]: give exactly one of text and token_ids")
    return given.text or {"prompt_token_ids": list(given.token_ids)}


def _logprobs(entries) -> list[pb.PositionLogprobs]:
    """Per position, its entry's log-probabilities (a None entry, the first prompt token's: none)."""
    return [pb.PositionLogprobs(top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in (entry or {}).items()])
            for entry in entries]


def _completion(c, finish_reason: str) -> pb.Completion:
    msg = pb.Completion(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=finish_reason,
                        cumulative_logprob=c.cumulative_logprob)
    if finish_reason and c.stop_reason is not None:
        msg.stop_reason = str(c.stop_reason)
    if c.logprobs:
        msg.logprobs.extend(_logprobs(c.logprobs))
    return msg


def _usage(out, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens)


def _status(e: RequestError) -> tuple[grpc.StatusCode, str]:
    code = next(STATUS_CODES[cls] for cls in type(e).__mro__ if cls in STATUS_CODES)
    return code, _client_names(e.message) if code == grpc.StatusCode.INVALID_ARGUMENT else e.message


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, requests: RequestLifecycle, chat_template: str | None = None,
                 models: ServingModels | None = None):
        self.requests, self.chat_template = requests, chat_template  # chat_template: the server's, for messages
        self.serving_models = models or ServingModels(requests)  # the adapters a request's lora_name may name

    # --- the RPCs ---------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        final = None
        async with contextlib.aclosing(self._outputs(request, context, "final_only")) as outputs:
            async for out in outputs:
                final = out
        completions = [_completion(c, c.finish_reason or "") for c in final.outputs]
        return pb.GenerateResponse(request_id=final.request_id, completions=completions,
                                   usage=_usage(final, sum(len(c.token_ids) for c in final.outputs)),
                                   prompt_logprobs=_logprobs(final.prompt_logprobs or []))

    async def GenerateStream(self, request, context):
        finished: set[int] = set()
        total = 0
        async with contextlib.aclosing(self._outputs(request, context, "delta")) as outputs:
            async for out in outputs:
                completions = []
                for c in out.outputs:
                    reason = c.finish_reason if c.finish_reason and c.index not in finished else ""
                    if reason:
                        finished.add(c.index)
                    if c.token_ids or c.text or reason:
                        completions.append(_completion(c, reason))
                        total += len(c.token_ids)
                if not completions and not out.finished:
                    continue
                yield pb.GenerateResponse(request_id=out.request_id, completions=completions,
                                          usage=_usage(out, total) if out.finished else None,
                                          prompt_logprobs=_logprobs(out.prompt_logprobs or []))

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, with requests parsed leniently (see _lenient)."""
        parse = _lenient(pb.GenerateRequest.FromString)
        serialize = pb.GenerateResponse.SerializeToString
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_unary_rpc_method_handler(self.Generate, parse, serialize),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(self.GenerateStream, parse, serialize),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo, _lenient(pb.GetModelInfoRequest.FromString),
                pb.GetModelInfoResponse.SerializeToString),
            "Embed": grpc.unary_unary_rpc_method_handler(
                self.Embed, _lenient(pb.EmbedRequest.FromString), pb.EmbedResponse.SerializeToString),
            "Score": grpc.unary_unary_rpc_method_handler(
                self.Score, _lenient(pb.ScoreRequest.FromString), pb.ScoreResponse.SerializeToString),
        })

    async def GetModelInfo(self, request, context):
        try:
            engine = self.requests.require_engine()
        except NotServingError as e:
            await self._reject(context, *_status(e))
        cfg = engine.engine.config
        scheme = cfg.model.weights_scheme()
        return pb.GetModelInfoResponse(
            model_name=engine.engine.model_name, max_model_len=cfg.scheduler.max_model_len,
            block_size=cfg.cache.block_size,
            num_kv_blocks=cfg.cache.num_kv_blocks, max_num_seqs=cfg.scheduler.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, dtype=str(cfg.dtype),
            vocab_size=cfg.model.vocab_size, kv_cache_dtype=cfg.cache.kv_cache_dtype,
            quantization=scheme["quantization"] or "", quantized_weights=scheme["quantized_weights"] or "",
            quantization_group_size=scheme["quantization_group_size"] or 0,
            quantization_zero_point=scheme["quantization_zero_point"], lora_adapters=[
                pb.LoRAAdapter(name=name, path=adapter.lora_request.lora_path,
                               base_model_name=self.serving_models.parent(adapter))
                for name, adapter in list(self.serving_models.adapters.items())])

    async def Embed(self, request, context):
        """Each input's pooling output (one engine request each, run together)."""
        from jaxpage.pooling_params import PoolingParams

        if isinstance(request, UndecodableRequest):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            prompts = [_embed_prompt(i, x) for i, x in enumerate(request.inputs)]
            if not prompts:
                raise ValueError("inputs: empty")
            params = PoolingParams(task=request.task or "embed",
                                   dimensions=request.dimensions if request.HasField("dimensions") else None,
                                   normalize=request.normalize if request.HasField("normalize") else None)
            check_prompt_bytes([p for p in prompts if isinstance(p, str)], self.requests.max_prompt_bytes, "inputs")
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, _client_names(str(e)))
        request_id = request.request_id or f"embd-{uuid.uuid4().hex}"
        outs = await self._pooled(request, context, request_id, prompts, params)
        return pb.EmbedResponse(request_id=request_id, prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                                embeddings=[pb.Embedding(values=o.outputs.data, prompt_tokens=len(o.prompt_token_ids))
                                            for o in outs])

    async def Score(self, request, context):
        """Each pair's score (serving/scoring.py)."""
        from jaxpage.entrypoints.score_utils import score_pairs
        from serving.scoring import pair_scores

        if isinstance(request, UndecodableRequest):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
        request_id = request.request_id or f"score-{uuid.uuid4().hex}"
        try:
            pairs = score_pairs(list(request.text_1), list(request.text_2))
            check_prompt_bytes([t for pair in pairs for t in pair], self.requests.max_prompt_bytes, "text_1")
            engine = self.requests.require_engine().engine
        except RequestError as e:
            await self._reject(context, *_status(e))
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

        async def run(prompts: list, params) -> list:
            return await self._pooled(request, context, request_id, prompts, params)
        try:
            scores, tokens = await pair_scores(engine, pairs, run)
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ScoreResponse(request_id=request_id, scores=scores, prompt_tokens=tokens)

    async def _pooled(self, request, context, request_id: str, prompts: list, params) -> list:
        """Each prompt's PoolingRequestOutput (engine requests "<id>-<i>", run together); a failure of any ends
        the call with its status code."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]

        async def one(i: str, prompt):
            final = None
            async with contextlib.aclosing(self._run(request, context, i, lambda engine: (prompt, params))) as outs:
                async for out in outs:
                    final = out
            return final
        return list(await asyncio.gather(*(one(i, p) for i, p in zip(ids, prompts))))

    def count_error(self, code: grpc.StatusCode) -> None:
        self.requests.count_error(code.name)

    # --- one request's life -----------------------------------------------------------------------------
    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.count_error(code)
        await context.abort(code, message)

    async def _outputs(self, request, context, output_kind: str) -> AsyncIterator:
        """The request's RequestOutputs from the lifecycle; every failure ends the call with a status code.

        A call ended while its handler was not waiting on the engine stream is aborted by the done callback."""
        if isinstance(request, UndecodableRequest):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)

        def prepare(engine):
            params = sampling_params(request.sampling, output_kind)
            check_prompt_size(request, self.requests.max_prompt_bytes)
            return engine_prompt(request, engine.engine, self.chat_template), params

        async with contextlib.aclosing(self._run(request, context, request.request_id or f"req-{uuid.uuid4().hex}",
                                                 prepare)) as outputs:
            async for out in outputs:
                yield out

    async def _run(self, request, context, request_id: str, prepare) -> AsyncIterator:
        """One engine request's outputs (prepare(engine) -> (prompt, params)) on the request's adapter."""
        try:
            lora_request = self.serving_models.resolve(request.lora_name, "lora_name").lora_request
        except RequestError as e:
            await self._reject(context, *_status(e))
        outputs = self.requests.generate(request_id, prepare, request.priority,
                                         lambda release: context.add_done_callback(lambda _: release()),
                                         lora_request)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield out
        except RequestError as e:
            await self._reject(context, *_status(e))
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: ended while a response was being written
            log.info("request %s ended early (client cancel, disconnect, deadline or server stop): aborted",
                     request_id)
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= DEADLINE_SLACK_S
            self.count_error(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED)
            raise
