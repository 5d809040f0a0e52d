"""A closed loop on the engine alone: C streams of random prompts, each finished request replaced between steps.

No server and no client, so two trees (or two settings) compare on the engine's own steps: output tokens/s, the
gap between a request's tokens as the engine returns them (ITL at the engine), and the calls to ``step()`` that
return two tokens of one request (two steps read in one call). Run the trees in ABBA order: this VM's speed
drifts by more than the differences measured (RESULTS.md, "A request ending"). The engine takes up to 2,048 tokens
a step, prefix caching off (the random prompts share nothing), not serve's defaults.

    PYTHONPATH=. python benchmarks/closed_loop.py --concurrency 32 --requests 160 --workload spread
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.vs_vllm import WORKLOADS as SERVED
from jaxpage import LLM, SamplingParams

WORKLOADS = {name: w for name, w in SERVED.items() if not w.prefix_len}  # vs_vllm.py's workloads without a shared prefix


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """The lengths vllm bench serve's random dataset draws from: length spread by +-ratio."""
    return round(length * (1 - ratio)), round(length * (1 + ratio))


def run(concurrency: int, requests: int, workload: str, seed: int = 0) -> dict:
    load = os.getloadavg()[0]
    engine = LLM(max_num_batched_tokens=2048, progress=False, enable_prefix_caching=False).engine
    rng = np.random.default_rng(seed)
    w = WORKLOADS[workload]
    (p_lo, p_hi), (o_lo, o_hi) = length_range(w.input_len, w.range_ratio), length_range(w.output_len, w.range_ratio)

    def add(request_id: str) -> None:
        prompt = rng.integers(100, 40000, int(rng.integers(p_lo, p_hi + 1))).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(o_lo, o_hi + 1)), ignore_eos=True)
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)

    for i in range(concurrency):  # warm-up: every bucket the loop uses compiled
        add(f"warm{i}")
    while engine.has_unfinished_requests():
        engine.step()
    added, tokens, doubled, last, gaps, calls = 0, 0, 0, {}, [], []
    for _ in range(concurrency):
        add(str(added))
        added += 1
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        called = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        calls.append(now - called)
        ids = [o.request_id for o in outputs]
        doubled += len(ids) != len(set(ids))
        for o in outputs:
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
                if added < requests:
                    add(str(added))
                    added += 1
    wall = time.perf_counter() - start
    ms = lambda a, q: round(float(np.percentile(np.asarray(a) * 1e3, q)), 1)  # noqa: E731
    return {"concurrency": concurrency, "requests": requests, "workload": workload,
            "output_tok_s": round(tokens / wall, 1), "steps": len(calls), "itl_p50_ms": ms(gaps, 50),
            "itl_p99_ms": ms(gaps, 99), "step_call_p50_ms": ms(calls, 50), "step_call_p99_ms": ms(calls, 99),
            "calls_with_two_tokens_of_a_request": doubled, "load_1min_before": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="spread")
    parser.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    args = parser.parse_args()
    result = run(args.concurrency, args.requests, args.workload)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
