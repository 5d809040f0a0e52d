"""Where a CPU decode step's milliseconds go, float32 against bfloat16: per executable, and per op inside each.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/cpu_step_profile.py [--dtypes float32 bfloat16]
        [--buckets 1 8] [--max-num-seqs 8] [--top 12] [--json out.json]

SmolLM2-135M, the engine's own compiled executables of each token bucket (the host layer loop,
jaxpage/worker/layer_loop.py), on an all-padding batch of plain greedy rows (benchmarks/step_parts.py): the
attention's loop runs its first chunk of pages only, so a long context's further chunks are left out. Each
executable is timed alone with block_until_ready (medians of 7), then the whole loop call, whose excess over
the parts is the host's time between launches. Then each executable runs under ``jax.profiler.trace``: XLA:CPU records every thunk (an HLO
instruction: a fusion, a dot, a custom call) on whichever of its threads runs it (the client's and the Eigen pool's:
a step's thunks hop between them), and the thunks are summed per step and put in
kinds from the compiled HLO (oneDNN matmul, XLA dot, K/V write, the attention's loop, other fusions); a thunk
inside the attention's while loop is counted in the loop's own thunk, not again.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import re
import tempfile
from pathlib import Path

import jax

from benchmarks.step_parts import greedy_padding, median_ms
from jaxpage import LLM
from jaxpage.models import top_weights

OPTIONS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "kv_cache_memory": 64 << 20,
           "progress": False, "enable_prefix_caching": False}
INSIDE_LOOP = "(inside the attention's loop, counted in it)"
BOOKKEEPING = ("ThreadpoolListener", "end:", "ThunkExecutor", "ThreadPool")
KINDS = (("jaxpage_onednn_matmul", "oneDNN matmul (FFI)"), ("jaxpage_write_kv", "K/V write (FFI)"),
         ("jaxpage_paged_attention", "paged attention (FFI)"),
         ("jaxpage_gather_rows", "page gather (FFI)"), ("ynn", "XLA dot (YNNPACK)"), (" dot(", "XLA dot (Eigen)"),
         (" while(", "attention: the while loop over page chunks (all of its body)"),
         ("scatter(", "XLA scatter"), ("gather(", "XLA gather"), ("sort(", "sort"))


def thunk_ms(fn, calls: int) -> dict[str, float]:
    """Each thunk's total ms over ``calls`` runs of fn, divided by calls, from a jax.profiler trace."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    totals = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # tf_XLAPjRtCpuClient and tf_XLAEigen threads
                continue
            for event in line.events:
                if not event.name.startswith(BOOKKEEPING):
                    totals[event.name] += event.duration_ns / 1e6 / calls
    return dict(totals)


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


