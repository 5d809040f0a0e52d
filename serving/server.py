"""The gRPC server: jaxpage.v1.Generation over an AsyncEngine, with health, reflection and Prometheus metrics.

    jaxpage serve [--model PATH] [--host 127.0.0.1] [--port 50051] [--metrics-port 9090] [--max-queue N] ...

Beside it, on --http-port, the OpenAI-compatible HTTP API (serving/openai_api.py) over the same service.

Start-up: the port opens at once with health NOT_SERVING; the engine loads and compiles every bucket in a
thread, runs one warm-up request, and only then does health turn SERVING. A request that fails on the engine
thread ends alone (INTERNAL). When the engine loop itself dies (a device error), a watcher turns health
NOT_SERVING, fails the calls in flight with UNAVAILABLE and makes a fresh engine, at most
--max-engine-restarts times over the process's life; after that the process exits 1, for a supervisor to
restart it: never a live process that serves nothing. SIGTERM/SIGINT stop accepting calls, let the calls in
flight finish within --grace-seconds, and exit 0 (a second signal cancels what is left).

Every error status a call ends with is counted in request_errors_total by code, rejections included.

Every call runs in the event loop; the engine's step loop runs in its own thread. A call that ends early
(client cancel, disconnect, expired deadline) is cancelled by grpc.aio; the cancellation goes through the
engine's output stream, whose clean-up aborts the request and returns its KV blocks at once.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from typing import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from serving import security
from serving.limits import check_prompt_bytes
from serving.metrics import Metrics

log = logging.getLogger("jaxpage.serve")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxpage.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_POLL_SECONDS = 0.25
ENGINE_DEATH_GRACE_SECONDS = 1.0  # then calls the dead engine did not fail itself are failed by the watcher

# SamplingParams fields whose proto field has presence: absent means "the engine's default".
_OPTIONAL = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "length_penalty",
             "skip_special_tokens")
_PLAIN = ("ignore_eos", "use_beam_search", "include_stop_str_in_output")


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


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
    """Field names as the client wrote them: the engine's ``SamplingParams.n`` is the request's ``sampling.n``."""
    return message.replace("SamplingParams.", "sampling.")


def sampling_params(msg: pb.SamplingParams, output_kind: str):
    """The engine's SamplingParams from the proto; ValueError (naming ``sampling.<field>``) on bad values."""
    from jaxpage.sampling_params import SamplingParams
    from serving.structured import from_proto

    kw = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    kw.update({name: getattr(msg, name) for name in _PLAIN})
    kw["stop"] = list(msg.stop)
    kw["stop_token_ids"] = list(msg.stop_token_ids)
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


def engine_prompt(request: pb.GenerateRequest, engine) -> str | dict:
    """The prompt as the engine takes it; exactly one of prompt, prompt_token_ids and messages."""
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
    try:
        return engine.apply_chat_template([{"role": m.role, "content": m.content} for m in request.messages])
    except ValueError as e:
        raise ValueError(f"messages: {e}") from None


def _logprobs(entries) -> list[pb.PositionLogprobs]:
    return [pb.PositionLogprobs(top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry.items()])
            for entry in entries]


