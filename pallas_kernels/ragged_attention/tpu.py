"""Ragged paged attention for TPU: one kernel pass writes a flat mixed batch's K/V into the pool and attends.

The batch is the engine's (jaxpage.model.TokenBatch): T tokens, each with its block-table row (token_seq), its
position and its slot; a sequence's tokens are contiguous, decodes usually first. The kernel:

- grid ``(KV-head blocks, query blocks of TQ tokens)``; head blocks are ``parallel`` (megacore: they touch
  disjoint heads of the pool), query blocks ``arbitrary`` (in order: a prompt chunk's later query blocks read
  the K/V its earlier ones wrote);
- step (hb, qb) walks the runs of equal ``token_seq`` inside its query block; for each run it streams the
  sequence's pages from the one holding the first key any of the run's tokens sees (page 0 without a window)
  up to the run's last position in chunks of P pages (one async copy per page of heads hb, double buffered);
- as a chunk arrives, the run's new K/V rows that belong in its pages (by slot: a padding token whose slot is
  not in its row's pages is not written) are selected into the VMEM copy, the aligned tiles of rows holding
  them (an int8 pool: and those pages' scales) are written back to the pool while the chunk is computed, and
  waited for before the buffer is reused. So every key a token may see is in VMEM or already in the pool, and
  the K/V write reads nothing (the old separate write kernel, ``kv_write_tpu``, read and wrote back a tile per
  token; the XLA path on a TPU still uses it);
- the chunk goes through an online softmax over all TQ x G query rows (rows outside the run are masked), and
  the run's rows of the output are stored.

Tokens in the null block (padding) get finite but unspecified outputs: they may read null-block slots that
other padding tokens overwrote. Loaded values are reshaped, refs never are; every copy has a static shape.
The wrapper lays q out as [KVH, T * G, D] (and the output back), so a KV head's query rows are one 2-D tile,
and the new K/V as [head blocks, T, 2, KV heads of a block, D].

On the packed pool (pallas_kernels.packed, ``[L, N, KVH, block_size, 2 * D]``: what the engine makes for head_dim
64) a page's rows are K and V side by side in 128 lanes, and nothing is sliced at lane 64: q gets zeros in its V
lanes, so q . row is q . K; p @ rows is [p @ K, p @ V], of which the output is the V half. On an MXU 128 wide or
wider a 64-wide contraction or output already takes a whole pass, and a 64-lane vector a whole register, so the
128-wide ones should cost no more (not measured on a chip). The new K/V
arrive packed too ([head blocks, T, KV heads of a block, 2 * D]); an int8 pool's scales keep their layout, K
lanes dequantized by K's scale, V lanes by V's.

Not tuned yet: a run's first chunk is not prefetched during the previous run (JAX's kernel does that across
sequences), every run computes all TQ x G rows of its query block (decodes use G of them), and with one head
block (the default) a v5p's second core has no grid step (query blocks are in order).

The GPU version is pallas_kernels.ragged_attention.gpu.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_write.tpu import tile_rows
from pallas_kernels.packed import is_packed
from pallas_kernels.quant import pool_parts, quantize, scale_operands, with_parts
from pallas_kernels.common import check_ragged_args, window_start
from pallas_kernels.decode_attention.tpu import (ANY, ARBITRARY, PARALLEL, _CompilerParams, attend_chunk, chunk_copies,
                                       finish_state, init_state, kv_scratch, load_kv)


def _unpack(refs, quantized: bool):
    """(new scales, scales in HBM, output, kv_buf, sems, scale_buf, scale_sems, write_sem, dirty) from the refs
    after the new K/V; the scales' None where the pool has none. The pool (and scales) are read and written
    through the kernel's aliased outputs, never its inputs."""
    if quantized:
        new_scales, _, _, o_ref, pool_hbm, scales_hbm, kv_buf, sems, scale_buf, scale_sems, write_sem, dirty = refs
        return new_scales, pool_hbm, scales_hbm, o_ref, kv_buf, sems, scale_buf, scale_sems, write_sem, dirty
    _, o_ref, pool_hbm, kv_buf, sems, write_sem, dirty = refs
    return None, pool_hbm, None, o_ref, kv_buf, sems, None, None, write_sem, dirty


