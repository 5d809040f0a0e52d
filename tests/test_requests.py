"""The request lifecycle both front ends share (serving/requests.py), in process over a stand-in engine: admission,
the in-flight table, the metrics, the watcher's failing of a call and the neutral errors (each front end's codes
for them are tested end to end in test_grpc_service.py and test_openai_api.py)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from jaxpage.sampling_params import SamplingParams
from serving.metrics import Metrics
from serving.requests import (
    DuplicateRequestError,
    EngineDiedError,
    InvalidRequestError,
    NotServingError,
    QueueFullError,
    RequestLifecycle,
    RequestTooLargeError,
)
from jaxpage.engine.async_engine import AsyncEngine
from tests.fake_engine import STAND_IN_TOKEN as TOKEN
from tests.fake_engine import stand_in_engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, output_kind="delta")


def given(prompt, params):
    return lambda engine: (prompt, params)


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "", **labels}) or 0.0


@contextlib.asynccontextmanager
async def lifecycle(max_queue: int | None = None, **engine_options):
    requests = RequestLifecycle(Metrics(), max_queue=max_queue)
    requests.engine = AsyncEngine(stand_in_engine(**engine_options))
    requests.accepting = True
    try:
        yield requests
    finally:
        await asyncio.to_thread(requests.engine.shutdown)


async def collect(outputs) -> list:
    async with contextlib.aclosing(outputs):
        return [out async for out in outputs]


def test_a_request_streams_its_outputs_and_leaves_the_table_and_the_metrics_right():
    async def run():
        async with lifecycle() as requests:
            outs = await collect(requests.generate("r1", given({"prompt_token_ids": [1, 2, 3]}, greedy(4))))
            return requests, outs

    requests, outs = asyncio.run(run())
    assert [t for out in outs for c in out.outputs for t in c.token_ids] == [TOKEN] * 4
    assert outs[-1].finished and requests.in_flight == {}
    m = requests.metrics
    assert sample(m, "jaxpage:num_requests_in_flight") == 0
    assert sample(m, "jaxpage:generation_tokens_total") == 4
    assert sample(m, "jaxpage:prompt_tokens_total") == 3
    assert sample(m, "jaxpage:request_success_total", finished_reason="length") == 1
    assert sample(m, "jaxpage:e2e_request_latency_seconds_count") == 1


def test_admission_refuses_without_an_engine_with_a_full_queue_and_a_duplicate_id():
    async def run():
        requests = RequestLifecycle(Metrics())
        with pytest.raises(NotServingError, match="the server is starting: the engine is loading"):
            await anext(requests.generate("r", given({"prompt_token_ids": [1]}, greedy(1))))
        async with lifecycle(max_queue=2, step_seconds=0.01) as requests:
            first = requests.generate("r1", given({"prompt_token_ids": [1]}, greedy(1000)))
            await anext(first)
            with pytest.raises(DuplicateRequestError, match="request_id='r1' is already in use"):
                await anext(requests.generate("r1", given({"prompt_token_ids": [1]}, greedy(1))))
            second = requests.generate("r2", given({"prompt_token_ids": [1]}, greedy(1000)))
            await anext(second)
            with pytest.raises(QueueFullError, match=r"the queue is full: 2 requests in flight \(--max-queue 2\)"):
                await anext(requests.generate("r3", given({"prompt_token_ids": [1]}, greedy(1))))
            await first.aclose()
            assert list(requests.in_flight) == ["r2"]
            assert len(await collect(requests.generate("r3", given({"prompt_token_ids": [1]}, greedy(1))))) == 1
            await second.aclose()

    asyncio.run(run())


def test_bad_values_are_invalid_and_a_request_that_can_never_fit_is_too_large():
    def bad(engine):
        raise ValueError("SamplingParams.n must be at least 1")

    async def run():
        async with lifecycle(num_kv_blocks=17, max_model_len=256) as requests:
            with pytest.raises(InvalidRequestError, match="SamplingParams.n") as e:
                await anext(requests.generate("r1", bad))
            assert not isinstance(e.value, RequestTooLargeError)
            two = SamplingParams(n=2, temperature=1.0, max_tokens=200, output_kind="delta")
            with pytest.raises(RequestTooLargeError, match="the pool has 16"):
                await anext(requests.generate("r2", given({"prompt_token_ids": [1] * 50}, two)))
            assert requests.in_flight == {}

    asyncio.run(run())


def test_a_call_the_watcher_fails_hears_the_engine_died_and_what_comes_next():
    async def run():
        async with lifecycle(step_seconds=0.01) as requests:
            requests.will_restart = lambda: False
            task = asyncio.ensure_future(collect(requests.generate("r1", given({"prompt_token_ids": [1]},
                                                                            greedy(1000)))))
            while not requests.engine.engine.has_unfinished_requests():
                await asyncio.sleep(0.01)
            requests.fail_in_flight()
            with pytest.raises(EngineDiedError, match="the engine loop died; no engine restarts are left"):
                await task
            await asyncio.sleep(0.1)  # the engine loop applies the abort
            return requests

    requests = asyncio.run(run())
    assert requests.in_flight == {} and sample(requests.metrics, "jaxpage:num_requests_in_flight") == 0


def test_release_aborts_a_request_whose_handler_is_not_waiting_on_it():
    async def run():
        async with lifecycle(step_seconds=0.01) as requests:
            releases = []
            outputs = requests.generate("r1", given({"prompt_token_ids": [1]}, greedy(1000)), 0, releases.append)
            await anext(outputs)
            releases[0]()  # the call ended (the gRPC done callback) while the handler was elsewhere
            assert requests.in_flight == {}
            for _ in range(100):
                if not requests.engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            assert not requests.engine.engine.has_unfinished_requests()
            await outputs.aclose()

    asyncio.run(run())
