r"""Paged vs contiguous KV caches on the same memory: throughput, concurrency and KV waste, side by side.

    python -m benchmarks.throughput [--json out.json] [--plot out.png]     # main run: about 8 minutes here
    python -m benchmarks.throughput --max-len 1024 --json out.json          # 1024-token reservations (half the KV)
    python -m benchmarks.throughput --quick --json out.json                 # smoke run (CI): about 30-80 s
    jaxpage bench throughput [...]                                          # the same, from the CLI
    python -m benchmarks.throughput --workload alpaca --num-requests 200 --duration 40 --warmup 15 \
        --extra-workloads shared_prefix parallel_sampling --extra-requests 64 --extra-duration 40 \
        --extra-warmup 15 --streams 0 --json extras.json                   # the other workloads: about 9 minutes

One process loads the model once and shares its weights (device arrays) between three systems, each holding the
same KV memory budget of ``--slots`` max-length sequences (``slots * max_len / block_size`` blocks, plus the
null block):

- ``paged``: jaxpage's LLMEngine (prefix caching on, ``--preemption-mode`` recompute or swap) on the engine's
  own ModelRunner, stepped here so that concurrency and KV occupancy are read after every step.
- ``static_contiguous`` and ``slot_contiguous``: benchmarks/baselines.py, on the same jitted step.

The systems are interleaved step by step, each on its own clock (only its own steps count), so they see the
same machine load however it drifts on this shared 2-core machine (``--sequential`` runs them one after the
other instead). Every request arrives at t=0, is greedy, ignores EOS and generates exactly its workload's output
length. The main run is a backlog larger than the machine gets through: each system runs ``--warmup`` seconds
unmeasured (the admission and prefill transient), then ``--duration`` measured seconds of saturated steady state;
``--duration 0`` drains the workload instead (as --quick does). See baselines.RunStats for the metrics: KV waste
is 1 - (tokens whose K/V live sequences hold) / (token slots reserved for live sequences), summed over the
window's steps; ``kv_waste_at_peak`` is at the step that reserved the most memory. CPU seconds are reported
beside wall seconds. Compilation happens before any clock starts.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxpage.worker.model_runner as model_runner
from benchmarks.baselines import (ContiguousCache, RunStats, SlotBatching, StaticBatching,
                                  interleave, run_alone)
from benchmarks.report import save_plot
from jaxpage.attention.kv_cache import bytes_per_block
from jaxpage.config import ModelConfig
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.models import config_from_hf, unstack_layers
from jaxpage.models.loader import default_cache_dir, load_model
from jaxpage.sampling_params import SamplingParams
from jaxpage.testing import workloads
from jaxpage.worker.compile_cache import enable_compilation_cache
from jaxpage.worker.model_runner import ModelRunner

SYSTEMS = ("paged", "static_contiguous", "slot_contiguous")


# --- the paged engine -------------------------------------------------------------------------------------
def paged_systems(args) -> dict[str, str]:
    """The paged engine once per --kv-cache-dtype: system name -> kv_cache_dtype ("paged" is auto)."""
    if "paged" not in args.systems:
        return {}
    return {"paged" if kv == "auto" else f"paged_{kv}": kv for kv in args.kv_cache_dtype}


PREFILL_LIMITS = ("long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills")


def prefill_limits_defaults() -> dict:
    """The engine's defaults of the partial-prefill options that the paged engine here takes."""
    return {name: getattr(EngineArgs, name) for name in PREFILL_LIMITS}


def paged_runner(loaded, model: ModelConfig, params: dict, args, num_kv_blocks: int, max_num_seqs: int,
                 budget_bytes: int | None = None, kv_cache_dtype: str = "auto") -> ModelRunner:
    """The engine's own runner over the shared weights, its pool sized from the byte budget when given (a
    quantized KV cache gets more blocks from the same bytes). With swap, the host pool has as many blocks as the
    device pool (host memory, outside the KV budget)."""
    config = build_engine_config(
        model, dtype=args.dtype, block_size=args.block_size, kv_cache_memory=budget_bytes,
        num_kv_blocks=None if budget_bytes else num_kv_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_len, gpu_memory_utilization=0.9,
        scan_layers=args.scan_layers, kv_cache_dtype=kv_cache_dtype,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills, prefill_into_padding=args.prefill_into_padding)
    blocks = config.cache.num_kv_blocks
    assert kv_cache_dtype != "auto" or blocks == num_kv_blocks, (blocks, num_kv_blocks)
    num_host_blocks = config.cache.num_kv_blocks if args.preemption_mode == "swap" else 0
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, preemption_mode=args.preemption_mode),
        cache=dataclasses.replace(config.cache, num_host_blocks=num_host_blocks))
    runner = ModelRunner(config, params, loaded.eos_token_ids)
    runner.warm_up(progress=False)
    return runner


