"""Speculative decoding's gain: tokens/s of 1, 4 and 16 greedy streams on SmolLM2-135M-Instruct with n-gram
speculation (prompt lookup), suffix decoding and, asked for, a draft model (SmolLM2 drafting for itself: no smaller
model of its tokenizer is here, so every draft is accepted and the row shows the mechanism's cost at full
acceptance) against the same engine options without it (async scheduling on, but with the draft model), on an
input-grounded workload (the model asked to repeat a given text, whose output repeats its input) and on a plain
chat question; the engines interleaved round by round in one process, so the ratios are side by
side. Each stream is a request of the workload's prompt (one id each). Also: accepted draft tokens per
verification, output tokens per step, and whether every engine gave the same tokens (they must: greedy).

    python benchmarks/spec_decode.py [--rounds 3] [--tokens 96] [--k 4] [--streams 1 4 16]
        [--methods ngram suffix draft_model] [--json benchmarks/results/spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxpage.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from jaxpage.models.loader import default_model_path  # noqa: E402
from jaxpage.sampling_params import SamplingParams  # noqa: E402

TEXT = ("The pool is one array allocated at start-up. Sequences own blocks of it through block tables, and the "
        "scheduler hands out blocks as sequences grow, takes them back when they finish, and shares the blocks of "
        "a common prompt prefix between requests by reference count. A block that a sequence writes into while "
        "another holds it is copied first.")
WORKLOADS = {"repeat the input": f"Repeat the following text exactly, word for word:\n\n{TEXT}",
             "plain chat": "Give me three tips for a good night's sleep."}


def run_one(engine: LLMEngine, prompt: list[int], tokens: int, streams: int = 1) -> dict:
    """``streams`` requests of one prompt at once: their tokens, output tokens/s from admission to the last
    token, and the engine steps they took."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="final_only")
    started, steps, outs = time.perf_counter(), 0, {}
    for i in range(streams):
        engine.add_request(f"s{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        steps += 1
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - started
    ids = [o.outputs[0].token_ids for _, o in sorted(outs.items())]
    return {"token_ids": ids, "tokens_per_s": sum(map(len, ids)) / seconds, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"], choices=["ngram", "suffix", "draft_model"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    options = dict(max_num_seqs=max(16, max(args.streams)), max_num_batched_tokens=128, max_model_len=1024,
                   dtype="float32", kv_cache_memory=256 << 20, progress=False)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2},
             "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
             "draft_model": {"method": "draft_model", "model": str(default_model_path()),
                             "num_speculative_tokens": args.k}}
    started = time.perf_counter()
    engines = {"no speculation": LLMEngine.from_args(EngineArgs(**options))}
    for method in args.methods:
        engines[method] = LLMEngine.from_args(EngineArgs(**options, speculative_config=specs[method]))
    warm_up_s = time.perf_counter() - started
    plain = engines["no speculation"]
    prompts = {name: plain.tokenize(plain.apply_chat_template([{"role": "user", "content": text}]))
               for name, text in WORKLOADS.items()}
    for engine in engines.values():  # untimed: the first run of each bucket
        run_one(engine, prompts["plain chat"], 8)
    cases = [(w, n) for w in WORKLOADS for n in args.streams]
    runs = {c: {e: [] for e in engines} for c in cases}
    same = {f"{w}, {n}": True for w, n in cases}
    load = []
    for _ in range(args.rounds):
        for workload, n in cases:
            got = {name: run_one(engine, prompts[workload], args.tokens, n) for name, engine in engines.items()}
            for name, r in got.items():
                same[f"{workload}, {n}"] &= r["token_ids"] == got["no speculation"]["token_ids"]
                runs[workload, n][name].append(r)
        load.append(os.getloadavg()[0])
    median = statistics.median
    result = {"new_tokens": args.tokens, "speculative_configs": {m: specs[m] for m in args.methods},
              "rounds": args.rounds, "warm_up_s": warm_up_s, "machine": platform.machine(), "load_1min": load,
              "same_tokens": same, "cases": []}
    for (workload, n), by in runs.items():
        tps = {e: median(r["tokens_per_s"] for r in rs) for e, rs in by.items()}
        per_step = {e: median(sum(map(len, r["token_ids"])) / r["steps"] / n for r in rs) for e, rs in by.items()}
        result["cases"].append({"workload": workload, "streams": n, "tokens_per_s": tps,
                                "tokens_per_step_per_stream": per_step,
                                "speedup": {m: tps[m] / tps["no speculation"] for m in args.methods}})
        print(f"{workload:>16} x{n:<2}: {tps['no speculation']:6.1f} tokens/s; " + ", ".join(
            f"{m} {tps[m]:6.1f} ({tps[m] / tps['no speculation']:.2f}x, {per_step[m]:.2f} a step)"
            for m in args.methods) + f"; same tokens: {same[f'{workload}, {n}']}")
    for method in args.methods:
        stats = engines[method].stats()
        drafts, drafted = max(stats["spec_decode_num_drafts"], 1), max(stats["spec_decode_num_draft_tokens"], 1)
        result[method] = {"accepted_per_draft": stats["spec_decode_num_accepted_tokens"] / drafts,
                          "acceptance_rate": stats["spec_decode_num_accepted_tokens"] / drafted,
                          "accepted_per_pos": stats["spec_decode_num_accepted_tokens_per_pos"]}
        print(f"{method}: accepted per draft {result[method]['accepted_per_draft']:.2f}, "
              f"acceptance {result[method]['acceptance_rate']:.2f}")
    print(f"load {load}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
