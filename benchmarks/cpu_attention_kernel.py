"""The CPU paged-attention kernel alone (cpu_kernels/paged_attention.cc) at a decode step's shape: 30 layer calls.

    PYTHONPATH=<tree> JAX_PLATFORMS=cpu python benchmarks/cpu_attention_kernel.py [--seqs 32] [--context 160]
        [--pages random|hot] [--shared 0] [--reps 15]

SmolLM2's bfloat16 pool [30, 2912, 2, 3, 16, 64] (about 1 GiB), one decode token per sequence with 9 query heads
over 3 KV heads. ``random``: each sequence's pages are distinct blocks drawn at random from the whole pool, as a
served engine's are scattered; ``hot``: every sequence reads the same few blocks, which stay in cache, so the
figure is the kernel's arithmetic without its memory stalls. ``--shared N``: the first N tokens' blocks are the same
for every sequence (a cached prompt prefix, as the shared_prefix workload's), the rest as --pages says. Prints the median ms of the 30 calls and the K/V
bytes they read per ms. To compare two trees, run it under each tree's PYTHONPATH, alternating.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.paged_attention import available, paged_attention

LAYERS, BLOCKS, KV_HEADS, BLOCK, DIM, HEADS = 30, 2912, 3, 16, 64, 9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--pages", choices=["random", "hot"], default="random")
    parser.add_argument("--shared", type=int, default=0, help="tokens of leading blocks every sequence shares")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    assert available(), "the CPU kernels did not build"
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((LAYERS, BLOCKS, 2, KV_HEADS, BLOCK, DIM), np.float32), jnp.bfloat16)
    width = -(-args.context // BLOCK)
    if args.pages == "random":
        tables = rng.permutation(BLOCKS - 1)[:args.seqs * width].reshape(args.seqs, width) + 1
    else:
        tables = np.tile(np.arange(width) + 1, (args.seqs, 1))
    tables[:, :args.shared // BLOCK] = BLOCKS - 1 - np.arange(args.shared // BLOCK)  # blocks no row holds
    tables = jnp.asarray(tables, jnp.int32)
    q = jnp.asarray(rng.standard_normal((args.seqs, HEADS, DIM), np.float32), jnp.bfloat16)
    seqs = jnp.arange(args.seqs, dtype=jnp.int32)
    positions = jnp.full((args.seqs,), args.context - 1, jnp.int32)
    attend = jax.jit(lambda q, pool, layer: paged_attention(q, pool, layer, seqs, positions, tables, DIM ** -0.5))

    def step():
        jax.block_until_ready([attend(q, pool, jnp.int32(layer)) for layer in range(LAYERS)])
    step()
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    megabytes = LAYERS * args.seqs * args.context * 2 * KV_HEADS * DIM * 2 / 1e6
    print(f"{args.seqs} sequences x {args.context} tokens ({args.shared} shared), {args.pages} pages: 30 calls {ms:.2f} ms, "
          f"{megabytes:.0f} MB of K/V, {megabytes / ms:.1f} GB/s")


if __name__ == "__main__":
    main()