def _completion(c, finish_reason: str) -> pb.Completion:
    msg = pb.Completion(index=c.index, text=c.text, token_ids=c.token_ids, finish_reason=finish_reason,
                        cumulative_logprob=c.cumulative_logprob)
    if finish_reason and c.stop_reason is not None:
        msg.stop_reason = str(c.stop_reason)
    if c.logprobs:
        msg.logprobs.extend(_logprobs(c.logprobs))
    return msg


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, metrics: Metrics, max_queue: int | None = None, max_prompt_bytes: int | None = None):
        self.engine = None  # the AsyncEngine, once loaded and warm
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_prompt_bytes = max_prompt_bytes
        self.accepting = False
        self.not_accepting_reason = "the server is starting: the engine is loading"
        self.in_flight: dict[str, asyncio.Task] = {}
        self._failed_by_watcher: set[str] = set()
        self.will_restart: Callable[[], bool] = lambda: True  # whether a dead engine is replaced (the Server says)

    def after_engine_death(self) -> str:
        """What a call failed by the engine's death is told comes next."""
        return ("the server restarts the engine: retry shortly" if self.will_restart()
                else "no engine restarts are left: the server stops")

    # --- the RPCs ---------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        final = None
        async with contextlib.aclosing(self._outputs(request, context, "final_only")) as outputs:
            async for out, _ in outputs:
                final = out
        completions = [_completion(c, c.finish_reason or "") for c in final.outputs]
        return pb.GenerateResponse(request_id=final.request_id, completions=completions,
                                   usage=self._usage(final, sum(len(c.token_ids) for c in final.outputs)))

    async def GenerateStream(self, request, context):
        finished: set[int] = set()
        total = 0
        async with contextlib.aclosing(self._outputs(request, context, "delta")) as outputs:
            async for out, _ in outputs:
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
                                          usage=self._usage(out, total) if out.finished else None)

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
        })

    async def GetModelInfo(self, request, context):
        engine = await self._engine_or_abort(context)
        cfg = engine.engine.config
        return pb.GetModelInfoResponse(
            model_name=engine.engine.model_name, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, dtype=str(cfg.dtype),
            vocab_size=cfg.model.vocab_size, kv_cache_dtype=cfg.kv_cache_dtype,
            quantization=cfg.model.quantization or "")

    # --- one request's life -----------------------------------------------------------------------------
    async def _engine_or_abort(self, context):
        if not self.accepting or self.engine is None:
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, self.not_accepting_reason)
        return self.engine

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self._count_error(code)
        await context.abort(code, message)

    async def _outputs(self, request, context, output_kind: str) -> AsyncIterator[tuple]:
        """Admits the request and yields (RequestOutput, now); maps every failure to a status code.

        Clean-up frees the request's blocks at once however the call ends: cancellation (client cancel,
        disconnect, deadline) raises CancelledError inside the engine stream, whose own clean-up aborts; a
        call ended while its handler was not waiting on the stream is aborted by the done callback.
        """
        from jaxpage.engine.async_engine import EngineDeadError, RequestFailedError
        from jaxpage.engine.llm_engine import DoesNotFitError

        started = time.monotonic()
        if isinstance(request, UndecodableRequest):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, request.error)
        engine = await self._engine_or_abort(context)
        if self.max_queue is not None and len(self.in_flight) >= self.max_queue:
            await self._reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the queue is full: {len(self.in_flight)} requests in flight "
                               f"(--max-queue {self.max_queue}); retry later")
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self.in_flight:
            await self._reject(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r} is already in use")
        task = asyncio.current_task()
        self.in_flight[request_id] = task
        m = self.metrics
        m.labels(m.in_flight).inc()
        context.add_done_callback(lambda _: self._on_done(engine, request_id, task))
        stream, iterating, finished, last, served = None, False, False, None, {}
        try:
            try:
                params = sampling_params(request.sampling, output_kind)
                check_prompt_size(request, self.max_prompt_bytes)
                prompt = engine_prompt(request, engine.engine)
                stream = await engine.add_request(request_id, prompt, params, priority=request.priority)
                served = m.served_by(engine.replica_of(request_id))
            except DoesNotFitError as e:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            except ValueError as e:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, _client_names(str(e))) from None
            except EngineDeadError as e:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            try:
                iterating = True
                async for out in stream:
                    now = time.monotonic()
                    self._observe(out, started, last, now, params, served)
                    last = now
                    finished = out.finished
                    yield out, now
            except EngineDeadError as e:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{e}; {self.after_engine_death()}") from None
            except RequestFailedError as e:
                raise RequestError(grpc.StatusCode.INTERNAL, str(e)) from None
            except asyncio.CancelledError:
                if request_id in self._failed_by_watcher:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"the engine loop died; {self.after_engine_death()}") from None
                log.info("request %s ended early (client cancel, disconnect, deadline or server stop): "
                         "aborted", request_id)
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                self._count_error(grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED)
                raise
        except RequestError as e:
            self._count_error(e.code)
            await context.abort(e.code, e.message)
        finally:
            if stream is not None and not finished:
                if iterating:
                    await stream.aclose()  # the stream's clean-up aborts the request (if not done already)
                else:
                    self._abort(engine, request_id)
            self._forget(request_id, task)
        if finished:
            m.labels(m.e2e, **served).observe(time.monotonic() - started)

    def _forget(self, request_id: str, task) -> None:
        if self.in_flight.get(request_id) is task:
            del self.in_flight[request_id]
            self._failed_by_watcher.discard(request_id)
            self.metrics.labels(self.metrics.in_flight).dec()

    def _on_done(self, engine, request_id: str, task) -> None:
        """The call has ended; if its handler has not cleaned up (it was not waiting on the engine), do it."""
        if self.in_flight.get(request_id) is task:
            self._abort(engine, request_id)
            self._forget(request_id, task)

    @staticmethod
    def _abort(engine, request_id: str) -> None:
        try:
            engine.abort(request_id)
        except Exception:  # noqa: BLE001 - a dead engine may fail to abort; nothing is left to free then
            log.exception("abort of %s failed", request_id)

    def _observe(self, out, started: float, last: float | None, now: float, params, served: dict) -> None:
        """One output's latencies and token counts; served: the request's replica label (``Metrics.served_by``)."""
        m = self.metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if last is None:
            m.labels(m.prompt_tokens, **served).inc(len(out.prompt_token_ids))
            if params.output_kind == "delta":
                m.labels(m.ttft, **served).observe(now - started)
            elif out.metrics is not None and out.metrics.first_token_time is not None:
                # one response at the end: the engine's own first-token time, from this call's start
                m.labels(m.ttft, **served).observe(out.metrics.first_token_time - started)
                tpot = out.metrics.time_per_output_token
                if tpot is not None:
                    itl = m.labels(m.itl, **served)
                    for _ in range(out.metrics.num_output_tokens - 1):
                        itl.observe(tpot)
        elif new_tokens:
            m.labels(m.itl, **served).observe(now - last)
        if new_tokens:
            m.labels(m.generation_tokens, **served).inc(new_tokens)
        if out.finished:
            reason = out.outputs[0].finish_reason if out.outputs else "stop"
            m.labels(m.request_success, **served, finished_reason=reason or "stop").inc()

    def _count_error(self, code: grpc.StatusCode) -> None:
        self.metrics.labels(self.metrics.request_errors, code=code.name).inc()

    @staticmethod
    def _usage(out, completion_tokens: int) -> pb.Usage:
        return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens)

    def fail_in_flight(self) -> None:
        """The engine died: fail every call still waiting on it (the engine normally fails them itself)."""
        for request_id, task in list(self.in_flight.items()):
            self._failed_by_watcher.add(request_id)
            task.cancel()


