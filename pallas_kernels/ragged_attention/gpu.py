"""Ragged paged attention for GPU (Pallas, Triton lowering): one call writes a flat mixed batch's K/V into the
pool and attends; the GPU counterpart of pallas_kernels.ragged_attention.tpu.

Flash-style query blocks: a program takes up to ``queries_per_block`` consecutive tokens of one sequence (a
block never spans two sequences' runs) times their G query heads as the rows of one tile, so that every page it
loads serves all of them; a decode token is a block of one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import gpu
from pallas_kernels.quant import dequantize, pool_parts, quantize, with_parts
from pallas_kernels.common import check_ragged_args, check_unpacked, window_start


def _write_kv(layer, kv_head, first, count, slot_ref, k_ref, v_ref, pool_out_ref, block_size, new_scales_ref=None,
              scales_out_ref=None):
    """The block's tokens' K/V (quantized by the wrapper, with their scales when the pool has them) into their
    slots; nobody in this call reads those slots from the pool."""
    def body(i, carry):
        token = first + i
        slot = slot_ref[token]
        block, offset = slot // block_size, slot % block_size
        pool_out_ref[layer, block, 0, kv_head, offset, :] = k_ref[token, kv_head, :]
        pool_out_ref[layer, block, 1, kv_head, offset, :] = v_ref[token, kv_head, :]
        if scales_out_ref is not None:
            for kv in (0, 1):
                scales_out_ref[layer, block, kv, kv_head, offset] = new_scales_ref[token, kv, kv_head]
        return carry

    jax.lax.fori_loop(0, count, body, jnp.int32(0))


def _unpack_refs(refs, quantized):
    """(new K/V scales, pool scales, out, pool out, pool scales out) after the pool; None where not quantized."""
    if quantized:
        return refs
    o_ref, pool_out_ref = refs
    return None, None, o_ref, pool_out_ref, None


def _ragged_gpu_kernel(layer_ref, window_ref, tseq_ref, pos_ref, slot_ref, run_ref, first_ref, count_ref,
                       tables_ref, q_ref, k_ref, v_ref, pool_ref, *refs, block_size,
                       pages_per_block, new_block, queries, quantized, **step):
    new_scales_ref, scales_ref, o_ref, pool_out_ref, scales_out_ref = _unpack_refs(refs, quantized)
    qblock, kv_head = pl.program_id(0), pl.program_id(1)
    layer, first, count = layer_ref[0], first_ref[qblock], count_ref[qblock]  # count 0: an unused program
    seq, start = tseq_ref[first], run_ref[first]
    last = first + count - 1  # the block's last token; the run's keys this call brings are tokens start .. last
    start_pos = pos_ref[start]  # keys below the run's first position were in the pool before this call
    _write_kv(layer, kv_head, first, count, slot_ref, k_ref, v_ref, pool_out_ref, block_size, new_scales_ref,
              scales_out_ref)

    group, head_dim = q_ref.shape[2:]
    q = q_ref[pl.ds(first, queries), kv_head, :, :].reshape(queries * group, head_dim)  # row = token * G + head
    row_token = first + jax.lax.broadcasted_iota(jnp.int32, (queries * group,), 0) // group
    row_lowest = window_start(start_pos + row_token - start, window_ref[0])  # positions are consecutive in a run
    lowest = window_start(start_pos + first - start, window_ref[0])  # the block's first row's, the least
    carry = gpu.paged_keys_loop(
        q, pool_ref, layer, kv_head, lambda c: tables_ref[seq, pl.ds(c * pages_per_block, pages_per_block)],
        0, jnp.where(count > 0, pl.cdiv(start_pos, block_size), 0), start_pos, gpu.init_carry(*q.shape),
        block_size=block_size, pages_per_block=pages_per_block, lowest=lowest, row_lowest=row_lowest,
        scales_ref=scales_ref, **step)

    def new_keys(c, carry):  # the run's keys from this call, straight from the inputs, causal by token index
        key0 = start + c * new_block
        k, v = (_load_new(ref, new_scales_ref, pl.ds(key0, new_block), kv, kv_head, q.dtype)
                for kv, ref in enumerate((k_ref, v_ref)))
        key = key0 + jnp.arange(new_block)
        row_visible = (key[None, :] <= row_token[:, None]) & (start_pos + key[None, :] - start >= row_lowest[:, None])
        return gpu.online_softmax_step(q, k, v, key <= last, carry, row_visible=row_visible, **step)

    first_new = jnp.maximum(lowest - start_pos, 0) // new_block  # chunks wholly before the window skipped
    num_new = jnp.where(count > 0, pl.cdiv(last - start + 1, new_block), 0)
    carry = jax.lax.fori_loop(first_new, num_new, new_keys, carry)
    out = gpu.finish_carry(carry)[0].reshape(queries, group, head_dim).astype(o_ref.dtype)
    in_block = jax.lax.broadcasted_iota(jnp.int32, out.shape, 0) < count
    gpu.masked_store(o_ref.at[pl.ds(first, queries), kv_head, :, :], out, in_block)


def _load_new(ref, new_scales_ref, tokens, kv: int, kv_head, dtype):
    """This call's K (kv 0) or V (kv 1) of ``tokens`` for one KV head, dequantized as the pool holds them."""
    scales = None if new_scales_ref is None else new_scales_ref[tokens, kv, kv_head]
    return dequantize(ref[tokens, kv_head, :], scales, dtype)


