"""One layer's XLA attention (jaxpage.attention.backends.paged_attention_xla) at SmolLM2's shapes, float32, the
page plan made inside the call: a 512-token prompt chunk of one sequence at positions 512..1023 (a bucket with
more slots than block-table rows, so query tiles) and one decode token at context 200 (every token its own tile).
Run it under two trees to compare them (`PYTHONPATH=<tree> python benchmarks/xla_attention_tiles.py`).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention.backends import paged_attention_xla

POOL = (30, 400, 2, 3, 16, 64)  # layers, blocks, K/V, kv heads, block size, head_dim
HEADS = 9


def ms_per_call(positions, token_seq, tables, reps: int = 30) -> float:
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal(POOL), jnp.float32)
    q = jnp.asarray(rng.standard_normal((positions.shape[0], HEADS, POOL[-1])), jnp.float32)
    fn = jax.jit(lambda q, pool: paged_attention_xla(q, pool, jnp.int32(3), token_seq, positions, tables, 0.125))
    fn(q, pool).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        fn(q, pool).block_until_ready()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    tables = jnp.arange(1, 1 + 64 * 4, dtype=jnp.int32).reshape(4, 64)
    chunk = ms_per_call(jnp.arange(512, 1024, dtype=jnp.int32), jnp.zeros(512, jnp.int32), tables)
    print(f"prompt chunk, 512 tokens at 512..1023: {chunk:.1f} ms a layer")
    decode = ms_per_call(jnp.array([200], jnp.int32), jnp.zeros(1, jnp.int32), tables)
    print(f"one decode token at context 200: {decode:.3f} ms a layer")


if __name__ == "__main__":
    main()
