"""The engine's host time per step: LLMEngine.step over a runner that does no device work, at N decoding sequences.

    python -m benchmarks.engine_host [--seqs 256] [--steps 300] [--build-batch] [--json F]
    python -m benchmarks.engine_host --compare /path/to/tree_a /path/to/tree_b --rounds 12 [--json F]
    jaxpage bench engine-host [...]                                   # the same, from the CLI

What the engine core costs the host each step (scheduling, the async loop's bookkeeping, taking the tokens, the
outputs), without a model: ``--seqs`` requests of 16 prompt tokens and 600 output tokens (greedy, ignoring EOS)
are admitted, 20 steps run, then the median wall time of ``--steps`` steps, with async scheduling and without.
The runner returns fixed tokens; with ``--build-batch`` it first builds each step's batch on the host
(jaxpage/worker/input_batch.py's build_batch over its persistent InputBatch, as ModelRunner.launch does). With
``--compare`` each tree runs in a process of its own (its checkout first on sys.path), the order flipped every
round; the table gives each tree's median and the median of the paired ratios (B / A).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(seqs: int, steps: int, async_scheduling: bool, build_batch: bool = False) -> float:
    """Median seconds of LLMEngine.step at ``seqs`` decoding sequences over a runner doing nothing (but build
    each step's batch, with ``build_batch``)."""
    import numpy as np
    import transformers

    from jaxpage.engine.config_builder import build_engine_config
    from jaxpage.engine.llm_engine import LLMEngine
    from jaxpage.models import config_from_hf
    from jaxpage.sampling_params import MAX_LOGPROBS, SamplingParams
    from jaxpage.worker.model_runner import LaunchedStep
    from jaxpage.worker.input_batch import InputBatch
    from jaxpage.worker.input_batch import build_batch as build
    from jaxpage.worker.sampler import SamplerOutput

    class NullRunner:  # jaxpage.worker.runner.Runner, with fixed tokens and no device
        tiers = disk_store = disk_tier = None  # disk_tier: the name before 2026-12-07, for --compare with older trees

        def __init__(self, config):
            # getattr: EngineConfig was flat before 2026-12-07 (--compare with older trees)
            self.config, self.supports_async_scheduling = config, getattr(config, "scheduler", config).async_scheduling
            self.input_batch = InputBatch(config) if build_batch else None

        def warm_up(self, progress=True): ...
        def apply(self, ops): return []
        def load_lora(self, request): ...
        def remove_lora(self, lora_int_id): ...

        def execute(self, scheduled, bitmask=None):
            if self.input_batch is not None:
                build(self.config, scheduled, (0,), self.input_batch, bitmask)
            rows = len(scheduled)
            top = np.zeros((rows, MAX_LOGPROBS), np.int64)
            return SamplerOutput(np.full(rows, 7), np.full(rows, -1.0), top, top.astype(np.float64))

        def launch(self, scheduled, bitmask=None, previous=None):
            return LaunchedStep(scheduled, self.execute(scheduled))

        def fetch(self, launched):
            return launched.out

    model = config_from_hf(transformers.LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024))
    config = build_engine_config(model, dtype="float32", block_size=16, kv_cache_memory=None,
                                 num_kv_blocks=seqs * 40 + 1, max_num_seqs=seqs, max_num_batched_tokens=8 * seqs,
                                 max_model_len=1024, gpu_memory_utilization=0.9, async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullRunner(config), eos_token_ids=(0,))
    for i in range(seqs):
        engine.add_request(str(i), {"prompt_token_ids": list(range(1, 17))},
                           SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_tree(tree: str, seqs: int, steps: int, async_scheduling: bool, build_batch: bool = False) -> float:
    """``measure`` in a process of its own with ``tree`` first on sys.path."""
    code = (f"import sys, importlib.util; sys.path.insert(0, {os.path.abspath(tree)!r}); "
            f"spec = importlib.util.spec_from_file_location('engine_host', {os.path.abspath(__file__)!r}); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            f"print(module.measure({seqs}, {steps}, {async_scheduling}, {build_batch}))")  # this file, the tree's jaxpage
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256, help="decoding sequences")
    parser.add_argument("--steps", type=int, default=300, help="timed steps (after 20 untimed)")
    parser.add_argument("--compare", nargs=2, metavar=("TREE_A", "TREE_B"), help="two checkouts, paired")
    parser.add_argument("--rounds", type=int, default=6, help="--compare: rounds per mode")
    parser.add_argument("--build-batch", action="store_true", help="the runner builds each step's host batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = {"seqs": args.seqs, "steps": args.steps, "build_batch": args.build_batch,
              "load_average": os.getloadavg()[0], "modes": {}}
    for mode, on in (("async", True), ("sync", False)):
        if not args.compare:
            result["modes"][mode] = {"median_us": measure(args.seqs, args.steps, on, args.build_batch) * 1e6}
            continue
        a, b = [], []
        for r in range(args.rounds):
            trees = args.compare if r % 2 == 0 else args.compare[::-1]
            got = {t: run_tree(t, args.seqs, args.steps, on, args.build_batch) for t in trees}
            a.append(got[args.compare[0]])
            b.append(got[args.compare[1]])
        result["modes"][mode] = {"a_us": [x * 1e6 for x in a], "b_us": [x * 1e6 for x in b],
                                 "paired_ratio_b_over_a": statistics.median(y / x for x, y in zip(a, b))}
    result["load_average_end"] = os.getloadavg()[0]
    print("| mode | " + ("median us |" if not args.compare else "A us | B us | B / A (paired median) |"))
    for mode, r in result["modes"].items():
        print(f"| {mode} | {r['median_us']:.0f} |" if not args.compare else
              f"| {mode} | {statistics.median(r['a_us']):.0f} | {statistics.median(r['b_us']):.0f} | "
              f"{r['paired_ratio_b_over_a']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
