"""SmolLM2 (float32, or --dtype) on whatever jaxpage is importable, by phase: output tokens/s at 1, 8 and 32
streams (64-token prompts, greedy; the prompts' prefill counts in the time, which weighs most at 32) and the
seconds of one 1,024-token prompt's prefill (one output token). To compare two trees,
run it under each one's PYTHONPATH, alternating, on the same machine load:

    PYTHONPATH=/path/to/tree python benchmarks/phase_speed.py [--rounds 2] [--json F]

This machine's speed drifts by up to 2x within minutes, so separate runs of two trees compare badly; --compare
keeps one engine of each tree running (this file run with each tree first on PYTHONPATH, --serve) and runs every
phase on both, round by round, the order flipped every round; it reports each tree's median and the median of
the paired ratios (B / A):

    python benchmarks/phase_speed.py --compare /path/to/tree_a /path/to/tree_b --rounds 6 --phases decode1 decode8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

PHASES = (("decode1", 1, 64, 48), ("decode8", 8, 64, 48), ("decode32", 32, 64, 32), ("prefill1024", 1, 1024, 1))  # name, streams, prompt, new


def make_llm(dtype: str):
    from jaxpage import LLM

    return LLM(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=2048, dtype=dtype,
               kv_cache_memory=1 << 30, progress=False)


def run_phase(llm, name: str, rng) -> float:
    """One phase: output tokens/s, or the prefill's seconds."""
    from jaxpage import SamplingParams

    streams, prompt_len, new = next(phase[1:] for phase in PHASES if phase[0] == name)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, prompt_len).tolist()} for _ in range(streams)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - t
    return round(streams * new / seconds, 2) if new > 1 else round(seconds, 2)


def serve(dtype: str) -> None:
    """--serve: a phase name a line on stdin, its figure a line on stdout."""
    llm, rng = make_llm(dtype), np.random.default_rng(0)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(run_phase(llm, line.strip(), rng)), flush=True)


def start_worker(script: str, tree: str, *args: str) -> subprocess.Popen:
    """``script --serve *args`` with ``tree`` first on PYTHONPATH, once it has printed "ready"."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
    worker = subprocess.Popen([sys.executable, os.path.abspath(script), "--serve", *args], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while worker.stdout.readline().strip() != "ready":
        assert worker.poll() is None, f"the worker of {tree} exited"
    return worker


def compare(trees: list[str], phases: list[str], rounds: int, dtype: str) -> dict:
    workers = [start_worker(__file__, tree, "--dtype", dtype) for tree in trees]
    figures = {tree: {name: [] for name in phases} for tree in trees}
    for r in range(rounds):
        for name in phases:
            for tree, worker in (list(zip(trees, workers)) if r % 2 == 0 else list(zip(trees, workers))[::-1]):
                worker.stdin.write(name + "\n")
                worker.stdin.flush()
                figures[tree][name].append(json.loads(worker.stdout.readline()))
    for worker in workers:
        worker.stdin.close()
        worker.wait()
    a, b = (figures[tree] for tree in trees)
    return {"trees": trees, "figures": figures, "median": {t: {n: statistics.median(v) for n, v in figures[t].items()}
                                                           for t in trees},
            "paired_ratio_b_over_a": {n: round(statistics.median(y / x for x, y in zip(a[n], b[n])), 3)
                                      for n in phases}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--phases", nargs="+", default=[name for name, *_ in PHASES], choices=[n for n, *_ in PHASES])
    parser.add_argument("--compare", nargs=2, metavar=("TREE_A", "TREE_B"))
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.dtype)
    row = {"dtype": args.dtype, "load_average": list(os.getloadavg())}
    if args.compare:
        row.update(compare(args.compare, args.phases, args.rounds, args.dtype))
    else:
        start = time.perf_counter()
        llm, rng = make_llm(args.dtype), np.random.default_rng(0)
        row["start_s"] = round(time.perf_counter() - start, 1)
        for _ in range(args.rounds):
            for name in args.phases:
                row.setdefault(name, []).append(run_phase(llm, name, rng))
    row["load_average_end"] = list(os.getloadavg())
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
