"""Host work per engine step, without the model: scheduling, batch building and the update of 256 sequences.

Reports scheduling + batch building (the issue's measure) and, stricter, the whole host step: that plus the
token bookkeeping, detokenization and the streamed (delta) outputs of every request.

    python benchmarks/host_overhead.py [--seqs 256] [--steps 200] [--json out.json]

The stand-in runner (benchmarks/stand_in.py) builds the real flat batch (jaxpage.worker.input_batch.build_batch, over a persistent InputBatch as
ModelRunner keeps one) and returns a token per row, so everything the host does per step is timed, and nothing
of the device.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks.stand_in import StandInRunner, smollm2_shaped_config, start_decoding  # noqa: E402
from jaxpage.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the timed steps")
    args = parser.parse_args()
    config = smollm2_shaped_config(args.seqs)
    runner = StandInRunner(config, build_batches=True)
    engine = LLMEngine(config, runner)
    start_decoding(engine, args.seqs, 10_000)
    schedule, schedule_seconds = engine.scheduler.schedule, []

    def timed_schedule():
        t = time.perf_counter()
        try:
            return schedule()
        finally:
            schedule_seconds.append(time.perf_counter() - t)

    engine.scheduler.schedule = timed_schedule
    runner.build_seconds.clear()
    step_seconds = []
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - t)
    if profiler:
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    result = {"machine": platform.machine(), "running_seqs": engine.scheduler.num_running_seqs(),
              "step_ms_median": 1e3 * statistics.median(step_seconds),
              "build_batch_ms_median": 1e3 * statistics.median(runner.build_seconds)}
    per_step = [a + b for a, b in zip(schedule_seconds, runner.build_seconds)]
    result["schedule_ms_median"] = 1e3 * statistics.median(schedule_seconds[:args.steps])
    result["schedule_and_build_ms_median"] = 1e3 * statistics.median(per_step[:args.steps])
    result["schedule_and_update_ms_median"] = result["step_ms_median"] - result["build_batch_ms_median"]
    print(f"{'running seqs':>14} {'schedule+batch ms':>18} {'schedule':>9} {'batch':>7} {'whole host step ms':>19}")
    print(f"{result['running_seqs']:>14} {result['schedule_and_build_ms_median']:>18.3f} "
          f"{result['schedule_ms_median']:>9.3f} {result['build_batch_ms_median']:>7.3f} "
          f"{result['step_ms_median']:>19.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
