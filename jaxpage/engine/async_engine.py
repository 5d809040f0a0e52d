"""AsyncEngine: the engine's step loop in its own thread, with an asyncio-facing API.

Requests are added from the event loop; each gets an asyncio queue that the loop thread fills with outputs
(through ``call_soon_threadsafe``), so coroutines never block on the device. The engine itself is not
thread-safe: every call into it holds one lock, so an abort waits at most for the step in flight.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import AsyncIterator

from jaxpage.engine.llm_engine import EngineArgs, LLMEngine
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped on an error; requests in flight and new ones fail with this."""


class RequestFailedError(RuntimeError):
    """The engine ended this one request on an internal failure; the others go on."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._outside: list[None] = []  # one entry per caller from another thread waiting for the lock
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # filled by coroutines, drained by the loop thread between steps: the event loop never waits for a step
        # (request_id, prompt, params, priority, lora_request, loop, queue, admitted)
        self._inbox: collections.deque = collections.deque()
        self._aborts: collections.deque[str] = collections.deque()
        self._stopping = False
        self.error: BaseException | None = None
        # text prompts are tokenized here, off the loop thread (one worker: the tokenizer is not reentrant)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpage-tokenize")
        self._thread = threading.Thread(target=self._loop, name="jaxpage-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs) -> "AsyncEngine":
        return cls(LLMEngine.from_args(args))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Queues the request (bad input raises here) and returns the stream of its outputs.

        The loop thread admits every request that arrived during a step before the next one, so the event loop
        never waits for the step in flight, and a burst of arrivals joins the batch together."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) and prompt:
            ids = await loop.run_in_executor(self._tokenizer_thread, self.engine.tokenize, prompt)
            prompt = {"prompt": prompt, "prompt_token_ids": ids}
        queue: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        self._inbox.append((request_id, prompt, params, priority, lora_request, loop, queue, admitted))
        self._work.set()
        if not self.is_running:  # the loop died (or is stopping) meanwhile and may not see the inbox again
            self._fail_inbox()
        try:
            await admitted  # ValueError for bad input, EngineDeadError if the loop died
        except asyncio.CancelledError:  # the caller left while it waited: drop it once admitted
            self._aborts.append(request_id)
            self._work.set()
            raise
        return self._stream(request_id, queue)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text's token ids, from the thread that tokenizes prompts (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self.engine.tokenize, text,
                                                                add_special_tokens)

    async def add_lora(self, lora_request) -> None:
        """LLMEngine.add_lora between two steps, off the event loop (a bad adapter: its ValueError)."""
        await asyncio.to_thread(self._call_locked, self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLMEngine.remove_lora between two steps, off the event loop."""
        return await asyncio.to_thread(self._call_locked, self.engine.remove_lora, lora_int_id)

    def _call_locked(self, fn, *args):
        with self._locked():
            return fn(*args)

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

    @contextlib.contextmanager
    def _locked(self):
        """The lock, for a caller outside the loop thread: the loop lets it in before its next step (a plain lock
        is not fair: the loop thread, releasing and re-taking it, could starve the caller for several steps)."""
        self._outside.append(None)
        try:
            with self._lock:
                yield
        finally:
            self._outside.pop()

    def replica_of(self, request_id: str) -> int:
        """The data-parallel rank of the replica serving ``request_id``: this engine's (as ``DataParallelEngine``
        says it of its replicas)."""
        return self.engine.config.parallel.data_parallel_rank

    def abort(self, request_id: str) -> None:
        with self._locked():
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _admit(self) -> None:
        """Loop thread, holding the lock: admits the waiting requests, then applies the aborts."""
        while self._inbox:
            request_id, prompt, params, priority, lora_request, loop, queue, admitted = self._inbox.popleft()
            try:
                self.engine.add_request(request_id, prompt, params, priority, lora_request=lora_request)
            except Exception as e:  # noqa: BLE001 - bad input: raised by add_request in the caller
                loop.call_soon_threadsafe(_settle, admitted, e)
                continue
            self._streams[request_id] = (loop, queue)
            loop.call_soon_threadsafe(_settle, admitted, None)
        while self._aborts:
            self.engine.abort_request(self._aborts.popleft())

    def _fail_inbox(self) -> None:
        while True:
            try:
                *_, loop, _queue, admitted = self._inbox.popleft()
            except IndexError:
                return
            loop.call_soon_threadsafe(_settle, admitted, EngineDeadError(f"the engine is not running: {self.error!r}"))

    def stats(self) -> dict:
        with self._locked():
            return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._work.set()
        self._thread.join(timeout)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():  # else a step may still be running: the writer flushes at exit
            self.engine.close()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if self._inbox or self._aborts:
                    with self._lock:
                        self._admit()
                if not self.engine.has_unfinished_requests():
                    self._work.wait(0.1)
                    self._work.clear()
                    continue
                while self._outside:  # a caller waits for the lock (an abort, a metrics scrape): let it in first
                    time.sleep(0.0005)
                with self._lock:
                    outputs = self.engine.step()
                    targets = [(self._streams.get(o.request_id), o) for o in outputs]
                    for out in outputs:
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                for target, out in targets:
                    if target is not None:
                        item = out if out.error is None else RequestFailedError(out.error)
                        target[0].call_soon_threadsafe(target[1].put_nowait, item)
        except BaseException as e:  # noqa: BLE001 - report any failure to every waiting request
            log.exception("engine loop died")
            self.error = e
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for loop, queue in streams:
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self._fail_inbox()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
