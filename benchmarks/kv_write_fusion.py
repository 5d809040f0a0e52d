"""The TPU K/V write inside the ragged attention kernel against the separate write kernel: step memory and bytes.

    python -m benchmarks.kv_write_fusion [--chips v5e] [--json out.json]

- ``steps``: the SmolLM2 engine step (``pallas_tpu``, bfloat16, the lane's config) compiled ahead of time for each
  chip at every token bucket, with its per-chip memory from ``memory_analysis()`` (arguments, aliased pool,
  temporaries). Run it at two revisions to compare.
- ``bytes``: the bytes one layer's K/V write moves through HBM by each kernel's DMA plan, per bucket, for a
  decode-only batch (every token its own sequence, at the last row of a page: the worst case) and for one prompt
  chunk of the bucket's length: the separate kernel (``write_kv_tpu``) reads and writes the aligned tile of
  rows around each token, deduplicated within its blocks of 8 tokens, and an int8 pool's page of scales the
  same way; the fused kernel writes back only the tiles (and pages of scales) holding new rows, deduplicated
  within its query blocks, and reads nothing (attention has already loaded those pages).
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from benchmarks import compile_targets as ct
from pallas_kernels.kv_write_tpu import tile_rows


def step_memory(chips: list[str]) -> list[dict]:
    config = ct.engine_config("smollm2-135m")
    rows = []
    for chip in chips:
        for num_tokens in config.token_buckets():
            r = ct.compile_step(chip, "smollm2-135m", num_tokens, config)
            rows.append(dict(chip=chip, tokens=num_tokens, ok=r.ok, error=r.error, seconds=round(r.seconds, 1),
                             **r.memory))
            print(f"| {chip} | T{num_tokens} | {'compiled' if r.ok else r.error} | "
                  f"args {r.memory.get('argument', 0) / 2**20:.1f} MiB | alias {r.memory.get('alias', 0) / 2**20:.1f} MiB | "
                  f"temp {r.memory.get('temp', 0) / 2**20:.2f} MiB | {r.seconds:.0f} s |", flush=True)
    return rows


def _distinct_per_block(ids: np.ndarray, block: int) -> int:
    """Distinct ids within each consecutive block of ``block`` entries, summed over the blocks."""
    return sum(len(np.unique(ids[i:i + block])) for i in range(0, len(ids), block))


def write_bytes(slots: np.ndarray, *, block_size: int, kv_heads: int, head_dim: int, kv_dtype: str,
                separate_block: int = 8, queries_per_block: int = 16) -> dict:
    """(separate kernel, fused kernel) HBM bytes of one layer's K/V write for tokens at ``slots``."""
    dtype = jnp.dtype(jnp.int8 if kv_dtype == "int8" else kv_dtype)
    rows = tile_rows(dtype)
    lanes = max(head_dim, 128)  # a row of head_dim 64 takes 128 lanes in HBM
    tile = 2 * kv_heads * rows * lanes * dtype.itemsize
    scale_page = 2 * max(kv_heads, 8) * max(block_size, 128) * 4 if kv_dtype == "int8" else 0  # whole tiles
    tiles, pages = slots // rows, slots // block_size
    separate = 2 * (_distinct_per_block(tiles, separate_block) * tile
                    + _distinct_per_block(pages, separate_block) * scale_page)
    block = np.gcd(len(slots), queries_per_block)
    fused = _distinct_per_block(tiles, block) * tile + _distinct_per_block(pages, block) * scale_page
    return {"separate": int(separate), "fused": int(fused)}


def byte_table(block_sizes=(16, 32, 64), kv_dtypes=("bfloat16", "float32", "int8")) -> list[dict]:
    model, buckets = ct.smollm2_config(), ct.engine_config("smollm2-135m").token_buckets()
    rows = []
    for kv_dtype in kv_dtypes:
        for block_size in block_sizes:
            if block_size % tile_rows(jnp.int8 if kv_dtype == "int8" else kv_dtype):
                continue
            for num_tokens in buckets:
                decodes = np.arange(1, num_tokens + 1) * block_size + block_size - 1  # one page each, last row
                chunk = block_size + np.arange(num_tokens)  # one prompt chunk from the second page on
                for batch, slots in (("decode", decodes), ("prefill", chunk)):
                    b = write_bytes(slots, block_size=block_size, kv_heads=model.num_kv_heads,
                                    head_dim=model.head_dim, kv_dtype=kv_dtype)
                    rows.append(dict(kv=kv_dtype, block_size=block_size, tokens=num_tokens, batch=batch, **b))
                    print(f"| {kv_dtype} | bs{block_size} | T{num_tokens} | {batch} | {b['separate'] / 1024:.0f} KiB | "
                          f"{b['fused'] / 1024:.0f} KiB | {b['fused'] / b['separate']:.2f} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=["v5e"], choices=list(ct.TPU_CHIPS))
    parser.add_argument("--only", choices=["steps", "bytes"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    if args.only != "steps":
        print("| KV dtype | block | bucket | batch | separate write | fused write | fused / separate |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        results["bytes"] = byte_table()
    if args.only != "bytes":
        print("| chip | bucket | result | arguments | aliased | temporaries | compile |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        results["steps"] = step_memory(args.chips)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
