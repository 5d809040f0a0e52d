"""Speculative decoding's gain: tokens/s of one greedy stream on SmolLM2-135M-Instruct with n-gram speculation
(prompt lookup) and with a draft model (SmolLM2 drafting for itself: no smaller model of its tokenizer is here,
so every draft is accepted and the row shows the mechanism's cost at full acceptance) against the same engine
options without speculation, on an input-grounded workload (the model asked to repeat a given text, whose output
repeats its input) and on a plain chat question; the runs interleaved round by round in one process, so the
ratios are side by side. Also: accepted draft tokens per verification and output tokens per step, and whether
every engine gave the same tokens (they must: greedy).

    python benchmarks/spec_decode.py [--rounds 3] [--tokens 96] [--k 4] [--methods ngram draft_model]
        [--json benchmarks/results/spec_decode.json]
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


def run_one(engine: LLMEngine, prompt: list[int], tokens: int) -> dict:
    """One request alone: its tokens, tokens/s from admission to its last token, and the engine steps it took."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="final_only")
    started, steps, out = time.perf_counter(), 0, None
    engine.add_request(f"s{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        steps += 1
        out = next((o for o in engine.step() if o.finished), out)
    seconds = time.perf_counter() - started
    ids = out.outputs[0].token_ids
    return {"token_ids": ids, "tokens_per_s": len(ids) / seconds, "steps": steps}


def acceptance(stats: dict) -> dict:
    """A speculating engine's accepted tokens per verification, acceptance rate and acceptances by position."""
    drafts, drafted = max(stats["spec_decode_num_drafts"], 1), max(stats["spec_decode_num_draft_tokens"], 1)
    return {"accepted_per_draft": stats["spec_decode_num_accepted_tokens"] / drafts,
            "acceptance_rate": stats["spec_decode_num_accepted_tokens"] / drafted,
            "accepted_per_pos": stats["spec_decode_num_accepted_tokens_per_pos"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    options = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, dtype="float32",
                   kv_cache_memory=256 << 20, progress=False)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2},
             "draft_model": {"method": "draft_model", "model": str(default_model_path()),
                             "num_speculative_tokens": args.k}}
    specs = {m: specs[m] for m in args.methods}
    started = time.perf_counter()
    engines = {"no speculation": LLMEngine.from_args(EngineArgs(**options))}
    engines.update({m: LLMEngine.from_args(EngineArgs(**options, speculative_config=spec))
                    for m, spec in specs.items()})
    warm_up_s = time.perf_counter() - started
    plain = engines["no speculation"]
    prompts = {name: plain.tokenize(plain.apply_chat_template([{"role": "user", "content": text}]))
               for name, text in WORKLOADS.items()}
    for engine in engines.values():  # untimed: the first run of each bucket
        run_one(engine, prompts["plain chat"], 8)
    runs = {w: {e: [] for e in engines} for w in WORKLOADS}
    same = {w: {m: True for m in specs} for w in WORKLOADS}
    load = []
    for _ in range(args.rounds):
        for workload, prompt in prompts.items():
            got = {name: run_one(engine, prompt, args.tokens) for name, engine in engines.items()}
            for m in specs:
                same[workload][m] &= got[m]["token_ids"] == got["no speculation"]["token_ids"]
            for name, r in got.items():
                runs[workload][name].append(r)
        load.append(os.getloadavg()[0])
    result = {"streams": 1, "new_tokens": args.tokens, "speculative_configs": specs, "rounds": args.rounds,
              "warm_up_s": warm_up_s, "machine": platform.machine(), "load_1min": load, "same_tokens": same,
              "tokens_per_s": {w: {e: statistics.median(r["tokens_per_s"] for r in rs) for e, rs in by.items()}
                               for w, by in runs.items()},
              "tokens_per_step": {w: {e: statistics.median(len(r["token_ids"]) / r["steps"] for r in rs)
                                      for e, rs in by.items()} for w, by in runs.items()},
              "acceptance": {m: acceptance(engines[m].stats()) for m in specs}}
    for workload, by in result["tokens_per_s"].items():
        for m in specs:
            ratio = by[m] / by["no speculation"]
            result.setdefault("speedup", {}).setdefault(workload, {})[m] = ratio
            print(f"{workload:>16} {m:>11}: {by['no speculation']:6.1f} -> {by[m]:6.1f} tokens/s ({ratio:.2f}x), "
                  f"{result['tokens_per_step'][workload][m]:.2f} tokens a step, same tokens: {same[workload][m]}")
    for m, a in result["acceptance"].items():
        print(f"{m}: accepted per draft {a['accepted_per_draft']:.2f}, acceptance {a['acceptance_rate']:.2f}")
    print(f"load {load}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
