"""The K/V write for TPU: each new token's K and V into its slot of the pool, in place, by DMA. The XLA attention
path's write on a TPU; the ragged kernel (ragged_tpu) writes its batch's K/V itself, in the attention pass.

XLA:TPU cannot scatter into the pool in its own layout: it relayouts the whole pool around every scatter (two
full copies per layer per step, and a pool-sized temporary). Mosaic rejects a DMA of a single token's row of a
16-bit pool ("Offsets along tiled dimensions must be aligned to tiles": a page's ``[block_size, head_dim]`` is
tiled in HBM, rows packed in pairs, and a token's offset is not a multiple of the tile). So this kernel reads
the aligned tile of rows around each token (``[2, KVH, rows, D]``), selects the token's row in, and writes the
tile back: one read and one write of a few KiB per token. A grid step takes a block of tokens with all their
reads (then writes) in flight together; every buffer gets the rows of all the block's tokens that fall in its
tile, and only the tile's last token writes it back (two DMAs to one place at once would race); steps run in
order (grid axis ``arbitrary``).

An int8 pool's scales (``[2, KVH, block_size]`` a page) go the same way a whole page at a time (a page's scales
are one aligned tile): read, the tokens' scales selected in, written back by the page's last token.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant import pool_parts, quantize, with_parts
from pallas_kernels.common import check_pool
from pallas_kernels.decode_attention.tpu import ANY, ARBITRARY, _CompilerParams


def tile_rows(dtype) -> int:
    """Rows of one (sublane) tile of the pool in HBM: 8 for 32-bit values, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _write_kernel(layer_ref, slot_ref, kv_ref, *refs, block_size, quantized):
    if quantized:
        scales_ref, _pool_in, _scales_in, pool_hbm, scales_hbm, buf, sems, scale_buf, scale_sems = refs
        _write_tiles(layer_ref, slot_ref, scales_ref, scales_hbm, scale_buf, scale_sems, block_size, block_size,
                     lambda page, _: page)
    else:
        _pool_in, pool_hbm, buf, sems = refs
    rows = buf.shape[3]
    _write_tiles(layer_ref, slot_ref, kv_ref, pool_hbm, buf, sems, block_size, rows,
                 lambda page, first: page.at[:, :, pl.ds(first, rows)])


def _write_tiles(layer_ref, slot_ref, new_ref, pool_hbm, buf, sems, block_size, rows, tile_of_page):
    """Every token's row (new_ref [tokens, 2, KVH, ...]) into the aligned tile of ``rows`` slots around its slot
    (``tile_of_page(page ref, first slot)``; buf [tokens, 2, KVH, rows, ...]): read, select in, write back."""
    tokens, _, kv_heads = buf.shape[:3]
    first_token, layer = pl.program_id(0) * tokens, layer_ref[0]

    def tile(i):  # the aligned rows of token i's page around its slot, in HBM
        slot = slot_ref[first_token + i]
        first = pl.multiple_of(slot % block_size // rows * rows, rows)
        return tile_of_page(pool_hbm.at[layer, slot // block_size], first)

    reads = [pltpu.make_async_copy(tile(i), buf.at[i], sems.at[i]) for i in range(tokens)]
    for copy in reads:
        copy.start()
    for copy in reads:
        copy.wait()
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1) if buf.ndim == 5 else (rows,), 0)

    def put(j, _):  # token j's row into every buffer holding its tile, in token order (the last of a slot wins)
        slot = slot_ref[first_token + j]

        def into(i, _):
            mine = jnp.logical_and(row == slot % rows, slot // rows == slot_ref[first_token + i] // rows)
            for kv in range(2):
                for h in range(kv_heads):
                    buf[i, kv, h] = jnp.where(mine, new_ref[j, kv, h][None], buf[i, kv, h])

        jax.lax.fori_loop(0, tokens, into, None)

    jax.lax.fori_loop(0, tokens, put, None)
    writes = []
    for i in range(tokens):  # one write per tile: the buffer of the tile's last token (the others hold the same)
        tile_id = slot_ref[first_token + i] // rows
        last = functools.reduce(jnp.logical_and, [slot_ref[first_token + j] // rows != tile_id
                                                  for j in range(i + 1, tokens)], jnp.bool_(True))
        writes.append((last, pltpu.make_async_copy(buf.at[i], tile(i), sems.at[i])))
    for last, copy in writes:
        pl.when(last)(copy.start)
    for last, copy in writes:
        pl.when(last)(copy.wait)


def write_kv_tpu(pool: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array, *,
                 interpret=False, tokens_per_block: int = 8) -> jax.Array:
    """Same result as reference.write_kv_reference (tokens sharing a slot: the last one wins); the pool is aliased to
    the output, so under ``jit`` with the pool donated it is updated in place.

    pool: [L, N, 2, KVH, block_size, D] (or an int8 ScaledPool); k, v: [T, KVH, D], quantized here (the
    reference's ``quant.quantize``) to the pool's dtype; slot_mapping: int32 [T].
    block_size must be a multiple of ``tile_rows(pool.dtype)`` (16 for bfloat16). tokens_per_block (reduced to
    gcd(T, it)): tokens per grid step, whose tile reads (and writes) are in flight together."""
    _, _, _, kv_heads, block_size, head_dim = check_pool(pool, layer)
    rows = tile_rows(pool.dtype)
    if block_size % rows:
        raise ValueError(f"block_size={block_size} must be a multiple of {rows} for a {pool.dtype} pool on TPU")
    num_tokens = k.shape[0]
    tokens = math.gcd(num_tokens, tokens_per_block)
    values, scales = pool_parts(pool)
    kv, kv_scales = quantize(jnp.stack([k, v], axis=1), pool.dtype)  # [T, 2, KVH, D], [T, 2, KVH] or None
    new = [kv] if scales is None else [kv, kv_scales]
    pools = [values] if scales is None else [values, scales]
    scratch = [pltpu.VMEM((tokens, 2, kv_heads, rows, head_dim), pool.dtype), pltpu.SemaphoreType.DMA((tokens,))]
    if scales is not None:  # a whole page of scales per token
        scratch += [pltpu.VMEM((tokens, 2, kv_heads, block_size), jnp.float32), pltpu.SemaphoreType.DMA((tokens,))]
    out = pl.pallas_call(
        functools.partial(_write_kernel, block_size=block_size, quantized=scales is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tokens // tokens,),
            in_specs=[pl.BlockSpec((tokens,) + x.shape[1:], lambda t, *_, n=x.ndim: (t,) + (0,) * (n - 1))
                      for x in new]
            + [pl.BlockSpec(memory_space=ANY) for _ in pools],
            out_specs=[pl.BlockSpec(memory_space=ANY) for _ in pools],
            scratch_shapes=scratch,
        ),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
        input_output_aliases={2 + len(new) + i: i for i in range(len(pools))},
        compiler_params=_CompilerParams(dimension_semantics=(ARBITRARY,)),
        interpret=interpret,
        name="write_kv_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping, *new, *pools)
    return with_parts(*out)
