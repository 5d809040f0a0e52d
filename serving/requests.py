"""One request's life on the server, for both front ends (gRPC: serving/grpc_service.py; HTTP: serving/openai_api.py).

``RequestLifecycle`` holds what the front ends share: the engine (once loaded and warm), admission (the engine
takes calls, --max-queue has room, the request id is free), the in-flight table (counted over gRPC and HTTP calls
together; drained on SIGTERM), the requests' Prometheus metrics, the watcher's failing of the calls in flight when
the engine loop dies, and the loop over the engine's outputs. It raises the neutral errors below; each front end
maps them to its own status codes and messages.

A call that ends early (client cancel, disconnect, expired deadline) is cancelled in the event loop; the
cancellation goes through the engine's output stream, whose clean-up aborts the request and frees its KV blocks
at once. It reaches the front end as CancelledError, except when the watcher cancelled it: then EngineDiedError.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

from serving.metrics import Metrics

log = logging.getLogger("jaxpage.serve")


class RequestError(Exception):
    """A request refused or ended by the server; the front ends map each kind to their status codes."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotServingError(RequestError):
    """No engine takes requests: the server is starting, stopping or restarting it, or it died before admission."""


class QueueFullError(RequestError):
    """--max-queue requests are in flight."""


class DuplicateRequestError(RequestError):
    """Another request in flight has this request id."""


class InvalidRequestError(RequestError):
    """A ValueError of the request's values (its message names the engine's fields: ``SamplingParams.n``)."""


class RequestTooLargeError(InvalidRequestError):
    """The request can never fit in the KV pool."""


class EngineDiedError(RequestError):
    """The engine loop died under the admitted request."""


class EngineFailedError(RequestError):
    """The engine failed this one request; the others go on."""


class RequestLifecycle:
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

    @property
    def serving(self) -> bool:
        """Accepting calls, with an engine whose loop runs (the HTTP /health)."""
        return self.accepting and self.engine is not None and self.engine.is_running

    def require_engine(self):
        """The engine, or NotServingError saying why there is none."""
        if not self.accepting or self.engine is None:
            raise NotServingError(self.not_accepting_reason)
        return self.engine

    def after_engine_death(self) -> str:
        """What a call failed by the engine's death is told comes next."""
        return ("the server restarts the engine: retry shortly" if self.will_restart()
                else "no engine restarts are left: the server stops")

    def count_error(self, code: str) -> None:
        """One error in request_errors_total; code: a gRPC status name, so both front ends count in one series."""
        self.metrics.labels(self.metrics.request_errors, code=code).inc()

    def fail_in_flight(self) -> None:
        """The engine died: fail every call still waiting on it (the engine normally fails them itself)."""
        for request_id, task in list(self.in_flight.items()):
            self._failed_by_watcher.add(request_id)
            task.cancel()

    async def generate(self, request_id: str, prepare: Callable[[object], tuple], priority: int = 0,
                       when_admitted: Callable[[Callable[[], None]], None] | None = None, lora_request=None
                       ) -> AsyncIterator:
        """Admits the request and yields its RequestOutputs, observed in the metrics.

        prepare(engine) -> (prompt, SamplingParams) runs once the request is admitted (its ValueError is an
        InvalidRequestError). when_admitted(release) is handed a function that aborts and forgets the request
        unless its handler already has (for a call that may end while its handler is not waiting on the engine).
        lora_request: the request's LoRA adapter (a jaxpage.lora.request.LoRARequest; None: the base model).
        """
        from jaxpage.engine.async_engine import EngineDeadError, RequestFailedError

        started = time.monotonic()
        engine = self._admit(request_id)
        task = asyncio.current_task()
        try:
            if when_admitted is not None:
                when_admitted(lambda: self._release(engine, request_id, task))
            stream, params, served = await self._add(engine, request_id, prepare, priority, lora_request)
            async with contextlib.aclosing(stream):  # its clean-up aborts the request (if not done already)
                last = None
                async for out in stream:
                    now = time.monotonic()
                    _observe(self.metrics, out, started, last, now, params, served)
                    last = now
                    yield out
        except EngineDeadError as e:
            raise EngineDiedError(f"{e}; {self.after_engine_death()}") from None
        except RequestFailedError as e:
            raise EngineFailedError(str(e)) from None
        except asyncio.CancelledError:
            if request_id in self._failed_by_watcher:
                raise EngineDiedError(f"the engine loop died; {self.after_engine_death()}") from None
            raise
        finally:
            self._forget(request_id, task)

    def _admit(self, request_id: str):
        engine = self.require_engine()
        if self.max_queue is not None and len(self.in_flight) >= self.max_queue:
            raise QueueFullError(f"the queue is full: {len(self.in_flight)} requests in flight "
                                 f"(--max-queue {self.max_queue}); retry later")
        if request_id in self.in_flight:
            raise DuplicateRequestError(f"request_id={request_id!r} is already in use")
        self.in_flight[request_id] = asyncio.current_task()
        self.metrics.labels(self.metrics.in_flight).inc()
        return engine

    async def _add(self, engine, request_id: str, prepare: Callable[[object], tuple], priority: int,
                   lora_request=None) -> tuple:
        """(the engine's output stream, the SamplingParams, the replica label of the metrics)."""
        from jaxpage.engine.async_engine import EngineDeadError
        from jaxpage.engine.llm_engine import DoesNotFitError

        try:
            prompt, params = prepare(engine)
            stream = await engine.add_request(request_id, prompt, params, priority=priority,
                                              lora_request=lora_request)
        except DoesNotFitError as e:
            raise RequestTooLargeError(str(e)) from None
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        except EngineDeadError as e:
            raise NotServingError(str(e)) from None
        return stream, params, self.metrics.served_by(engine.replica_of(request_id))

    def _forget(self, request_id: str, task) -> None:
        if self.in_flight.get(request_id) is task:
            del self.in_flight[request_id]
            self._failed_by_watcher.discard(request_id)
            self.metrics.labels(self.metrics.in_flight).dec()

    def _release(self, engine, request_id: str, task) -> None:
        """The call has ended; if its handler has not cleaned up (it was not waiting on the engine), do it."""
        if self.in_flight.get(request_id) is task:
            try:
                engine.abort(request_id)
            except Exception:  # noqa: BLE001 - a dead engine may fail to abort; nothing is left to free then
                log.exception("abort of %s failed", request_id)
            self._forget(request_id, task)


def _observe(m: Metrics, out, started: float, last: float | None, now: float, params, served: dict) -> None:
    """One output's latencies and token counts; served: the request's replica label (``Metrics.served_by``)."""
    if not isinstance(out.outputs, list):  # a pooling request's one output: its prompt, computed
        m.labels(m.prompt_tokens, **served).inc(len(out.prompt_token_ids))
        m.labels(m.request_success, **served, finished_reason="stop").inc()
        m.labels(m.e2e, **served).observe(now - started)
        return
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
        m.labels(m.e2e, **served).observe(now - started)
