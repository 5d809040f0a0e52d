"""Multi-turn chat against a prefix cache smaller than the conversations, on SmolLM2-135M-Instruct.

``--conversations`` N conversations of ``--turns`` T turns: each turn's prompt is the conversation so far (a
system prompt, the earlier user messages and the model's greedy answers, as token ids) plus a new user message
of seeded random token ids. The conversations are interleaved: ``--concurrency`` turns in flight, a conversation
whose turn ended queues behind the others for its next one (so the turns of the others come between two of its
own), the first turns in a seeded shuffled order. The device pool (``--num-kv-blocks``) holds a fraction of the
conversations' prefixes. Each configuration runs in a fresh process:

- ``no_offload``: the device prefix cache alone;
- ``host``: the host tier (``kv_offloading_size`` GiB), ``host_disk``: a smaller host tier over a disk tier
  (``kv_offloading_dir``, emptied first), ``disk_restart``: host + disk again in a fresh process on the same
  directory, with nothing on the device or the host: a restarted server's prefix cache. These need the engine's
  tier options; without them they are skipped, saying so.
- ``dp_load``, ``dp_cache_aware``: 2 data-parallel replicas on 2 forced CPU devices (each with the pool above),
  ``2 x --concurrency`` turns in flight, routed by load or cache-aware (jaxpage/engine/routing.py).

Reported per configuration, from the engine's stats: prompt tokens looked up, found in the device's prefix cache
and restored from the host or disk tier (``external_prefix_cache_hits``), the prompt tokens computed (the rest)
and the hit rate (device and tiers), TTFT p50/p99, output tokens/s over the workload's wall
time, the routers' decisions, any tier counters the engine reports, and whether the answers equal no_offload's
(greedy: they must).

    python -m benchmarks.multi_turn [--configs no_offload host ...] [--conversations 8] [--turns 4]
        [--concurrency 2] [--num-kv-blocks 64] [--json benchmarks/results/multi_turn.json] [--quick]
    jaxpage bench multi-turn [...]                                   # the same, from the CLI
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxpage.testing.launch import ROOT, apply_quick

TIER_OPTIONS = ("kv_offloading_size", "kv_offloading_dir")
CONFIGS = ("no_offload", "host", "host_disk", "disk_restart", "dp_load", "dp_cache_aware")
QUICK = {"conversations": 3, "turns": 2, "concurrency": 1, "message_tokens": 12, "answer_tokens": 4,
         "system_tokens": 20, "configs": ["no_offload", "dp_load", "dp_cache_aware"]}


def config_options(name: str, args) -> dict:
    """The engine options of a configuration (beside the common ones)."""
    disk = str(Path(args.work_dir) / "disk-tier")
    return {"no_offload": {},
            "host": {"kv_offloading_size": args.host_gib},
            "host_disk": {"kv_offloading_size": args.small_host_gib, "kv_offloading_dir": disk},
            "disk_restart": {"kv_offloading_size": args.small_host_gib, "kv_offloading_dir": disk},
            "dp_load": {"data_parallel_size": 2, "data_parallel_routing": "load"},
            "dp_cache_aware": {"data_parallel_size": 2, "data_parallel_routing": "cache_aware"}}[name]


def engine_options(args) -> dict:
    options = {"block_size": 16, "num_kv_blocks": args.num_kv_blocks, "max_num_seqs": 8,
               "max_num_batched_tokens": 64, "max_model_len": args.max_model_len, "dtype": "float32",
               "progress": False}
    if args.model:
        options["model"] = args.model
    if args.cache_dir:
        options["cache_dir"] = args.cache_dir
    return options


def conversation_tokens(args, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user messages, seeded random token ids."""
    import numpy as np

    high = min(vocab_size, 20_000)  # SmolLM2: ordinary tokens, no special ones (those are below 100)
    rng = np.random.default_rng(args.seed)
    system = rng.integers(100, high, args.system_tokens).tolist()
    messages = [[rng.integers(100, high, args.message_tokens).tolist() for _ in range(args.turns)]
                for _ in range(args.conversations)]
    return system, messages


