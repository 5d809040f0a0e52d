"""What the gRPC service costs: time to first token and tokens/s over gRPC against the offline engine.

    python benchmarks/grpc_overhead.py [--streams 1 32] [--max-tokens 64] [--repeats 3] [--json out.json]

Runs both in one go on the same machine with the same engine options: a `jaxpage serve` subprocess driven by
N concurrent GenerateStream calls (grpc.aio, one channel) from this process, and the offline engine in this
process (`LLM.generate` on the same prompts). Both are loaded at once and their rounds alternate (the idle one
uses no CPU), so that both see the same background load: on a shared machine, running one after the other
measures the neighbours more than the service. Each of --repeats rounds uses fresh random prompts (no
prefix-cache hits); an untimed round warms both. Greedy, ignore_eos: every request makes --max-tokens tokens.

TTFT: from the call (or `generate`) start to the first token (client-side over gRPC; the engine's first-token
time offline). Tokens/s: all output tokens over the wall time of the round. Figures are medians over rounds;
the cost is also given as the median over rounds of the paired ratio (gRPC round r against offline round r).
CPU s/1k tok: CPU time (all threads, XLA's included) per 1000 output tokens: the server process's (plus this
process's client work, for "server + client") against this process's offline. On a machine shared with other
jobs, CPU time is the steadier measure of what the service adds; wall-clock figures move with the neighbours.
The service's own work is measured apart: CPU of the server's threads other than XLA's compute pool (the
engine loop, the event loop, gRPC) beyond the same threads of the offline engine, over the offline total.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.launch import free_port, spawn, wait_serving  # noqa: E402
from serving import generation_pb2 as pb  # noqa: E402
from serving import generation_pb2_grpc as pb_grpc  # noqa: E402


def make_prompts(args, round_index: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 * round_index + n)
    return [rng.integers(100, 40000, args.prompt_tokens).tolist() for _ in range(n)]


def engine_flags(args) -> list[str]:
    return ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype]


def _cpu(stat_path: Path) -> float:
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of a process, from /proc (Linux)."""
    return _cpu(Path(f"/proc/{pid}/stat"))


