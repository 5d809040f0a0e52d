"""Plain-JAX micro-benchmark for the model layer: 30 SmolLM2-shaped layers of matmuls (no attention) and the tied
LM head, float32, in the forms the engine could compile, alternated in one process (15 calls each; median, min).

    python benchmarks/cpu_layer_forms.py [--rows 1 8 32] [--forms scan unrolled host_loop head_only]

scan: lax.scan over stacked weights (XLA:CPU copies each layer's slices before its dots); unrolled: one buffer per
layer, the layers unrolled in one executable; host_loop: one jitted layer called per layer from Python;
head_only: the LM head alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

L, D, H, KVH, HD, F, V = 30, 576, 9, 3, 64, 1536, 49152  # SmolLM2-135M


def weights(rng: np.random.Generator) -> tuple[dict, list[dict], jax.Array]:
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

    stack = {"wq": w(L, D, H, HD), "wk": w(L, D, KVH, HD), "wv": w(L, D, KVH, HD), "wo": w(L, H, HD, D),
             "w_gate": w(L, D, F), "w_up": w(L, D, F), "w_down": w(L, F, D)}
    layers = jax.device_put([jax.tree.map(lambda a: a[i], stack) for i in range(L)])  # own buffers
    return stack, layers, w(V, D)


def layer(x: jax.Array, lp: dict) -> jax.Array:
    """The model's matmuls in its einsum forms; q * (k + v) stands in for attention."""
    q = jnp.einsum("td,dhk->thk", x, lp["wq"])
    kv = jnp.einsum("td,dhk->thk", x, lp["wk"]) + jnp.einsum("td,dhk->thk", x, lp["wv"])
    x = x + jnp.einsum("thk,hkd->td", q * jnp.repeat(kv, H // KVH, axis=1), lp["wo"])
    return x + (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def head(x: jax.Array, embed: jax.Array) -> jax.Array:
    return jnp.einsum("nd,vd->nv", x, embed)


@jax.jit
def scan_form(x, stack, embed):
    x, _ = jax.lax.scan(lambda x, lp: (layer(x, lp), None), x, stack)
    return head(x, embed)


@jax.jit
def unrolled_form(x, layers, embed):
    for lp in layers:
        x = layer(x, lp)
    return head(x, embed)


_layer, _head = jax.jit(layer), jax.jit(head)


def host_loop_form(x, layers, embed):
    for lp in layers:
        x = _layer(x, lp)
    return _head(x, embed)


head_only = jax.jit(lambda x, layers, embed: head(x, embed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--forms", nargs="+", default=["scan", "unrolled", "host_loop", "head_only"])
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    stack, layers, embed = weights(np.random.default_rng(0))
    forms = {"scan": (scan_form, stack), "unrolled": (unrolled_form, layers),
             "host_loop": (host_loop_form, layers), "head_only": (head_only, layers)}
    for m in args.rows:
        x = jnp.ones((m, D), jnp.float32)
        times = {name: [] for name in args.forms}
        for name in args.forms:
            fn, params = forms[name]
            jax.block_until_ready(fn(x, params, embed))  # compile and first run
        for _ in range(args.calls):
            for name in args.forms:
                fn, params = forms[name]
                t = time.perf_counter()
                jax.block_until_ready(fn(x, params, embed))
                times[name].append(time.perf_counter() - t)
        print(f"M={m}: " + "  ".join(f"{k} {1e3 * statistics.median(v):.1f} ms (min {1e3 * min(v):.1f})"
                                     for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
