"""Where an engine step's time goes on a GPU, and what the prefill limits cost the paged engine there.

    python -m benchmarks.gpu_step_profile --out DIR [--json F]    # one H200 (or H100): about 3 minutes
    python -m benchmarks.gpu_step_profile --out DIR --smoke       # anywhere: the tiny model, a few steps

1. Decode steps of a Llama-3-8B-shaped model (random bfloat16 weights, jaxpage/testing/random_model.py; the engine as
   benchmarks/device_check.py builds it) at 1 and 32 streams: the wall time of ``LLMEngine.step`` and the device's
   busy time in it (the union of the GPU streams' kernel events, from ``jax.profiler``). Wall minus busy is the
   time the device waits for the host. The floor for comparison: the weights' bytes over the copy bandwidth.
2. The paged engine on 256 streams of 128 + 128 tokens, all at t=0, with serve's prefill limits
   (long_prefill_token_threshold, max_num_partial_prefills) and with them lifted (only the step's token
   budget, as vLLM V1 schedules by default): output tokens/s, peak running sequences and steps.
3. With --layouts, only part 1, for each driver of the step's layer loop (jaxpage.worker.step.LAYER_LOOPS):
   ``host_loop`` (one compiled layer called once per layer from the host over each layer's own weight buffers:
   the default on a CPU and a GPU), ``scan`` (one program, a ``lax.scan`` over stacked weights), ``scan_dsf``
   (the scan compiled with XLA:GPU's dynamic-slice fusion) and ``unrolled`` (``scan_layers=False``), chosen
   here through step.LAYER_LOOP. This is the measurement that picks the GPU's entry there.
Writes DIR/gpu_step_profile.json (also to --json F; DIR/gpu_layouts.json with --layouts) and prints it, then a
table.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import device_check, kernels, throughput
from benchmarks.profile import traced_steps, union_ms
from jaxpage.worker import step

MEASURE_ORDER = ("host_loop", "scan_dsf", "unrolled", "scan")
assert sorted(MEASURE_ORDER) == sorted(step.LAYER_LOOPS)


def gpu_event(plane: str, line: str, name: str) -> bool:
    return plane.startswith("/device:GPU")


def decode_profile(loaded, runner, streams: int, steps: int, prompt: int, vocab: int) -> dict:
    """Wall and GPU-busy ms per decode step once all ``streams`` decode (untimed steps first, then traced)."""
    engine = device_check.engine_for(loaded, runner)
    device_check.add_requests(engine, streams, prompt, 2 * steps + 16, vocab)
    while any(len(s.token_ids) - s.num_computed_tokens > 1 for r in engine.requests.values() for s in r.group.seqs):
        engine.step()
    untraced = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        untraced.append((time.perf_counter() - started) * 1e3)
    try:
        walls, events = traced_steps(engine, steps, keep=gpu_event)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot trace here still leaves the untraced walls
        return {"streams": streams, "untraced_wall_ms_median": float(np.median(untraced)), "trace_error": repr(e)}
    lines = collections.defaultdict(list)
    for line, _, a, b in events:
        lines[line].append((a, b))
    streams_ms = union_ms([iv for line, ivs in lines.items() if line.startswith("Stream") for iv in ivs]) / steps
    return {"streams": streams, "steps": steps, "untraced_wall_ms_median": float(np.median(untraced)),
            "wall_ms_median": float(np.median(walls)),
            "wall_ms_mean": float(np.mean(walls)), "gpu_busy_ms": streams_ms,
            "gpu_idle_ms": float(np.mean(walls)) - streams_ms,
            "gpu_idle_frac": 1.0 - streams_ms / float(np.mean(walls)),
            "per_line_union_ms": {line: union_ms(ivs) / steps for line, ivs in lines.items()},
            "kernels": collections.Counter(name for line, name, *_ in events if line.startswith("Stream"))
            .most_common(12)}


def layouts(setup: dict, steps: int, out: Path, deadline: float = float("inf"), streams=None) -> dict:
    """Part 3: decode steps of each layer-loop driver (jaxpage.worker.step.LAYER_LOOPS) at each of ``streams``
    (default: 1 and 32), chosen through step.LAYER_LOOP; a driver not started by ``deadline`` (perf_counter
    seconds) is recorded as skipped."""
    streams = streams or (1, min(32, max(setup["streams"])))
    here = jax.devices()[0].platform
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layouts": {}, "skipped": []}
    for loop in MEASURE_ORDER:  # the one-launch candidates before the scan the H200 runs of 2026-12-04 measured
        if time.perf_counter() > deadline:
            result["skipped"].append({"layout": loop, "why": "time budget"})
            continue
        try:
            with driving(here, loop):
                started = time.perf_counter()
                loaded, runner, _, _ = device_check.paged_setup(setup, scan_layers=loop != "unrolled")
                entry = {"compile_and_init_s": time.perf_counter() - started}
                assert runner.layer_loop == loop, (runner.layer_loop, loop)
                entry["decode"] = [decode_profile(loaded, runner, n, steps, setup["prompt"],
                                                  setup["model"].vocab_size) for n in streams]
        except Exception as e:  # noqa: BLE001 - a layout that fails here is recorded; the others still run
            entry = {"error": repr(e)}
        result["layouts"][loop] = entry
        print(loop, json.dumps(entry, default=str)[:600], flush=True)
        (out / "gpu_layouts.json").write_text(json.dumps(result, indent=1, default=str))
        loaded = runner = None  # the weights and the pool go before the next layout's
        jax.clear_caches()
    return result


@contextlib.contextmanager
def driving(platform: str, loop: str):
    """step.LAYER_LOOP naming ``loop`` for ``platform`` (the one-device default there), "unrolled" aside: an
    engine asks for it with scan_layers=False."""
    before = step.LAYER_LOOP.get(platform)
    step.LAYER_LOOP[platform] = "host_loop" if loop == "unrolled" else loop
    try:
        yield
    finally:
        step.LAYER_LOOP[platform] = before


def print_table(result: dict) -> None:
    """Decode steps (wall, GPU busy and idle ms) and the prefill-limit runs, one line each."""
    for name, entry in (result["layouts"].items() if "layouts" in result else [("", result)]):
        if "error" in entry:
            print(f"\n{name}: {entry['error']}")
            continue
        print(f"\n{name} layout:" if name else "")
        print("| streams | wall ms (median) | GPU busy ms | GPU idle ms | idle % |\n| --- | --- | --- | --- | --- |")
        for d in entry.get("decode", []):
            print(f"| {d['streams']} | {d.get('wall_ms_median', d['untraced_wall_ms_median']):.2f} | "
                  f"{d.get('gpu_busy_ms', float('nan')):.2f} | {d.get('gpu_idle_ms', float('nan')):.2f} | "
                  f"{100 * d.get('gpu_idle_frac', float('nan')):.0f} |")
    if result.get("prefill_limits"):
        print("\n| prefill limits | output tok/s | seconds | steps | peak running | ITL p50 / p99 ms |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for r in result["prefill_limits"]:
            limits = r["limits"] if isinstance(r["limits"], str) else "lifted"
            print(f"| {limits} | {r['output_tokens_per_s']:.0f} | {r['seconds']:.1f} | {r['steps']} | "
                  f"{r['peak_running']} | {r.get('itl_ms_p50', float('nan')):.1f} / "
                  f"{r.get('itl_ms_p99', float('nan')):.1f} |")
    if "floor_ms" in result:
        print(f"\nfloor: {result['weights_gb']:.2f} GB of weights at {result['copy_gbps']:.0f} GB/s = "
              f"{result['floor_ms']:.2f} ms a step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_step_profile.json (gpu_layouts.json)")
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, a few steps (runs on a CPU)")
    parser.add_argument("--layouts", action="store_true", help="decode steps of each layer layout (part 3) only")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--layouts: a driver not started within these seconds is skipped")
    args = parser.parse_args(argv)
    setup = dict(device_check.SMOKE, output=40) if args.smoke else device_check.FULL
    model, steps, many = setup["model"], (4 if args.smoke else 24), max(setup["streams"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.layouts:
        deadline = time.perf_counter() + (args.budget_s or float("inf"))
        result = layouts(setup, device_check.SMOKE["layout_steps"] if args.smoke else steps, out, deadline)
        print_table(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        return 0
    loaded, runner, _, params = device_check.paged_setup(setup)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": model.num_layers,
              "config": {k: getattr(runner.config, k) for k in ("max_num_batched_tokens", "async_scheduling",
                                                                 *throughput.PREFILL_LIMITS)}}
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    result["weights_gb"] = weights / 1e9
    result["copy_gbps"] = kernels.copy_bandwidth(2 ** 28 if args.smoke else 2 ** 32, 5)
    result["floor_ms"] = weights / (result["copy_gbps"] * 1e9) * 1e3  # each weight read once per step
    write = lambda: (out / "gpu_step_profile.json").write_text(json.dumps(result, indent=1, default=str))  # noqa: E731
    result["prefill_limits"] = []
    for limits in ({}, device_check.LIFTED, {}, device_check.LIFTED):
        result["prefill_limits"].append(device_check.policy_run(loaded, runner, limits, many, setup["prompt"], setup["output"],
                                                   model.vocab_size))
        write()
    result["decode"] = []
    for n in (1, min(32, many)):
        result["decode"].append(decode_profile(loaded, runner, n, steps, setup["prompt"], model.vocab_size))
        write()
    print(json.dumps(result, indent=1, default=str))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
