"""The argument checks every paged-attention kernel and reference shares, and their masking helpers.

The references (one beside each kernel, ``<kernel>/reference.py``) define the semantics; each kernel takes the
same data arguments (and the same ``scale`` and ``soft_cap``) and adds only tuning keywords. All work on the
engine's one KV layout (jaxpage.attention.kv_cache):

    pool: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]   (axis 2: 0 = K, 1 = V)

taken whole together with a ``layer`` index (an int32 scalar, possibly traced inside ``lax.scan``). Block 0 is the
null block. A quantized pool (int8 with its scales, a ``quant.ScaledPool``, or fp8) holds K/V quantized by
``quant.quantize`` on write, and every read dequantizes a page (``quant.dequantize``) to q's dtype. Keys are masked by position, and masked values never reach a product (``where`` on V, not ``0 * V``),
so whatever stale data or NaN sits past a sequence's length cannot leak into its output.

Sliding window: ``window`` (an int32 scalar, possibly traced: the model scans over layers with a per-layer window)
W > 0 lets a query at position p see only the keys at positions k with ``p - W < k <= p``; W = 0 is full causal
attention. Kernels skip the pages wholly before the window and mask the rest.
"""
from __future__ import annotations
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import is_quantized

MASK_VALUE = -1e30  # finite, so a fully masked row gives exp(MASK - MASK) = 1 rather than NaN


def _is_int32(x) -> bool:
    return jnp.asarray(x).dtype == jnp.int32


def check_pool(pool: jax.Array, layer) -> tuple[int, int, int, int, int, int]:
    """The pool's shape in the unpacked layout's terms (L, N, 2, KVH, block_size, D), for either layout."""
    if pool.ndim == 5 and pool.shape[4] % 2 == 0:  # packed (pallas_kernels.packed)
        num_layers, num_blocks, kv_heads, block_size, lanes = pool.shape
        shape = (num_layers, num_blocks, 2, kv_heads, block_size, lanes // 2)
    elif pool.ndim == 6 and pool.shape[2] == 2:
        shape = pool.shape
    else:
        raise ValueError(f"pool must be [num_layers, num_blocks, 2, kv_heads, block_size, head_dim] or packed "
                         f"[num_layers, num_blocks, kv_heads, block_size, 2 * head_dim], got {pool.shape}")
    if jnp.ndim(layer) != 0 or not _is_int32(layer):
        raise ValueError(f"layer must be an int32 scalar, got {jnp.asarray(layer).dtype}{jnp.shape(layer)}")
    return shape


def check_unpacked(pool, kernel: str) -> None:
    """Refuses a packed pool (pallas_kernels.packed) where only the unpacked layout is read."""
    if pool.ndim != 6:
        raise ValueError(f"{kernel} reads the unpacked pool [num_layers, num_blocks, 2, kv_heads, block_size, "
                         f"head_dim], got {pool.shape} (the packed layout is ragged_paged_attention_tpu's)")


def check_window(window) -> None:
    if jnp.ndim(window) != 0 or not jnp.issubdtype(jnp.asarray(window).dtype, jnp.integer):
        raise ValueError(f"window must be an integer scalar, got {jnp.asarray(window).dtype}{jnp.shape(window)}")


def check_pool_dtype(q_dtype, pool_dtype) -> None:
    if not (q_dtype == pool_dtype or is_quantized(pool_dtype)):
        raise ValueError(f"the pool ({pool_dtype}) must have q's dtype ({q_dtype}) or be quantized (int8, fp8)")


def window_start(last_pos, window):
    """The first key position a query at ``last_pos`` sees: 0 for full attention (window 0)."""
    return jnp.where(window > 0, jnp.maximum(last_pos - window + 1, 0), 0)


def check_decode_args(q, pool, layer, block_tables, context_lens, scale, soft_cap, window=0):
    """Checks the shapes and dtypes of a decode call; returns (S, H, D, KVH, block_size, W).

    q: [S, H, D] in pool's dtype; block_tables: int32 [S, W]; context_lens: int32 [S]; H a multiple of KVH.
    Not checked (values, not shapes): 0 <= context_lens <= W * block_size and 0 <= table entries < num_blocks.
    """
    check_unpacked(pool, "a decode kernel")
    _, _, _, kv_heads, block_size, head_dim = check_pool(pool, layer)
    if q.ndim != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [S, num_heads, {head_dim}], got {q.shape}")
    num_seqs, num_heads, _ = q.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of kv_heads={kv_heads}")
    check_pool_dtype(q.dtype, pool.dtype)
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or not _is_int32(block_tables):
        raise ValueError(f"block_tables must be int32 [{num_seqs}, W], got {block_tables.dtype}{block_tables.shape}")
    if context_lens.shape != (num_seqs,) or not _is_int32(context_lens):
        raise ValueError(f"context_lens must be int32 [{num_seqs}], got {context_lens.dtype}{context_lens.shape}")
    if not isinstance(scale, (int, float)) or (soft_cap is not None and not soft_cap > 0):
        raise ValueError(f"scale must be a Python number and soft_cap None or > 0, got {scale}, {soft_cap}")
    check_window(window)
    return num_seqs, num_heads, head_dim, kv_heads, block_size, block_tables.shape[1]


def check_ragged_args(q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap,
                      window=0):
    """Checks a ragged call; returns (T, H, D, KVH, block_size, S, W).

    q: [T, H, D]; k, v: [T, KVH, D]; all in pool's dtype; token_seq, positions, slot_mapping: int32 [T];
    block_tables: int32 [S, W].
    Not checked (values): 0 <= token_seq < S; a sequence's tokens are contiguous with strictly increasing
    positions; slot_mapping[t] = block_tables[token_seq[t], p // bs] * bs + p % bs for p = positions[t]
    (padding tokens: a slot in the null block); positions < W * bs.
    """
    _, _, _, kv_heads, block_size, head_dim = check_pool(pool, layer)
    if q.ndim != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [T, num_heads, {head_dim}], got {q.shape}")
    num_tokens, num_heads, _ = q.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of kv_heads={kv_heads}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != (num_tokens, kv_heads, head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {kv_heads}, {head_dim}], got {x.shape}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_pool_dtype(q.dtype, pool.dtype)
    for name, x in (("token_seq", token_seq), ("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape != (num_tokens,) or not _is_int32(x):
            raise ValueError(f"{name} must be int32 [{num_tokens}], got {x.dtype}{x.shape}")
    if block_tables.ndim != 2 or not _is_int32(block_tables):
        raise ValueError(f"block_tables must be int32 [S, W], got {block_tables.dtype}{block_tables.shape}")
    if not isinstance(scale, (int, float)) or (soft_cap is not None and not soft_cap > 0):
        raise ValueError(f"scale must be a Python number and soft_cap None or > 0, got {scale}, {soft_cap}")
    check_window(window)
    return (num_tokens, num_heads, head_dim, kv_heads, block_size) + tuple(block_tables.shape)


def soft_cap_logits(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    return logits if soft_cap is None else soft_cap * jnp.tanh(logits / soft_cap)

