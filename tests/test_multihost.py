"""Two processes, one mesh (jaxpage.worker.multihost): `jaxpage serve --tensor-parallel-size 4` over two local processes
(``jax.distributed`` on 127.0.0.1), two forced CPU devices each.

- process 0 answers over gRPC with the tokens of one engine on one device (this process): greedy prompts of
  several lengths, one with penalties, and seeded n=2 sampling on a small pool with swap preemption and shared
  prefixes, so that the followers replay block copies (copy-on-write) and swaps (process 0's metrics count the
  preemptions);
- SIGTERM to every process at once (as an orchestrator stops a deployment), with a call in flight: the call
  finishes with its tokens (the followers leave SIGTERM to JAX's preemption notifier and follow process 0 until it
  has drained and stops them) and both processes exit with code 0;
- the options come from the flags, then JAX's environment variables; bad values are refused by name.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpage.testing.launch import free_port, spawn, wait_serving
from jaxpage import LLM, SamplingParams
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.factories import EIGHT_HEADS, engine_options, tiny_llama
from tests.reference import save_random_model

OPTIONS = engine_options(preemption_mode="swap")
VOCAB = 256
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=30, temperature=0.8, n=2, seed=7)
PENALIZED = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("multihost") / "llama"
    save_random_model(tiny_llama(**EIGHT_HEADS), path, seed=5)
    return path


def workload() -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(3)
    greedy = [(rng.integers(1, VOCAB, n).tolist(), GREEDY) for n in (1, 9, 17, 33)]
    greedy.append((rng.integers(1, VOCAB, 5).tolist(), PENALIZED))  # the penalty table goes to the followers
    shared = rng.integers(1, VOCAB, 20).tolist()
    return greedy + [(shared + rng.integers(1, VOCAB, n).tolist(), SAMPLED) for n in (3, 9, 14)]


def proto_params(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, n=p.n,
                             repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                             **({"seed": p.seed} if p.seed is not None else {}))


async def call_all(target: str, work) -> list[list[list[int]]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        answers = await asyncio.gather(*(stub.Generate(pb.GenerateRequest(prompt_token_ids=ids,
                                                                          sampling=proto_params(p)), timeout=300)
                                         for ids, p in work))
    return [[list(c.token_ids) for c in a.completions] for a in answers]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_two_processes_serve_one_devices_tokens_and_stop_together(model_dir, cache_dir, tmp_path):
    llm = LLM(model=str(model_dir), cache_dir=str(cache_dir), **OPTIONS)
    reference = [[c.token_ids for c in llm.generate({"prompt_token_ids": ids}, p)[0].outputs] for ids, p in workload()]
    draining = (workload()[0][0], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    drained = [c.token_ids for c in llm.generate({"prompt_token_ids": draining[0]}, draining[1])[0].outputs]

    coordinator, port, metrics_port = f"127.0.0.1:{free_port()}", free_port(), free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items() if k != "progress"]
    common = ["-m", "serving.cli", "serve", "--model", str(model_dir), "--cache-dir", str(cache_dir), "--no-progress",
              "--tensor-parallel-size", "4", "--coordinator-address", coordinator, "--num-processes", "2",
              "--port", str(port), "--metrics-port", str(metrics_port), "--http-port", "0",
              "--max-seqs-per-request", "4", *flags]  # serve's default, 2, would run one n=2 request at a time
    procs = [spawn([*common, "--process-id", str(i)], tmp_path / f"process{i}.log", env=env) for i in range(2)]
    try:
        wait_serving(f"127.0.0.1:{port}", procs[0], 300, tmp_path / "process0.log")
        # the sampled requests together, on their own: each alone holds most of the pool, so they preempt
        greedy = [i for i, (_, p) in enumerate(workload()) if p is not SAMPLED]
        for part in (greedy, [i for i in range(len(workload())) if i not in greedy]):
            got = asyncio.run(call_all(f"127.0.0.1:{port}", [workload()[i] for i in part]))
            assert got == [reference[i] for i in part]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        assert metric(url, "jaxpage:num_preemptions_total") > 0  # swaps happened (preemption_mode swap)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(lambda: asyncio.run(call_all(f"127.0.0.1:{port}", [draining])))
            while metric(url, "jaxpage:num_requests_running") < 1:
                time.sleep(0.05)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            assert in_flight.result(120) == [drained]
        codes = [p.wait(60) for p in procs]
        assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_distributed_options_come_from_flags_then_jax_environment(monkeypatch):
    from jaxpage.worker.multihost import DistributedArgs, initialize
    from serving.cli import build_parser

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    ns = build_parser().parse_args(["serve", "--process-id", "2"])
    assert DistributedArgs.from_cli_args(ns) == DistributedArgs("10.0.0.1:1234", 4, 2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four' must be an integer"):
        DistributedArgs.from_cli_args(ns)
    with pytest.raises(ValueError, match=r"--process-id=2 must be in \[0, --num-processes=2\)"):
        initialize(DistributedArgs("127.0.0.1:1", 2, 2))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name)
    assert not DistributedArgs.from_cli_args(build_parser().parse_args(["serve"])).requested
