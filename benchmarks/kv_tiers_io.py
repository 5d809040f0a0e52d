"""What one block costs in the prefix cache's tiers, at SmolLM2-135M's block shape (30 layers, 3 KV heads of 64,
16 tokens: 720 KiB in float32): the device -> host store and host -> device restore of ``KVTierMoves`` (batched
gather/scatter, 16 blocks a call), and the disk tier's write and checked read, one file per block (what
``DiskKVTier`` does) against one file per 16-block segment (the alternative), alternated round by round.

    python benchmarks/kv_tiers_io.py [--rounds 3] [--blocks 64]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import jax
import numpy as np

from jaxpage.attention.block_moves import BlockMoves, padded_ids
from jaxpage.attention.kv_cache import allocate_kv_pool, bytes_per_block
from jaxpage.config import ModelConfig
from jaxpage.core.kv_disk_tier import DiskKVTier

RESULTS = Path(__file__).parent / "results" / "kv_tiers_io.json"
SEGMENT = 16


def smollm2_kv() -> ModelConfig:
    import transformers

    from jaxpage.models import config_from_hf

    return config_from_hf(transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                   num_hidden_layers=30, num_attention_heads=9,
                                                   num_key_value_heads=3, max_position_embeddings=2048))


def device_moves(model: ModelConfig, num_blocks: int, rounds: int) -> dict:
    """Seconds per block of a batched store (gather + copy to the host arena) and restore (host -> scatter)."""
    from jaxpage.attention.kv_cache import host_kv_pool

    pool = allocate_kv_pool(model, num_blocks + 1, 16, np.float32)
    arena = host_kv_pool(model, num_blocks, 16, np.float32)
    moves = BlockMoves.jit(jax.devices()[0], np.float32)
    ids = list(range(1, num_blocks + 1))
    store, restore = [], []
    for _ in range(rounds + 1):  # the first round compiles
        started = time.perf_counter()
        for i in range(0, num_blocks, SEGMENT):
            moves.swap_out(pool, arena, padded_ids(ids[i:i + SEGMENT], SEGMENT), np.arange(i, i + SEGMENT))
        store.append((time.perf_counter() - started) / num_blocks)
        started = time.perf_counter()
        for i in range(0, num_blocks, SEGMENT):
            pool = moves.swap_in(pool, arena, np.arange(i, i + SEGMENT), padded_ids(ids[i:i + SEGMENT], SEGMENT))
        jax.block_until_ready(pool)
        restore.append((time.perf_counter() - started) / num_blocks)
    return {"store_ms_per_block": [1e3 * t for t in store[1:]], "restore_ms_per_block": [1e3 * t for t in restore[1:]]}


def disk_per_block(directory: Path, blocks: list[np.ndarray]) -> tuple[float, float]:
    tier = DiskKVTier(directory, 1 << 40, {"model": "bench"}, [(blocks[0].dtype, blocks[0].shape)])
    hashes = [os.urandom(16) for _ in blocks]
    started = time.perf_counter()
    for h, b in zip(hashes, blocks):
        tier.write(h, [b])
    tier.flush()  # the writer thread's files, all in place
    written = time.perf_counter() - started
    started = time.perf_counter()
    for h in hashes:
        assert tier.read(h) is not None
    return written / len(blocks), (time.perf_counter() - started) / len(blocks)


def disk_segments(directory: Path, blocks: list[np.ndarray]) -> tuple[float, float]:
    """The alternative: SEGMENT blocks a file (header + one CRC over the segment), read back whole."""
    header = json.dumps({"model": "bench", "shape": list(blocks[0].shape)}).encode()
    started = time.perf_counter()
    paths = []
    for i in range(0, len(blocks), SEGMENT):
        payload = b"".join(b.tobytes() for b in blocks[i:i + SEGMENT])
        path = directory / f"seg{i}.kvseg"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(header + zlib.crc32(payload).to_bytes(4, "little") + payload)
        os.replace(tmp, path)
        paths.append(path)
    written = time.perf_counter() - started
    started = time.perf_counter()
    for path in paths:
        data = path.read_bytes()
        payload = memoryview(data)[len(header) + 4:]
        assert zlib.crc32(payload) == int.from_bytes(data[len(header):len(header) + 4], "little")
        np.frombuffer(payload, blocks[0].dtype).reshape(-1, *blocks[0].shape)
    return written / len(blocks), (time.perf_counter() - started) / len(blocks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=64)
    args = parser.parse_args()
    model = smollm2_kv()
    shape = (model.num_layers, 2, model.num_kv_heads, 16, model.head_dim)
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(shape, np.float32) for _ in range(args.blocks)]
    result = {"block_bytes": bytes_per_block(model, 16, np.float32), "blocks": args.blocks,
              "load": os.getloadavg(), "per_block_file": [], "segment_file": []}
    for _ in range(args.rounds):  # alternated, side by side
        for name, fn in (("per_block_file", disk_per_block), ("segment_file", disk_segments)):
            with tempfile.TemporaryDirectory() as d:
                w, r = fn(Path(d), blocks)
            result[name].append({"write_ms_per_block": 1e3 * w, "read_ms_per_block": 1e3 * r})
    result["device_moves"] = device_moves(model, args.blocks, args.rounds)
    result["load_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
