"""The paged KV pool: its one layout, its size, and how tokens are written to and read from it.

Layout: ``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]``.
- Page-major: one page (block) of every layer is one contiguous run, K and V side by side, which is what the
  TPU kernel copies with one DMA per page and what swapping and copy-on-write move.
- Within a page, each KV head's K (and V) is a contiguous ``[block_size, head_dim]`` tile, which is what a
  GPU split-K decode kernel loads per head.
- The layer axis leads so the model's ``lax.scan`` over layers carries the whole pool and updates it in place.
Block 0 is the null block: padding tokens write there and padded block-table entries point there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.config import ModelConfig

NULL_BLOCK = 0


def kv_pool_shape(model: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)


def bytes_per_block(model: ModelConfig, block_size: int, dtype) -> int:
    return int(np.prod(kv_pool_shape(model, 1, block_size))) * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(model: ModelConfig, block_size: int, dtype, budget_bytes: int,
                          max_model_len: int) -> int:
    """How many blocks (null block included) a byte budget holds; refuses one too small for a full sequence."""
    per_block = bytes_per_block(model, block_size, dtype)
    needed_blocks = -(-max_model_len // block_size) + 1
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < needed_blocks:
        raise ValueError(
            f"kv_cache_memory={budget_bytes} bytes holds {num_blocks} KV blocks, but one sequence of "
            f"max_model_len={max_model_len} tokens needs {needed_blocks} (null block included), that is "
            f"{needed_blocks * per_block} bytes ({per_block} bytes per block of {block_size} tokens); "
            f"raise kv_cache_memory or lower max_model_len")
    return num_blocks


def device_kv_budget(memory_fraction: float) -> int | None:
    """A fraction of the device memory still free after the weights; None where the device does not say."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return int(free * memory_fraction)


def allocate_kv_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype) -> jax.Array:
    return jnp.zeros(kv_pool_shape(model, num_blocks, block_size), dtype)


def write_kv(pool: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    """Scatters new K/V ``[T, kv_heads, head_dim]`` into their slots (block * block_size + offset)."""
    block_size = pool.shape[4]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv = jnp.stack([k, v], axis=1).astype(pool.dtype)  # [T, 2, kv_heads, head_dim]
    return pool.at[layer, blocks, :, :, offsets, :].set(kv)


def copy_blocks(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies whole pages ``src[i] -> dst[i]`` in every layer (copy-on-write, swap-in)."""
    return pool.at[:, dst].set(pool[:, src])
