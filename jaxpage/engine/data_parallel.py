"""Data parallelism: ``data_parallel_size`` independent engine replicas, each on its own group of
``tensor_parallel_size`` devices (``parallel.device_group``), behind one front end with AsyncEngine's interface
(vLLM's data-parallel load balancing in one process).

A request goes to the replica its ``Router`` picks (jaxpage/engine/routing.py: by load, the fewest requests
running or waiting as this front end counts them, from dispatch until the stream ends, ties to the lowest rank;
or cache-aware, by the prefix each replica was sent), and its abort to the replica that holds it. A text prompt
is tokenized here first when the router needs its token ids. Stats add up over the replicas, each replica's own
under ``"replicas"`` (the metrics label them by rank), the router's decisions under ``"routing"``; the front end
runs while every replica does.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from jaxpage.distributed.parallel import device_group
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.async_engine import AsyncEngine
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.engine.routing import Router
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

_RATIOS = ("kv_waste", "kv_waste_at_peak")  # not summed: recomputed, or the worst replica's
_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos",)  # lists of counts: summed position by position


def make_async_engine(args: EngineArgs):
    """The serving engine the options ask for: one AsyncEngine, or replicas behind a DataParallelEngine."""
    return AsyncEngine.from_args(args) if args.data_parallel_size == 1 else DataParallelEngine.from_args(args)


class DataParallelEngine:
    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas
        self._owner: dict[str, int] = {}  # request id -> the rank of the replica that has it
        self.load = [0] * len(replicas)  # per replica: requests dispatched whose streams have not ended
        config = replicas[0].engine.config
        self.router = Router(config.parallel.routing, len(replicas), config.cache.block_size,
                             config.cache.num_kv_blocks - 1)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "DataParallelEngine":
        device_group(args.tensor_parallel_size, args.data_parallel_size)  # refuses bad sizes before any loading
        replicas: list[AsyncEngine] = []
        try:
            for rank in range(args.data_parallel_size):
                replicas.append(AsyncEngine(LLMEngine.from_args(args, data_parallel_rank=rank)))
        except BaseException:
            for replica in replicas:
                replica.shutdown()
            raise
        return cls(replicas)

    @property
    def engine(self) -> LLMEngine:
        """Replica 0's engine: the model, tokenizer and config, the same in every replica."""
        return self.replicas[0].engine

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          priority: int = 0, lora_request=None) -> AsyncIterator[RequestOutput]:
        if self.router.config.policy == "cache_aware" and isinstance(prompt, str) and prompt:
            prompt = {"prompt": prompt, "prompt_token_ids": await self.replicas[0].tokenize(prompt)}
        if request_id in self._owner:
            raise ValueError(f"request_id={request_id!r} is already in use")
        rank = self.router.choose(self.load, _token_ids(prompt), lora_request.lora_int_id if lora_request else 0)
        self._owner[request_id] = rank
        self.load[rank] += 1
        try:
            stream = await self.replicas[rank].add_request(request_id, prompt, params, priority, lora_request)
        except BaseException:
            self._release(request_id)
            raise
        return self._stream(request_id, stream)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.replicas[0].tokenize(text, add_special_tokens)

    async def add_lora(self, lora_request) -> None:
        """The adapter onto every replica's host (each may serve it)."""
        await asyncio.gather(*(r.add_lora(lora_request) for r in self.replicas))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """True when no replica still runs a request with it."""
        return all(await asyncio.gather(*(r.remove_lora(lora_int_id) for r in self.replicas)))

    async def _stream(self, request_id: str, stream) -> AsyncIterator[RequestOutput]:
        try:
            async with contextlib.aclosing(stream):  # closing it aborts an unfinished request at once
                async for out in stream:
                    yield out
        finally:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self.load[rank] -= 1

    def replica_of(self, request_id: str) -> int:
        """The rank of the replica serving ``request_id`` (from ``add_request`` until its stream ends)."""
        return self._owner[request_id]

    def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            self.replicas[rank].abort(request_id)

    def stats(self) -> dict:
        return {**merge_stats([r.stats() for r in self.replicas]), "routing": self.router.stats()}

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)


def _token_ids(prompt) -> list[int]:
    """The prompt's token ids for routing; none for a prompt the replica will refuse (it says why)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    return list(ids) if isinstance(ids, (list, tuple)) and all(type(t) is int for t in ids) else []


def merge_stats(replicas: list[dict]) -> dict:
    """The replicas' stats together: counts summed (per draft position too), latencies concatenated, KV waste
    over all stored tokens (at peak: the worst replica's); each replica's own under ``"replicas"``."""
    merged: dict = {}
    for key, value in replicas[0].items():
        if key in _RATIOS:
            continue
        values = [r[key] for r in replicas]
        if key in _PER_POSITION:
            merged[key] = [sum(counts) for counts in zip(*values, strict=True)]
        else:
            merged[key] = [x for v in values for x in v] if isinstance(value, list) else sum(values)
    allocated = merged["kv_slots_allocated"]
    merged["kv_waste"] = 1 - merged["kv_tokens_stored"] / allocated if allocated else 0.0
    merged["kv_waste_at_peak"] = max(r["kv_waste_at_peak"] for r in replicas)
    merged["replicas"] = replicas
    return merged
