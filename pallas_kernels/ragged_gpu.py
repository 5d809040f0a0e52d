"""Ragged paged attention for GPU (Pallas, Triton lowering): one call writes a flat mixed batch's K/V into the
pool and attends; the GPU counterpart of pallas_kernels.ragged_tpu."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_decode as gpu
from pallas_kernels.reference import check_ragged_args

def _ragged_gpu_kernel(layer_ref, tseq_ref, pos_ref, slot_ref, start_ref, tables_ref, q_ref, k_ref, v_ref,
                       pool_ref, o_ref, pool_out_ref, *, block_size, pages_per_block, new_block, **step):
    token, kv_head = pl.program_id(0), pl.program_id(1)
    layer, seq, slot, start = layer_ref[0], tseq_ref[token], slot_ref[token], start_ref[token]
    start_pos = pos_ref[start]  # keys below the run's first position were in the pool before this call
    head_dim = q_ref.shape[1]

    # This token's K/V into its slot; nobody in this call reads that slot from the pool (see below).
    block, offset = slot // block_size, slot % block_size
    pool_out_ref[layer, block, 0, kv_head, offset, :] = k_ref[token, kv_head, :]
    pool_out_ref[layer, block, 1, kv_head, offset, :] = v_ref[token, kv_head, :]

    q = q_ref[...]  # [Gp, D]
    carry = gpu.paged_keys_loop(
        q, pool_ref, layer, kv_head, lambda c: tables_ref[seq, pl.ds(c * pages_per_block, pages_per_block)],
        0, pl.cdiv(start_pos, block_size), start_pos, gpu.init_carry(*q.shape), block_size=block_size,
        pages_per_block=pages_per_block, **step)

    def new_keys(c, carry):  # this call's keys of the run, straight from the inputs: tokens start .. token
        first = start + c * new_block
        k = k_ref[pl.ds(first, new_block), kv_head, :]
        v = v_ref[pl.ds(first, new_block), kv_head, :]
        visible = first + jnp.arange(new_block) <= token
        return gpu.online_softmax_step(q, k, v, visible, carry, **step)

    carry = jax.lax.fori_loop(0, pl.cdiv(token - start + 1, new_block), new_keys, carry)
    o_ref[...] = gpu.finish_carry(carry)[0].astype(o_ref.dtype)


def ragged_paged_attention_gpu(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer,
                               token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                               block_tables: jax.Array, *, scale: float, soft_cap: float | None = None,
                               interpret=False, pages_per_compute_block: int | None = None,
                               new_tokens_per_block: int = 16, num_warps: int = 4,
                               num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention on GPU (Triton lowering): one call writes the batch's K/V and attends; same
    semantics as reference.ragged_paged_attention_reference for every token outside the null block.

    One program per (token, KV head) with the token's G query heads as rows (padded to 16). GPU programs
    have no order, so a program never reads from the pool what this call writes: it takes keys below its run's
    first position from the pool (pages through the block table), and the run's keys from this call (tokens
    ``run start .. itself``) straight from the k/v inputs, then writes its own K/V into its slot of the output
    pool (aliased to the input: updated in place). This needs, besides check_ragged_args' invariants, that a
    sequence's tokens have consecutive positions (a prompt chunk or a decode), as the engine's batches do.
    Run starts come from a small jnp scan of token_seq. Constraints as for paged_decode_attention_gpu.
    Not tuned: prompt tokens each read their sequence's pages again (a query-block version would share them).
    """
    num_tokens, num_heads, head_dim, kv_heads, block_size, _, width = check_ragged_args(
        q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap)
    pages_per_block = pages_per_compute_block or gpu.default_pages_per_block(block_size, width)
    gpu.check_triton_shapes(block_size, head_dim, pages_per_block, interpret)
    if new_tokens_per_block & (new_tokens_per_block - 1) or (not interpret and new_tokens_per_block < 16):
        raise ValueError(f"new_tokens_per_block={new_tokens_per_block} must be a power of two (>= 16 on GPU)")
    group = num_heads // kv_heads
    rows = max(16, gpu.next_pow2(group))
    q_g = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % pages_per_block)))
    k_pad, v_pad = (jnp.pad(x, ((0, new_tokens_per_block), (0, 0), (0, 0))) for x in (k, v))
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    boundary = jnp.concatenate([jnp.ones((1,), bool), token_seq[1:] != token_seq[:-1]])
    run_start = jax.lax.cummax(jnp.where(boundary, index, 0))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_ragged_gpu_kernel, scale=float(scale), soft_cap=soft_cap, precision=precision,
                               block_size=block_size, pages_per_block=pages_per_block,
                               new_block=new_tokens_per_block)
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731 (indexed in-kernel)
    operands = (jnp.asarray(layer, jnp.int32).reshape(1), token_seq, positions, slot_mapping, run_start, tables,
                q_g, k_pad, v_pad, pool)
    in_specs = [whole(x) for x in operands]
    in_specs[6] = pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0))
    out, pool = pl.pallas_call(
        kernel,
        grid=(num_tokens, kv_heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)), whole(pool)],
        out_shape=[jax.ShapeDtypeStruct(q_g.shape, q.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
        input_output_aliases={len(operands) - 1: 1},
        interpret=interpret,
        name="ragged_paged_attention_gpu",
        **gpu.triton_params(num_warps, num_stages),
    )(*operands)
    return out[:, :, :group].reshape(num_tokens, num_heads, head_dim), pool
