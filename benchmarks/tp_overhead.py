"""What tensor parallelism adds to an engine step on forced CPU devices, in one run: the same decode workload
on the real model (SmolLM2-135M, 9 heads, 3 KV heads) at tensor_parallel_size=1 and 3, rounds alternating.

    python benchmarks/tp_overhead.py [--tp 3] [--streams 8] [--max-tokens 32] [--rounds 3] [--json out.json]

The forced devices share this machine's cores, so the ratio is the cost of the partitioned program (the
shard_map'd attention, the all-reduces GSPMD inserts, the smaller matmuls) and not a speed-up. Also prints the
collectives of the compiled TP step (from its HLO): what a TPU/GPU would move between chips per step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpage import LLM, SamplingParams  # noqa: E402

OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, dtype="float32",
               kv_cache_memory=128 << 20, progress=False)
PROMPT = "Write a short story about a lighthouse keeper."


def decode_step_seconds(llm: LLM, streams: int, max_tokens: int) -> list[float]:
    """Wall time of each engine step in which every stream got a token (decode steps; prefill steps left out)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", PROMPT, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == streams:
            times.append(time.perf_counter() - start)
    return times


def collectives(llm: LLM) -> list[str]:
    """The cross-device collectives of the compiled step's HLO (op and result shape), one per line."""
    compiled = llm.engine.runner.executable(llm.engine.config.token_buckets()[0])
    ops = re.findall(r"= (\S+\[[^\]]*\][^ ]*) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                     r"(?:-start)?\(", compiled.as_text())
    return sorted({f"{op} {shape}" for shape, op in ops})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    engines = {tp: LLM(tensor_parallel_size=tp, **OPTIONS) for tp in (1, args.tp)}
    steps: dict[int, list[float]] = {tp: [] for tp in engines}
    for _ in range(args.rounds):
        for tp, llm in engines.items():
            steps[tp] += decode_step_seconds(llm, args.streams, args.max_tokens)
    median = {tp: statistics.median(t) for tp, t in steps.items()}
    for tp in engines:
        print(f"TP={tp}: median decode step {median[tp] * 1e3:.1f} ms over {len(steps[tp])} steps "
              f"({args.streams} streams)")
    print(f"ratio TP={args.tp} / TP=1: {median[args.tp] / median[1]:.2f}")
    print("collectives of the TP step:", *collectives(engines[args.tp]), sep="\n  ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_step_s": median, "ratio": median[args.tp] / median[1],
                       "collectives": collectives(engines[args.tp]), "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
