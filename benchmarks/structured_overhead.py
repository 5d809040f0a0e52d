"""What structured outputs cost per engine step: N streams constrained by a JSON schema against N unconstrained
streams, on the real model, in one run (rounds alternate, so both see the same machine load).

    python benchmarks/structured_overhead.py [--streams 32] [--max-tokens 48] [--rounds 3] [--json out.json]

Every stream of a round starts together and runs max_tokens tokens (unconstrained: ignore_eos; constrained: a
schema whose shortest valid output is longer than max_tokens), so the decode steps compared have all N rows.
Each step is split into: the grammar work on the host (matchers advanced, bitmask filled: StructuredOutputManager
.bitmask), the runner (batch building, transfer, the jitted step, results back) and the rest of the engine's host
work (scheduling, detokenization, outputs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

from jaxpage import LLM, SamplingParams, StructuredOutputsParams

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16}}}
SCHEMA = {"type": "array", "minItems": 8, "items": ITEM}  # the shortest valid output is ~100 tokens
PROMPT = "A list of people, as JSON:"


class StepTimer:
    """Wraps the engine's step, its runner's execute and its grammar work with wall-clock timers: one dict per
    step of seconds by part, and the rows the step ran."""

    def __init__(self, engine):
        self.rows: list[dict] = []
        self._engine, self._current = engine, {}
        engine.step = self._timed(engine.step, "step")
        engine.runner.execute = self._timed(engine.runner.execute, "runner")

    def _timed(self, inner, label: str):
        def timed(*args, **kw):
            if label == "step":
                self._current = {}
                self.rows.append(self._current)
            elif label == "runner":
                self._current["rows"] = len(args[0])
            started = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self._current[label] = self._current.get(label, 0.0) + time.perf_counter() - started
        return timed

    def wrap_grammar(self) -> None:
        structured = self._engine.structured
        structured.bitmask = self._timed(structured.bitmask, "grammar")


def run_round(llm: LLM, timer: StepTimer, streams: int, max_tokens: int, constrained: bool) -> list[dict]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=not constrained,
                             structured_outputs=so) for i in range(streams)]
    start = len(timer.rows)
    outs = llm.generate([PROMPT] * streams, params)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "a stream ended early"
    return [r for r in timer.rows[start:] if r.get("rows") == streams]  # the decode steps with every stream


def summarize(steps: list[dict]) -> dict:
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    step, runner, grammar = med("step"), med("runner"), med("grammar")
    return {"steps": len(steps), "step_s": step, "runner_s": runner, "grammar_s": grammar,
            "other_host_s": step - runner - grammar}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=args.streams, max_num_batched_tokens=max(64, args.streams), max_model_len=512,
              dtype="float32", kv_cache_memory=256 << 20, progress=False)
    timer = StepTimer(llm.engine)
    run_round(llm, timer, 2, 4, True)  # warm: the grammar compiled and cached, the manager made
    timer.wrap_grammar()
    results = {"plain": [], "constrained": []}
    for _ in range(args.rounds):
        for kind in ("plain", "constrained"):
            results[kind] += run_round(llm, timer, args.streams, args.max_tokens, kind == "constrained")
    summary = {kind: summarize(steps) for kind, steps in results.items()}
    summary["ratio"] = summary["constrained"]["step_s"] / summary["plain"]["step_s"]
    report = {"args": vars(args), "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
              "date": datetime.date.today().isoformat(), "summary": summary}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report | {"steps": results}, f, indent=1)


if __name__ == "__main__":
    main()
