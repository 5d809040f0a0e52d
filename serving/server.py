"""The server process: the gRPC server (serving/grpc_service.py) with health, reflection and Prometheus metrics.

    jaxpage serve [--model PATH] [--host 127.0.0.1] [--port 50051] [--metrics-port 9090] [--max-queue N] ...

Beside it, on --http-port, the OpenAI-compatible HTTP API (serving/openai_api.py); both front ends share one
RequestLifecycle (serving/requests.py).

Start-up: the port opens at once with health NOT_SERVING; the engine loads and compiles every bucket in a
thread, runs one warm-up request, and only then does health turn SERVING. A request that fails on the engine
thread ends alone (INTERNAL). When the engine loop itself dies (a device error), a watcher turns health
NOT_SERVING, fails the calls in flight with UNAVAILABLE and makes a fresh engine, at most
--max-engine-restarts times over the process's life; after that the process exits 1, for a supervisor to
restart it: never a live process that serves nothing. SIGTERM/SIGINT stop accepting calls, let the calls in
flight finish within --grace-seconds, and exit 0 (a second signal cancels what is left).

Every call runs in the event loop; the engine's step loop runs in its own thread.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
import time
import uuid
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from serving import security
from serving.chat_options import ChatOptions
from serving.cli_args import ServerArgs
from serving.grpc_service import SERVICE_NAME, GenerationService
from serving.metrics import Metrics
from serving.requests import RequestLifecycle
from serving.serving_models import ServingModels

log = logging.getLogger("jaxpage.serve")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_POLL_SECONDS = 0.25
ENGINE_DEATH_GRACE_SECONDS = 1.0  # then calls the dead engine did not fail itself are failed by the watcher


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
    from jaxpage.pooling_params import PoolingParams
    from jaxpage.sampling_params import SamplingParams

    prompt = "Hello" if engine.engine.tokenizer is not None else {"prompt_token_ids": [1, 2, 3]}
    params = (PoolingParams(task="encode") if engine.engine.config.runner == "pooling"
              else SamplingParams(temperature=0, max_tokens=2, output_kind="delta"))
    stream = await engine.add_request(f"warmup-{uuid.uuid4().hex}", prompt, params)
    async for _ in stream:
        pass


def _freeze_startup_heap() -> None:
    """Takes what start-up made (~0.8M objects: the tokenizer, the weights' host side, compiled programs) out of
    the collector's generations, as vLLM's engine does: a full collection over them took ~0.3 s of the engine's
    thread here, a stall of every running stream."""
    gc.collect()
    gc.freeze()


class Server:
    def __init__(self, args: ServerArgs, make_engine: Callable[[], object], data_parallel_size: int = 1):
        self.args = args
        self.make_engine = make_engine
        metrics = Metrics(self._stats, self._model_name, data_parallel_size)
        self.requests = RequestLifecycle(metrics, args.max_queue, args.max_prompt_bytes)
        self.requests.will_restart = lambda: self.restarts < args.max_engine_restarts
        self.chat = ChatOptions.from_server_args(args)  # the chat template serves gRPC's messages too
        self.models = ServingModels(self.requests, args.served_model_name, args.lora_modules)
        self.service = GenerationService(self.requests, self.chat.chat_template, self.models)
        self.health = health_aio.HealthServicer()
        self.stopping = asyncio.Event()
        self.signals = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.http = None  # the OpenAI-compatible HTTP server (serving/http_server.py), unless --http-port 0
        self.restarts = 0  # engines made after the first one died
        self.exit_code = 0

    def _stats(self):
        engine = self.requests.engine
        return None if engine is None else engine.stats()

    def _model_name(self) -> str:
        engine = self.requests.engine
        return "" if engine is None else engine.engine.model_name

    async def set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        args = self.args
        key = security.api_key(args.api_key)
        await self.start_grpc(key)
        if args.http_port:
            await self.start_http(key)
        scheme, metrics_host = "https" if args.tls_cert else "http", args.metrics_host or args.host
        if args.metrics_port:
            security.serve_metrics(self.requests.metrics.registry, metrics_host, args.metrics_port, key,
                                   *args.tls_files)
        log.info("listening on %s:%d (%s%s; health NOT_SERVING until warm); metrics on %s", args.host, self.port,
                 "TLS" if args.tls_cert else "plaintext", ", bearer token" if key else "",
                 f"{scheme}://{metrics_host}:{args.metrics_port}/metrics" if args.metrics_port else "none")

    async def start_grpc(self, key: str | None) -> None:
        args = self.args
        interceptors = [security.BearerTokenInterceptor(key, self.service.count_error)] if key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", args.max_message_bytes)])
        self.server.add_generic_rpc_handlers((self.service.rpc_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if args.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                self.server)
        await self.set_health(NOT_SERVING)
        address = f"{args.host}:{args.port}"
        if args.tls_cert:
            self.port = self.server.add_secure_port(address, security.server_credentials(*args.tls_files))
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot listen on {args.host}:{args.port}")
        await self.server.start()

    async def start_http(self, key: str | None) -> None:
        from serving.http_server import HttpServer
        from serving.openai_api import build_app

        args = self.args
        app = build_app(self.requests, args.served_model_name, key, args.max_message_bytes, self.chat, self.models,
                        args.allow_runtime_lora_updating)
        self.http = HttpServer(app, args.host, args.http_port, args.grace_seconds,
                               security.uvicorn_tls(*args.tls_files))
        await self.http.start()
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if args.tls_cert else "http", args.host,
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
        gc.unfreeze()  # a restarted engine's predecessor becomes collectable again
        loading = asyncio.ensure_future(_in_thread(self.make_engine))
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            return False
        stop.cancel()
        engine = loading.result()  # a failed load raises here
        await _warm_up(engine)
        await self.models.check_all(engine, restart=self.restarts > 0)  # --lora-modules, and those loaded since
        _freeze_startup_heap()
        self.requests.engine = engine
        if self.stopping.is_set():
            return False
        self.requests.accepting = True
        await self.set_health(SERVING)
        cfg = engine.engine.config
        log.info("SERVING %s on %s:%d after %.1f s (%d KV blocks of %d tokens, max_model_len %d)",
                 engine.engine.model_name, self.args.host, self.port, time.monotonic() - started,
                 cfg.cache.num_kv_blocks, cfg.cache.block_size, cfg.scheduler.max_model_len)
        return True

    async def watch(self) -> None:
        """Health follows the engine. When its loop dies: NOT_SERVING, the calls in flight fail (UNAVAILABLE),
        and a fresh engine replaces it, at most --max-engine-restarts times; after that the process stops
        with exit code 1, for a supervisor to restart it."""
        while not self.stopping.is_set():
            engine = self.requests.engine
            if engine is not None and not engine.is_running and not self.stopping.is_set():
                await self._engine_died(engine)
                if not await self._restart(engine):
                    self.exit_code = 1
                    self.stopping.set()
                    return
            await asyncio.sleep(HEALTH_POLL_SECONDS)

    async def _engine_died(self, engine) -> None:
        self.requests.accepting = False
        next_step = self.requests.after_engine_death()
        self.requests.not_accepting_reason = f"the engine loop died ({engine.error!r}); {next_step}"
        await self.set_health(NOT_SERVING)
        log.error("engine loop died (%r): health NOT_SERVING", engine.error)
        await asyncio.sleep(ENGINE_DEATH_GRACE_SECONDS)
        self.requests.fail_in_flight()

    async def _restart(self, dead) -> bool:
        """Replaces the dead engine; False once the restarts are used up (or a stop came)."""
        limit = self.args.max_engine_restarts
        await asyncio.to_thread(dead.shutdown, 1.0)
        self.requests.engine = None
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
        self.requests.accepting = False
        self.requests.not_accepting_reason = "the server is shutting down"
        await self.health.enter_graceful_shutdown()
        n = len(self.requests.in_flight)
        log.info("shutting down: %d calls in flight, up to %.0f s to finish", n, self.args.grace_seconds)
        await asyncio.gather(self.server.stop(self.args.grace_seconds),
                             *([self.http.stop()] if self.http is not None else []))
        engine = self.requests.engine
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


def run(ns: argparse.Namespace, make_engine: Callable[[], object] | None = None) -> int:
    """`jaxpage serve`: runs until SIGTERM/SIGINT; returns the exit code."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("jaxpage", "serving"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False  # a library may have configured the root logger too
    server = Server(ServerArgs.from_cli_args(ns), make_engine or default_engine_factory(ns), ns.data_parallel_size)
    code = asyncio.run(server.run())
    if server.requests.engine is None:  # stopped while loading: the load thread cannot be interrupted
        logging.shutdown()
        os._exit(code)
    return code