# --- the process ---------------------------------------------------------------------------------------
def default_engine_factory(ns: argparse.Namespace) -> Callable[[], object]:
    def make():
        from jaxpage.engine.arg_utils import EngineArgs
        from jaxpage.engine.data_parallel import make_async_engine

        return make_async_engine(EngineArgs.from_cli_args(ns))
    return make


async def _in_thread(fn: Callable):
    """Runs fn in a daemon thread (a load still running at exit must not hold the process)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target():
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001
            # bound now: Python unbinds ``e`` when the except block ends, before the loop runs the callback
            loop.call_soon_threadsafe(lambda error=e: future.done() or future.set_exception(error))
        else:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

    threading.Thread(target=target, name="jaxpage-load", daemon=True).start()
    return await future


async def _warm_up(engine) -> None:
    """One request end to end (tokenizer, detokenizer, output path), so the first client pays nothing."""
    from jaxpage.sampling_params import SamplingParams

    prompt = "Hello" if engine.engine.tokenizer is not None else {"prompt_token_ids": [1, 2, 3]}
    stream = await engine.add_request(f"warmup-{uuid.uuid4().hex}", prompt,
                                      SamplingParams(temperature=0, max_tokens=2, output_kind="delta"))
    async for _ in stream:
        pass


class Server:
    def __init__(self, ns: argparse.Namespace, make_engine: Callable[[], object]):
        self.ns = ns
        self.make_engine = make_engine
        metrics = Metrics(self._stats, self._model_name, getattr(ns, "data_parallel_size", 1))
        self.service = GenerationService(metrics, ns.max_queue, getattr(ns, "max_prompt_bytes", None))
        self.service.will_restart = lambda: self.restarts < getattr(ns, "max_engine_restarts", 3)
        self.health = health_aio.HealthServicer()
        self.stopping = asyncio.Event()
        self.signals = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.http = None  # the OpenAI-compatible HTTP server (serving/http_server.py), unless --http-port 0
        self.restarts = 0  # engines made after the first one died
        self.exit_code = 0

    def _stats(self):
        engine = self.service.engine
        return None if engine is None else engine.stats()

    def _model_name(self) -> str:
        engine = self.service.engine
        return "" if engine is None else engine.engine.model_name

    async def set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        ns = self.ns
        key = security.api_key(getattr(ns, "api_key", None))
        interceptors = [security.BearerTokenInterceptor(key, self.service._count_error)] if key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", _max_message_bytes(ns))])
        self.server.add_generic_rpc_handlers((self.service.rpc_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if getattr(ns, "reflection", True):
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                self.server)
        await self.set_health(NOT_SERVING)
        cert, cert_key, client_ca = _tls_files(ns)
        address = f"{ns.host}:{ns.port}"
        if cert:
            self.port = self.server.add_secure_port(address, security.server_credentials(cert, cert_key, client_ca))
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {ns.host}:{ns.port}")
        await self.server.start()
        if ns.http_port:
            await self.start_http()
        scheme = "https" if cert else "http"
        if ns.metrics_port:
            security.serve_metrics(self.service.metrics.registry, ns.metrics_host or ns.host, ns.metrics_port, key,
                                   cert, cert_key, client_ca)
        log.info("listening on %s:%d (%s%s; health NOT_SERVING until warm); metrics on %s", ns.host, self.port,
                 "TLS" if cert else "plaintext", ", bearer token" if key else "",
                 f"{scheme}://{ns.metrics_host or ns.host}:{ns.metrics_port}/metrics" if ns.metrics_port else "none")

    async def start_http(self) -> None:
        from serving.http_server import HttpServer
        from serving.openai_api import build_app

        ns = self.ns
        cert, cert_key, client_ca = _tls_files(ns)
        app = build_app(self.service, ns.served_model_name, security.api_key(getattr(ns, "api_key", None)),
                        _max_message_bytes(ns))
        self.http = HttpServer(app, ns.host, ns.http_port, ns.grace_seconds,
                               security.uvicorn_tls(cert, cert_key, client_ca))
        await self.http.start()
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if cert else "http", ns.host,
                 self.http.port)

    def on_signal(self) -> None:
        self.signals += 1
        self.stopping.set()
        if self.signals > 1 and self.server is not None:
            log.warning("second signal: cancelling the calls in flight")
            asyncio.ensure_future(self.server.stop(0))
            if self.http is not None:
                self.http.force_stop()

    async def load(self) -> bool:
        """Loads and warms the engine unless a stop comes first; True once SERVING."""
        started = time.monotonic()
        loading = asyncio.ensure_future(_in_thread(self.make_engine))
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            return False
        stop.cancel()
        engine = loading.result()  # a failed load raises here
        await _warm_up(engine)
        self.service.engine = engine
        if self.stopping.is_set():
            return False
        self.service.accepting = True
        await self.set_health(SERVING)
        cfg = engine.engine.config
        log.info("SERVING %s on %s:%d after %.1f s (%d KV blocks of %d tokens, max_model_len %d)",
                 engine.engine.model_name, self.ns.host, self.port, time.monotonic() - started,
                 cfg.num_kv_blocks, cfg.block_size, cfg.max_model_len)
        return True

    async def watch(self) -> None:
        """Health follows the engine. When its loop dies: NOT_SERVING, the calls in flight fail (UNAVAILABLE),
        and a fresh engine replaces it, at most --max-engine-restarts times; after that the process stops
        with exit code 1, for a supervisor to restart it."""
        while not self.stopping.is_set():
            engine = self.service.engine
            if engine is not None and not engine.is_running and not self.stopping.is_set():
                await self._engine_died(engine)
                if not await self._restart(engine):
                    self.exit_code = 1
                    self.stopping.set()
                    return
            await asyncio.sleep(HEALTH_POLL_SECONDS)

    async def _engine_died(self, engine) -> None:
        self.service.accepting = False
        next_step = self.service.after_engine_death()
        self.service.not_accepting_reason = f"the engine loop died ({engine.error!r}); {next_step}"
        await self.set_health(NOT_SERVING)
        log.error("engine loop died (%r): health NOT_SERVING", engine.error)
        await asyncio.sleep(ENGINE_DEATH_GRACE_SECONDS)
        self.service.fail_in_flight()

    async def _restart(self, dead) -> bool:
        """Replaces the dead engine; False once the restarts are used up (or a stop came)."""
        limit = getattr(self.ns, "max_engine_restarts", 3)
        await asyncio.to_thread(dead.shutdown, 1.0)
        self.service.engine = None
        while self.restarts < limit and not self.stopping.is_set():
            self.restarts += 1
            log.warning("restarting the engine (%d of at most %d)", self.restarts, limit)
            try:
                if await self.load():
                    return True
            except Exception:  # noqa: BLE001 - a failed restart counts as one; the next may succeed
                log.exception("engine restart %d failed", self.restarts)
        if not self.stopping.is_set():
            log.error("the engine died and %d restarts are used up: exiting 1", limit)
        return False

    async def stop(self) -> None:
        self.service.accepting = False
        self.service.not_accepting_reason = "the server is shutting down"
        await self.health.enter_graceful_shutdown()
        n = len(self.service.in_flight)
        log.info("shutting down: %d calls in flight, up to %.0f s to finish", n, self.ns.grace_seconds)
        await asyncio.gather(self.server.stop(self.ns.grace_seconds),
                             *([self.http.stop()] if self.http is not None else []))
        engine = self.service.engine
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        log.info("stopped")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal)
        await self.start()
        try:
            serving = await self.load()
        except BaseException:
            await self.server.stop(0)
            raise
        watcher = asyncio.ensure_future(self.watch()) if serving else None
        await self.stopping.wait()
        await self.stop()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        return self.exit_code


def _tls_files(ns: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """--tls-cert, --tls-key, --tls-client-ca (each None when not given)."""
    return tuple(getattr(ns, name, None) for name in ("tls_cert", "tls_key", "tls_client_ca"))


def _max_message_bytes(ns: argparse.Namespace) -> int:
    return getattr(ns, "max_message_bytes", None) or 4 << 20


def run(ns: argparse.Namespace, make_engine: Callable[[], object] | None = None) -> int:
    """`jaxpage serve`: runs until SIGTERM/SIGINT; returns the exit code."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("jaxpage", "serving"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False  # a library may have configured the root logger too
    server = Server(ns, make_engine or default_engine_factory(ns))
    code = asyncio.run(server.run())
    if server.service.engine is None:  # stopped while loading: the load thread cannot be interrupted
        logging.shutdown()
        os._exit(code)
    return code
