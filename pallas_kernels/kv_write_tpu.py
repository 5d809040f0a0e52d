"""The K/V write for TPU: each new token's K and V into its slot of the pool, in place, by DMA.

XLA:TPU cannot scatter into the pool in its own layout: it relayouts the whole pool around every scatter (two
full copies per layer per step, and a pool-sized temporary). Mosaic rejects a DMA of a single token's row of a
16-bit pool ("Offsets along tiled dimensions must be aligned to tiles": a page's ``[block_size, head_dim]`` is
tiled in HBM, rows packed in pairs, and a token's offset is not a multiple of the tile). So this kernel reads
the aligned tile of rows around the token (``[2, KVH, rows, D]``), selects the token's row in, and writes the
tile back: one read and one write of a few KiB per token, the tokens in order (grid axis ``arbitrary``), so
tokens sharing a tile see each other's rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import check_pool
from pallas_kernels.tpu_decode import ANY, ARBITRARY, _CompilerParams


def tile_rows(dtype) -> int:
    """Rows of one (sublane) tile of the pool in HBM: 8 for 32-bit values, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _write_kernel(layer_ref, slot_ref, kv_ref, _pool_in, pool_hbm, buf, sem, *, block_size):
    token = pl.program_id(0)
    rows = buf.shape[2]
    slot = slot_ref[token]
    block, offset = slot // block_size, slot % block_size
    first = pl.multiple_of(offset // rows * rows, rows)
    tile = pool_hbm.at[layer_ref[0], block, :, :, pl.ds(first, rows)]  # [2, KVH, rows, D]
    read = pltpu.make_async_copy(tile, buf, sem)
    read.start()
    read.wait()
    mine = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) == offset - first
    for kv in range(2):
        for h in range(buf.shape[1]):
            buf[kv, h] = jnp.where(mine, kv_ref[kv, h][None, :], buf[kv, h])
    write = pltpu.make_async_copy(buf, tile, sem)
    write.start()
    write.wait()


def write_kv_tpu(pool: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 interpret=False) -> jax.Array:
    """Same result as reference.write_kv (tokens sharing a slot: the last one wins); the pool is aliased to
    the output, so under ``jit`` with the pool donated it is updated in place.

    pool: [L, N, 2, KVH, block_size, D]; k, v: [T, KVH, D] in the pool's dtype; slot_mapping: int32 [T].
    block_size must be a multiple of ``tile_rows(pool.dtype)`` (16 for bfloat16)."""
    _, _, _, kv_heads, block_size, head_dim = check_pool(pool, layer)
    rows = tile_rows(pool.dtype)
    if block_size % rows:
        raise ValueError(f"block_size={block_size} must be a multiple of {rows} for a {pool.dtype} pool on TPU")
    num_tokens = k.shape[0]
    kv = jnp.stack([k, v], axis=1).astype(pool.dtype)  # [T, 2, KVH, D]
    return pl.pallas_call(
        functools.partial(_write_kernel, block_size=block_size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tokens,),
            in_specs=[pl.BlockSpec((None, 2, kv_heads, head_dim), lambda t, *_: (t, 0, 0, 0)),
                      pl.BlockSpec(memory_space=ANY)],
            out_specs=pl.BlockSpec(memory_space=ANY),
            scratch_shapes=[pltpu.VMEM((2, kv_heads, rows, head_dim), pool.dtype), pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},
        compiler_params=_CompilerParams(dimension_semantics=(ARBITRARY,)),
        interpret=interpret,
        name="write_kv_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping, kv, pool)
