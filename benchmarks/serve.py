"""Online serving latency: Poisson arrivals at a sweep of request rates against `jaxpage serve`, over gRPC or HTTP.

    python -m benchmarks.serve [--rates 0.25 0.5 1 2] [--num-requests 32 | --duration S] [--workload alpaca]
                               [--max-tokens N] [--seed 0] [--json out.json] [--plot out.png]
                               [--protocol grpc http] [--repeats R]
                               [--address HOST:PORT [--http-url URL] [--metrics-url URL]]  # a running server
    python -m benchmarks.serve --quick --json out.json                               # smoke run: about a minute
    python -m benchmarks.serve --rates inf --num-requests 1 32 --protocol grpc http --repeats 3  # gRPC vs HTTP
    jaxpage bench serve [...]                                                        # the same, from the CLI
The vLLM paper's serving experiment (Kwon et al., SOSP 2023, figure 12), in the manner of vLLM's
benchmark_serving: for each request rate, the workload's requests (jaxpage/testing/workloads.py, seeded; Alpaca-like
by default) are sent with exponential inter-arrival times (a Poisson process, seeded numpy), each as one
grpc.aio GenerateStream call, or with --protocol http one streamed POST /v1/completions of the OpenAI-compatible
API (httpx, token ids as the prompt, vLLM's return_token_ids to count tokens per chunk); greedy, ignore_eos,
max_tokens = the workload's output length, so every request makes exactly that many tokens. With several
protocols, several --num-requests or --repeats, each rate runs once per (count, repeat, protocol), the protocols
alternating, so that all see the same background load; the JSON's "comparison" gives per (rate, count) the
median over repeats of tokens/s and mean TTFT for each protocol. Every run sends requests of the same lengths,
with fresh random prompt tokens (no prefix-cache hits from one run to the next); the next run starts when the
previous one has drained.

Without --address the script starts a `jaxpage serve` subprocess (python -m serving.cli serve, the engine
options below) and waits for health SERVING; with it, it drives the server given (and reads its Prometheus
metrics if --metrics-url is given).

Per request, all client-side (from the moment the call is made):
  TTFT   time to the first streamed chunk carrying tokens;
  TPOT   (e2e - TTFT) / (output tokens - 1), the mean time per output token after the first;
  ITL    every gap between consecutive streamed chunks that carry tokens (a chunk may carry several tokens:
         tokens are counted from its token_ids, and the gap is recorded once per chunk, as vLLM does);
  E2E    the call's end-to-end latency;
  normalized latency  e2e / output tokens (s/token), the paper's metric, averaged over the rate's requests.
Per rate: mean, P50 and P99 of each; achieved throughput (finished requests and output tokens over the span from
the first call to the last completion); and from the server's /metrics, sampled every --sample-interval seconds,
the peak running/waiting requests and KV usage and the preemptions during the rate.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import numpy as np

from benchmarks.report import save_plot
from jaxpage.testing import workloads
from jaxpage.testing.launch import apply_quick, free_port, spawn, wait_serving
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc

QUICK = dict(rates=[2.0], num_requests=[4], max_tokens=8, max_model_len=256, max_num_seqs=8,
             max_num_batched_tokens=64)


# --- the server ----------------------------------------------------------------------------------------
def server_flags(args) -> list[str]:
    flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
             "--block-size", str(args.block_size)] + ([] if args.scan_layers else ["--no-scan-layers"])
    for name in ("model", "kv_cache_memory", "num_kv_blocks"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def scrape(url: str | None) -> dict[str, float]:
    """The server's metrics as {name: value} (labels dropped, summed over them); {} when unavailable."""
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if m and not line.startswith("#"):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


async def sample_metrics(url: str | None, interval: float, samples: list[dict], stop: asyncio.Event) -> None:
    while url and not stop.is_set():
        values = await asyncio.to_thread(scrape, url)
        if values:
            samples.append(values)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


# --- the protocols: one request's stream as (tokens, finish reason, usage's completion tokens) per chunk ---
class RequestFailed(Exception):
    pass


async def grpc_chunks(stub, req: workloads.Request, timeout: float | None):
    sampling = pb.SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=list(req.prompt_token_ids), sampling=sampling)
    try:
        async for response in stub.GenerateStream(request, timeout=timeout):
            yield (sum(len(c.token_ids) for c in response.completions),
                   next((c.finish_reason for c in response.completions if c.finish_reason), ""),
                   response.usage.completion_tokens if response.HasField("usage") else None)
    except grpc.RpcError as e:
        raise RequestFailed(f"{e.code().name}: {e.details()}") from None


