"""The K/V write and one layer's attention on XLA:CPU, float32 against bfloat16 pools, with and without the CPU
kernels (cpu_kernels.kv_write): SmolLM2's default pool [30, 2912, 2, 3, 16, 64], 8 new tokens, the pool donated.

    python benchmarks/cpu_kv_kernels.py             # with the kernels (where they build)
    JAXPAGE_ONEDNN=0 python benchmarks/cpu_kv_kernels.py   # XLA's scatter and gather only
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import kv_write
from jaxpage.attention.backends import paged_attention_xla
from pallas_kernels.reference import write_kv

POOL = (30, 2912, 2, 3, 16, 64)
TOKENS = 8


def timed(fn, pool, *args, reps: int = 5) -> float:
    """ms a call, the pool threaded through (donated) as the engine does."""
    pool = fn(pool, *args)[-1]
    jax.block_until_ready(pool)
    start = time.perf_counter()
    for _ in range(reps):
        pool = fn(pool, *args)[-1]
    jax.block_until_ready(pool)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    slots = jnp.arange(TOKENS, dtype=jnp.int32) + 16
    tables = jnp.tile(jnp.arange(1, 5, dtype=jnp.int32), (TOKENS, 1))
    seqs = jnp.arange(TOKENS, dtype=jnp.int32)
    print(f"CPU kernels available: {kv_write.available()}")
    for dtype in (jnp.float32, jnp.bfloat16):
        k = jnp.asarray(rng.standard_normal((TOKENS, 3, 64)), dtype)
        q = jnp.asarray(rng.standard_normal((TOKENS, 9, 64)), dtype)
        write = jax.jit(lambda p, k: (write_kv(p, 3, k, k, slots),), donate_argnums=0)

        def layer(p, q, k):
            p = write_kv(p, 3, k, k, slots)
            return paged_attention_xla(q, p, jnp.int32(3), seqs, seqs, tables, 0.125), p

        name = jnp.dtype(dtype).name
        print(f"{name}: K/V write {timed(write, jnp.zeros(POOL, dtype), k):.2f} ms, write + attention "
              f"{timed(jax.jit(layer, donate_argnums=0), jnp.zeros(POOL, dtype), q, k):.2f} ms")


if __name__ == "__main__":
    main()