def paged_engine(loaded, runner: ModelRunner) -> LLMEngine:
    """A fresh engine (queues, block pool, stats) on a compiled runner: as LLMEngine.from_args, minus the loading."""
    return LLMEngine(runner.config, runner, tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                     model_name=loaded.name)


@contextlib.contextmanager
def timed_execute(runner: ModelRunner, timers: dict):
    """Times runner.execute and, inside it, build_batch (the batch's host work) without changing either."""
    execute, build = runner.execute, model_runner.build_batch

    def timed_build(*a, **k):
        t = time.perf_counter()
        try:
            return build(*a, **k)
        finally:
            timers["build_batch"] += time.perf_counter() - t

    def timed_exec(scheduled):
        t = time.perf_counter()
        try:
            return execute(scheduled)
        finally:
            timers["execute"] += time.perf_counter() - t

    runner.execute, model_runner.build_batch = timed_exec, timed_build
    try:
        yield
    finally:
        del runner.execute
        model_runner.build_batch = build


def paged_steps(engine: LLMEngine, workload: workloads.Workload, stats: RunStats, counters: dict):
    """The engine on the workload, all requests at t=0, one engine.step() per iteration (yields after each)."""

    def progress() -> dict:
        in_flight = sum(s.num_output_tokens for r in engine.requests.values() for s in r.group.seqs)
        return {**counters, "tokens": counters["finished_tokens"] + in_flight,
                "preemptions": engine.scheduler.num_preemptions}

    with timed_execute(engine.runner, counters):
        stats.start(progress)
        for i, r in enumerate(workload.requests):
            params = SamplingParams(n=r.n, temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, seed=i,
                                    output_kind="final_only")
            engine.add_request(f"r{i}", {"prompt_token_ids": list(r.prompt_token_ids)}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    counters["completed"] += 1
                    counters["finished_tokens"] += sum(len(c.token_ids) for c in out.outputs)
            stats.pause()  # reading the occupancy every step is the benchmark's work, not the engine's
            stored, allocated = engine._kv_occupancy()
            stats.record(engine.scheduler.num_running_seqs(), stored, allocated)
            stats.resume()
            yield


def paged_summary(engine: LLMEngine, workload: workloads.Workload, stats: RunStats, counters: dict) -> dict:
    if stats.drained:
        assert counters["finished_tokens"] == workload.num_output_tokens, (counters, workload.num_output_tokens)
    w = stats.totals
    stats.num_preemptions = w["preemptions"]
    summary = stats.summary()
    s = engine.stats()
    summary["engine_stats"] = {k: s[k] for k in ("num_blocks", "peak_blocks_used", "kv_waste_at_peak",
                                                 "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")}
    profile = {
        "engine_step_seconds": w["t"],
        "device_step_seconds": w["execute"] - w["build_batch"],  # jitted step + results back to the host
        "build_batch_seconds": w["build_batch"],
        "schedule_update_seconds": w["t"] - w["execute"],  # scheduler, KV manager, detokenizer, outputs
    }
    profile["device_step_frac"] = profile["device_step_seconds"] / w["t"]
    summary["profile"] = profile
    return summary


def contiguous_caches(model, params, args, slots: int, attention_backend: str, systems=None) -> dict:
    """One compiled contiguous cache per baseline: interleaved, they must not write each other's slots."""
    caches = {}
    for name in systems or args.systems:
        if not name.startswith("paged"):
            caches[name] = ContiguousCache(model, params, args.dtype, slots, args.max_len, args.block_size,
                                           args.max_num_batched_tokens, attention_backend)
            caches[name].warm_up()
    return caches


# --- one comparison ---------------------------------------------------------------------------------------
def compare(loaded, args, workload, runners: dict, caches: dict, systems, duration=None, warmup=0.0) -> dict:
    """All systems on one workload, interleaved step by step (each on its own clock) unless --sequential.
    runners: the paged systems' runners by name."""
    runs, engines = {}, {}
    for name in systems:
        stats = RunStats.for_workload(workload, duration, warmup)
        if name in runners:
            engine = paged_engine(loaded, runners[name])
            counters = {"completed": 0, "finished_tokens": 0, "execute": 0.0, "build_batch": 0.0}
            engines[name] = (engine, counters)
            runs[name] = (paged_steps(engine, workload, stats, counters), stats)
        else:
            system = (StaticBatching if name == "static_contiguous" else SlotBatching)(caches[name])
            runs[name] = (system.steps(workload, stats), stats)
    load = {}
    if args.sequential:
        for name, run in runs.items():
            load[name] = [os.getloadavg()[0]]
            run_alone(*run)
            load[name].append(os.getloadavg()[0])
    else:
        before = os.getloadavg()[0]
        interleave(runs)
        load = {name: [before, os.getloadavg()[0]] for name in runs}
    result = {"workload": workload.describe(), "interleaved": not args.sequential}
    for name, (_, stats) in runs.items():
        summary = paged_summary(*engines[name][:1], workload, stats, engines[name][1]) if name in engines \
            else stats.summary()
        summary["load_average"] = load[name]
        summary["trace"] = {"t": [round(t, 3) for t in stats.times], "running": stats.running,
                            "stored": stats.stored, "allocated": stats.allocated}
        result[name] = summary
        print(f"  {name}: {summary['requests_per_s']:.3f} req/s, {summary['output_tokens_per_s']:.1f} out tok/s, "
              f"peak {summary['peak_concurrency']} seqs, waste {summary['kv_waste_frac']:.1%}, "
              f"{summary['seconds']:.1f} s, {summary['completed_requests']} requests done", flush=True)
    baselines = [result[n] for n in ("static_contiguous", "slot_contiguous") if n in result]
    if "paged" in result and baselines:
        best = max(baselines, key=lambda b: b["requests_per_s"])
        result["paged_speedup_vs_best_baseline"] = result["paged"]["requests_per_s"] / best["requests_per_s"]
        result["paged_speedup_vs_best_baseline_cpu"] = (result["paged"]["output_tokens_per_cpu_s"]
                                                         / max(b["output_tokens_per_cpu_s"] for b in baselines))
    quantized = [n for n, r in result.items() if n.startswith("paged_") and isinstance(r, dict)
                 and "requests_per_s" in r and "paged" in result]
    for name in quantized:  # quantized KV vs auto
        result[f"{name}_vs_paged"] = {k: result[name][k] / max(result["paged"][k], 1e-9)
                                      for k in ("requests_per_s", "output_tokens_per_s", "peak_concurrency",
                                                "mean_concurrency")}
    return result


def print_table(title: str, result: dict) -> None:
    w = result["workload"]
    print(f"\n{title}: {w['name']}, {w['num_requests']} requests ({w['num_sequences']} sequences) at t=0, mean "
          f"{w['mean_prompt_tokens']:.0f} in / {w['mean_output_tokens']:.0f} out, max_len {w['max_len']}")
    head = (f"{'system':<18} {'req/s':>7} {'out tok/s':>9} {'tok/cpu-s':>9} {'peak seqs':>9} {'mean seqs':>9} "
            f"{'KV waste':>8} {'@peak':>6} {'preempt':>7} {'done':>5} {'wall s':>7} {'load':>5}")
    print(head)
    for name in (n for n in result if isinstance(result[n], dict) and "peak_concurrency" in result[n]
                 and not n.endswith("_vs_paged")):
        r = result[name]
        print(f"{name:<18} {r['requests_per_s']:>7.3f} {r['output_tokens_per_s']:>9.1f} "
              f"{r['output_tokens_per_cpu_s']:>9.1f} {r['peak_concurrency']:>9d} {r['mean_concurrency']:>9.1f} "
              f"{r['kv_waste_frac']:>8.1%} {r['kv_waste_at_peak']:>6.1%} {r['num_preemptions']:>7d} "
              f"{r['completed_requests']:>5d} {r['seconds']:>7.1f} {np.mean(r['load_average']):>5.1f}")
    if not all(result[n]["drained"] for n in SYSTEMS if n in result):
        print("(a time window of a larger backlog: req/s = output tokens/s / mean output tokens per request)")
    for key in (k for k in result if k.endswith("_vs_paged")):
        print(f"{key}: " + ", ".join(f"{k} {v:.2f}x" for k, v in result[key].items()))
    if "paged_speedup_vs_best_baseline" in result:
        print(f"paged / best baseline: {result['paged_speedup_vs_best_baseline']:.2f}x requests/s "
              f"({result['paged_speedup_vs_best_baseline_cpu']:.2f}x output tokens per CPU second)")
    if "paged" in result and "profile" in result["paged"]:
        p = result["paged"]["profile"]
        print(f"paged time: device step {p['device_step_seconds']:.1f} s ({p['device_step_frac']:.0%}), "
              f"build_batch {p['build_batch_seconds']:.2f} s, schedule+update {p['schedule_update_seconds']:.2f} s")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: r for name, r in results["runs"].items() if all(s in r for s in SYSTEMS)}
    colors = {"paged": "tab:green", "static_contiguous": "tab:red", "slot_contiguous": "tab:orange"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    x = np.arange(len(runs))
    for i, name in enumerate(SYSTEMS):
        axes[0, 0].bar(x + (i - 1) * 0.27, [r[name]["requests_per_s"] for r in runs.values()], 0.27,
                       label=name, color=colors[name])
        axes[0, 1].bar(x + (i - 1) * 0.27, [100 * r[name]["kv_waste_frac"] for r in runs.values()], 0.27,
                       label=name, color=colors[name])
    for ax, label in ((axes[0, 0], "requests / s"), (axes[0, 1], "KV waste (% of reserved slots)")):
        ax.set_xticks(x, list(runs), fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    main = results["runs"][results["main"]]
    for name in SYSTEMS:
        if name in main:
            tr = main[name]["trace"]
            axes[1, 0].plot(tr["t"], tr["running"], label=name, color=colors[name], lw=1)
            util = np.array(tr["stored"]) / results["budget_tokens"]
            axes[1, 1].plot(tr["t"], 100 * util, label=name, color=colors[name], lw=1)
    for ax in axes[1]:
        for name in SYSTEMS:
            if name in main and main[name]["warmup_seconds"]:
                ax.axvline(main[name]["warmup_seconds"], color=colors[name], ls=":", lw=0.8)
    axes[1, 0].set(xlabel="seconds (dotted: measured window starts)", ylabel="running sequences",
                   title=f"{results['main']}: concurrency")
    axes[1, 1].set(xlabel="seconds", ylabel="% of KV budget holding live tokens",
                   title=f"{results['main']}: KV budget in use")
    axes[1, 0].legend(fontsize=8)
    axes[1, 1].legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, {results['dtype']}, KV budget {results['slots']} x {results['max_len']} tokens "
                 f"({results['budget_bytes'] / 2**20:.0f} MiB)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-len", type=int, default=2048,
                        help="the contiguous baselines reserve this per sequence (the paper's OPT: 2048)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--slots", type=int, default=5, help="KV budget, in max-length contiguous sequences")
    parser.add_argument("--workload", default="sharegpt", choices=list(workloads.WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=64,
                        help="requests in the main workload, all at t=0 (a backlog larger than --duration needs)")
    parser.add_argument("--duration", type=float, default=90.0,
                        help="measured seconds of each system on the main workload (0: until it is drained)")
    parser.add_argument("--warmup", type=float, default=50.0,
                        help="unmeasured seconds before the window (the admission and prefill transient)")
    parser.add_argument("--extra-workloads", nargs="*", default=[], choices=list(workloads.WORKLOADS),
                        help="also compare on these (each with --extra-requests requests)")
    parser.add_argument("--extra-requests", type=int, default=16)
    parser.add_argument("--extra-duration", type=float, default=60.0)
    parser.add_argument("--extra-warmup", type=float, default=20.0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the ShareGPT length means")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the paged engine's cap on running sequences")
    for name, default in prefill_limits_defaults().items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help="the paged engine's partial-prefill option (default: the engine's)")
    parser.add_argument("--prefill-into-padding", action=argparse.BooleanOptionalAction,
                        default=EngineArgs.prefill_into_padding,
                        help="the paged engine's: a capped prompt chunk fills its step's bucket padding")
    parser.add_argument("--streams", type=int, default=32, help="the N-concurrent-streams run (0: skip)")
    parser.add_argument("--stream-prompt", type=int, default=32)
    parser.add_argument("--stream-output", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "int8", "fp8"],
                        help="the paged engine's KV cache dtype(s): one paged system each (paged, paged_int8, "
                             "paged_fp8), all on the same KV byte budget")
    parser.add_argument("--preemption-mode", default="swap", choices=["recompute", "swap"],
                        help="the paged engine's; swap gets a host pool as large as the KV budget (on a CPU a "
                             "swap is a copy within the same RAM, cheaper than recomputing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequential", action="store_true",
                        help="run the systems one after the other instead of interleaving their steps")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="the layer layout of every system (the engine's scan_layers option)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and workload: a smoke run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_len, args.slots, args.num_requests, args.scale = 64, 3, 6, 0.08
        args.max_num_batched_tokens, args.max_num_seqs, args.streams, args.extra_workloads = 32, 16, 0, []
        args.duration = 0.0

    cache_dir = default_cache_dir()
    enable_compilation_cache(cache_dir)
    started = time.perf_counter()
    loaded = load_model(args.model, cache_dir)
    model = config_from_hf(loaded.hf_config)
    # shared by all systems, in the layout the engine runs
    layout = (lambda p: p) if args.scan_layers else unstack_layers
    params = jax.tree.map(lambda a: jnp.asarray(a, args.dtype), layout(loaded.params))
    blocks_per_seq = args.max_len // args.block_size
    budget_blocks = args.slots * blocks_per_seq
    budget_bytes = (budget_blocks + 1) * bytes_per_block(model, args.block_size, args.dtype)
    results = {"machine": platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__,
               "model": loaded.name, "dtype": args.dtype, "kv_cache_dtypes": args.kv_cache_dtype,
               "max_len": args.max_len, "block_size": args.block_size,
               "slots": args.slots, "budget_blocks": budget_blocks, "budget_tokens": budget_blocks * args.block_size,
               "budget_bytes": budget_bytes, "max_num_batched_tokens": args.max_num_batched_tokens,
               "paged_max_num_seqs": args.max_num_seqs, "quick": args.quick, "runs": {}}
    print(f"model {loaded.name} ({args.dtype}); KV budget {budget_blocks} blocks = {args.slots} x {args.max_len} "
          f"tokens = {budget_bytes / 2**20:.1f} MiB, the same for every system", flush=True)

    t = time.perf_counter()
    runners = {name: paged_runner(loaded, model, params, args, budget_blocks + 1, args.max_num_seqs, budget_bytes,
                                  kv) for name, kv in paged_systems(args).items()}
    systems = [s for s in args.systems if s != "paged"] + list(runners)
    backend = next(iter(runners.values())).config.attention_backend if runners else "xla"
    caches = contiguous_caches(model, params, args, args.slots, backend, systems)
    assert all(c.reserved_blocks == budget_blocks for c in caches.values())  # floor(budget / M) slots: = budget
    results["warmup_seconds"] = time.perf_counter() - t

    def make(name, n):
        if name == "sharegpt":
            return workloads.sharegpt(n, args.max_len, model.vocab_size, args.seed, scale=args.scale)
        return workloads.make(name, n, args.max_len, model.vocab_size, args.seed)

    main_workload = make(args.workload, args.num_requests)
    results["main"] = main_workload.name
    print(f"{main_workload.name}: {main_workload.describe()}", flush=True)
    results["runs"][main_workload.name] = compare(loaded, args, main_workload, runners, caches, systems,
                                                  args.duration, args.warmup)
    for name in args.extra_workloads:
        w = make(name, args.extra_requests)
        print(f"{w.name}: {w.describe()}", flush=True)
        results["runs"][w.name] = compare(loaded, args, w, runners, caches, systems, args.extra_duration,
                                          args.extra_warmup)
    results["num_kv_blocks"] = {name: r.config.cache.num_kv_blocks for name, r in runners.items()}
    del runners, caches

    if args.streams:
        n = args.streams
        w = workloads.fixed(n, args.stream_prompt, args.stream_output, model.vocab_size, args.seed, args.max_len)
        print(f"{n} concurrent streams: {w.describe()}", flush=True)
        blocks = n * blocks_per_seq  # room for all of them at full length: nobody waits for memory
        stream_runner = paged_runner(loaded, model, params, args, blocks + 1, n)
        stream_systems = [s for s in ("paged", "slot_contiguous") if s in args.systems]
        stream_caches = contiguous_caches(model, params, args, n, stream_runner.config.attention_backend,
                                          stream_systems)
        results["streams"] = compare(loaded, args, w, {"paged": stream_runner}, stream_caches, stream_systems)
        del stream_runner, stream_caches

    main_result = results["runs"][main_workload.name]
    for name in main_result:
        if isinstance(main_result[name], dict) and "trace" in main_result[name]:
            results[name] = {k: v for k, v in main_result[name].items() if k != "trace"}
    results["total_seconds"] = time.perf_counter() - started
    for title, r in results["runs"].items():
        print_table("Throughput", r)
    if "streams" in results:
        print_table(f"{args.streams} concurrent streams", results["streams"])
    print(f"\ntotal {results['total_seconds']:.0f} s (warm-up {results['warmup_seconds']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot_path and all(s in main_result for s in SYSTEMS):
        save_plot(plot_path, lambda: plot(results, plot_path))
    return results


if __name__ == "__main__":
    main()