async def http_chunks(client: httpx.AsyncClient, req: workloads.Request, timeout: float | None):
    body = {"prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise RequestFailed(chunk["error"]["message"])
                yield (sum(len(c["token_ids"]) for c in chunk["choices"]),
                       next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), ""),
                       (chunk.get("usage") or {}).get("completion_tokens"))
    except httpx.HTTPError as e:
        raise RequestFailed(f"{type(e).__name__}: {e}") from None


# --- one rate ------------------------------------------------------------------------------------------
async def one_request(send, req: workloads.Request, send_at: float, t0: float, timeout: float | None) -> dict:
    """Sends req at t0 + send_at through ``send`` (grpc_chunks or http_chunks with its client bound)."""
    delay = t0 + send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = time.perf_counter()
    record = {"arrival": start - t0, "scheduled_arrival": send_at, "prompt_tokens": len(req.prompt_token_ids),
              "requested_tokens": req.max_tokens, "output_tokens": 0, "chunk_tokens": [], "chunk_times": [],
              "finish_reason": "", "usage_completion_tokens": None, "error": None}
    try:
        async for n, finish_reason, usage in send(req, timeout):
            now = time.perf_counter()
            if n:
                record["chunk_tokens"].append(n)
                record["chunk_times"].append(now - start)
                record["output_tokens"] += n
            if finish_reason:
                record["finish_reason"] = finish_reason
            if usage is not None:
                record["usage_completion_tokens"] = usage
    except RequestFailed as e:
        record["error"] = str(e)
    end = time.perf_counter()
    times, n = record["chunk_times"], record["output_tokens"]
    record["e2e"] = end - start
    record["ttft"] = times[0] if times else None
    record["itl"] = [b - a for a, b in zip(times, times[1:])]
    record["tpot"] = (record["e2e"] - times[0]) / (n - 1) if n > 1 else None
    record["normalized_latency"] = record["e2e"] / n if n else None
    record["finished"] = record["error"] is None and bool(record["finish_reason"])
    return record


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def arrival_times(rate: float, n: int, seed: int) -> np.ndarray:
    """Poisson arrivals at ``rate`` req/s: the first at t=0, then exponential gaps (vLLM's benchmark_serving)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def fresh_prompts(workload: workloads.Workload, vocab_size: int, seed: int) -> list[workloads.Request]:
    """The workload's lengths with new random prompt tokens (no prefix-cache hits between rates)."""
    rng = np.random.default_rng(seed)
    return [workloads.Request(tuple(int(t) for t in rng.integers(workloads.FIRST_TOKEN_ID, vocab_size,
                                                                  len(r.prompt_token_ids))), r.max_tokens)
            for r in workload.requests]


async def run_rate(send, rate: float, requests: list[workloads.Request], args, seed: int) -> dict:
    arrivals = arrival_times(rate, len(requests), seed)
    samples: list[dict] = []
    stop = asyncio.Event()
    before = await asyncio.to_thread(scrape, args.metrics_url)
    sampler = asyncio.ensure_future(sample_metrics(args.metrics_url, args.sample_interval, samples, stop))
    t0 = time.perf_counter() + 0.05
    records = await asyncio.gather(*(one_request(send, r, float(a), t0, args.request_timeout)
                                     for r, a in zip(requests, arrivals)))
    stop.set()
    await sampler
    after = await asyncio.to_thread(scrape, args.metrics_url)
    span = max(r["arrival"] + r["e2e"] for r in records) - min(r["arrival"] for r in records)
    done = [r for r in records if r["finished"]]
    out_tokens = sum(r["output_tokens"] for r in done)
    result = {"rate": rate, "num_requests": len(records), "num_finished": len(done),
              "num_errors": sum(r["error"] is not None for r in records),
              "offered_rate": (len(records) - 1) / float(arrivals[-1]) if len(records) > 1 and arrivals[-1] > 0
              else None,
              "duration_s": span, "throughput_requests_per_s": len(done) / span,
              "throughput_output_tokens_per_s": out_tokens / span,
              "total_output_tokens": out_tokens, "total_requested_tokens": sum(r.max_tokens for r in requests),
              "max_tokens_per_chunk": max((max(r["chunk_tokens"]) for r in done if r["chunk_tokens"]), default=0)}
    for key in ("ttft", "tpot", "e2e", "normalized_latency"):
        result[key] = stats([r[key] for r in done if r[key] is not None])
    result["itl"] = stats([g for r in done for g in r["itl"]])
    if after:
        p = "jaxpage:"
        result["server"] = {
            "preemptions": after.get(p + "num_preemptions", 0) - before.get(p + "num_preemptions", 0),
            "peak_running": max((s.get(p + "num_requests_running", 0) for s in samples), default=None),
            "peak_waiting": max((s.get(p + "num_requests_waiting", 0) for s in samples), default=None),
            "peak_kv_cache_usage": max((s.get(p + "kv_cache_usage_perc", 0) for s in samples), default=None),
            "kv_blocks_total": after.get(p + "kv_blocks_total"),
            "prefix_cache_hits": after.get(p + "prefix_cache_hits", 0) - before.get(p + "prefix_cache_hits", 0),
            "request_errors": after.get(p + "request_errors_total", 0) - before.get(p + "request_errors_total", 0)}
    result["requests"] = [{k: v for k, v in r.items() if k != "chunk_times"} for r in records]
    return result


