"""Where a served step's time goes on the CPU: the engine's own steps at C streams, traced thunk by thunk.

    JAX_PLATFORMS=cpu python -m benchmarks.profile [--concurrency 32] [--steps 24] [--mixed 6] [--wave 0]
        [--prefix 0] [--json out.json]
    jaxpage bench profile [...]                                        # the same, from the CLI
SmolLM2-135M with serve's defaults (bfloat16 on an avx512_bf16 CPU, async scheduling, 2048 batched tokens), C
requests of 64 random prompt tokens, greedy, every one running to its max_tokens. Once all of them decode, --steps
calls of ``LLMEngine.step`` run under ``jax.profiler.trace`` (decode steps: ~70-100 tokens of context). Then
--mixed times: one request is aborted and a new 64-token prompt added, and the step that computes it beside the
other C-1 decodes is traced (the spread workload's step, where a new prompt arrives beside running decodes).
--wave N: then N times, with nothing running, C new prompts arrive at once and the step that computes them all
(the fixed workload's wave, C x 64 rows; the first of the N+1 is not counted) is traced.
--prefix N: every prompt starts with the same N random tokens, computed once before the others arrive, with prefix
caching on (the shared_prefix workload's steps).

Per kind of step: the wall time of an engine step, and the XLA:CPU threads' thunks summed per step, in kinds read
from the compiled layer's and sampler's HLO (``kind_of``): thread-ms of work, the ms when
at least one thread ran a thunk ("busy", the union over threads) and when none did ("idle": the host between
launches, or the scheduler and detokenizer, on the step's critical path). OpenMP threads inside a custom call
(oneDNN, the packed products, the attention kernel) are not traced: their time is inside the call's thunk.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import tempfile
import time

import jax
import numpy as np

from jaxpage import LLM, SamplingParams

SERVE = {"max_num_batched_tokens": 2048, "progress": False, "enable_prefix_caching": False}
INSIDE_LOOP = "(inside the attention's loop, counted in it)"
BOOKKEEPING = ("ThreadpoolListener", "end:", "ThunkExecutor", "ThreadPool")
KINDS = (("jaxpage_onednn_matmul", "oneDNN matmul (FFI)"), ("jaxpage_write_kv", "K/V write (FFI)"),
         ("jaxpage_paged_attention", "paged attention (FFI)"),
         ("jaxpage_gather_rows", "page gather (FFI)"), ("ynn", "XLA dot (YNNPACK)"), (" dot(", "XLA dot (Eigen)"),
         (" while(", "attention: the while loop over page chunks (all of its body)"),
         ("scatter(", "XLA scatter"), ("gather(", "XLA gather"), ("sort(", "sort"))


def kind_of(name: str, hlo: str) -> str:
    """The kind of the thunk named ``name``: from its instruction's line in the HLO, and for a fusion, from the
    instructions of its fused computation."""
    line = re.search(rf"^\s*(ROOT )?%?{re.escape(name)} = .*$", hlo, re.MULTILINE)
    text = line.group(0) if line else name
    if "/while/body/" in text:
        return INSIDE_LOOP
    called = re.search(r"calls=(%?[\w.\-]+)", text)
    if called:
        body = re.search(rf"^%?{re.escape(called.group(1).lstrip('%'))} .*?^}}", hlo, re.MULTILINE | re.DOTALL)
        text += body.group(0) if body else ""
    for needle, kind in KINDS:
        if needle in text or needle in name:
            return kind
    return "other fusions (elementwise, norms, rope, softmax, reductions)"


def add_requests(llm: LLM, ids: range, rng, prompt_len: int, max_tokens: int, prefix: list[int] = ()) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in ids:  # token ids past the special ones, as vLLM's random dataset draws them
        prompt = {"prompt_token_ids": list(prefix) + rng.integers(100, 40000, prompt_len).tolist()}
        llm.engine.add_request(str(i), prompt, params)


def xla_cpu_thunk(plane: str, line: str, event: str) -> bool:
    return "XLA" in line and not event.startswith(BOOKKEEPING)


def traced_steps(engine, steps: int, before_each=None, keep=xla_cpu_thunk,
                 read: bool = False) -> tuple[list[float], list]:
    """``steps`` engine steps under one profiler session: each step's wall ms, and the events (line, name, start,
    end) that ``keep(plane, line, name)`` selects (by default the XLA:CPU threads' thunks) that start while a
    step runs (times are the session's own). ``read``: each step's own tokens are read in its window
    (``wait_for_step``): a step that is not the decode fast path is read by the next call otherwise."""
    walls = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                if before_each is not None:
                    before_each()
                start = time.perf_counter_ns()
                with jax.profiler.TraceAnnotation("engine_step"):
                    engine.step()
                    if read:
                        engine.wait_for_step()
                walls.append((time.perf_counter_ns() - start) / 1e6)
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    events, windows = [], []
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == "engine_step":
                    windows.append((e.start_ns, e.end_ns))
                elif keep(plane.name, line.name, e.name):
                    events.append((line.name, e.name, e.start_ns, e.end_ns))
    return walls, [e for e in events if any(a <= e[2] < b for a, b in windows)]


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def summarize(sessions: list[tuple[list[float], list]], hlo: str, top: int = 16) -> dict:
    """Per step, over profiler sessions of (walls, events): wall, thunk thread-ms by kind (a thunk that XLA splits
    over its threads counts on each), busy (any XLA thread in a thunk) and idle ms."""
    walls = [w for session_walls, _ in sessions for w in session_walls]
    n = len(walls)
    kinds, per_thread, thunks = collections.Counter(), collections.Counter(), collections.Counter()
    busy = 0.0
    for _, events in sessions:
        events = [e for e in events if kind_of(e[1], hlo) != INSIDE_LOOP]
        busy += union_ms([(a, b) for *_, a, b in events]) / n
        for line, name, a, b in events:
            kinds[kind_of(name, hlo)] += (b - a) / 1e6 / n
            per_thread[line] += (b - a) / 1e6 / n
            thunks[name] += (b - a) / 1e6 / n
    return {"steps": n, "wall_ms_mean": sum(walls) / n, "wall_ms_median": float(np.median(walls)),
            "walls_ms": [round(w, 1) for w in walls], "busy_ms": busy, "idle_ms": sum(walls) / n - busy,
            "thread_ms": dict(per_thread), "kinds_ms": {k: round(v, 3) for k, v in kinds.most_common()},
            "top_thunks_ms": {t: [round(ms, 3), kind_of(t, hlo)] for t, ms in thunks.most_common(top)}}


def wave_steps(llm: LLM, waves: int, c: int, rng, prompt_len: int, prefix: list[int]) -> list:
    """``waves`` times: every request finishes, then ``c`` new prompts arrive at once; the step that computes them
    is traced (one profiler session each)."""
    engine = llm.engine
    for request in list(engine.requests):
        engine.abort_request(request)
    sessions, first = [], 10 ** 6
    for w in range(waves):
        while engine.has_unfinished_requests():
            engine.step()
        add_requests(llm, range(first + w * c, first + (w + 1) * c), rng, prompt_len, 2, prefix)
        sessions.append(traced_steps(engine, 1, read=True))
    return sessions


def print_table(result: dict) -> None:
    """Per kind of step (decode, mixed, wave): wall, busy and idle ms, and the thunks' thread-ms by kind."""
    steps = [k for k in ("decode", "mixed", "wave") if k in result]
    kinds = list(dict.fromkeys(kind for k in steps for kind in result[k]["kinds_ms"]))
    print(f"\n{result['concurrency']} streams, {result['dtype']}, ms per step\n| | " + " | ".join(steps) + " |\n| --- |"
          + " --- |" * len(steps))
    for label, key in (("wall (mean)", "wall_ms_mean"), ("wall (median)", "wall_ms_median"),
                       ("busy (any XLA thread)", "busy_ms"), ("idle (no XLA thread)", "idle_ms")):
        print(f"| {label} | " + " | ".join(f"{result[k][key]:.2f}" for k in steps) + " |")
    for kind in kinds:
        print(f"| thread-ms: {kind} | " + " | ".join(f"{result[k]['kinds_ms'].get(kind, 0):.2f}" for k in steps)
              + " |")
    for k in steps:
        print(f"\n{k}: the top thunks (thread-ms a step; all of them and every step's wall in --json):")
        for thunk, (ms, kind) in list(result[k]["top_thunks_ms"].items())[:8]:
            print(f"  {ms:8.3f}  {thunk}  [{kind}]")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--mixed", type=int, default=6, help="mixed steps to trace (a new prompt beside decodes)")
    parser.add_argument("--wave", type=int, default=0, help="wave steps to trace (C prompts at once, none running)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=0, help="random tokens every prompt starts with (cached)")
    parser.add_argument("--json", help="write the result (every step's figures) here")
    args = parser.parse_args(argv)
    llm = LLM(**{**SERVE, "enable_prefix_caching": args.prefix > 0})
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 40000, args.prefix).tolist()
    if prefix:
        llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1))
    c, budget = args.concurrency, args.steps + 3 * args.mixed + 16
    add_requests(llm, range(c), rng, args.prompt_len, budget, prefix)
    for _ in range(6):  # the prompts' steps (one wave) and the first decodes
        llm.engine.step()
    runner = llm.engine.runner
    bucket = lambda n: min(b for b in runner.config.token_buckets() if b >= n)  # noqa: E731
    hlo = {kind: runner.executable(bucket(n)).as_text() for kind, n in
           (("decode", c), ("mixed", c - 1 + args.prompt_len))}  # (a cached prefix is not computed again)
    result = {"concurrency": c, "load_1min_before": os.getloadavg()[0], "jax": jax.__version__,
              "dtype": str(runner.config.dtype)}
    result["decode"] = summarize([traced_steps(llm.engine, args.steps)], hlo["decode"])
    next_id = iter(range(c, 10 * c))

    def swap_one():  # the async step in flight finishes first; then one row leaves and a new prompt comes
        llm.engine.wait_for_step()
        victim = next(r for r in llm.engine.requests)
        llm.engine.abort_request(victim)
        new = next(next_id)
        add_requests(llm, range(new, new + 1), rng, args.prompt_len, budget, prefix)
    sessions = []
    for _ in range(args.mixed):
        sessions.append(traced_steps(llm.engine, 1, swap_one, read=True))
        for _ in range(2):
            llm.engine.step()
    result["mixed"] = summarize(sessions, hlo["mixed"])
    if args.wave:
        result["wave"] = summarize(wave_steps(llm, args.wave + 1, c, rng, args.prompt_len, prefix)[1:],
                                   runner.executable(bucket(c * args.prompt_len)).as_text())
    result["load_1min_after"] = os.getloadavg()[0]
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
