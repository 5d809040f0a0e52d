"""The fused q/k/v and gate/up projections against the separate matmuls they replaced, alternated in one process:
30 SmolLM2-shaped layers of the input projections only (q, k, v, gate, up and act(gate) * up; o, down and
attention are the same in both forms), unrolled in one jitted function, float32 or int8 weights (the CPU's int8
form), 15 calls each (median, min).

    python benchmarks/fused_projections.py [--rows 1 8 32 256] [--dtypes float32 int8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.models.layers import Linear, MergedColumnParallelLinear, QKVParallelLinear
from jaxpage.models.quant import building, quantize_int8

L, D, H, KVH, HD, F = 30, 576, 9, 3, 64, 1536  # SmolLM2-135M


def _load(linear: Linear, kernel: np.ndarray) -> None:
    if linear.kernel.dtype == jnp.int8:
        values, scale = quantize_int8(kernel, (0,))
        linear.kernel[...], linear.scale[...] = jnp.asarray(values), jnp.asarray(scale)
    else:
        linear.kernel[...] = jnp.asarray(kernel)


def separate_layer(w: dict) -> nnx.Module:
    m = nnx.Dict(q=Linear((D,), (H, HD), (None,) * 3), k=Linear((D,), (KVH, HD), (None,) * 3),
                 v=Linear((D,), (KVH, HD), (None,) * 3), gate=Linear((D,), (F,), (None,) * 2),
                 up=Linear((D,), (F,), (None,) * 2))
    for name in ("q", "k", "v", "gate", "up"):
        _load(m[name], w[name])
    return m


def fused_layer(w: dict) -> nnx.Module:
    m = nnx.Dict(qkv=QKVParallelLinear(D, H, KVH, HD), gate_up=MergedColumnParallelLinear(D, F, 2))
    _load(m["qkv"], QKVParallelLinear.fuse(w["q"], w["k"], w["v"]))
    _load(m["gate_up"], MergedColumnParallelLinear.fuse(w["gate"], w["up"]))
    return m


def run_separate(m, x):
    return m["q"](x), m["k"](x), m["v"](x), jax.nn.silu(m["gate"](x)) * m["up"](x)


def run_fused(m, x):
    gate, up = m["gate_up"].split(m["gate_up"](x))
    return (*m["qkv"].split(m["qkv"](x)), jax.nn.silu(gate) * up)


def compiled(make, run, weights: list[dict], quantization):
    with building(quantization):
        graph, state = nnx.split(nnx.List([make(w) for w in weights]))
    return jax.jit(lambda state, x: [run(m, x) for m in nnx.merge(graph, state)]), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "int8"], choices=["float32", "int8"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shapes = {"q": (D, H, HD), "k": (D, KVH, HD), "v": (D, KVH, HD), "gate": (D, F), "up": (D, F)}
    weights = [{n: rng.standard_normal(s, dtype=np.float32) * 0.02 for n, s in shapes.items()} for _ in range(L)]
    print(f"load average at start: {[round(x, 1) for x in os.getloadavg()]}")
    print("| weights | rows | separate ms (median, min) | fused ms (median, min) | fused / separate (median) |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        quantization = "int8" if dtype == "int8" else None
        pairs = (("separate", separate_layer, run_separate), ("fused", fused_layer, run_fused))
        forms = {name: compiled(make, run, weights, quantization) for name, make, run in pairs}
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, D), dtype=np.float32))
            ref = forms["separate"][0](forms["separate"][1], x)
            got = forms["fused"][0](forms["fused"][1], x)
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):  # the same outputs, whichever form
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
            times = {name: [] for name in forms}
            for _ in range(15):
                for name, (fn, state) in forms.items():
                    t = time.perf_counter()
                    jax.block_until_ready(fn(state, x))
                    times[name].append(1e3 * (time.perf_counter() - t))
            med = {n: statistics.median(t) for n, t in times.items()}
            ratio = statistics.median(f / s for f, s in zip(times["fused"], times["separate"]))
            print(f"| {dtype} | {rows} | {med['separate']:.2f}, {min(times['separate']):.2f} | "
                  f"{med['fused']:.2f}, {min(times['fused']):.2f} | {ratio:.3f} |", flush=True)
    print(f"load average at end: {[round(x, 1) for x in os.getloadavg()]}")


if __name__ == "__main__":
    main()
