"""AsyncEngine: streams from its loop thread, aborts that free blocks at once, and a loop that dies loudly."""
from __future__ import annotations

import asyncio
import random

import pytest

from jaxpage import SamplingParams
from jaxpage.engine.async_engine import AsyncEngine, EngineDeadError
from tests.factories import tiny_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory, num_kv_blocks=64)


def _prompts(n: int) -> list[dict]:
    rng = random.Random()
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 40))]} for _ in range(n)]


async def _collect(engine: AsyncEngine, request_id: str, prompt, params) -> list:
    return [out async for out in await engine.add_request(request_id, prompt, params)]


def test_concurrent_streams_equal_offline_generation(llm):
    prompts = _prompts(6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind="delta")
    offline = llm.generate(prompts, params)
    engine = AsyncEngine(llm.engine)
    try:
        async def run():
            return await asyncio.gather(*[_collect(engine, f"s{i}", p, params) for i, p in enumerate(prompts)])
        streams = asyncio.run(run())
    finally:
        engine.shutdown()
    for stream, ref in zip(streams, offline):
        assert stream[-1].finished and all(not o.finished for o in stream[:-1])
        assert [t for out in stream for t in out.outputs[0].token_ids] == ref.outputs[0].token_ids
        assert len(stream) == 12  # one delta per generated token


def test_cancelled_stream_frees_its_blocks_at_once(llm):
    engine = AsyncEngine(llm.engine)
    free_before = engine.stats()["num_free_blocks"]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind="delta")

    async def run():
        stream = await engine.add_request("long", {"prompt_token_ids": list(range(60))}, params)
        async for out in stream:
            if len(out.outputs[0].token_ids) and engine.stats()["num_free_blocks"] < free_before:
                break  # mid-generation, holding blocks
        await stream.aclose()
        return engine.stats()

    try:
        stats = asyncio.run(run())
    finally:
        engine.shutdown()
    assert stats["num_free_blocks"] == free_before and stats["num_running"] == 0


def test_bad_input_raises_at_add_and_the_engine_keeps_serving(llm):
    engine = AsyncEngine(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run():
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("bad", "", params)
        return await _collect(engine, "good", {"prompt_token_ids": [1, 2, 3]}, params)

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


def test_a_dying_loop_fails_requests_in_flight_and_refuses_new_ones(llm, monkeypatch):
    engine = AsyncEngine(llm.engine)

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine, "step", broken_step)

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(engine, "doomed", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=4))

    asyncio.run(run())
    assert not engine.is_running
    monkeypatch.undo()
    llm.engine.abort_request("doomed")  # the module's engine serves the other tests
