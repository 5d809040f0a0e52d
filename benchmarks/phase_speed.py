"""SmolLM2 (float32, or --dtype) on whatever jaxpage is importable, by phase: output tokens/s at 1, 8 and 32
streams (64-token prompts, greedy; the prompts' prefill counts in the time, which weighs most at 32) and the
seconds of one 1,024-token prompt's prefill (one output token). To compare two trees,
run it under each one's PYTHONPATH, alternating, on the same machine load:

    PYTHONPATH=/path/to/tree python benchmarks/phase_speed.py [--rounds 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PHASES = (("decode1", 1, 64, 48), ("decode8", 8, 64, 48), ("decode32", 32, 64, 32), ("prefill1024", 1, 1024, 1))  # name, streams, prompt, new


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--phases", nargs="+", default=[name for name, *_ in PHASES], choices=[n for n, *_ in PHASES])
    args = parser.parse_args(argv)
    from jaxpage import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=2048, dtype=args.dtype,
              kv_cache_memory=1 << 30, progress=False)
    row = {"dtype": args.dtype, "start_s": round(time.perf_counter() - start, 1), "load_average": list(os.getloadavg())}
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        for name, streams, prompt_len, new in (phase for phase in PHASES if phase[0] in args.phases):
            prompts = [{"prompt_token_ids": rng.integers(100, 40000, prompt_len).tolist()} for _ in range(streams)]
            params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - t
            row.setdefault(name, []).append(round(streams * new / seconds, 2) if new > 1 else round(seconds, 2))
    row["load_average_end"] = list(os.getloadavg())
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
