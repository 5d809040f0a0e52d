"""Latency by phase: SmolLM2 (float32, or --dtype) output tokens/s at 1, 8 and 32 streams and one long prefill.

    python -m benchmarks.latency [--rounds 2] [--phases decode1 decode8] [--json F] [--plot F.png]
    jaxpage bench latency [...]                                          # the same, from the CLI

Output tokens/s at 1, 8 and 32 streams (64-token prompts, greedy; the prompts' prefill counts in the time, which
weighs most at 32) and the seconds of one 1,024-token prompt's prefill (one output token), on whatever jaxpage is
importable. To compare two trees, run it under each one's PYTHONPATH, alternating, on the same machine load:

    PYTHONPATH=/path/to/tree python -m benchmarks.latency [--rounds 2] [--json F]

This machine's speed drifts by up to 2x within minutes, so separate runs of two trees compare badly; --compare
keeps one engine of each tree running (this file run with each tree first on PYTHONPATH, --serve) and runs every
phase on both, round by round, the order flipped every round; it reports each tree's median and the median of
the paired ratios (B / A):

    python -m benchmarks.latency --compare /path/to/tree_a /path/to/tree_b --rounds 6 --phases decode1 decode8
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
    """``script --serve *args`` with ``tree`` first on PYTHONPATH, once it has printed "ready". -P: the script's
    folder is not put on sys.path, where benchmarks/kernels.py would shadow the ``kernels`` package that
    transformers imports."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
    worker = subprocess.Popen([sys.executable, "-P", os.path.abspath(script), "--serve", *args], env=env,
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


def unit(name: str) -> str:
    return "s" if name.startswith("prefill") else "tok/s"


def print_table(row: dict, phases: list[str]) -> None:
    """One line a phase: every round's figure and the median (--compare: each tree's median and the paired ratio)."""
    if "trees" in row:
        a, b = row["trees"]
        print(f"\n| phase | unit | A: {a} | B: {b} | B / A (paired median) |\n| --- | --- | --- | --- | --- |")
        for name in phases:
            print(f"| {name} | {unit(name)} | {row['median'][a][name]:g} | {row['median'][b][name]:g} | "
                  f"{row['paired_ratio_b_over_a'][name]:g} |")
        return
    print("\n| phase | unit | rounds | median |\n| --- | --- | --- | --- |")
    for name in phases:
        print(f"| {name} | {unit(name)} | {', '.join(f'{x:g}' for x in row[name])} | "
              f"{statistics.median(row[name]):g} |")


def plot(row: dict, phases: list[str], path: str) -> None:
    """One panel a phase: the median (bars) and every round (dots), of each tree with --compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = row["trees"] if "trees" in row else [None]
    fig, axes = plt.subplots(1, len(phases), figsize=(2.6 * len(phases) + 1, 3.4), squeeze=False)
    for ax, name in zip(axes[0], phases):
        for i, tree in enumerate(trees):
            figures = row["figures"][tree][name] if tree else row[name]
            ax.bar(i, statistics.median(figures), color=f"C{i}", alpha=0.7)
            ax.plot([i] * len(figures), figures, "k.", markersize=4)
        ax.set_xticks(range(len(trees)), ["A", "B"] if len(trees) == 2 else [row["dtype"]])
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(unit(name) + (" (lower is better)" if unit(name) == "s" else ""))
    fig.suptitle("benchmarks/latency.py" + (f": A {trees[0]}, B {trees[1]}" if len(trees) == 2 else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="runs of every phase (default 2)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--plot", default=None, help="PNG: one panel a phase (needs matplotlib)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    parser.add_argument("--phases", nargs="+", default=[name for name, *_ in PHASES], choices=[n for n, *_ in PHASES],
                        metavar="PHASE", help=f"of {', '.join(n for n, *_ in PHASES)} (default: all)")
    parser.add_argument("--compare", nargs=2, metavar=("TREE_A", "TREE_B"),
                        help="two checkouts, one engine each, every phase on both a round (see below)")
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
    print_table(row, args.phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    if args.plot:
        from benchmarks.report import save_plot  # here: --compare's workers run this file under older trees

        save_plot(args.plot, lambda: plot(row, args.phases, args.plot))


if __name__ == "__main__":
    main()
