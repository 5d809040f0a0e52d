"""Data parallelism (jaxpage.engine.data_parallel) against one device, on 4 forced CPU devices.

As tests/test_tensor_parallel.py, the test collected in the ordinary run re-runs this file under pytest in a
child process with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``; the cases below run there only.
- DP 2 x TP 2: a mixed workload (prompts of 1 to 40 tokens, greedy and n=2 seeded sampling) sent at once gives
  the tokens of one engine on one device, both replicas take requests, and each replica's weights and KV pool
  sit on its own two devices;
- DP 2 with cache-aware routing: a prompt whose prefix a replica was sent goes to that replica (load routing sends
  it elsewhere), its blocks are found in that replica's cache, a much busier replica gives way to the least loaded,
  and the tokens are those of DP 2 with load routing;
- sizes that cannot work are refused by name;
- `jaxpage serve --data-parallel-size 2` answers over gRPC and over the OpenAI-compatible HTTP API with one
  device's tokens, and its metrics carry a ``replica`` label per replica, each of which served requests: the
  engine's gauges and counters and the requests' latency histograms and token counts.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.factories import run_on_forced_devices

NUM_DEVICES = 4
IN_CHILD = os.environ.get("JAXPAGE_DP_CHILD") == "1"


@pytest.mark.skipif(IN_CHILD, reason="the parent's test")
def test_data_parallel_on_four_cpu_devices():
    run_on_forced_devices(__file__, NUM_DEVICES, "JAXPAGE_DP_CHILD")


if IN_CHILD:
    import asyncio
    import functools
    import json
    import signal
    import tempfile
    import urllib.request

    import grpc
    import jax
    import numpy as np
    from prometheus_client.parser import text_string_to_metric_families

    from jaxpage.testing.launch import free_port, spawn, wait_serving
    from jaxpage import LLM, SamplingParams
    from jaxpage.config import RoutingConfig
    from jaxpage.engine.arg_utils import EngineArgs
    from jaxpage.engine.data_parallel import DataParallelEngine
    from serving import generation_pb2 as pb
    from serving import generation_pb2_grpc as pb_grpc
    from tests.factories import EIGHT_HEADS, engine_options, tiny_llama
    from tests.reference import save_random_model

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()

    WORK = Path(tempfile.mkdtemp(prefix="jaxpage-dp-"))
    OPTIONS = engine_options(num_kv_blocks=40, max_model_len=96, cache_dir=str(WORK / "cache"))
    VOCAB = 256
    GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
    SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, n=2, seed=7)

    @functools.cache
    def model_dir() -> str:
        save_random_model(tiny_llama(**EIGHT_HEADS), WORK / "llama", seed=11)
        return str(WORK / "llama")

    def workload() -> list[tuple[list[int], SamplingParams]]:
        rng = np.random.default_rng(0)
        lengths = (1, 7, 17, 40, 23, 3)
        return [(rng.integers(1, VOCAB, n).tolist(), SAMPLED if i == 2 else GREEDY) for i, n in enumerate(lengths)]

    @functools.cache
    def reference() -> list[list[list[int]]]:
        """One engine on one device."""
        llm = LLM(model=model_dir(), **OPTIONS)
        outs = [llm.generate({"prompt_token_ids": ids}, params)[0] for ids, params in workload()]
        return [[c.token_ids for c in out.outputs] for out in outs]

    async def serve_all(engine, work) -> list[list[list[int]]]:
        async def one(i, ids, params):
            final = None
            async for out in await engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params):
                final = out
            return [c.token_ids for c in final.outputs]
        return list(await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(work))))

    def test_dp2_tp2_gives_one_devices_tokens_on_both_replicas_own_devices():
        engine = DataParallelEngine.from_args(EngineArgs(model=model_dir(), data_parallel_size=2,
                                                         tensor_parallel_size=2, **OPTIONS))
        try:
            assert asyncio.run(serve_all(engine, workload())) == reference()
            stats = engine.stats()
            served = [len(r["requests"]) for r in stats["replicas"]]
            assert all(served) and sum(served) == len(workload()) == len(stats["requests"]), served
            assert engine.load == [0, 0]
            devices = jax.devices()
            for rank, replica in enumerate(engine.replicas):
                runner = replica.engine.runner
                group = set(devices[2 * rank:2 * rank + 2])
                assert {s.device for s in runner.kv_pool.addressable_shards} == group
                assert all(leaf.sharding.device_set == group for leaf in jax.tree.leaves(runner.params))
                shard = runner.kv_pool.addressable_shards[0].data
                assert shard.shape[3] * 2 == runner.kv_pool.shape[3]  # split by KV head within the replica
        finally:
            engine.shutdown()

    def routed(engine, rounds: list[list[list[int]]]) -> list[tuple[int, list[int]]]:
        """(replica, greedy tokens) of each prompt; each round's prompts sent at once, in order."""
        async def one(request_id, ids):
            stream = await engine.add_request(request_id, {"prompt_token_ids": ids}, GREEDY)
            rank, final = engine.replica_of(request_id), None
            async for out in stream:
                final = out
            return rank, final.outputs[0].token_ids

        async def run():
            done = []
            for i, prompts in enumerate(rounds):
                done += await asyncio.gather(*(one(f"t{i}.{j}", ids) for j, ids in enumerate(prompts)))
            return done
        return asyncio.run(run())

    def test_cache_aware_routing_sends_a_prefix_back_to_its_replica_with_load_routings_tokens():
        rng = np.random.default_rng(1)
        a, b, x, y, z, w = (rng.integers(1, VOCAB, n).tolist() for n in (40, 40, 10, 10, 10, 10))
        turns = [[a, b], [b + x, a + y]]  # the second turn's order reversed: load routing swaps the replicas
        engines = {policy: DataParallelEngine.from_args(EngineArgs(model=model_dir(), data_parallel_size=2,
                                                                   data_parallel_routing=policy, **OPTIONS))
                   for policy in ("load", "cache_aware")}
        try:
            got = {policy: routed(engine, turns) for policy, engine in engines.items()}
            assert [rank for rank, _ in got["cache_aware"]] == [0, 1, 1, 0]
            assert [rank for rank, _ in got["load"]] == [0, 1, 0, 1]
            assert [t for _, t in got["cache_aware"]] == [t for _, t in got["load"]]
            cache_aware = engines["cache_aware"].stats()
            assert cache_aware["prefix_cache_hits"] == 2 * 32 and engines["load"].stats()["prefix_cache_hits"] == 0
            routing = cache_aware["routing"]
            assert (routing["routed_cache_miss"], routing["routed_cache_hit"], routing["routed_balance_fallback"]) \
                == (2, 2, 0)
            assert routing["routed_matched_tokens"] == 2 * 32
            # any load difference is too much now: the second of two requests on one prefix gives way
            engines["cache_aware"].router.config = RoutingConfig("cache_aware", balance_abs_threshold=0,
                                                                 balance_rel_threshold=1.0)
            both = {policy: routed(engine, [[a + y + z, a + y + w]]) for policy, engine in engines.items()}
            assert [rank for rank, _ in both["cache_aware"]] == [0, 1]
            assert [t for _, t in both["cache_aware"]] == [t for _, t in both["load"]]
            assert engines["cache_aware"].stats()["routing"]["routed_balance_fallback"] == 1
            assert engines["load"].stats()["routing"]["routed_load"] == 6
        finally:
            for engine in engines.values():
                engine.shutdown()

    def test_sizes_that_cannot_work_are_refused_by_name():
        with pytest.raises(ValueError, match="data_parallel_size=3 x tensor_parallel_size=2 = 6 devices exceeds "
                                             "the 4 devices available"):
            DataParallelEngine.from_args(EngineArgs(model=model_dir(), data_parallel_size=3,
                                                    tensor_parallel_size=2, **OPTIONS))
        with pytest.raises(ValueError, match="data_parallel_size=2: one engine"):
            LLM(model=model_dir(), data_parallel_size=2, **OPTIONS)
        with pytest.raises(ValueError, match="data_parallel_size=0 must be an integer >= 1"):
            DataParallelEngine.from_args(EngineArgs(model=model_dir(), data_parallel_size=0, **OPTIONS))

    def replica_metrics(url: str) -> dict[tuple[str, str], float]:
        """(metric name, replica label) -> value, for the series that carry a replica label."""
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {(s.name, s.labels["replica"]): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if "replica" in s.labels}

    def http_completion(port: int, prompt_token_ids: list[int]) -> list[int]:
        """The token ids of a greedy /v1/completions answer (vLLM's return_token_ids)."""
        body = json.dumps({"prompt": prompt_token_ids, "max_tokens": 10, "temperature": 0,
                           "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"]

    def test_grpc_and_http_server_with_two_replicas_answers_and_labels_their_metrics():
        port, metrics_port, http_port = free_port(), free_port(), free_port()
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items() if k != "progress"]
        proc = spawn(["-m", "serving.cli", "serve", "--model", model_dir(), "--port", str(port), "--metrics-port",
                      str(metrics_port), "--http-port", str(http_port), "--data-parallel-size", "2", "--no-progress",
                      *flags],
                     WORK / "server.log")
        target = f"127.0.0.1:{port}"
        try:
            wait_serving(target, proc, 300, WORK / "server.log")
            greedy = [(ids, p) for ids, p in workload() if p is GREEDY]

            async def call_all():
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = pb_grpc.GenerationStub(channel)
                    calls = [stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0, max_tokens=10)), timeout=120)
                        for ids, _ in greedy]
                    return await asyncio.gather(*calls)
            answers = asyncio.run(call_all())
            want = [ref for ref, (_, p) in zip(reference(), workload()) if p is GREEDY]
            assert [[list(c.token_ids) for c in a.completions] for a in answers] == want
            over_http = [http_completion(http_port, ids) for ids, _ in greedy[:2]]
            assert over_http == [w[0] for w in want[:2]]
            metrics = replica_metrics(f"http://127.0.0.1:{metrics_port}/metrics")
            queries = {r: metrics[("jaxpage:prefix_cache_queries_total", r)] for r in ("0", "1")}
            assert queries["0"] > 3 and queries["1"] > 0, queries  # prompts on both (the 3-token warm-up: 0)
            assert metrics[("jaxpage:num_requests_running", "0")] == metrics[("jaxpage:num_requests_running", "1")] == 0
            served = {r: metrics[("jaxpage:e2e_request_latency_seconds_count", r)] for r in ("0", "1")}
            assert served["0"] + served["1"] == len(greedy) + 2 and min(served.values()) > 0, served
            assert min(metrics[("jaxpage:time_to_first_token_seconds_count", r)] for r in ("0", "1")) > 0
            assert min(metrics[("jaxpage:generation_tokens_total", r)] for r in ("0", "1")) > 0
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
            decisions = {s.labels["decision"]: s.value for family in text_string_to_metric_families(text)
                         for s in family.samples if s.name == "jaxpage:router_decisions_total"
                         and s.labels["policy"] == "cache_aware"}  # the default
            assert set(decisions) == {"load", "cache_hit", "cache_miss", "balance_fallback"}, decisions
            assert decisions["load"] == 0 and sum(decisions.values()) >= len(greedy) + 2, decisions
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