def host_thread_cpu_seconds(pid: int) -> float:
    """CPU time of the process's threads other than XLA's compute pool (tf_*): Python, gRPC, the engine loop."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("tf_"):
                total += _cpu(task / "stat")
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return total


async def grpc_round(stub, prompts, max_tokens: int, server_pid: int) -> dict:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    server_cpu, client_cpu = process_cpu_seconds(server_pid), time.process_time()
    server_host = host_thread_cpu_seconds(server_pid)
    started = time.monotonic()

    async def one(ids):
        first, tokens = None, 0
        async for response in stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling)):
            n = sum(len(c.token_ids) for c in response.completions)
            if n and first is None:
                first = time.monotonic() - started
            tokens += n
        return first, tokens

    results = await asyncio.gather(*(one(ids) for ids in prompts), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} calls failed; the first: {errors[0]!r}")
    wall = time.monotonic() - started
    return {"ttft": [r[0] for r in results], "tokens": sum(r[1] for r in results), "wall": wall,
            "server_cpu": process_cpu_seconds(server_pid) - server_cpu, "client_cpu": time.process_time() - client_cpu,
            "host_cpu": host_thread_cpu_seconds(server_pid) - server_host}


def offline_round(llm, params, prompts) -> dict:
    cpu, host, started = time.process_time(), host_thread_cpu_seconds(os.getpid()), time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.monotonic() - started
    host = host_thread_cpu_seconds(os.getpid()) - host
    return {"ttft": [o.metrics.first_token_time - started for o in outs],
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall": wall,
            "cpu": time.process_time() - cpu, "host_cpu": host}


async def alternate(args, target: str, llm, server_pid: int) -> tuple[dict, dict]:
    """Rounds over gRPC and offline, alternating (and swapping which goes first) so both see the same load."""
    from jaxpage import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    served, offline = {}, {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for n in args.streams:
            await grpc_round(stub, make_prompts(args, 999, n), args.max_tokens, server_pid)  # warm
            offline_round(llm, params, make_prompts(args, 998, n))
            served[n], offline[n] = [], []
            for r in range(args.repeats):
                prompts = make_prompts(args, r, n)
                for mode in (("grpc", "offline") if r % 2 == 0 else ("offline", "grpc")):
                    if mode == "grpc":
                        served[n].append(await grpc_round(stub, prompts, args.max_tokens, server_pid))
                    else:
                        offline[n].append(offline_round(llm, params, prompts))
                print(f"streams {n} round {r}: grpc {served[n][-1]['wall']:.2f} s, "
                      f"offline {offline[n][-1]['wall']:.2f} s", flush=True)
    return served, offline


def summarize(rounds: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rounds)
    cpu = {"cpu_s_per_1k_tokens": 1e3 * sum(r["cpu"] for r in rounds) / tokens} if "cpu" in rounds[0] else {
        "cpu_s_per_1k_tokens": 1e3 * sum(r["server_cpu"] + r["client_cpu"] for r in rounds) / tokens,
        "server_cpu_s_per_1k_tokens": 1e3 * sum(r["server_cpu"] for r in rounds) / tokens,
        "client_cpu_s_per_1k_tokens": 1e3 * sum(r["client_cpu"] for r in rounds) / tokens}
    cpu["host_cpu_s_per_1k_tokens"] = 1e3 * sum(r["host_cpu"] for r in rounds) / tokens
    return {**cpu, "ttft_median_s": statistics.median(statistics.median(r["ttft"]) for r in rounds),
            "ttft_max_s": statistics.median(max(r["ttft"]) for r in rounds),
            "tokens_per_s": statistics.median(r["tokens"] / r["wall"] for r in rounds),
            "wall_s": statistics.median(r["wall"] for r in rounds)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    port = free_port()
    target = f"127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"grpc_overhead_server_{port}.log"
    proc = spawn(["-m", "serving.cli", "serve", "--port", str(port), "--metrics-port", "0", "--http-port", "0",
                  *engine_flags(args)], log_path)
    try:
        from jaxpage import LLM

        llm = LLM(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, progress=False)
        wait_serving(target, proc, timeout=600, log_path=log_path)
        served, offline = asyncio.run(alternate(args, target, llm, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)

    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "command": " ".join(["python", *sys.argv]), "options": vars(args), "by_streams": {}}
    print(f"{'streams':>7} {'mode':>8} {'TTFT med s':>11} {'TTFT max s':>11} {'tok/s':>9} {'CPU s/1k tok':>13}")
    for n in args.streams:
        g, o = summarize(served[n]), summarize(offline[n])
        cost = {"ttft_median": g["ttft_median_s"] / o["ttft_median_s"] - 1,
                "tokens_per_s": g["tokens_per_s"] / o["tokens_per_s"] - 1,
                "server_cpu": g["server_cpu_s_per_1k_tokens"] / o["cpu_s_per_1k_tokens"] - 1,
                "server_and_client_cpu": g["cpu_s_per_1k_tokens"] / o["cpu_s_per_1k_tokens"] - 1,
                # what the service's own host work adds: its non-XLA threads beyond the offline engine's
                "service_host_cpu": (g["host_cpu_s_per_1k_tokens"] - o["host_cpu_s_per_1k_tokens"])
                / o["cpu_s_per_1k_tokens"],
                "paired_wall_median": statistics.median(a["wall"] / b["wall"] - 1
                                                        for a, b in zip(served[n], offline[n])),
                "paired_ttft_median": statistics.median(statistics.median(a["ttft"]) / statistics.median(b["ttft"]) - 1
                                                        for a, b in zip(served[n], offline[n]))}
        result["by_streams"][n] = {"grpc": g, "offline": o, "grpc_cost": cost, "raw": {"grpc": served[n],
                                                                                     "offline": offline[n]}}
        for mode, s in (("offline", o), ("grpc", g)):
            print(f"{n:>7} {mode:>8} {s['ttft_median_s']:>11.3f} {s['ttft_max_s']:>11.3f} "
                  f"{s['tokens_per_s']:>9.1f} {s['cpu_s_per_1k_tokens']:>13.2f}")
        print(f"{'':>7} {'':>8} gRPC vs offline: TTFT {100 * cost['ttft_median']:+.1f}%, tokens/s "
              f"{100 * cost['tokens_per_s']:+.1f}%; paired per round: wall {100 * cost['paired_wall_median']:+.1f}%, "
              f"TTFT {100 * cost['paired_ttft_median']:+.1f}%; CPU: server {100 * cost['server_cpu']:+.1f}%, "
              f"server + client {100 * cost['server_and_client_cpu']:+.1f}%; the service's host threads "
              f"{100 * cost['service_host_cpu']:+.1f}% (host CPU s/1k tok: server {g['host_cpu_s_per_1k_tokens']:.2f}, "
              f"offline {o['host_cpu_s_per_1k_tokens']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
