"""A wave of prompts over a cached prefix, as the shared_prefix workload sends them, and the decode steps after it.

    PYTHONPATH=<tree> JAX_PLATFORMS=cpu python benchmarks/prefix_wave.py [--prefix 256] [--new 64] [--prompts 32]
        [--waves 3] [--json out.json]

SmolLM2-135M with serve's defaults (bfloat16 on an avx512_bf16 CPU, 2048 batched tokens) and prefix caching on.
One request computes the shared prefix (--prefix random token ids); then --waves times, --prompts requests of the
prefix and --new fresh ids each are generated together, one token each: the wall time of the wave (its prompt
tokens are ~one step of --prompts x --new tokens, whose attention reads the cached prefix). Then twice the same
with 25 tokens each: (25-token wave - 1-token wave) / 24 is the decode step at ~prefix + new tokens of context.
Compare two trees by running it under each one's PYTHONPATH, alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from jaxpage import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    llm = LLM(max_num_batched_tokens=2048, progress=False, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 40000, args.prefix).tolist()

    def wave(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": prefix + rng.integers(100, 40000, args.new).tolist()}
                   for _ in range(args.prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return (time.perf_counter() - start) * 1e3

    llm.generate([{"prompt_token_ids": prefix}], SamplingParams(temperature=0.0, max_tokens=1))
    wave(1), wave(25)  # compiles every bucket the waves use
    one = [wave(1) for _ in range(args.waves)]
    long = [wave(25) for _ in range(2)]
    result = {"args": vars(args), "load_1min": os.getloadavg()[0], "wave_ms": [round(x, 1) for x in one],
              "wave_ms_median": round(statistics.median(one), 1),
              "decode_step_ms": round((statistics.median(long) - statistics.median(one)) / 24, 2)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
