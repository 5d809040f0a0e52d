"""What the Flax NNX model layer costs against the plain functions it replaced: compile time and step time of
SmolLM2's jitted engine step, the two code bases side by side in one run.

    python -m benchmarks.nnx_overhead [--baseline 14e4871] [--candidate ae71b61] [--repeats 3] [--json F]

The baseline is a git revision from just before the model layer (its plain-function jaxpage/model.py), the
candidate the revision that replaced it by the NNX layer and nothing else (default) or, with ``--candidate
HEAD-TREE``, this working tree; both are checked out into temporary worktrees. Each measurement runs in a fresh process of one code base or the other, alternating,
so that both see the same machine load. Per process: lower + compile the step at the decode bucket (8 tokens)
and a prefill bucket (256 tokens) with the compilation cache off, then time 30 runs of each compiled step on
the real weights (median).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = (8, 256)


def measure() -> dict:
    import time

    import jax
    import numpy as np

    from jaxpage.config import ModelConfig
    try:  # the layer folders (issue 23)
        from jaxpage.engine.config_builder import build_engine_config
        from jaxpage.models.loader import default_cache_dir, load_model
        from jaxpage.worker.model_runner import ModelRunner
        from jaxpage.worker.step import abstract_step_inputs
    except ImportError:  # the revisions this script compares: one flat jaxpage/
        from jaxpage.config import build_engine_config
        from jaxpage.model_loader import default_cache_dir, load_model
        from jaxpage.model_runner import ModelRunner, abstract_step_inputs
    if hasattr(ModelConfig, "from_hf"):  # the baseline
        config_from_hf = ModelConfig.from_hf
    else:
        from jaxpage.models import config_from_hf
    loaded = load_model(None, default_cache_dir())
    config = build_engine_config(config_from_hf(loaded.hf_config), dtype="float32", block_size=16,
                                 kv_cache_memory=None, num_kv_blocks=512, max_num_seqs=8,
                                 max_num_batched_tokens=max(BUCKETS), max_model_len=2048,
                                 gpu_memory_utilization=0.9)
    runner = ModelRunner(config, loaded.params)
    out = {}
    for n in BUCKETS:
        batch, sampling = abstract_step_inputs(config, n)
        t = time.perf_counter()
        lowered = runner._step.lower(runner.params, runner.kv_pool, batch, sampling)
        lower_s = time.perf_counter() - t
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t - lower_s
        inputs = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), (batch, sampling))
        times = []
        for _ in range(31):
            t = time.perf_counter()
            result, runner.kv_pool = compiled(runner.params, runner.kv_pool, *inputs)
            jax.block_until_ready(result)
            times.append(time.perf_counter() - t)
        out[n] = {"trace_lower_s": lower_s, "compile_s": compile_s, "step_ms": 1e3 * statistics.median(times[1:])}
    return out


def run(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}  # no compilation cache: measure() never enables it
    proc = subprocess.run([sys.executable, "-c", "import json, benchmarks.nnx_overhead as b; "
                           "print('RESULT', json.dumps(b.measure()))"],
                          cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"measuring {root} failed:\n{proc.stderr[-3000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def _checkout(path: Path, rev: str) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    (path / "benchmarks" / "nnx_overhead.py").write_text(Path(__file__).read_text())
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="14e4871", help="a git revision with the plain-function model")
    parser.add_argument("--candidate", default="ae71b61",
                        help="the revision with the NNX model layer, or HEAD-TREE for this working tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = _checkout(Path(tmp) / "baseline", args.baseline)
        cand = ROOT if args.candidate == "HEAD-TREE" else _checkout(Path(tmp) / "candidate", args.candidate)
        try:
            runs = {"plain": [], "nnx": []}
            for _ in range(args.repeats):
                runs["plain"].append(run(base))
                runs["nnx"].append(run(cand))
        finally:
            for tree in {base, cand} - {ROOT}:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    rows = []
    for n in BUCKETS:
        med = {k: {m: statistics.median(r[n][m] for r in v) for m in ("trace_lower_s", "compile_s", "step_ms")}
               for k, v in runs.items()}
        rows.append({"tokens": n, **{f"{k}_{m}": x for k, d in med.items() for m, x in d.items()},
                     "step_ratio": med["nnx"]["step_ms"] / med["plain"]["step_ms"],
                     "compile_ratio": med["nnx"]["compile_s"] / med["plain"]["compile_s"],
                     "trace_ratio": med["nnx"]["trace_lower_s"] / med["plain"]["trace_lower_s"]})
    print("| tokens | step ms plain | step ms NNX | ratio | compile s plain | compile s NNX | ratio | trace+lower s plain | NNX | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['plain_step_ms']:.1f} | {r['nnx_step_ms']:.1f} | {r['step_ratio']:.3f} | "
              f"{r['plain_compile_s']:.2f} | {r['nnx_compile_s']:.2f} | {r['compile_ratio']:.3f} | "
              f"{r['plain_trace_lower_s']:.2f} | {r['nnx_trace_lower_s']:.2f} | {r['trace_ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": args.baseline, "candidate": args.candidate,
                                               "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