def query_blocks(token_seq: jax.Array, queries: int, max_blocks: int):
    """(run start per token, first token per block, tokens per block): a run (a sequence's consecutive tokens)
    is cut into blocks of ``queries`` tokens from its start; blocks past the last have 0 tokens."""
    num_tokens = token_seq.shape[0]
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    change = token_seq[1:] != token_seq[:-1]
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), change]), index, 0))
    run_last = jax.lax.cummin(jnp.where(jnp.concatenate([change, jnp.ones((1,), bool)]), index, num_tokens),
                              reverse=True)
    starts = (index - run_start) % queries == 0
    at = jnp.where(starts, jnp.cumsum(starts) - 1, max_blocks)  # out of range: dropped
    first = jnp.zeros((max_blocks,), jnp.int32).at[at].set(index, mode="drop")
    count = jnp.zeros((max_blocks,), jnp.int32).at[at].set(jnp.minimum(queries, run_last - index + 1), mode="drop")
    return run_start, first, count


def ragged_paged_attention_gpu(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer,
                               token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                               block_tables: jax.Array, *, scale: float, soft_cap: float | None = None,
                               window=0, interpret=False, pages_per_compute_block: int | None = None,
                               queries_per_block: int | None = None, new_tokens_per_block: int = 16,
                               num_warps: int = 4, num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """Ragged paged attention on GPU (Triton lowering): one call writes the batch's K/V and attends; same
    semantics as reference.ragged_paged_attention_reference for every token outside the null block; window: int32
    scalar, traced or not (0: full causal attention): pages and new-key chunks wholly before it are skipped.

    One program per (query block, KV head): up to ``queries_per_block`` consecutive tokens of one run (default:
    64 rows of tokens x G padded heads, one Hopper wgmma tile) share each page and key chunk they load. GPU
    programs have no order, so a program never reads from the pool what this call writes: it takes keys below
    its run's first position from the pool (pages through the block table), and the run's keys from this call
    (tokens ``run start .. its last token``, causal by token index) straight from the k/v inputs, then writes
    its own tokens' K/V into their slots of the output pool (aliased to the input: updated in place). This
    needs, besides check_ragged_args' invariants, that a sequence's tokens have consecutive positions (a prompt
    chunk or a decode) and are contiguous, as the engine's batches are: then there are at most S + 1 runs
    (padding may form a second run of row 0), which bounds the grid at ``min(T, ceil(T / Q) + S + 1)`` blocks.
    Constraints as for paged_decode_attention_gpu; queries_per_block and new_tokens_per_block powers of two,
    on GPU rows (queries x G padded) and new tokens per block >= 16.
    """
    num_tokens, num_heads, head_dim, kv_heads, block_size, num_seqs, width = check_ragged_args(
        q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap, window)
    check_unpacked(pool, "ragged_paged_attention_gpu")
    pages_per_block = pages_per_compute_block or gpu.default_pages_per_block(block_size, width)
    gpu.check_triton_shapes(block_size, head_dim, pages_per_block, interpret)
    group = num_heads // kv_heads
    padded_group = gpu.next_pow2(group)
    queries = queries_per_block or max(1, 64 // padded_group)
    for name, n in (("queries_per_block", queries), ("new_tokens_per_block", new_tokens_per_block)):
        if n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two")
    if not interpret and min(queries * padded_group, new_tokens_per_block) < 16:
        raise ValueError(f"queries_per_block * G ({queries} x {padded_group}) and new_tokens_per_block "
                         f"({new_tokens_per_block}) must be >= 16 on GPU")
    max_blocks = min(num_tokens, pl.cdiv(num_tokens, queries) + num_seqs + 1)
    run_start, first, count = query_blocks(token_seq, queries, max_blocks)
    q_g = jnp.pad(q.reshape(num_tokens, kv_heads, group, head_dim),
                  ((0, queries), (0, 0), (0, padded_group - group), (0, 0)))
    tables = jnp.pad(block_tables, ((0, 0), (0, -width % pages_per_block)))
    values, scales = pool_parts(pool)
    (kv_new, new_scales), pad = quantize(jnp.stack([k, v], axis=1), pool.dtype), ((0, new_tokens_per_block),)
    k_pad, v_pad = (jnp.pad(kv_new[:, i], pad + ((0, 0), (0, 0))) for i in (0, 1))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_ragged_gpu_kernel, scale=float(scale), soft_cap=soft_cap, precision=precision,
                               block_size=block_size, pages_per_block=pages_per_block,
                               new_block=new_tokens_per_block, queries=queries, quantized=scales is not None)
    whole = lambda x: pl.BlockSpec(x.shape, lambda b, h: (0,) * x.ndim)  # noqa: E731 (indexed in-kernel)
    operands = (jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(window, jnp.int32).reshape(1), token_seq, positions, slot_mapping, run_start, first,
                count, tables, q_g, k_pad, v_pad, values)
    pools = (values,)
    if scales is not None:  # the new K/V's scales, then the pool's, written in place like the values
        operands, pools = operands + (jnp.pad(new_scales, pad + ((0, 0), (0, 0))), scales), (values, scales)
    aliases = {12: 1} if scales is None else {12: 1, 14: 2}
    out, *pools = pl.pallas_call(
        kernel,
        grid=(max_blocks, kv_heads),
        in_specs=[whole(x) for x in operands],
        out_specs=[whole(q_g)] + [whole(x) for x in pools],
        out_shape=[jax.ShapeDtypeStruct(q_g.shape, q.dtype)] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
        input_output_aliases=aliases,
        interpret=interpret,
        name="ragged_paged_attention_gpu",
        **gpu.triton_params(num_warps, num_stages),
    )(*operands)
    return out[:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim), with_parts(*pools)
