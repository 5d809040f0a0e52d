"""Pure-jnp references for the paged-attention kernels, and the argument checks every kernel shares.

The references define the semantics; each kernel takes the same data arguments (and the same ``scale`` and
``soft_cap``) and adds only tuning keywords. All work on the engine's one KV layout (jaxpage.attention.kv_cache):

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

import jax
import jax.numpy as jnp

from cpu_kernels import kv_write
from pallas_kernels.packed import is_packed, pack_pool, unpack_pool
from pallas_kernels.quant import dequantize, is_quantized, pool_parts, quantize, with_parts

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


def write_kv(pool: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatters new K/V [T, KVH, D] into their slots (block * block_size + offset) of ``layer``: the one K/V write
    of the XLA path and the references (quantized when the pool is)."""
    block_size = pool.shape[4]
    values, scales = pool_parts(pool)
    if k.shape[0] == 1:
        # XLA turns a one-update scatter into a bounds-checked dynamic-update-slice, and then copies the whole
        # pool around it (measured: 10 s per SmolLM2 step on a CPU); a second write, into slot 0 of the null
        # block (jaxpage.attention.kv_cache.NULL_BLOCK, which padding tokens write too), keeps it an in-place scatter
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
        slot_mapping = jnp.concatenate([jnp.asarray(slot_mapping, jnp.int32), jnp.zeros(1, jnp.int32)])
    kv, kv_scales = quantize(jnp.stack([k, v], axis=1), pool.dtype)  # [T, 2, KVH, D], [T, 2, KVH]
    at = (layer, slot_mapping // block_size, slice(None), slice(None), slot_mapping % block_size)
    def scatter(values, kv):
        return values.at[at].set(kv)

    if kv_write.needs_kernel(values.dtype) and kv_write.available():  # XLA:CPU copies the pool around this scatter
        halves = (quantize(k, pool.dtype)[0], quantize(v, pool.dtype)[0])  # K and V apart: no stack on the CPU
        cpu = lambda values, kv, k, v: kv_write.write_kv(values, k, v, layer=layer, slots=slot_mapping)  # noqa: E731
        new_values = jax.lax.platform_dependent(values, kv, *halves, cpu=cpu,
                                                default=lambda values, kv, k, v: scatter(values, kv))
    else:
        new_values = scatter(values, kv)
    return with_parts(new_values, None if scales is None else scales.at[at].set(kv_scales))


def ragged_paged_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer,
                                     token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                                     block_tables: jax.Array, *, scale: float,
                                     soft_cap: float | None = None, window=0) -> tuple[jax.Array, jax.Array]:
    """A flat mixed batch (prefill chunks and decodes): write its K/V, then causal paged attention per token.

    q: [T, H, D]; k, v: [T, KVH, D]; pool: the whole KV pool, written and read at ``layer``; token_seq [T]: the
    row of block_tables [S, W] each token belongs to; positions [T]: token t attends to the key positions
    ``<= positions[t]`` (and ``> positions[t] - window`` when window > 0) of its own sequence; slot_mapping [T]: where token t's K/V go. First every token's K/V
    is written to its slot (write_kv), then every token attends over its sequence's pages
    (jaxpage.attention.backends.paged_attention_xla). Returns (out [T, H, D] in q's dtype, the updated pool).
    """
    check_ragged_args(q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap,
                      window)
    if is_packed(pool):  # the reference reads and writes the unpacked layout: a copy of the whole pool
        out, pool = ragged_paged_attention_reference(q, k, v, unpack_pool(pool), layer, token_seq, positions,
                                                     slot_mapping, block_tables, scale=scale, soft_cap=soft_cap,
                                                     window=window)
        return out, pack_pool(pool)
    pool = write_kv(pool, layer, k, v, slot_mapping)
    out = paged_decode_attention_reference(q, pool, layer, block_tables[token_seq], positions + 1,
                                           scale=scale, soft_cap=soft_cap, window=window)
    return out, pool
