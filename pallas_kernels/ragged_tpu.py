"""Ragged paged attention for TPU: one call writes a flat mixed batch's K/V into the pool and attends.

The batch is the engine's (jaxpage.model.TokenBatch): T tokens, each with its block-table row (token_seq), its
position and its slot; a sequence's tokens are contiguous, decodes usually first. The kernel:

- the batch's K/V go into their slots first (``kv_write_tpu``; in place when the pool is donated), so every
  key a token may see is in the pool before the attention kernel starts, and that kernel only reads it;
- grid ``(KV-head blocks, query blocks of TQ tokens)``, both ``parallel`` (megacore: nothing is written to the
  pool, so grid steps have no order);
- step (hb, qb) walks the runs of equal ``token_seq`` inside its query block; for each run it streams the
  sequence's pages from the one holding the first key any of the run's tokens sees (page 0 without a window)
  up to the run's last position in chunks of P pages (one async copy per page of heads hb,
  double buffered) through an online softmax over all TQ x G query rows (rows outside the run are masked),
  and stores the run's rows of the output.

Tokens in the null block (padding) get finite but unspecified outputs: they may read null-block slots that
other padding tokens overwrote. Loaded values are reshaped, refs never are; every copy has a static shape.
The wrapper lays q out as [KVH, T * G, D] (and the output back), so a KV head's query rows are one 2-D tile.

Not tuned yet: a run's first chunk is not prefetched during the previous run (JAX's kernel does that across
sequences), and every run computes all TQ x G rows of its query block (decodes use G of them).

The GPU version is pallas_kernels.ragged_gpu.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_write_tpu import write_kv_tpu
from pallas_kernels.reference import check_ragged_args, window_start
from pallas_kernels.tpu_decode import (ANY, ARBITRARY, PARALLEL, PageCopies, _CompilerParams, attend_chunk,
                                       finish_state, init_state)


def _ragged_kernel(layer_ref, window_ref, tseq_ref, pos_ref, tables_ref,  # scalar prefetch (SMEM)
                   q_ref, row_pos_ref, pool_hbm,  # inputs
                   o_ref,  # output
                   kv_buf, sems,  # scratch
                   *, scale, soft_cap, width, num_tokens, tokens_per_block, pages_per_block, precision):
    head_block, q_block = pl.program_id(0), pl.program_id(1)
    _, _, _, kv_heads, block_size, head_dim = kv_buf.shape  # kv heads of this head block
    rows = q_ref.shape[1]
    group, block_tokens = rows // tokens_per_block, pages_per_block * block_size
    first_head, layer = head_block * kv_heads, layer_ref[0]
    t0 = q_block * tokens_per_block
    t_end = t0 + tokens_per_block
    heads = pl.ds(first_head, kv_heads)

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

        def copies(chunk, slot):
            return PageCopies(lambda page: pool_hbm.at[layer, page, :, heads],
                              lambda j: tables_ref[seq * width + jnp.minimum(j, width - 1)],
                              kv_buf.at[slot], sems.at[slot], chunk, num_pages, pages_per_block, first_page)

        copies(0, 0).start()

        def body(chunk, states):
            slot = chunk % 2

            @pl.when(chunk + 1 < num_chunks)
            def _prefetch_next():
                copies(chunk + 1, 1 - slot).start()

            copies(chunk, slot).wait()
            first = first_page * block_size + chunk * block_tokens
            key_pos = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
            visible = jnp.logical_and(row_in_run, key_pos <= row_pos)  # [rows, K]
            visible = jnp.logical_and(visible, key_pos >= row_lowest)
            # keys past the run's last position, or before its window, may be stale or never copied: select
            # them away
            key_col = first + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
            written = jnp.logical_and(key_col <= max_pos, key_col >= run_lowest)
            new_states = []
            for h in range(kv_heads):
                k = kv_buf[slot, :, 0, h].reshape(block_tokens, head_dim)
                v = kv_buf[slot, :, 1, h].reshape(block_tokens, head_dim)
                v = jnp.where(written, v, jnp.zeros_like(v))
                new_states.append(attend_chunk(q_ref[h], k, v, visible, states[h],
                                               scale=scale, soft_cap=soft_cap, precision=precision))
            return tuple(new_states)

        states = jax.lax.fori_loop(0, num_chunks, body, tuple(init_state(rows, head_dim) for _ in range(kv_heads)))
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
    """Writes the batch's K/V into the pool and attends; same semantics as
    reference.ragged_paged_attention_reference for every token outside the null block.

    q: [T, H, D]; k, v: [T, KVH, D]; pool: [L, N, 2, KVH, block_size, D], whole, written and read at ``layer``;
    token_seq, positions, slot_mapping: int32 [T]; block_tables: int32 [S, W] (see check_ragged_args for the
    batch invariants); window: int32 scalar, traced or not (0: full causal attention). Returns (out [T, H, D], pool). The K/V go in first (``write_kv_tpu``, in place under
    ``jit`` with the pool donated); the attention kernel then only reads the pool.
    queries_per_block (TQ): tokens per grid step, reduced to gcd(T, TQ); pages_per_compute_block (P,
    default ``max(1, 128 // block_size)`` capped at W); kv_heads_per_block: KV heads per step (divides KVH;
    default all). Both grid axes are ``parallel`` (megacore). For real Mosaic: TQ * G a multiple of 8 and
    block_size a multiple of the sublane tiling (8 for 32-bit, 16 for bf16).
    q and the output pass through XLA as [KVH, T * G, D] (one small transpose each way).
    interpret: False, True or ``pltpu.InterpretParams(...)`` as for the decode kernel.
    """
    num_tokens, num_heads, head_dim, kv_heads, block_size, _, width = check_ragged_args(
        q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap, window)
    tokens_per_block = math.gcd(num_tokens, queries_per_block)
    pages_per_block = pages_per_compute_block or max(1, min(width, 128 // block_size))
    kv_heads_per_block = kv_heads_per_block or kv_heads
    if kv_heads % kv_heads_per_block:
        raise ValueError(f"kv_heads_per_block={kv_heads_per_block} must divide kv_heads={kv_heads}")
    pool = write_kv_tpu(pool, layer, k, v, slot_mapping, interpret=interpret)
    group = num_heads // kv_heads
    rows = tokens_per_block * group
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_ragged_kernel, scale=float(scale), soft_cap=soft_cap, width=width,
                               num_tokens=num_tokens, tokens_per_block=tokens_per_block,
                               pages_per_block=pages_per_block, precision=precision)
    # q as [KVH, T * G, D]: a KV head's query rows are one 2-D tile, taken by indexing the ref, never reshaped
    q_rows = q.reshape(num_tokens, kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows = q_rows.reshape(kv_heads, num_tokens * group, head_dim)
    row_positions = jnp.repeat(positions, group).reshape(num_tokens * group, 1)
    q_spec = pl.BlockSpec((kv_heads_per_block, rows, head_dim), lambda hb, qb, *_: (hb, qb, 0))
    scalars = (jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(window, jnp.int32).reshape(1), token_seq, positions, block_tables.reshape(-1))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(kv_heads // kv_heads_per_block, num_tokens // tokens_per_block),
            in_specs=[q_spec, pl.BlockSpec((rows, 1), lambda hb, qb, *_: (qb, 0)), pl.BlockSpec(memory_space=ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block, 2, kv_heads_per_block, block_size, head_dim), pool.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=_CompilerParams(dimension_semantics=(PARALLEL, PARALLEL)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*scalars, q_rows, row_positions, pool)
    out = out.reshape(kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_heads, head_dim), pool
