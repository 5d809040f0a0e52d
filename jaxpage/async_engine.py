"""AsyncEngine: the engine's step loop in its own thread, with an asyncio-facing API.

Requests are added from the event loop; each gets an asyncio queue that the loop thread fills with outputs
(through ``call_soon_threadsafe``), so coroutines never block on the device. The engine itself is not
thread-safe: every call into it holds one lock, so an abort waits at most for the step in flight.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from jaxpage.llm_engine import EngineArgs, LLMEngine
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped on an error; requests in flight and new ones fail with this."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxpage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs) -> "AsyncEngine":
        return cls(LLMEngine.from_args(args))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queues the request (bad input raises here) and returns the stream of its outputs."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params, priority)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (cancel, disconnect, deadline): free its blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._work.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished_requests():
                    self._work.wait(0.1)
                    self._work.clear()
                    continue
                with self._lock:
                    outputs = self.engine.step()
                    targets = [(self._streams.get(o.request_id), o) for o in outputs]
                    for out in outputs:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                for target, out in targets:
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put_nowait, out)
        except BaseException as e:  # noqa: BLE001 - report any failure to every waiting request
            log.exception("engine loop died")
            self.error = e
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for loop, queue in streams:
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(f"engine loop died: {e!r}"))