# --- reporting -----------------------------------------------------------------------------------------
def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}" if x >= 1 else f"{1e3 * x:.1f}"


def print_table(rates: list[dict]) -> None:
    head = (f"{'proto':>5} {'rate':>6} {'done':>7} {'req/s':>6} {'tok/s':>6} {'norm ms/tok':>11} "
            f"{'TTFT mean/p50/p99 ms':>22} {'TPOT mean/p50/p99 ms':>21} {'ITL mean/p50/p99 ms':>21} "
            f"{'E2E mean/p50/p99 s':>21} {'preempt':>7} {'peak run/wait':>13} {'peak KV':>7}")
    print(head)
    for r in rates:
        def three(key, f=_ms):
            s = r[key]
            return "/".join(f(s[k]) for k in ("mean", "p50", "p99"))
        srv = r.get("server") or {}
        peak = (f"{srv['peak_running']:.0f}/{srv['peak_waiting']:.0f}" if srv.get("peak_running") is not None
                else "-")
        kv = f"{100 * srv['peak_kv_cache_usage']:.1f}%" if srv.get("peak_kv_cache_usage") is not None else "-"
        done = f"{r['num_finished']}/{r['num_requests']}"
        print(f"{r['protocol']:>5} {r['rate']:>6g} {done:>7} {r['throughput_requests_per_s']:>6.2f} "
              f"{r['throughput_output_tokens_per_s']:>6.1f} {_ms(r['normalized_latency']['mean']):>11} "
              f"{three('ttft'):>22} {three('tpot'):>21} {three('itl'):>21} "
              f"{three('e2e', lambda x: '-' if x is None else f'{x:.2f}'):>21} "
              f"{srv.get('preemptions', '-'):>7} {peak:>13} {kv:>7}")


