"""One KV pool or one pool per layer group, for models that mix local (sliding window) and global layers.

    python -m benchmarks.hybrid_kv [--budget-gib 32] [--block-size 16] [--json benchmarks/results/hybrid_kv.json]

A block of jaxpage's pool spans every layer, so (a) with one pool a sequence holds ceil(n / bs) blocks in every
layer, local ones included. (b) With one pool per layer group, each with its own block tables (vLLM's hybrid KV
cache manager), the local layers' group keeps only the blocks a window can still see: ceil(W / bs) + 1. Pure
arithmetic on the real models' shapes (layer counts, KV heads, head_dim, windows; bfloat16): the KV bytes a
sequence holds at its final length, and how many such sequences a fixed budget admits at once; for a length mix
(benchmarks/workloads.py's ShareGPT-like one, also scaled up to long chats), the mean over the mix. Under (b) the
budget is shared between the groups as the sequences need it (vLLM's manager carves every group's pages from one
free list), the best case for (b).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from benchmarks import workloads
from jaxpage.config import ModelConfig
from jaxpage.models import config_from_hf

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
MIXES = (("sharegpt", 1.0), ("sharegpt_x8", 8.0), ("sharegpt_x32", 32.0))
MIX_REQUESTS = 2000
DTYPE_BYTES = 2  # bfloat16


def shapes() -> dict[str, ModelConfig]:
    """Gemma 2 9B (local:global 1:1, window 4096), Gemma 3 12B and 27B (5:1, window 1024), as published;
    max_position_embeddings raised to 32k so that the arithmetic runs over the whole range."""
    from transformers import Gemma2Config, Gemma3TextConfig

    common = dict(vocab_size=1024, max_position_embeddings=32768)
    return {
        "gemma2-9b": config_from_hf(Gemma2Config(
            hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, sliding_window=4096, **common)),
        "gemma3-12b": config_from_hf(Gemma3TextConfig(
            hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, sliding_window=1024, **common)),
        "gemma3-27b": config_from_hf(Gemma3TextConfig(
            hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
            num_key_value_heads=16, head_dim=128, sliding_window=1024, **common)),
    }


def layer_block_bytes(cfg: ModelConfig, block_size: int) -> int:
    """One layer's K and V for one block of tokens."""
    return 2 * cfg.num_kv_heads * block_size * cfg.head_dim * DTYPE_BYTES


def seq_bytes(cfg: ModelConfig, n: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """KV bytes of sequences of n tokens: (one pool, per-group pools)."""
    windows = cfg.layer_windows()
    blocks = -(-np.asarray(n) // block_size)
    one_pool = blocks * cfg.num_layers
    per_group = blocks * int((windows == 0).sum())
    for w in set(windows[windows > 0].tolist()):
        per_group = per_group + np.minimum(blocks, math.ceil(w / block_size) + 1) * int((windows == w).sum())
    unit = layer_block_bytes(cfg, block_size)
    return one_pool * unit, per_group * unit


def row(name: str, cfg: ModelConfig, label: str, n: np.ndarray, block_size: int, budget: int) -> dict:
    a, b = (float(np.mean(x)) for x in seq_bytes(cfg, n, block_size))
    return {"model": name, "lengths": label, "mean_tokens": float(np.mean(n)),
            "one_pool_MiB_per_seq": a / 2**20, "per_group_MiB_per_seq": b / 2**20,
            "one_pool_seqs": int(budget // a), "per_group_seqs": int(budget // b), "per_group_gain": a / b}


def mix_lengths(scale: float, max_len: int) -> np.ndarray:
    """Final lengths (prompt + output) of a ShareGPT-like mix, means scaled by ``scale``."""
    w = workloads.sharegpt(MIX_REQUESTS, max_len, vocab_size=1000, seed=0, scale=scale)
    return np.array([len(r.prompt_token_ids) + r.max_tokens for r in w.requests])


def measure(budget: int, block_size: int) -> list[dict]:
    lengths = {str(n): np.array([n]) for n in CONTEXTS}
    lengths.update({label: mix_lengths(scale, max(CONTEXTS)) for label, scale in MIXES})
    return [row(name, cfg, label, n, block_size, budget) for name, cfg in shapes().items()
            for label, n in lengths.items()]


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<11} {'lengths':>13} {'mean tok':>9} {'one pool MiB':>13} {'per-group MiB':>14} "
          f"{'seqs (a)':>9} {'seqs (b)':>9} {'gain':>6}")
    for r in rows:
        print(f"{r['model']:<11} {r['lengths']:>13} {r['mean_tokens']:>9.0f} {r['one_pool_MiB_per_seq']:>13.1f} "
              f"{r['per_group_MiB_per_seq']:>14.1f} {r['one_pool_seqs']:>9} {r['per_group_seqs']:>9} "
              f"{r['per_group_gain']:>5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=32.0, help="KV cache memory (GiB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    rows = measure(budget, args.block_size)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"budget_bytes": budget, "block_size": args.block_size,
                                         "dtype_bytes": DTYPE_BYTES, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