def profile(llm: LLM, num_tokens: int, top: int, hlo_dir: str | None = None) -> dict:
    runner = llm.engine.runner
    loop, config = runner.executable(num_tokens), runner.config
    batch, sampling = greedy_padding(config, num_tokens)
    batch = jax.tree.map(lambda a: jax.device_put(a, loop.inputs), batch)
    weights, layers = top_weights(runner.params), runner.params["layers"]
    x, shared = loop.begin(weights, batch)
    per_row = dataclasses.replace(sampling, prompt_targets=None)  # the tail without prompt logprobs

    def all_layers():
        y = x
        for i, consts in enumerate(loop.consts):
            y, runner.kv_pool = loop.layer(layers[i], consts, y, runner.kv_pool, batch, shared)
        return y

    def one_layer():
        y, runner.kv_pool = loop.layer(layers[0], loop.consts[0], x, runner.kv_pool, batch, shared)
        return y

    _, rows = loop.end(weights, x, batch)
    sampler, greedy = loop.for_rows("sampler", rows.shape[0]), loop.for_rows("greedy", rows.shape[0])
    parts = {"begin": lambda: loop.begin(weights, batch), "30 layers": all_layers,
             "end (final norm, row pick)": lambda: loop.end(weights, x, batch),
             "sampler (LM head, greedy)": lambda: sampler(weights, rows, per_row)}
    if greedy is not None:  # the plain greedy sampler: what the step runs for these rows
        parts["plain greedy sampler (LM head, argmax)"] = lambda: greedy(weights, rows)
    result = {"parts_ms": {name: median_ms(fn) for name, fn in parts.items()}}

    def step():
        out, runner.kv_pool = loop(runner.params, runner.kv_pool, batch, sampling)
        return out
    result["step_ms"] = median_ms(step)
    # plain greedy rows: the step runs the plain greedy sampler, not the general one
    in_step = [name for name in parts if not (greedy is not None and name == "sampler (LM head, greedy)")]
    result["host_gap_ms"] = result["step_ms"] - sum(result["parts_ms"][name] for name in in_step)
    executables = {"layer": (one_layer, loop.layer), "sampler": (parts["sampler (LM head, greedy)"], sampler)}
    for name, (fn, compiled) in executables.items():
        hlo, thunks = compiled.as_text(), thunk_ms(fn, 10)
        if hlo_dir:
            Path(hlo_dir, f"{llm.engine.runner.config.dtype}-{num_tokens}-{name}.txt").write_text(hlo)
        kinds = collections.Counter()
        for thunk, ms in thunks.items():
            if kind_of(thunk, hlo) != INSIDE_LOOP:
                kinds[kind_of(thunk, hlo)] += ms
        result[f"{name}_kinds_ms"] = dict(kinds.most_common())
        result[f"{name}_top_thunks_ms"] = {t: [ms, kind_of(t, hlo)] for t, ms in
                                           collections.Counter(thunks).most_common(top)}
        result[f"{name}_wall_ms"] = median_ms(fn)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json")
    parser.add_argument("--hlo-dir", help="write each profiled executable's compiled HLO here")
    parser.add_argument("--max-num-seqs", type=int, default=OPTIONS["max_num_seqs"],
                        help="the engine's (a bucket above it takes the attention's query tiles)")
    args = parser.parse_args()
    results = {}
    options = {**OPTIONS, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": max(OPTIONS["max_num_batched_tokens"], args.max_num_seqs)}
    for dtype in args.dtypes:
        llm = LLM(dtype=dtype, **options)
        results[dtype] = {n: profile(llm, n, args.top, args.hlo_dir) for n in args.buckets}
        del llm
    for n in args.buckets:
        print(f"\n### bucket {n}\n\n| part | " + " | ".join(args.dtypes) + " |\n| --- |" + " --- |" * len(args.dtypes))
        first = results[args.dtypes[0]][n]
        for part in first["parts_ms"]:
            print(f"| {part} | " + " | ".join(f"{results[d][n]['parts_ms'][part]:.2f} ms" for d in args.dtypes)
                  + " |")
        for key in ("host_gap_ms", "step_ms"):
            print(f"| {key[:-3]} | " + " | ".join(f"{results[d][n][key]:.2f} ms" for d in args.dtypes) + " |")
        for name in ("layer", "sampler"):
            kinds = sorted({k for d in args.dtypes for k in results[d][n][f"{name}_kinds_ms"]})
            print(f"| **one {name}: wall** | " + " | ".join(f"{results[d][n][f'{name}_wall_ms']:.3f} ms"
                                                      for d in args.dtypes) + " |")
            for kind in kinds:
                print(f"| {name}: {kind} | " + " | ".join(
                    f"{results[d][n][f'{name}_kinds_ms'].get(kind, 0):.3f} ms" for d in args.dtypes) + " |")
        for d in args.dtypes:
            print(f"\n{d}, bucket {n}, the layer's top thunks (ms per call):")
            for thunk, (ms, kind) in results[d][n]["layer_top_thunks_ms"].items():
                print(f"  {ms:.3f}  {thunk}  [{kind}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args), "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
