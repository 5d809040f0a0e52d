"""Start-up and decode speed of the engine on one model: load (converted or cached), warm-up, tokens/s.

    python benchmarks/startup_and_decode.py [--model PATH] [--streams 1 8 32] [--json out.json]

Each stream decodes --max-tokens greedy tokens (ignore_eos) after a short prompt; all streams start together.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from jaxpage import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, progress=False,
              max_num_seqs=max(args.streams), max_num_batched_tokens=max(64, max(args.streams)))
    engine = llm.engine
    result = {"machine": platform.machine(), "dtype": engine.config.dtype, "start_s": time.perf_counter() - started,
              "load_s": engine.load_seconds, "warmup_s": engine.warmup_seconds, "decode": {}}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["Warm the caches"], SamplingParams(temperature=0, max_tokens=2))
    for n in args.streams:
        prompts = [f"Story {i}: once upon a time" for i in range(n)]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["decode"][n] = {"output_tokens_per_s": tokens / elapsed, "seconds": elapsed}
    print(f"load {result['load_s']:.1f} s, warm-up {result['warmup_s']:.1f} s, dtype {result['dtype']}")
    print(f"{'streams':>8} {'out tok/s':>10} {'s':>7}")
    for n, r in result["decode"].items():
        print(f"{n:>8} {r['output_tokens_per_s']:>10.1f} {r['seconds']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
