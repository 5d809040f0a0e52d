"""Paged decode attention for NVIDIA GPUs (A100, H100): Pallas with the Triton lowering, split-K over pages.

One program per (sequence, KV head, split): it loads the sequence's query heads that share this KV head
(padded to at least 16 rows, the smallest tensor-core tile), walks its split's pages ``pages_per_compute_block``
at a time (a gather of whole pages from the pool through the block table) with an online softmax in float32,
and writes its split's normalised partial output and log-sum-exp. A few jnp ops then combine the splits
(weights ``exp(lse_i - max lse)``), which is exact and stable. Splits past a sequence's length do no work.

Everything below the function signature is free to change: a Mosaic GPU version can replace the body
(JAX deprecated the Triton lowering in 0.11) without touching a caller.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant import dequantize, pool_parts, scale_operands, split_scales
from pallas_kernels.common import MASK_VALUE, check_decode_args, soft_cap_logits, window_start

try:  # the Triton flavour's compiler params; their presence selects the Triton lowering on GPU
    from jax.experimental.pallas import triton as _pl_triton
    _TritonParams = getattr(_pl_triton, "CompilerParams", None) or getattr(_pl_triton, "TritonCompilerParams")
except ImportError:  # a JAX without the Triton lowering: interpret mode still works
    _pl_triton = _TritonParams = None

# JAX >= 0.11 warns at every lowering of a Triton kernel (far from any call of ours, inside the caller's jit);
# we stay on that lowering on purpose until it is removed (GPU_PATH.md), so that one warning is not shown.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
TARGET_PROGRAMS = 512  # enough programs to fill an H100's 132 SMs a few times over


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_params(num_warps: int, num_stages: int) -> dict:
    """pallas_call keywords selecting the Triton lowering on GPU (ignored by the interpreter)."""
    return {} if _TritonParams is None else dict(
        compiler_params=_TritonParams(num_warps=num_warps, num_stages=num_stages))


def masked_store(ref, value, mask) -> None:
    """Stores ``value`` where ``mask`` is set (the Triton flavour's masked store; plain where it is absent)."""
    store = getattr(_pl_triton, "store", None)
    if store is not None:
        store(ref, value, mask=mask)
    else:  # read-modify-write: correct for the interpreter, where programs run one after another
        ref[...] = jnp.where(mask, value, ref[...])


def check_triton_shapes(block_size: int, head_dim: int, pages_per_block: int, interpret) -> None:
    """Triton wants power-of-two tiles, and tl.dot at least 16 along each side (not the interpreter)."""
    if block_size & (block_size - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"block_size ({block_size}) and head_dim ({head_dim}) must be powers of two, head_dim >= 16")
    if pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_compute_block={pages_per_block} must be a power of two")
    if not interpret and pages_per_block * block_size < 16:
        raise ValueError(f"pages_per_compute_block * block_size = {pages_per_block * block_size} must be >= 16")


def default_pages_per_block(block_size: int, width: int) -> int:
    """About 64 keys per step, no more pages than the table has (rounded up to a power of two), >= 16 keys."""
    return max(min(max(1, 64 // block_size), next_pow2(width)), pl.cdiv(16, block_size))


def choose_splits(num_seqs: int, kv_heads: int, width: int, pages_per_compute_block: int) -> int:
    """Pages per split: split the table until there are about TARGET_PROGRAMS programs (never below one
    compute block per split)."""
    chunks = pl.cdiv(width, pages_per_compute_block)
    splits = max(1, min(chunks, pl.cdiv(TARGET_PROGRAMS, num_seqs * kv_heads)))
    return pl.cdiv(chunks, splits) * pages_per_compute_block


def online_softmax_step(q, k, v, visible, carry, *, scale, soft_cap, precision, row_visible=None):
    """One chunk of keys: q [R, D], k and v [K, D] (loaded values), visible [K] bool; carry (m [R], l [R],
    acc [R, D]) in float32. Masked keys are selected away (``where``), never multiplied, so NaN or stale data
    in them cannot leak; a chunk with no visible key leaves the carry as it was. row_visible [R, K], when
    given, masks further per row (causal attention inside a query block); V is selected by ``visible``."""
    m, l, acc = carry
    logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * scale
    logits = soft_cap_logits(logits, soft_cap)
    mask = visible[None, :] if row_visible is None else visible[None, :] & row_visible
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(logits - m_new[:, None]), 0.0)
    v = jnp.where(visible[:, None], v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
    return m_new, l * correction + p.sum(axis=1), acc * correction[:, None] + pv


def init_carry(rows: int, head_dim: int):
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def load_pages(pool_ref, scales_ref, layer, pages, kv: int, kv_head, dtype) -> jax.Array:
    """K (kv 0) or V (kv 1) of one KV head on ``pages`` [P], as [P * block_size, D] in ``dtype`` (dequantized)."""
    values = pool_ref[layer, pages, kv, kv_head, :, :]
    scales = None if scales_ref is None else scales_ref[layer, pages, kv, kv_head, :]
    return dequantize(values, scales, dtype).reshape(-1, values.shape[-1])


def paged_keys_loop(q, pool_ref, layer, kv_head, page_at, first_page, num_pages, length, carry, *, block_size,
                    pages_per_block, lowest=0, row_lowest=None, scales_ref=None, **step):
    """The online softmax over pages ``first_page .. first_page + num_pages - 1`` (``page_at(i)`` gives the block
    ids of this loop's i-th chunk of ``pages_per_block`` pages), keys at positions ``>= length`` or ``< lowest``
    masked (chunks wholly below ``lowest`` skipped), and per row below ``row_lowest`` [R] when given.
    scales_ref: a quantized pool's scales (None: no scales)."""
    block_tokens = pages_per_block * block_size

    def body(c, carry):
        pages = page_at(c)  # [P]
        k, v = (load_pages(pool_ref, scales_ref, layer, pages, kv, kv_head, q.dtype) for kv in (0, 1))
        key_pos = (first_page + c * pages_per_block) * block_size + jnp.arange(block_tokens)
        row_visible = None if row_lowest is None else key_pos[None, :] >= row_lowest[:, None]
        return online_softmax_step(q, k, v, (key_pos < length) & (key_pos >= lowest), carry,
                                   row_visible=row_visible, **step)

    first_chunk = jnp.maximum(lowest // block_size - first_page, 0) // pages_per_block
    return jax.lax.fori_loop(first_chunk, pl.cdiv(num_pages, pages_per_block), body, carry)


def finish_carry(carry):
    """(normalised output [R, D], log-sum-exp [R]); a row that saw no key gives 0 and MASK_VALUE."""
    m, l, acc = carry
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    return acc / l_safe[:, None], jnp.where(empty, MASK_VALUE, m + jnp.log(l_safe))


def _decode_kernel(layer_ref, window_ref, lens_ref, tables_ref, q_ref, pool_ref, *refs, block_size,
                   pages_per_block, pages_per_split, quantized, **step):
    scales_ref, (o_ref, lse_ref) = split_scales(refs, quantized)
    kv_head, split = pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[0], lens_ref[0]
    lowest = window_start(length - 1, window_ref[0])  # splits wholly before it do no work
    first_page = split * pages_per_split
    num_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_split)
    q = q_ref[...]  # [Gp, D]
    carry = paged_keys_loop(q, pool_ref, layer, kv_head,
                            lambda c: tables_ref[pl.ds(c * pages_per_block, pages_per_block)],
                            first_page, num_pages, length, init_carry(*q.shape), block_size=block_size,
                            pages_per_block=pages_per_block, lowest=lowest, scales_ref=scales_ref, **step)
    o_ref[...], lse_ref[...] = finish_carry(carry)


def paged_decode_attention_gpu(q: jax.Array, pool: jax.Array, layer, block_tables: jax.Array,
                               context_lens: jax.Array, *, scale: float, soft_cap: float | None = None,
                               window=0, interpret=False, pages_per_split: int | None = None,
                               pages_per_compute_block: int | None = None, num_warps: int = 4,
                               num_stages: int = 2) -> jax.Array:
    """Paged decode attention; same semantics as reference.paged_decode_attention_reference.

    q: [S, H, D] (one query token per sequence); pool: [L, N, 2, KVH, block_size, D], whole, read at ``layer``
    (int32 scalar); block_tables: int32 [S, W]; context_lens: int32 [S] (0 = empty row, output 0); window:
    int32 scalar, traced or not (0: every key). Returns [S, H, D] in q's dtype.
    Constraints (Triton): block_size and D powers of two, D >= 16; ``pages_per_compute_block`` (default
    about 64 keys, see default_pages_per_block) a power of two covering at least 16 keys; ``pages_per_split``
    (default: enough splits for ~TARGET_PROGRAMS programs) is rounded up to a multiple of it. The table is padded with null-block
    entries to a whole number of splits; padded and out-of-length keys are masked, never read into a sum.
    interpret: True runs the kernel on CPU through the Pallas interpreter.
    """
    num_seqs, num_heads, head_dim, kv_heads, block_size, width = check_decode_args(
        q, pool, layer, block_tables, context_lens, scale, soft_cap, window)
    pages_per_block = pages_per_compute_block or default_pages_per_block(block_size, width)
    check_triton_shapes(block_size, head_dim, pages_per_block, interpret)
    if pages_per_split is None:
        pages_per_split = choose_splits(num_seqs, kv_heads, width, pages_per_block)
    pages_per_split = pl.cdiv(pages_per_split, pages_per_block) * pages_per_block
    num_splits = pl.cdiv(width, pages_per_split)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_splits * pages_per_split - width)))

    group = num_heads // kv_heads
    rows = max(16, next_pow2(group))
    q_g = q.reshape(num_seqs, kv_heads, group, head_dim)
    q_g = jnp.pad(q_g, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT

    values, scales = pool_parts(pool)
    kernel = functools.partial(_decode_kernel, scale=float(scale), soft_cap=soft_cap, block_size=block_size,
                               pages_per_block=pages_per_block, pages_per_split=pages_per_split,
                               precision=precision, quantized=scales is not None)
    params = triton_params(num_warps, num_stages)
    o, lse = pl.pallas_call(
        kernel,
        grid=(num_seqs, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, k: (0,)),  # layer
            pl.BlockSpec((1,), lambda s, h, k: (0,)),  # window
            pl.BlockSpec((1,), lambda s, h, k: (s,)),  # context length
            pl.BlockSpec((None, pages_per_split), lambda s, h, k: (s, k)),  # this split's table entries
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, k: (s, h, 0, 0)),  # q
            pl.BlockSpec(pool.shape, lambda s, h, k: (0,) * 6),  # the whole pool: indexed by page in-kernel
        ] + [pl.BlockSpec(x.shape, lambda s, h, k: (0,) * 5) for x in scale_operands(scales)],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, k: (s, h, k, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (s, h, k, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((num_seqs, kv_heads, num_splits, rows, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((num_seqs, kv_heads, num_splits, rows), jnp.float32)],
        interpret=interpret,
        name="paged_decode_attention_gpu",
        **params,
    )(layer_arr, jnp.asarray(window, jnp.int32).reshape(1), context_lens, tables, q_g, values,
      *scale_operands(scales))
    if num_splits == 1:
        out = o[:, :, 0]
    else:  # combine the splits' partial softmaxes: weights exp(lse_i - max_j lse_j), exact and stable
        weights = jnp.exp(lse - lse.max(axis=2, keepdims=True))
        out = (weights[..., None] * o).sum(axis=2) / weights.sum(axis=2)[..., None]
    return out[:, :, :group].reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
