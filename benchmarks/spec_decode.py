"""Speculative decoding on plain chat: output tokens/s and acceptance of 1, 4 and 16 greedy streams of
SmolLM2-135M-Instruct with an EAGLE-3 head (trained by jaxpage.spec_decode.eagle3_trainer), n-gram prompt lookup
and a draft model (SmolLM2 drafting for itself: no smaller model of its tokenizer is here, so every draft is
accepted and the row is the mechanism's cost at full acceptance), against the same engine without speculation.
The questions are the held-out split of jaxpage.spec_decode.chat_prompts (topics and forms the head never saw;
none asks to repeat a text), one per stream. The engines run in one process, round by round and case by case
(paired), so the ratios are side by side; every engine must give the tokens of the engine without speculation.

    python -m benchmarks.spec_decode --head DIR [--rounds 3] [--tokens 96] [--k 3] [--streams 1 4 16]
        [--methods eagle3 ngram draft_model] [--json benchmarks/results/spec_decode_eagle3.json]

Acceptance length: output tokens per step of a stream (1 + accepted drafts a step, as EAGLE papers count it).
``--time-calls --methods eagle3``: instead, where one stream's steps go (the head's passes and the target's steps
timed around the runners' methods; medians in ms) and a plain decode step's time."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from jaxpage.engine.llm_engine import EngineArgs, LLMEngine
from jaxpage.models.loader import default_model_path
from jaxpage.sampling_params import SamplingParams
from jaxpage.spec_decode.chat_prompts import chat_prompts


def run_case(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> dict:
    """One request per prompt at once: their tokens, output tokens/s from admission to the last token, steps."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="final_only")
    started, steps, outs = time.perf_counter(), 0, {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{time.monotonic_ns()}-{i:03d}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        steps += 1
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - started
    ids = [o.outputs[0].token_ids for _, o in sorted(outs.items())]
    return {"token_ids": ids, "tokens_per_s": sum(map(len, ids)) / seconds, "steps": steps}


def time_calls(engine: LLMEngine, prompt: list[int], tokens: int) -> dict:
    """One greedy stream on an engine with a head: the median ms of the head's first pass, of each further pass
    and of the target's step, and how many of each."""
    drafter, runner, seen = engine.drafter, engine.runner, {"head first pass": [], "head next pass": [],
                                                            "target step": []}

    def timed(name, fn):
        def call(*args):
            started = time.perf_counter()
            out = fn(*args)
            seen[name(*args)].append(time.perf_counter() - started)
            return out
        return call
    drafter._step = timed(lambda rows, hidden, first: f"head {'first' if first else 'next'} pass", drafter._step)
    runner.execute = timed(lambda *_: "target step", runner.execute)
    try:
        run_case(engine, [prompt], tokens)
    finally:
        del drafter._step, runner.execute
    return {k: {"calls": len(v), "median_ms": 1000 * statistics.median(v)} for k, v in seen.items() if v}


def spec_configs(args) -> dict:
    return {"eagle3": {"method": "eagle3", "model": str(args.head), "num_speculative_tokens": args.k},
            "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                      "prompt_lookup_min": 2},
            "draft_model": {"method": "draft_model", "model": str(default_model_path()),
                            "num_speculative_tokens": args.k}}


def summary(runs: dict, streams: int, methods: list[str]) -> dict:
    median = statistics.median
    tps = {e: median(r["tokens_per_s"] for r in rs) for e, rs in runs.items()}
    length = {e: median(sum(map(len, r["token_ids"])) / r["steps"] / streams for r in rs) for e, rs in runs.items()}
    return {"streams": streams, "tokens_per_s": tps, "acceptance_length": length,
            "speedup": {m: tps[m] / tps["none"] for m in methods},
            "speedup_per_round": {m: [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[m], runs["none"])]
                                  for m in methods}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", type=Path, help="the EAGLE-3 head's directory (method eagle3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--methods", nargs="+", default=["eagle3", "ngram", "draft_model"],
                        choices=["eagle3", "ngram", "draft_model"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--time-calls", action="store_true")
    args = parser.parse_args()
    options = dict(max_num_seqs=max(16, max(args.streams)), max_num_batched_tokens=256, max_model_len=1024,
                   kv_cache_memory=512 << 20, progress=False)
    specs = spec_configs(args)
    engines = {"none": LLMEngine.from_args(EngineArgs(**options))}
    for method in args.methods:
        engines[method] = LLMEngine.from_args(EngineArgs(**options, speculative_config=specs[method]))
    plain = engines["none"]
    questions = chat_prompts("held_out", max(args.streams), seed=1)
    template = plain.tokenizer.apply_chat_template
    prompts = [plain.tokenize(template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
               for q in questions]
    if args.time_calls:
        run_case(engines["eagle3"], prompts[:1], 8)
        timings = time_calls(engines["eagle3"], prompts[0], args.tokens)
        plain_tps = run_case(plain, prompts[:1], args.tokens)["tokens_per_s"]
        print(json.dumps({"head": timings, "plain_decode_ms": 1000 / plain_tps, "load_1min": os.getloadavg()[0]}))
        return
    for engine in engines.values():  # untimed: each engine's first steps
        run_case(engine, prompts[:2], 8)
    runs = {n: {e: [] for e in engines} for n in args.streams}
    same, load = {n: True for n in args.streams}, []
    for _ in range(args.rounds):
        for n in args.streams:
            got = {name: run_case(engine, prompts[:n], args.tokens) for name, engine in engines.items()}
            for name, r in got.items():
                same[n] &= r["token_ids"] == got["none"]["token_ids"]
                runs[n][name].append(r)
        load.append(os.getloadavg()[0])
    result = {"new_tokens": args.tokens, "k": args.k, "dtype": plain.config.dtype, "rounds": args.rounds,
              "speculative_configs": {m: specs[m] for m in args.methods}, "machine": platform.processor() or
              platform.machine(), "load_1min": load, "same_tokens": same,
              "cases": [summary(runs[n], n, args.methods) for n in args.streams]}
    for case in result["cases"]:
        tps, length = case["tokens_per_s"], case["acceptance_length"]
        print(f"x{case['streams']:<2}: none {tps['none']:6.1f} tok/s; " + ", ".join(
            f"{m} {tps[m]:6.1f} ({case['speedup'][m]:.2f}x, length {length[m]:.2f})" for m in args.methods)
              + f"; same tokens: {same[case['streams']]}")
    for method in args.methods:
        s = engines[method].stats()
        result[method] = {k: s[k] for k in s if k.startswith("spec_decode_")}
    print(f"load {load}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
