"""SmolLM2's decode products on the CPU over time: 30 layers of packed bfloat16 q/k/v, o, gate/up and down and the
LM head (269 MB of weights) at a few rows, on oneDNN's kernel (AMX brgemm where the CPU has it) and on
``cpu_kernels/packed_gemv.cc`` and the default choice (on an AMX CPU the faster of the two by their times:
``cpu_kernels/timed_choice.h``), alternated batch by batch, with a plain two-thread read of 269 MB beside them
(``memory_stream.c``, built with the system's C compiler) to tell the memory's speed from the kernels'.

    python benchmarks/product_speeds.py [--rows 1 8] [--seconds 90] [--json F]

A shared VM's speed moves within seconds, so figures of two kernels (or two trees) compare only when taken in
alternation; --compare runs the products at --rows under two trees (each tree first on PYTHONPATH, in its own
process, the default kernel choice), alternating, and reports the median of the paired ratios (B / A):

    python benchmarks/product_speeds.py --compare /path/to/tree_a /path/to/tree_b --rows 1 --seconds 60
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # a layer's q/k/v, o, gate/up, down: [K, N]
LAYERS, HIDDEN, VOCAB, FFN = 30, 576, 49152, 1536
WEIGHT_MB = 269


def products():
    """SmolLM2-shaped packed weights, built once; returns ``make(rows, gemv_rows)``: a timed call of the jitted
    decode products at ``rows`` rows with that ``gemv_rows`` (None: the default)."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels import onednn

    rng = np.random.default_rng(0)
    packed = lambda shape: jnp.asarray(onednn.pack(rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)))
    layers = [[packed(s) for s in SHAPES] for _ in range(LAYERS)]
    head = packed((HIDDEN, VOCAB))

    def make(rows, gemv_rows):
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32), jnp.bfloat16)
        mm = lambda a, w: onednn.matmul(a, w, packed=True, gemv_rows=gemv_rows)

        @jax.jit
        def step(x, layers, head):
            for qkv, o, gate_up, down in layers:
                x = x + mm(mm(x, qkv)[:, :HIDDEN], o)
                x = x + mm(mm(x, gate_up)[:, :FFN], down) * 0.01
            return mm(x, head)

        step(x, layers, head).block_until_ready()
        return lambda: step(x, layers, head).block_until_ready()
    return make


def median_ms(run, calls: int = 5) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def stream_probe() -> list[str] | None:
    """The memory probe's command line (built once into a temporary folder), or None without a C compiler."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    binary = Path(tempfile.mkdtemp(prefix="jaxpage-stream-")) / "memory_stream"
    subprocess.run([compiler, "-O2", "-mavx512f", "-pthread", str(Path(__file__).with_name("memory_stream.c")),
                    "-o", str(binary)], check=True)
    return [str(binary), str(WEIGHT_MB), "3"]


def over_time(rows: list[int], seconds: float) -> dict:
    probe = stream_probe()
    make = products()
    kernels = {}
    for r in rows:
        kernels[f"onednn_{r}"], kernels[f"gemv_{r}"], kernels[f"default_{r}"] = make(r, 0), make(r, 8), make(r, None)
    batches = []
    end = time.time() + seconds
    while time.time() < end:
        batch = {"t": time.strftime("%H:%M:%S")}
        if probe:
            batch["stream_gbs"] = json.loads(subprocess.check_output(probe))[-1]
        batch.update({name: median_ms(run) for name, run in kernels.items()})
        batches.append(batch)
        print(json.dumps(batch), flush=True)
    return {"rows": rows, "weight_mb": WEIGHT_MB, "batches": batches,
            "median_ms": {name: statistics.median(b[name] for b in batches) for name in kernels}}


def serve(rows: int) -> None:
    """--serve: the default kernel choice's products; a line on stdin runs a batch, its median ms comes back."""
    run = products()(rows, None)
    print("ready", flush=True)
    for _ in sys.stdin:
        print(median_ms(run), flush=True)


def compare(trees: list[str], rows: int, seconds: float) -> dict:
    # only here: a worker runs this file with another tree first on its path, which the repository's root would shadow
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.phase_speed import start_worker

    workers = [start_worker(__file__, tree, "--rows", str(rows)) for tree in trees]
    figures = [[], []]
    end, i = time.time() + seconds, 0
    while time.time() < end:
        for w in ((0, 1) if i % 2 == 0 else (1, 0)):
            workers[w].stdin.write("go\n")
            workers[w].stdin.flush()
            figures[w].append(float(workers[w].stdout.readline()))
        i += 1
    for worker in workers:
        worker.stdin.close()
        worker.wait()
    ratios = [b / a for a, b in zip(*figures)]
    return {"trees": trees, "rows": rows, "pairs": len(ratios), "ms": figures,
            "median_ms": [statistics.median(f) for f in figures],
            "paired_ratio_b_over_a": round(statistics.median(ratios), 3),
            "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--compare", nargs=2, metavar=("TREE_A", "TREE_B"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.rows[0])
    row = {"load_average": list(os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    row.update(compare(args.compare, args.rows[0], args.seconds) if args.compare else
               over_time(args.rows, args.seconds))
    row["load_average_end"] = list(os.getloadavg())
    print(json.dumps({k: v for k, v in row.items() if k not in ("batches", "ms")}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
