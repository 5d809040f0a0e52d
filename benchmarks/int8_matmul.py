"""One weight matmul on this machine's default backend, SmolLM2's shapes, 1/8/32 rows: float32 and bfloat16
weights against int8 weights, weight-only (converted in the dot) and with dynamically quantized int8 activations
(int32 accumulation). Times are medians of interleaved repeats, as ratios to float32 in the same run.

    python benchmarks/int8_matmul.py [--rows 1 8 32] [--repeats 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.models.quant import int8_dot_dynamic, int8_dot_weight_only, quantize_int8

SHAPES = {"qkv/o 576x576": (576, 576), "gate/up 576x1536": (576, 1536), "down 1536x576": (1536, 576),
          "lm_head 576x49152": (576, 49152)}


def _bound(fn, *weights):
    jitted = jax.jit(fn)
    return lambda x: jitted(x, *weights)


def variants(w: np.ndarray) -> dict:
    kernel, scale = (jnp.asarray(a) for a in quantize_int8(w, (0,)))
    return {"float32": _bound(jnp.dot, jnp.asarray(w)),
            "bfloat16": _bound(lambda x, v: jnp.dot(x.astype(v.dtype), v), jnp.asarray(w, jnp.bfloat16)),
            "int8 weight-only": _bound(lambda x, k, s: int8_dot_weight_only(x, k, s, 1), kernel, scale),
            "int8 dynamic": _bound(lambda x, k, s: int8_dot_dynamic(x, k, s, 1), kernel, scale)}


def measure(fns: dict, x, repeats: int) -> dict:
    for fn in fns.values():
        jax.block_until_ready(fn(x))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"backend {jax.default_backend()}; median ms (ratio to float32)")
    for label, (d_in, d_out) in SHAPES.items():
        fns = variants(rng.standard_normal((d_in, d_out), np.float32) * 0.05)
        for rows in args.rows:
            t = measure(fns, jnp.asarray(rng.standard_normal((rows, d_in), np.float32)), args.repeats)
            cells = "  ".join(f"{n} {v * 1e3:.3f} ({v / t['float32']:.2f})" for n, v in t.items())
            print(f"{label:18s} rows {rows:3d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
