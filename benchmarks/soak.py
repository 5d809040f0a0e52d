"""Soak: thousands of requests of random sizes against a real `jaxpage serve` under a tight KV pool (preemption),
a fifth of them cancelled at a random moment. Not in CI.

Checks: every request that was not cancelled returns the greedy tokens of its prompt (the reference: the same
prompts run first in small waves, max tokens each; a request for m tokens must get the reference's first m);
a cancelled one ends CANCELLED or, if it finished first, correct; no other status; every KV block is free at the
end (from /metrics); the server's RSS (VmRSS) is sampled along the way.

    python -m benchmarks.soak --requests 2000 --json soak.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.launch import free_port, spawn, wait_serving
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


async def tokens_of(stub, req, timeout=600) -> list[int]:
    return [t async for r in stub.GenerateStream(req, timeout=timeout) for c in r.completions for t in c.token_ids]


async def soak(ns, target: str, pid: int) -> dict:
    rng = random.Random(ns.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(4, ns.max_prompt))] for _ in range(ns.prompts)]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.monotonic()
        reference = []
        for i in range(0, len(prompts), 8):  # small waves
            reference += await asyncio.gather(*[tokens_of(stub, request(p, ns.max_tokens)) for p in prompts[i:i + 8]])
        reference_seconds = time.monotonic() - started
        outcomes = {"ok": 0, "cancelled": 0, "finished_before_cancel": 0, "wrong_tokens": 0, "other_status": {}}
        rss, gate = [(0, rss_mib(pid))], asyncio.Semaphore(ns.concurrency)
        wrong_examples = []

        async def one(k: int):
            i, m, cancel = rng.randrange(len(prompts)), rng.randint(1, ns.max_tokens), rng.random() < ns.cancel
            delay = rng.uniform(0, 2.0)
            async with gate:
                task = asyncio.ensure_future(tokens_of(stub, request(prompts[i], m)))
                if cancel:
                    done, _ = await asyncio.wait({task}, timeout=delay)
                    if not done:
                        task.cancel()
                try:
                    got = await task
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                    return
                except grpc.aio.AioRpcError as e:
                    key = e.code().name
                    outcomes["other_status"][key] = outcomes["other_status"].get(key, 0) + 1
                    return
            if got != reference[i][:m]:
                outcomes["wrong_tokens"] += 1
                wrong_examples.append({"prompt": i, "max_tokens": m, "got": got, "want": reference[i][:m]})
            else:
                outcomes["finished_before_cancel" if cancel else "ok"] += 1
            if k % 200 == 0:
                rss.append((k, rss_mib(pid)))

        started = time.monotonic()
        await asyncio.gather(*[one(k) for k in range(ns.requests)])
        soak_seconds = time.monotonic() - started
    rss.append((ns.requests, rss_mib(pid)))
    return {"outcomes": outcomes, "wrong_examples": wrong_examples[:5], "rss_mib": rss,
            "reference_seconds": reference_seconds, "soak_seconds": soak_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel", type=float, default=0.2)
    parser.add_argument("--prompts", type=int, default=48, help="distinct prompts (each with a reference)")
    parser.add_argument("--max-prompt", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=20, help="tight: preemption happens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--log", default="soak_server.log", help="the server's log")
    ns = parser.parse_args()
    port, metrics_port = free_port(), free_port()
    log = Path(ns.log)
    flags = ["--max-model-len", "256", "--num-kv-blocks", str(ns.num_kv_blocks), "--max-num-seqs", "32",
             "--max-num-batched-tokens", "64", "--dtype", "float32"]
    proc = spawn(["-m", "serving.cli", "serve", *flags, "--port", str(port), "--metrics-port", str(metrics_port)],
                 log)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 600, log)
        result = asyncio.run(soak(ns, f"127.0.0.1:{port}", proc.pid))
        time.sleep(1.0)
        m = metrics(url)
        result.update(flags=flags, args=vars(ns), kv_blocks_free=m["jaxpage:kv_blocks_free"],
                      kv_blocks_total=m["jaxpage:kv_blocks_total"], preemptions=m["jaxpage:num_preemptions_total"],
                      running=m["jaxpage:num_requests_running"], in_flight=m["jaxpage:num_requests_in_flight"])
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps({k: v for k, v in result.items() if k != "wrong_examples"}, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