def _buffer_heads(kv_buf, packed: bool) -> int:
    """The KV heads a chunk buffer holds: [2, P, KVH, block_size, 2 * D] packed, else [2, P, 2, KVH, ...]."""
    return kv_buf.shape[2 if packed else 3]


def load_packed_kv(kv_buf, scale_buf, slot, h: int, dtype) -> jax.Array:
    """KV head h's packed rows (K lanes, then V lanes) from buffer ``slot``, [P * block_size, 2 * D] in ``dtype``;
    an int8 pool's K lanes dequantized by the K scales, its V lanes by the V scales."""
    values = kv_buf[slot, :, h]  # [P, block_size, 2 * D]
    if scale_buf is None:
        return values.astype(dtype).reshape(-1, values.shape[-1])
    lane = jax.lax.broadcasted_iota(jnp.int32, values.shape, 2)
    scales = jnp.where(lane < values.shape[-1] // 2, scale_buf[slot, :, 0, h][..., None],
                       scale_buf[slot, :, 1, h][..., None])
    return (values.astype(jnp.float32) * scales).astype(dtype).reshape(-1, values.shape[-1])


def _select_new_rows(run, first_page, slot, kv_buf, scale_buf, new_ref, new_scales, dirty, *, pos_ref,
                     slot_ref, page_block, t0, block_size, rows, packed):
    """The new K/V of tokens ``run`` = (start, end) into buffer ``slot``, which holds the chunk's pages from
    ``first_page`` on; marks each tile of rows it changes in ``dirty`` ([pages, tiles of a page]). Packed: a
    token's new row is its K and V side by side (``new_ref`` [TQ, KVH, 2 * D])."""
    pages_per_block, kv_heads, tiles = kv_buf.shape[1], _buffer_heads(kv_buf, packed), block_size // rows
    for i in range(pages_per_block * tiles):
        dirty[i] = 0
    row = jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_size,), 0)

    def put(t, _):
        page, token_slot = pos_ref[t] // block_size, slot_ref[t]
        i, offset = page - first_page, token_slot % block_size
        mine = jnp.logical_and(jnp.logical_and(i >= 0, i < pages_per_block),
                               page_block(page) == token_slot // block_size)

        @pl.when(mine)
        def _put():
            for kv in range(2):
                for h in range(kv_heads):
                    if not (packed and kv):  # packed: one row holds K and V
                        at = (slot, i, h) if packed else (slot, i, kv, h)
                        new = new_ref[t - t0, h] if packed else new_ref[t - t0, kv, h]
                        kv_buf[at] = jnp.where(row == offset, new[None], kv_buf[at])
                    if scale_buf is not None:
                        scale_buf[slot, i, kv, h] = jnp.where(lane == offset, new_scales[t - t0, kv, h][None],
                                                              scale_buf[slot, i, kv, h])
            dirty[i * tiles + offset // rows] = 1

    jax.lax.fori_loop(run[0], run[1], put, None)


def _write_backs(first_page, slot, kv_buf, scale_buf, pool_hbm, scales_hbm, write_sem, dirty, *, page_block,
                 num_pages, layer, heads, rows, packed):
    """The copies of buffer ``slot``'s dirty tiles (and, for an int8 pool, the whole scales of a page with one)
    back into the pool: [(condition, copy)]."""
    pages_per_block, block_size = kv_buf.shape[1], kv_buf.shape[-2]
    tiles = block_size // rows
    copies = []
    for i in range(pages_per_block):
        j = first_page + i
        block = page_block(j)
        page_dirty = []
        for t in range(tiles):
            flag = jnp.logical_and(j < num_pages, dirty[i * tiles + t] == 1)
            page_dirty.append(flag)
            tile = pl.ds(t * rows, rows)
            if packed:
                src, dst = kv_buf.at[slot, i, :, tile], pool_hbm.at[layer, block, heads, tile]
            else:
                src, dst = kv_buf.at[slot, i, :, :, tile], pool_hbm.at[layer, block, :, heads, tile]
            copies.append((flag, pltpu.make_async_copy(src, dst, write_sem)))
        if scale_buf is not None:
            copies.append((functools.reduce(jnp.logical_or, page_dirty), pltpu.make_async_copy(
                scale_buf.at[slot, i], scales_hbm.at[layer, block, :, heads], write_sem)))
    return copies


def _ragged_kernel(layer_ref, window_ref, tseq_ref, pos_ref, slot_ref, tables_ref,  # scalar prefetch (SMEM)
                   q_ref, row_pos_ref, new_ref,  # inputs (then the new scales, the pool and its scales)
                   *refs,  # outputs (attention, the pool, its scales), scratch
                   scale, soft_cap, width, num_tokens, tokens_per_block, pages_per_block, precision, quantized,
                   packed):
    (new_scales, pool_hbm, scales_hbm, o_ref, kv_buf, sems, scale_buf, scale_sems, write_sem,
     dirty) = _unpack(refs, quantized)
    head_block, q_block = pl.program_id(0), pl.program_id(1)
    kv_heads, (block_size, lanes) = _buffer_heads(kv_buf, packed), kv_buf.shape[-2:]  # of this head block
    rows = q_ref.shape[1]
    group, block_tokens = rows // tokens_per_block, pages_per_block * block_size
    layer = layer_ref[0]
    t0 = q_block * tokens_per_block
    t_end = t0 + tokens_per_block
    heads = pl.ds(head_block * kv_heads, kv_heads)
    tile = tile_rows(kv_buf.dtype)

    # Attention, one run of equal token_seq at a time. A KV head's query rows are [TQ * G, D], row r being
    # token t0 + r // G (the wrapper lays q out as [KVH, T * G, D]); row_pos_ref holds each row's position.
    row_pos = row_pos_ref[...]  # [rows, 1]
    window = window_ref[0]
    row_lowest = window_start(row_pos, window)  # each row's first visible key position
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    def run_body(start):
        seq = tseq_ref[start]

        def in_run(carry):
            r = carry[0]
            return jnp.logical_and(r < t_end, tseq_ref[jnp.minimum(r, num_tokens - 1)] == seq)

        def extend(carry):
            r, max_pos, min_pos = carry
            return r + 1, jnp.maximum(max_pos, pos_ref[r]), jnp.minimum(min_pos, pos_ref[r])

        end, max_pos, min_pos = jax.lax.while_loop(in_run, extend, (start, jnp.int32(0), pos_ref[start]))
        run_lowest = window_start(min_pos, window)
        first_page = run_lowest // block_size
        num_pages = jnp.minimum(max_pos // block_size + 1, width)
        num_chunks = pl.cdiv(num_pages - first_page, pages_per_block)
        row_in_run = jnp.logical_and(row >= (start - t0) * group, row < (end - t0) * group)

        def page_block(j):
            return tables_ref[seq * width + jnp.minimum(j, width - 1)]

        def copies(chunk, slot):
            bufs = [(kv_buf.at[slot], sems.at[slot])]
            bufs += [(scale_buf.at[slot], scale_sems.at[slot])] if quantized else []
            def page_refs(page):
                values = pool_hbm.at[layer, page, heads] if packed else pool_hbm.at[layer, page, :, heads]
                return [values] + ([scales_hbm.at[layer, page, :, heads]] if quantized else [])

            return chunk_copies(page_refs, page_block, bufs, chunk, num_pages, pages_per_block, first_page)

        copies(0, 0).start()

        def body(chunk, states):
            slot = chunk % 2

            @pl.when(chunk + 1 < num_chunks)
            def _prefetch_next():
                copies(chunk + 1, 1 - slot).start()

            copies(chunk, slot).wait()
            chunk_page = first_page + chunk * pages_per_block
            _select_new_rows((start, end), chunk_page, slot, kv_buf, scale_buf, new_ref, new_scales, dirty,
                             pos_ref=pos_ref, slot_ref=slot_ref, page_block=page_block, t0=t0,
                             block_size=block_size, rows=tile, packed=packed)
            writes = _write_backs(chunk_page, slot, kv_buf, scale_buf, pool_hbm, scales_hbm, write_sem, dirty,
                                  page_block=page_block, num_pages=num_pages, layer=layer, heads=heads, rows=tile,
                                  packed=packed)
            for needed, copy in writes:
                pl.when(needed)(copy.start)
            first = chunk_page * block_size
            key_pos = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            visible = jnp.logical_and(row_in_run, key_pos <= row_pos)  # [rows, K]
            visible = jnp.logical_and(visible, key_pos >= row_lowest)
            # keys past the run's last position, or before its window, may be stale or never copied: select
            # them away
            key_col = first + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
            written = jnp.logical_and(key_col <= max_pos, key_col >= run_lowest)
            new_states = []
            for h in range(kv_heads):
                if packed:  # q's V lanes are zeros, so q.row is q.K; the output is the V lanes of p.row
                    k = load_packed_kv(kv_buf, scale_buf, slot, h, q_ref.dtype)
                    v = k
                else:
                    k, v = (load_kv(kv_buf, scale_buf, slot, kv, h, q_ref.dtype) for kv in (0, 1))
                v = jnp.where(written, v, jnp.zeros_like(v))
                new_states.append(attend_chunk(q_ref[h], k, v, visible, states[h],
                                               scale=scale, soft_cap=soft_cap, precision=precision))
            for needed, copy in writes:  # before buffer ``slot`` takes chunk + 2, and before the next run
                pl.when(needed)(copy.wait)
            return tuple(new_states)

        states = jax.lax.fori_loop(0, num_chunks, body, tuple(init_state(rows, lanes) for _ in range(kv_heads)))
        for h in range(kv_heads):
            o_ref[h] = jnp.where(row_in_run, finish_state(states[h]).astype(o_ref.dtype), o_ref[h])
        return end

    jax.lax.while_loop(lambda start: start < t_end, run_body, t0)


def ragged_paged_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer,
                               token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                               block_tables: jax.Array, *, scale: float, soft_cap: float | None = None,
                               window=0, interpret=False, queries_per_block: int = 16,
                               pages_per_compute_block: int | None = None,
                               kv_heads_per_block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes the batch's K/V into the pool and attends, in one kernel; same semantics as
    reference.ragged_paged_attention_reference for every token outside the null block.

    q: [T, H, D]; k, v: [T, KVH, D]; pool: [L, N, 2, KVH, block_size, D] or packed [L, N, KVH, block_size,
    2 * D] (pallas_kernels.packed), whole, written and read at ``layer``;
    token_seq, positions, slot_mapping: int32 [T]; block_tables: int32 [S, W] (see check_ragged_args for the
    batch invariants); window: int32 scalar, traced or not (0: full causal attention). Returns (out [T, H, D],
    pool), the pool aliased to the kernel's output (in place under ``jit`` with the pool donated). K/V are
    quantized to the pool's dtype first (``quant.quantize``, as the reference's write).
    queries_per_block (TQ): tokens per grid step, reduced to gcd(T, TQ); pages_per_compute_block (P,
    default ``max(1, 128 // block_size)`` capped at W); kv_heads_per_block: KV heads per step (divides KVH;
    default all). block_size must be a multiple of ``kv_write_tpu.tile_rows(pool.dtype)`` (tiles are written
    whole). For real Mosaic: TQ * G a multiple of 8.
    q and the output pass through XLA as [KVH, T * G, D] (one small transpose each way).
    interpret: False, True or ``pltpu.InterpretParams(...)`` as for the decode kernel.
    """
    num_tokens, num_heads, head_dim, kv_heads, block_size, _, width = check_ragged_args(
        q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap, window)
    if block_size % tile_rows(pool.dtype):
        raise ValueError(f"block_size={block_size} must be a multiple of {tile_rows(pool.dtype)} for a "
                         f"{pool.dtype} pool on TPU")
    tokens_per_block = math.gcd(num_tokens, queries_per_block)
    pages_per_block = pages_per_compute_block or max(1, min(width, 128 // block_size))
    kv_heads_per_block = kv_heads_per_block or kv_heads
    if kv_heads % kv_heads_per_block:
        raise ValueError(f"kv_heads_per_block={kv_heads_per_block} must divide kv_heads={kv_heads}")
    group, head_blocks = num_heads // kv_heads, kv_heads // kv_heads_per_block
    rows = tokens_per_block * group
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    values, scales = pool_parts(pool)
    pools = (values,) + scale_operands(scales)
    packed = is_packed(pool)
    # [HB, T, 2, KVH/HB, D], packed [HB, T, KVH/HB, 2 * D] (and scales [HB, T, 2, KVH/HB])
    new = _new_kv_by_head_block(k, v, pool.dtype, head_blocks, packed)
    kernel = functools.partial(_ragged_kernel, scale=float(scale), soft_cap=soft_cap, width=width,
                               num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                               pages_per_block=pages_per_block, precision=precision, quantized=scales is not None,
                               packed=packed)
    # q as [KVH, T * G, D]: a KV head's query rows are one 2-D tile, taken by indexing the ref, never reshaped;
    # packed, zeros in the V lanes ([KVH, T * G, 2 * D])
    q_rows = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows = q_rows.reshape(kv_heads, num_tokens * group, head_dim)
    if packed:
        q_rows = jnp.concatenate([q_rows, jnp.zeros_like(q_rows)], axis=-1)
    lanes = q_rows.shape[-1]
    row_positions = jnp.repeat(positions, group).reshape(num_tokens * group, 1)
    q_spec = pl.BlockSpec((kv_heads_per_block, rows, lanes), lambda hb, qb, *_: (hb, qb, 0))
    new_specs = [pl.BlockSpec((None, tokens_per_block) + x.shape[2:],
                              lambda hb, qb, *_, n=x.ndim: (hb, qb) + (0,) * (n - 2)) for x in new]
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(window, jnp.int32).reshape(1), token_seq,
               positions, slot_mapping, block_tables.reshape(-1))
    first_pool = len(scalars) + 2 + len(new)  # operand index of the pool
    out, *pools = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(head_blocks, num_tokens // tokens_per_block),
            in_specs=[q_spec, pl.BlockSpec((rows, 1), lambda hb, qb, *_: (qb, 0))] + new_specs
            + [pl.BlockSpec(memory_space=ANY)] * len(pools),
            out_specs=[q_spec] + [pl.BlockSpec(memory_space=ANY)] * len(pools),
            scratch_shapes=kv_scratch(pages_per_block, kv_heads_per_block, block_size, head_dim, pool.dtype,
                                      scales is not None, packed)
            + [pltpu.SemaphoreType.DMA(()), pltpu.SMEM((pages_per_block * block_size // tile_rows(pool.dtype),),
                                                       jnp.int32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(q_rows.shape, q.dtype)] + [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                                   for x in pools],
        input_output_aliases={first_pool + i: 1 + i for i in range(len(pools))},
        compiler_params=_CompilerParams(dimension_semantics=(PARALLEL, ARBITRARY)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*scalars, q_rows, row_positions, *new, *pools)
    out = out[..., lanes - head_dim:].reshape(kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_heads, head_dim), with_parts(*pools)


def _new_kv_by_head_block(k, v, dtype, head_blocks: int, packed: bool) -> list[jax.Array]:
    """The new K/V quantized to the pool's ``dtype``, [HB, T, 2, KVH / HB, D], packed [HB, T, KVH / HB, 2 * D]
    (then int8's scales, [HB, T, 2, KVH / HB]): a head block's rows are a block of whole trailing dimensions, as
    Mosaic wants them."""
    kv, kv_scales = quantize(jnp.stack([k, v], axis=1), dtype)  # [T, 2, KVH, D], [T, 2, KVH] or None
    parts = [(jnp.concatenate([kv[:, 0], kv[:, 1]], axis=-1), 1) if packed else (kv, 2)]
    parts += [] if kv_scales is None else [(kv_scales, 2)]
    out = []
    for x, heads in parts:  # the KV head axis split into (HB, KVH / HB), HB moved first
        split = x.reshape(x.shape[:heads] + (head_blocks, x.shape[heads] // head_blocks) + x.shape[heads + 1:])
        out.append(jnp.moveaxis(split, heads, 0))
    return out