async def converse(engine, args, vocab_size: int) -> dict:
    """Runs the workload on an engine with AsyncEngine's interface; every conversation's answers."""
    import numpy as np

    from jaxpage.sampling_params import SamplingParams

    system, messages = conversation_tokens(args, vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True,
                            output_kind="final_only")
    slots = asyncio.Semaphore(args.concurrency * (2 if args.data_parallel else 1))  # FIFO: turns interleave
    answers: list[list[list[int]]] = [[] for _ in messages]

    async def conversation(c: int):
        history = list(system)
        for t, message in enumerate(messages[c]):
            history += message
            async with slots:
                final = None
                async for out in await engine.add_request(f"c{c}.t{t}", {"prompt_token_ids": history}, params):
                    final = out
            answers[c].append(list(final.outputs[0].token_ids))
            history += answers[c][-1]

    order = np.random.default_rng(args.seed + 1).permutation(args.conversations).tolist()
    tasks = []
    for c in order:  # each takes its place in the semaphore's queue in this order
        tasks.append(asyncio.create_task(conversation(c)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return {"answers": answers}


def run_config(name: str, args) -> dict:
    """One configuration in this process: its engine built, the workload run, its figures."""
    import numpy as np

    from jaxpage.engine.arg_utils import EngineArgs

    options = config_options(name, args)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(options) - known)
    if unknown:
        return {"skipped": f"this engine has no option {', '.join(unknown)} (the host and disk tiers of "
                           "issue 28 are not merged)"}
    if name == "host_disk":
        shutil.rmtree(options["kv_offloading_dir"], ignore_errors=True)
    engine_args = EngineArgs(**engine_options(args), **options)
    started = time.perf_counter()
    engine = make_engine(engine_args)
    startup_s = time.perf_counter() - started
    try:
        vocab = engine.engine.config.model.vocab_size
        load = [os.getloadavg()[0]]
        started = time.perf_counter()
        out = asyncio.run(converse(engine, args, vocab))
        seconds = time.perf_counter() - started
        load.append(os.getloadavg()[0])
        stats = engine.stats()
    finally:
        engine.shutdown()
    ttfts = [r["ttft"] for r in stats["requests"] if r["ttft"] is not None]
    output_tokens = sum(len(a) for conv in out["answers"] for a in conv)
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]  # hits: on the device
    restored = stats.get("external_prefix_cache_hits", 0)  # vLLM's name: found in the host or disk tier
    result = {"options": options, "startup_s": startup_s, "seconds": seconds, "load_1min": load,
              "requests": len(stats["requests"]), "prompt_tokens": queries, "prefix_cache_hits": hits,
              "tier_hits": restored, "prompt_tokens_computed": queries - hits - restored,
              "prefix_hit_rate": (hits + restored) / queries if queries else 0.0,
              "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
              "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / seconds,
              "answers_digest": hashlib.sha256(json.dumps(out["answers"]).encode()).hexdigest()[:16],
              "num_preemptions": stats["num_preemptions"],
              "tier_stats": {k: v for k, v in stats.items() if any(w in k for w in ("offload", "external", "disk"))}}
    if "routing" in stats:
        result["routing"] = stats["routing"]
        result["replica_hit_rates"] = [r["prefix_cache_hits"] / r["prefix_cache_queries"]
                                       if r["prefix_cache_queries"] else 0.0 for r in stats["replicas"]]
    return result


def make_engine(engine_args):
    from jaxpage.engine.async_engine import AsyncEngine
    from jaxpage.engine.data_parallel import DataParallelEngine

    if engine_args.data_parallel_size > 1:
        return DataParallelEngine.from_args(engine_args)
    return AsyncEngine.from_args(engine_args)


def run_child(name: str, args) -> dict:
    """A configuration in a fresh process (the data-parallel ones on 2 forced CPU devices)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if name.startswith("dp_"):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    argv = [sys.executable, "-m", "benchmarks.multi_turn", "--child", name, "--child-json", str(out),
            *child_flags(args)]
    proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def child_flags(args) -> list[str]:
    names = ("conversations", "turns", "concurrency", "system_tokens", "message_tokens", "answer_tokens",
             "num_kv_blocks", "max_model_len", "host_gib", "small_host_gib", "seed", "work_dir", "model",
             "cache_dir")
    return [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names if getattr(args, n) is not None]


def report(results: dict) -> None:
    print(f"{'config':>15} {'computed':>9} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} same")
    base = results.get("no_offload", {}).get("answers_digest")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:>15} skipped: {r['skipped']}")
            continue
        same = "-" if base is None or name == "no_offload" else ("yes" if r["answers_digest"] == base else "NO")
        print(f"{name:>15} {r['prompt_tokens_computed']:>9} {r['prefix_hit_rate']:>8.1%} "
              f"{r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>7.0f}ms {r['output_tokens_per_s']:>7.1f} "
              f"{same}" + (f"  routing {r['routing']}" if "routing" in r else ""))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="turns in flight (per replica with DP)")
    parser.add_argument("--system-tokens", type=int, default=32)
    parser.add_argument("--message-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=12)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="the device pool (per replica)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--host-gib", type=float, default=0.25, help="kv_offloading_size of the host config")
    parser.add_argument("--small-host-gib", type=float, default=0.02,
                        help="kv_offloading_size under the disk tier (smaller: the disk holds the rest)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="the disk tier's parent (default: a fresh temp dir)")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--child-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, help="write the workload, the options and every result here")
    parser.add_argument("--quick", action="store_true", help="a tiny workload (the smoke test)")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--child-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(parser, args, QUICK)
    args.data_parallel = bool(args.child and args.child.startswith("dp_"))
    if args.child:
        args.child_json.write_text(json.dumps(run_config(args.child, args)))
        return
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="jaxpage-multi-turn-")
    results = {}
    for name in args.configs:
        results[name] = run_child(name, args)
        print(f"{name}: done", flush=True)
    report(results)
    workload = {k: getattr(args, k) for k in ("conversations", "turns", "concurrency", "system_tokens",
                                              "message_tokens", "answer_tokens", "num_kv_blocks", "seed")}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"workload": workload, "machine": platform.machine(),
                                         "engine_options": engine_options(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
