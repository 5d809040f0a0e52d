"""The pure-jnp reference of the paged decode kernels (tpu.py, gpu.py beside it): the semantics they match."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE, check_decode_args, soft_cap_logits, window_start
from pallas_kernels.quant import dequantize, pool_parts


def paged_decode_attention_reference(q: jax.Array, pool: jax.Array, layer, block_tables: jax.Array,
                                     context_lens: jax.Array, *, scale: float,
                                     soft_cap: float | None = None, window=0) -> jax.Array:
    """One query token per sequence attending to its first ``context_lens[s]`` keys, read through its table
    (with a window W > 0, only to the last W of them: the query is at position ``context_lens[s] - 1``).

    q: [S, H, D]; pool: the whole KV pool, read at ``layer``; block_tables: int32 [S, W]; context_lens:
    int32 [S] (0 = an empty padding row, whose output is 0). Query heads ``g*G .. g*G+G-1`` share KV head g
    (G = H // KVH). Logits are ``q.k * scale``, then ``soft_cap * tanh(logits / soft_cap)`` when soft_cap
    is set, all in float32. Returns [S, H, D] in q's dtype.
    """
    num_seqs, num_heads, head_dim, kv_heads, block_size, width = check_decode_args(
        q, pool, layer, block_tables, context_lens, scale, soft_cap, window)
    group = num_heads // kv_heads
    values, scales = pool_parts(pool)
    kv = dequantize(values[layer, block_tables], None if scales is None else scales[layer, block_tables],
                    jnp.float32)  # [S, W, 2, KVH, bs, D]: a gather, not a copy of the layer
    kv = kv.transpose(0, 2, 3, 1, 4, 5).reshape(num_seqs, 2, kv_heads, width * block_size, head_dim)
    q_g = q.reshape(num_seqs, kv_heads, group, head_dim).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("skgd,skld->skgl", q_g, kv[:, 0], precision=hi) * scale
    logits = soft_cap_logits(logits, soft_cap)
    key_pos = jnp.arange(width * block_size)[None, :]
    visible = (key_pos < context_lens[:, None]) & (key_pos >= window_start(context_lens - 1, window)[:, None])
    logits = jnp.where(visible[:, None, None, :], logits, MASK_VALUE)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(visible[:, None, None, :], jnp.exp(logits - m), 0.0)
    l = p.sum(axis=-1)
    values = jnp.where(visible[:, None, :, None], kv[:, 1], 0.0)
    out = jnp.einsum("skgl,skld->skgd", p, values, precision=hi) / jnp.where(l == 0, 1.0, l)[..., None]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
