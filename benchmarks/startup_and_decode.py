"""Start-up and decode speed of the engine on one model: load (converted or cached), warm-up, tokens/s.

    python benchmarks/startup_and_decode.py [--model PATH] [--streams 1 8 32] [--profile-steps 10] [--json out.json]

Each stream decodes --max-tokens greedy tokens (ignore_eos) after a short prompt; all streams start together.
--profile-steps N traces N decode steps of the largest stream count with the JAX profiler and reports where a
step's time goes: host work against the compiled step, and the compiled step's XLA operations (thread time).
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import tempfile
import time
from pathlib import Path

import jax

from jaxpage import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's scan_layers option (--no-scan-layers: unrolled layers)")
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, progress=False,
              scan_layers=args.scan_layers,
              max_num_seqs=max(args.streams), max_num_batched_tokens=max(64, max(args.streams)))
    engine = llm.engine
    result = {"machine": platform.machine(), "dtype": engine.config.dtype, "scan_layers": args.scan_layers,
              "start_s": time.perf_counter() - started, "load_s": engine.load_seconds, "warmup_s": engine.warmup_seconds, "decode": {}}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["Warm the caches"], SamplingParams(temperature=0, max_tokens=2))
    for n in args.streams:
        prompts = [f"Story {i}: once upon a time" for i in range(n)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["decode"][n] = {"output_tokens_per_s": tokens / elapsed, "seconds": elapsed}
    if args.profile_steps:
        result["profile"] = profile_decode(llm, max(args.streams), args.profile_steps)
    print(f"load {result['load_s']:.1f} s, warm-up {result['warmup_s']:.1f} s, dtype {result['dtype']}")
    print(f"{'streams':>8} {'out tok/s':>10} {'s':>7}")
    for n, r in result["decode"].items():
        print(f"{n:>8} {r['output_tokens_per_s']:>10.1f} {r['seconds']:>7.2f}")
    if "profile" in result:
        print_profile(result["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def profile_decode(llm, streams: int, steps: int) -> dict:
    """Traces ``steps`` engine steps once ``streams`` sequences are all decoding; times per step."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"profile-{i}", f"Story {i}: once upon a time", params)
    scheduler = engine.scheduler
    while scheduler.waiting or not all(g.prompt_done for g in scheduler.running):
        engine.step()
    runner, execute_time = engine.runner, [0.0]
    execute = runner.execute

    def timed(scheduled):
        t = time.perf_counter()
        out = execute(scheduled)  # returns numpy: the step has finished
        execute_time[0] += time.perf_counter() - t
        return out

    runner.execute = timed
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - t
        runner.execute = execute
        ops = xla_op_times(next(Path(trace_dir).rglob("*.xplane.pb")))
    for i in range(streams):
        engine.abort_request(f"profile-{i}")
    return {"streams": streams, "steps": steps, "step_ms": 1e3 * wall / steps,
            "compiled_step_ms": 1e3 * execute_time[0] / steps,
            "host_ms": 1e3 * (wall - execute_time[0]) / steps,
            "xla_thread_ms_per_step": {k: v / steps for k, v in ops.most_common()}}


def xla_op_times(xplane: Path) -> collections.Counter:
    """Milliseconds of thread time per XLA operation kind (numbered suffixes dropped) on the CPU worker threads."""
    data = jax.profiler.ProfileData.from_file(str(xplane))
    totals = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "Eigen" not in line.name:  # XLA:CPU's intra-op thread pool
                continue
            for event in line.events:
                if event.name.startswith("ThunkExecutor") or "Await" in event.name:
                    continue  # the executor's own spans contain the operations
                totals[re.sub(r"[.\d]+$", "", event.name)] += event.duration_ns / 1e6
    return totals


def print_profile(p: dict) -> None:
    print(f"profile of {p['steps']} decode steps at {p['streams']} streams: {p['step_ms']:.1f} ms per step, of "
          f"which the compiled step {p['compiled_step_ms']:.1f} ms and host work {p['host_ms']:.1f} ms")
    ops = p["xla_thread_ms_per_step"]
    total = sum(ops.values())
    print(f"XLA operations, thread ms per step (the worker threads overlap; total {total:.1f}):")
    for name, ms in list(ops.items())[:10]:
        print(f"  {name:40s} {ms:7.1f}  {100 * ms / total:5.1f} %")


if __name__ == "__main__":
    main()
