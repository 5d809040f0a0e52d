"""Inter-token latency against TTFT and throughput for prefill policies: one `jaxpage serve` per policy, driven
alternately by a closed loop of concurrent streams (vLLM's `vllm bench serve --max-concurrency`).

    python benchmarks/itl_policy.py [--streams 32] [--num-requests 64] [--input-len 64] [--output-len 128]
                                    [--repeats 2] [--json benchmarks/results/itl_policy.json]

Each policy is a set of the engine's partial-prefill options (--long-prefill-token-threshold,
--max-num-partial-prefills, --max-long-partial-prefills; see jaxpage/core/prefill_limits.py). Every server
starts first (one at a time, sharing the compile cache); then each repeat runs every policy in turn, so that
all see the same background load. A run: --num-requests requests of --input-len random tokens (fresh for every
run: no prefix-cache hits) and exactly --output-len greedy tokens (ignore_eos), at most --streams in flight, the
next sent as soon as one finishes, over gRPC GenerateStream. Reported per policy, the median over repeats of:
ITL mean/P50/P99 (every gap between token-carrying chunks), TTFT mean/P99, output tokens/s.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import numpy as np

from benchmarks import workloads
from benchmarks.launch import free_port, spawn, wait_serving
from benchmarks.serving import grpc_chunks, one_request, stats
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc

# name -> (long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills); "unbounded" is
# the scheduler before these options: any number of prompts, each up to the whole budget, a step
POLICIES = {"unbounded": (1024, 64, 64), "128 tokens (64 x 2)": (64, 2, 2), "64 tokens (64 x 1)": (64, 1, 1),
            "32 tokens (32 x 1)": (32, 1, 1)}


def policy_flags(policy: tuple[int, int, int]) -> list[str]:
    threshold, partial, long = policy
    return ["--long-prefill-token-threshold", str(threshold), "--max-num-partial-prefills", str(partial),
            "--max-long-partial-prefills", str(long)]


def start_server(args, policy: tuple[int, int, int]) -> tuple[subprocess.Popen, str]:
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    target = f"127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"itl_policy_server_{port}.log"
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory",
             str(args.kv_cache_memory), *policy_flags(policy)]
    proc = spawn(["-m", "serving.cli", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                  "--http-port", str(http_port), *flags], log_path)
    started = time.monotonic()
    wait_serving(target, proc, timeout=args.server_timeout, log_path=log_path)
    print(f"{policy}: SERVING on {target} after {time.monotonic() - started:.0f} s (log {log_path})", flush=True)
    return proc, target


async def closed_loop(stub, requests: list[workloads.Request], streams: int) -> dict:
    """The requests through ``streams`` concurrent callers, each sending its next as its last one ends."""
    queue = list(reversed(requests))
    records: list[dict] = []

    async def caller():
        while queue:
            req = queue.pop()
            records.append(await one_request(lambda r, t: grpc_chunks(stub, r, t), req, 0.0, time.perf_counter(),
                                             None))

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(streams)))
    span = time.perf_counter() - start
    done = [r for r in records if r["finished"]]
    return {"num_requests": len(records), "num_finished": len(done), "duration_s": span,
            "output_tokens_per_s": sum(r["output_tokens"] for r in done) / span,
            "itl": stats([g for r in done for g in r["itl"]]), "ttft": stats([r["ttft"] for r in done]),
            "e2e": stats([r["e2e"] for r in done])}


async def measure(args, targets: dict[str, str]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    channels = {name: grpc.aio.insecure_channel(t) for name, t in targets.items()}
    try:
        stubs = {name: pb_grpc.GenerationStub(c) for name, c in channels.items()}
        info = await next(iter(stubs.values())).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        for name, stub in stubs.items():  # warm each server's paths (untimed)
            warm = workloads.fixed(args.streams, args.input_len, 4, info.vocab_size, seed=args.seed + 1)
            await closed_loop(stub, list(warm.requests), args.streams)
        for repeat in range(args.repeats):
            for i, (name, stub) in enumerate(stubs.items()):
                seed = args.seed + 1000 * (repeat * len(stubs) + i + 2)
                load = workloads.fixed(args.num_requests, args.input_len, args.output_len, info.vocab_size, seed)
                r = await closed_loop(stub, list(load.requests), args.streams)
                r.update(repeat=repeat, load_average=os.getloadavg())
                runs[name].append(r)
                print(f"repeat {repeat} {name:>20}: ITL p50/p99 {1e3 * r['itl']['p50']:.0f}/"
                      f"{1e3 * r['itl']['p99']:.0f} ms, TTFT mean/p99 {1e3 * r['ttft']['mean']:.0f}/"
                      f"{1e3 * r['ttft']['p99']:.0f} ms, {r['output_tokens_per_s']:.1f} tok/s, "
                      f"load {r['load_average'][0]:.2f}", flush=True)
    finally:
        for c in channels.values():
            await c.close()
    return runs


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """Per policy, the median over repeats of each figure."""
    def med(rs, *keys):
        values = []
        for r in rs:
            for k in keys:
                r = r[k]
            values.append(r)
        return float(np.median(values))
    return [{"policy": name, "options": dict(zip(("long_prefill_token_threshold", "max_num_partial_prefills",
                                                  "max_long_partial_prefills"), POLICIES[name])),
             "itl_mean_ms": 1e3 * med(rs, "itl", "mean"), "itl_p50_ms": 1e3 * med(rs, "itl", "p50"),
             "itl_p99_ms": 1e3 * med(rs, "itl", "p99"), "ttft_mean_ms": 1e3 * med(rs, "ttft", "mean"),
             "ttft_p99_ms": 1e3 * med(rs, "ttft", "p99"), "output_tokens_per_s": med(rs, "output_tokens_per_s")}
            for name, rs in runs.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--server-timeout", type=float, default=900)
    args = parser.parse_args(argv)
    procs, targets = [], {}
    try:
        for name in args.policies:
            proc, targets[name] = start_server(args, POLICIES[name])
            procs.append(proc)
        runs = asyncio.run(measure(args, targets))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    rows = summary(runs)
    print(f"{'policy':>20} {'ITL mean/p50/p99 ms':>20} {'TTFT mean/p99 ms':>17} {'tok/s':>6}")
    for r in rows:
        print(f"{r['policy']:>20} {r['itl_mean_ms']:>6.0f}/{r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f}"
              f"{r['ttft_mean_ms']:>11.0f}/{r['ttft_p99_ms']:.0f} {r['output_tokens_per_s']:>6.1f}")
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": datetime.date.today().isoformat(),
              "command": shlex.join(["python", "benchmarks/itl_policy.py", *(sys.argv[1:] if argv is None
                                                                              else argv)]),
              "options": vars(args), "summary": rows, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