def comparison(rates: list[dict]) -> list[dict]:
    """Per (rate, requests) and protocol: the median over repeats of output tokens/s and of the mean TTFT."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rates:
        groups.setdefault((r["rate"], r["num_requests"]), {}).setdefault(r["protocol"], []).append(r)
    return [{"rate": rate, "num_requests": count, **{
        protocol: {"repeats": len(rs),
                   "output_tokens_per_s": float(np.median([r["throughput_output_tokens_per_s"] for r in rs])),
                   "ttft_mean_s": float(np.median([r["ttft"]["mean"] for r in rs if r["ttft"]["mean"] is not None]))}
        for protocol, rs in by_protocol.items()}} for (rate, count), by_protocol in groups.items()]


def print_comparison(rows: list[dict], protocols: list[str]) -> None:
    print(f"{'rate':>6} {'streams':>7} " + " ".join(f"{p + ' tok/s':>11} {p + ' TTFT ms':>13}" for p in protocols))
    for row in rows:
        print(f"{row['rate']:>6g} {row['num_requests']:>7} " + " ".join(
            f"{row[p]['output_tokens_per_s']:>11.1f} {_ms(row[p]['ttft_mean_s']):>13}" for p in protocols))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = result["options"]["protocol"][0]
    result = dict(result, rates=[r for r in result["rates"] if not math.isinf(r["rate"]) and r["repeat"] == 0
                                 and r["protocol"] == first])
    rates = [r["rate"] for r in result["rates"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(rates, [r["normalized_latency"]["mean"] for r in result["rates"]], "o-", color="tab:green",
             label="jaxpage (mean e2e / output tokens)")
    ax1.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)",
            title="normalized latency vs request rate")
    ax2.plot(rates, [r["ttft"]["p50"] for r in result["rates"]], "o-", label="TTFT P50", color="tab:blue")
    ax2.plot(rates, [r["ttft"]["p99"] for r in result["rates"]], "s--", label="TTFT P99", color="tab:red")
    ax2.set(xlabel="request rate (req/s)", ylabel="time to first token (s)", title="TTFT vs request rate")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    o = result["options"]
    counts = sorted({r["num_requests"] for r in result["rates"]})
    counts = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    fig.suptitle(f"{result['model']}, {o['workload']} workload ({counts} requests per "
                 f"rate, mean {result['workload']['mean_prompt_tokens']:.0f} in / "
                 f"{result['workload']['mean_output_tokens']:.0f} out), {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(x):
    """The result for strict JSON: infinite floats (--rates inf) as the string "inf"; floats to 10 us / 6 digits."""
    if isinstance(x, float):
        return ("inf" if x > 0 else "-inf") if math.isinf(x) else float(f"{x:.6g}") if abs(x) >= 10 else round(x, 5)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def dumps(result: dict) -> str:
    """Indented JSON, with each list of numbers on one line (the per-request ITLs would take a line each)."""
    text = json.dumps(_finite(result), indent=1)
    return re.sub(r"\[\s*([-\d.e,\s]+?)\s*\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)


# --- main ----------------------------------------------------------------------------------------------
def requests_at(rate: float, args) -> list[int]:
    if args.duration and not math.isinf(rate):
        return [max(2, math.ceil(rate * args.duration))]
    return args.num_requests


def runs(args) -> list[tuple[float, int, int, str]]:
    """(rate, requests, repeat, protocol) in the order they run: the protocols alternate innermost."""
    return [(rate, count, repeat, protocol) for rate in args.rates for count in requests_at(rate, args)
            for repeat in range(args.repeats) for protocol in args.protocol]


async def sweep(args, target: str) -> tuple[dict, dict, list[dict]]:
    async with grpc.aio.insecure_channel(target) as channel, httpx.AsyncClient(
            base_url=args.http_url or "http://unused", timeout=None,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
        stub = pb_grpc.GenerationStub(channel)
        senders = {"grpc": lambda req, timeout: grpc_chunks(stub, req, timeout),
                   "http": lambda req, timeout: http_chunks(http, req, timeout)}
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        max_len = min(args.max_len or info.max_model_len, info.max_model_len)
        n = max(count for _, count, _, _ in runs(args))
        workload = workloads.make(args.workload, n, max_len, info.vocab_size, args.seed)
        if args.max_tokens:
            workload = workloads.Workload(workload.name, tuple(
                workloads.Request(r.prompt_token_ids, min(r.max_tokens, args.max_tokens), r.n)
                for r in workload.requests), workload.max_len)
        if workload.num_sequences != len(workload.requests):
            raise SystemExit(f"workload {args.workload!r} has n>1 requests; use a single-sample workload")
        # warm the channels and the server's paths (untimed)
        warm = fresh_prompts(workload, info.vocab_size, args.seed + 7919)[:2]
        await asyncio.gather(*(one_request(senders[p], workloads.Request(r.prompt_token_ids, min(r.max_tokens, 4)),
                                           0.0, time.perf_counter(), args.request_timeout)
                               for r in warm for p in args.protocol))
        results = []
        for i, (rate, count, repeat, protocol) in enumerate(runs(args)):
            # fresh prompts for every run: no prefix-cache hits from one run to the next
            requests = fresh_prompts(workload, info.vocab_size, args.seed + 1000 * (i + 1))[:count]
            r = await run_rate(senders[protocol], rate, requests, args, args.seed + i)
            r.update(protocol=protocol, repeat=repeat)
            results.append(r)
            print(f"{protocol} rate {rate:g} req/s: {r['num_finished']}/{r['num_requests']} finished in "
                  f"{r['duration_s']:.1f} s, {r['throughput_output_tokens_per_s']:.1f} tok/s, TTFT mean "
                  f"{_ms(r['ttft']['mean'])} ms, normalized latency {_ms(r['normalized_latency']['mean'])} ms/token",
                  flush=True)
    model_info = {"model_name": info.model_name, "max_model_len": info.max_model_len,
                  "block_size": info.block_size, "num_kv_blocks": info.num_kv_blocks,
                  "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens,
                  "dtype": info.dtype}
    return model_info, workload.describe(), results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1, 2],
                        help="request rates to sweep, req/s (inf: all at once)")
    parser.add_argument("--num-requests", type=int, nargs="+", default=[32],
                        help="requests per rate (several: each rate runs with each count)")
    parser.add_argument("--protocol", nargs="+", choices=["grpc", "http"], default=["grpc"],
                        help="gRPC GenerateStream and/or the OpenAI-compatible HTTP API (both: they alternate)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (rate, count, protocol)")
    parser.add_argument("--duration", type=float, default=None,
                        help="instead of --num-requests: about rate x duration requests per rate")
    parser.add_argument("--workload", default="alpaca", choices=["alpaca", "sharegpt"])
    parser.add_argument("--max-tokens", type=int, default=None, help="clip every request's output length")
    parser.add_argument("--max-len", type=int, default=None,
                        help="prompt + output clip of the workload (default: the server's max_model_len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every request's and every rate's figures here")
    parser.add_argument("--plot", default=None, help="PNG: normalized latency and TTFT against the rate "
                        "(needs matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a small server, one rate, 4 requests of at most 8 tokens")
    parser.add_argument("--address", default=None, help="host:port of a running server (default: start one)")
    parser.add_argument("--http-url", default=None,
                        help="the running server's HTTP API, e.g. http://127.0.0.1:8000 (with --address)")
    parser.add_argument("--metrics-url", default=None,
                        help="the running server's /metrics URL (with --address; default: none)")
    parser.add_argument("--machine", default=None, help="the machine, in words, for the JSON and the plot")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="seconds between /metrics samples")
    parser.add_argument("--request-timeout", type=float, default=None, help="deadline of each call, s")
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for SERVING")
    g = parser.add_argument_group("engine options of the server started here")
    g.add_argument("--model", default=None)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool budget, bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's scan_layers option")
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(parser, args, QUICK)
    if any(r <= 0 for r in args.rates):
        parser.error("--rates must be > 0")
    if "http" in args.protocol and args.address and not args.http_url:
        parser.error("--protocol http with --address needs --http-url")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    proc = None
    if args.address:
        target = args.address
    else:
        port, metrics_port, http_port = free_port(), free_port(), free_port()
        target = f"127.0.0.1:{port}"
        args.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        args.http_url = f"http://127.0.0.1:{http_port}"
        log_path = Path(tempfile.gettempdir()) / f"serving_bench_server_{port}.log"
        print(f"starting jaxpage serve on {target} (log {log_path})", flush=True)
        proc = spawn(["-m", "serving.cli", "serve", "--port", str(port), "--metrics-port", str(metrics_port),
                      "--http-port", str(http_port), *server_flags(args)], log_path)
    try:
        if proc is not None:
            started = time.monotonic()
            wait_serving(target, proc, timeout=args.server_timeout, log_path=log_path)
            print(f"server SERVING after {time.monotonic() - started:.1f} s", flush=True)
        model_info, workload, rates = asyncio.run(sweep(args, target))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except Exception:  # noqa: BLE001
                proc.kill()

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    result = {"machine": args.machine or f"{platform.machine()}, {os.cpu_count()} CPUs",
              "date": datetime.date.today().isoformat(),
              "command": shlex.join(["python", "-m", "benchmarks.serve", *(sys.argv[1:] if argv is None else argv)]),
              "model": model_info["model_name"] or "default model", "server": model_info,
              "options": {k: v for k, v in vars(args).items()}, "workload": workload,
              "load_average_after": load, "comparison": comparison(rates), "rates": rates}
    print_table(rates)
    if len(args.protocol) > 1:
        print_comparison(result["comparison"], args.protocol)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            f.write(dumps(result))
        print(f"wrote {args.json}")
    if args.plot:
        save_plot(args.plot, lambda: plot(result, args.plot))
    return result


if __name__ == "__main__":
    main()
