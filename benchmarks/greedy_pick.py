"""The plain greedy sampler's reductions on the CPU: the kernel (cpu_kernels/greedy_pick.cc) against XLA's ops.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/greedy_pick.py [--rows 1 8 32] [--vocab 49152] [--json out]

bfloat16 logits [rows, vocab] as SmolLM2's LM head gives them; each form jitted alone, medians of --reps calls
(warm caches: in a step the logits were just written by the LM head). Checks that both give the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import greedy_pick as kernel
from jaxpage.worker.sampler import greedy_pick_xla


def median_ms(fn, x, reps: int) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    assert kernel.available(), "the CPU kernels could not be built"
    forms = {"kernel": jax.jit(kernel.greedy_pick), "xla": jax.jit(greedy_pick_xla)}
    rng, results = np.random.default_rng(0), []
    print("| rows | kernel ms | XLA ms | XLA / kernel |\n| --- | --- | --- | --- |")
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, args.vocab)) * 3, jnp.bfloat16)
        tokens = [np.asarray(f(x)[0]) for f in forms.values()]
        assert np.array_equal(*tokens), "the kernel's tokens differ from XLA's"
        ms = {name: median_ms(f, x, args.reps) for name, f in forms.items()}
        results.append({"rows": rows, "vocab": args.vocab, **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"| {rows} | {ms['kernel']:.3f} | {ms['xla']:.3f} | {ms['xla'] / ms['kernel']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_1min": os.getloadavg()[0], "jax": jax.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
