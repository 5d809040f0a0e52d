"""The packed KV layout: a token's K and V side by side in one row of ``2 * head_dim`` lanes.

    pool: [num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim]   (lanes 0..D-1: K, D..2D-1: V)

A TPU tiles a row-major array's last two axes by (8, 128): in the engine's unpacked layout (pallas_kernels.common)
a head_dim-64 row takes 128 lanes, half of them padding. Packed, K and V of a token fill the 128 lanes, so a
block costs its real bytes. jaxpage.attention.kv_cache says when the engine packs (the ``pallas_tpu`` backend and
head_dim 64). A page is still one contiguous run of every KV head; an int8 pool's scales keep their layout
``[L, N, 2, KVH, block_size]``. The pool's rank tells its layout (5: packed, 6: not).
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.quant import pool_parts, with_parts

PACKED_LANES = 128  # a TPU vector register's lanes: K and V of head_dim 64 fill one row


def is_packed(pool) -> bool:
    return pool_parts(pool)[0].ndim == 5


def pack(values):
    """[..., 2, KVH, block_size, D] -> [..., KVH, block_size, 2 * D] (any leading axes)."""
    return jnp.concatenate([values[..., 0, :, :, :], values[..., 1, :, :, :]], axis=-1)


def unpack(values):
    """The inverse of ``pack``."""
    head_dim = values.shape[-1] // 2
    return jnp.stack([values[..., :head_dim], values[..., head_dim:]], axis=-4)


def pack_pool(pool):
    """A pool (a ScaledPool's values; its scales as they are) in the packed layout."""
    values, scales = pool_parts(pool)
    return with_parts(pack(values), scales)


def unpack_pool(pool):
    values, scales = pool_parts(pool)
    return with_parts(unpack(values), scales)
