"""Paged decode attention for TPU: Pallas Mosaic, in the style of JAX's own TPU ``paged_attention``.

- The layer index, context lengths and (flattened) block tables are scalar prefetch (SMEM).
- The pool stays in HBM (``memory_space=ANY``). The pool's layout keeps one page of one layer, K and V of
  every KV head, contiguous, so each page arrives with ONE async copy into fixed-shape VMEM scratch
  ``[2 (double buffer), P pages, 2, KVH, block_size, D]``; one DMA semaphore per buffer.
- One grid step per sequence, and every step is self-contained (it starts and waits for all of its own copies;
  nothing is prefetched across steps), so the sequence axis is ``parallel``: megacore-safe.
- Inside a step: chunks of P pages, double buffered (chunk c+1 is copied while chunk c is computed), from the
  page holding the window's first key (page 0 without a window); copies of pages past the context length are
  skipped and their buffer rows masked (``where``), never multiplied. The window is scalar prefetch too.
- Online softmax in float32 per KV head (a static loop; the G query heads of one KV head form one matmul).
  Loaded values are reshaped, refs never are; every copy has a static shape.
- A quantized pool: pages are copied as stored (int8 or fp8; an int8 pool's page scales by a second copy into
  their own buffer) and dequantized to q's dtype as they are loaded from VMEM (``load_kv``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant import dequantize, pool_parts, scale_operands
from pallas_kernels.common import MASK_VALUE, check_decode_args, soft_cap_logits, window_start

ANY = getattr(pl, "ANY", None) or pltpu.ANY  # HBM, left where it is
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
PARALLEL = getattr(pltpu, "PARALLEL", "parallel")
ARBITRARY = getattr(pltpu, "ARBITRARY", "arbitrary")


class PageCopies:
    """The async copies of chunk ``chunk`` (pages ``first + chunk*P .. first + chunk*P+P-1``) of one table row
    into one buffer.

    Page j's copy is issued only when ``j < num_pages``; ``wait`` waits under the same condition, so every
    started copy is waited for exactly once. ``src_page(page)`` gives the HBM ref of one page (it picks the
    layer and, for a KV-head block, the heads); ``page_at(j)`` reads the block table in SMEM.
    """

    def __init__(self, src_page, page_at, buf, sem, chunk, num_pages, pages_per_block, first=0):
        self._copies = []
        for i in range(pages_per_block):
            j = first + chunk * pages_per_block + i
            copy = pltpu.make_async_copy(src_page(page_at(j)), buf.at[i], sem)
            self._copies.append((j < num_pages, copy))

    def start(self):
        for needed, copy in self._copies:
            pl.when(needed)(copy.start)

    def wait(self):
        for needed, copy in self._copies:
            pl.when(needed)(copy.wait)


class CopyGroup:
    """Several PageCopies (a chunk's values, and its scales) started and waited together."""

    def __init__(self, *copies):
        self._copies = copies

    def start(self):
        for c in self._copies:
            c.start()

    def wait(self):
        for c in self._copies:
            c.wait()


def load_kv(kv_buf, scale_buf, slot, kv: int, h: int, dtype) -> jax.Array:
    """K (kv 0) or V (kv 1) of KV head h from buffer ``slot``, [P * block_size, D] in ``dtype`` (dequantized)."""
    values = kv_buf[slot, :, kv, h]  # [P, block_size, D]
    scales = None if scale_buf is None else scale_buf[slot, :, kv, h]  # [P, block_size]
    return dequantize(values, scales, dtype).reshape(-1, values.shape[-1])


def kv_scratch(pages_per_block: int, kv_heads: int, block_size: int, head_dim: int, dtype, quantized: bool,
               packed: bool = False):
    """Double-buffered chunk buffers and their DMA semaphores (then the scales' when ``quantized``); ``packed``:
    the values' buffer in the packed layout (pallas_kernels.packed), ``[2, P, KVH, block_size, 2 * D]``."""
    shape = (2, pages_per_block, 2, kv_heads, block_size)
    values = (2, pages_per_block, kv_heads, block_size, 2 * head_dim) if packed else shape + (head_dim,)
    scratch = [pltpu.VMEM(values, dtype), pltpu.SemaphoreType.DMA((2,))]
    return scratch + ([pltpu.VMEM(shape, jnp.float32), pltpu.SemaphoreType.DMA((2,))] if quantized else [])


def unpack_refs(refs, quantized: bool):
    """(scales in HBM, output, kv_buf, sems, scale_buf, scale_sems) from the refs after the pool; the scales'
    None where the pool has none."""
    if quantized:
        scales_hbm, o_ref, kv_buf, sems, scale_buf, scale_sems = refs
        return scales_hbm, o_ref, kv_buf, sems, scale_buf, scale_sems
    o_ref, kv_buf, sems = refs
    return None, o_ref, kv_buf, sems, None, None


def chunk_copies(src_page, page_at, bufs, chunk, num_pages, pages_per_block, first):
    """A CopyGroup of one chunk's copies: ``src_page(page)`` gives the HBM refs (values, scales...) of a page,
    ``bufs`` the (buffer, semaphore) pairs they go to."""
    return CopyGroup(*(PageCopies(lambda page, i=i: src_page(page)[i], page_at, buf, sem, chunk, num_pages,
                                  pages_per_block, first) for i, (buf, sem) in enumerate(bufs)))


def attend_chunk(q_rows, k, v, visible, state, *, scale, soft_cap, precision):
    """One online-softmax step: q_rows [R, D], k and v [K, D] (values), visible [R, K] or broadcastable."""
    m, l, acc = state
    logits = jnp.einsum("rd,kd->rk", q_rows, k, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    logits = soft_cap_logits(logits, soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(logits - m_new), 0.0)
    pv = jnp.einsum("rk,kd->rd", p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, l * correction + p.sum(axis=1, keepdims=True), acc * correction + pv


def init_state(rows: int, head_dim: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def finish_state(state):
    _, l, acc = state
    return acc / jnp.where(l == 0.0, 1.0, l)


def _decode_kernel(layer_ref, window_ref, lens_ref, tables_ref, q_ref, pool_hbm, *refs, scale,
                   soft_cap, width, pages_per_block, precision, quantized):
    scales_hbm, o_ref, kv_buf, sems, scale_buf, scale_sems = unpack_refs(refs, quantized)
    seq = pl.program_id(0)
    _, _, kv_heads, block_size, head_dim = kv_buf.shape[1:]
    group = q_ref.shape[1]
    layer, length = layer_ref[0], lens_ref[seq]
    lowest = window_start(length - 1, window_ref[0])  # the first key position the query sees
    first_page = lowest // block_size
    num_pages = pl.cdiv(length, block_size)
    num_chunks = pl.cdiv(jnp.maximum(num_pages - first_page, 0), pages_per_block)
    block_tokens = pages_per_block * block_size

    def copies(chunk, slot):
        bufs = [(kv_buf.at[slot], sems.at[slot])] + ([(scale_buf.at[slot], scale_sems.at[slot])] if quantized else [])
        return chunk_copies(lambda page: [ref.at[layer, page] for ref in (pool_hbm, scales_hbm)[:len(bufs)]],
                            lambda j: tables_ref[seq * width + jnp.minimum(j, width - 1)],
                            bufs, chunk, num_pages, pages_per_block, first_page)

    copies(0, 0).start()  # starts nothing when the row is empty

    def body(chunk, states):
        slot = chunk % 2

        @pl.when(chunk + 1 < num_chunks)
        def _prefetch_next():
            copies(chunk + 1, 1 - slot).start()

        copies(chunk, slot).wait()
        start = first_page * block_size + chunk * block_tokens
        key_row = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)  # per key, as a row
        key_col = start + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)  # as a column
        visible = jnp.logical_and(key_row < length, key_row >= lowest)
        visible_kv = jnp.logical_and(key_col < length, key_col >= lowest)
        new_states = []
        for h in range(kv_heads):
            k, v = (load_kv(kv_buf, scale_buf, slot, kv, h, q_ref.dtype) for kv in (0, 1))
            v = jnp.where(visible_kv, v, jnp.zeros_like(v))
            new_states.append(attend_chunk(q_ref[h], k, v, visible, states[h],
                                           scale=scale, soft_cap=soft_cap, precision=precision))
        return tuple(new_states)

    states = jax.lax.fori_loop(0, num_chunks, body,
                               tuple(init_state(group, head_dim) for _ in range(kv_heads)))
    for h in range(kv_heads):
        o_ref[h] = finish_state(states[h]).astype(o_ref.dtype)


def paged_decode_attention_tpu(q: jax.Array, pool: jax.Array, layer, block_tables: jax.Array,
                               context_lens: jax.Array, *, scale: float, soft_cap: float | None = None,
                               window=0, interpret=False, pages_per_compute_block: int | None = None) -> jax.Array:
    """Paged decode attention on TPU; same semantics as reference.paged_decode_attention_reference.

    q: [S, H, D]; pool: [L, N, 2, KVH, block_size, D] in HBM, whole, read at ``layer`` (int32 scalar);
    block_tables: int32 [S, W]; context_lens: int32 [S] (0 = empty row, output 0); window: int32 scalar, traced
    or not (0: every key). Returns [S, H, D].
    pages_per_compute_block (P, default ``max(1, 128 // block_size)`` capped at W): pages per DMA chunk; VMEM
    holds ``2 * P`` pages of all KV heads. q is viewed as [S, KVH, G, D] (a free reshape) so the kernel takes a
    KV head's G query rows by indexing the ref. For real Mosaic, block_size should be a multiple of the
    sublane tiling (8 for 32-bit, 16 for bf16) and D a multiple of 128.
    interpret: False (Mosaic), True (the generic Pallas interpreter) or ``pltpu.InterpretParams(...)`` (the TPU
    simulator, which checks DMAs, semaphores, out-of-bounds reads and, with several cores, races).
    """
    num_seqs, num_heads, head_dim, kv_heads, block_size, width = check_decode_args(
        q, pool, layer, block_tables, context_lens, scale, soft_cap, window)
    group = num_heads // kv_heads
    pages_per_block = pages_per_compute_block or max(1, min(width, 128 // block_size))
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    values, scales = pool_parts(pool)
    kernel = functools.partial(_decode_kernel, scale=float(scale), soft_cap=soft_cap, width=width,
                               pages_per_block=pages_per_block, precision=precision, quantized=scales is not None)
    seq_block = pl.BlockSpec((None, kv_heads, group, head_dim), lambda s, *_: (s, 0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_seqs,),
            in_specs=[seq_block] + [pl.BlockSpec(memory_space=ANY)] * (1 + len(scale_operands(scales))),
            out_specs=seq_block,
            scratch_shapes=kv_scratch(pages_per_block, kv_heads, block_size, head_dim, pool.dtype,
                                      scales is not None),
        ),
        out_shape=jax.ShapeDtypeStruct((num_seqs, kv_heads, group, head_dim), q.dtype),
        compiler_params=_CompilerParams(dimension_semantics=(PARALLEL,)),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(window, jnp.int32).reshape(1), context_lens, block_tables.reshape(-1),
      q.reshape(num_seqs, kv_heads, group, head_dim), values, *scale_operands(scales))
    return out.reshape(q.shape)
