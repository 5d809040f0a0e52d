"""Paged attention over the flat batch, through block tables: the backend choice and the XLA reference path."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.kv_cache import write_kv

BACKENDS = ("auto", "xla", "pallas_gpu", "pallas_tpu")


def resolve_backend(name: str) -> str:
    """'auto' picks the Pallas kernel of the platform, and the XLA path on the CPU."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} must be one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "xla")


def write_and_attend(backend: str, q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer: jax.Array,
                     token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array, block_tables: jax.Array,
                     scale: float) -> tuple[jax.Array, jax.Array]:
    """Writes this step's K/V into the pool and attends through the block tables; returns (out, pool).

    Every backend has these semantics (pallas_kernels.reference.ragged_paged_attention_reference). On a CPU the
    Pallas backends run through the Pallas interpreter, so the whole engine can be exercised here.
    """
    if backend == "xla":
        pool = write_kv(pool, layer, k, v, slot_mapping)
        return paged_attention_xla(q, pool, layer, token_seq, positions, block_tables, scale), pool
    import pallas_kernels

    kernel = {"pallas_gpu": pallas_kernels.ragged_paged_attention_gpu,
              "pallas_tpu": pallas_kernels.ragged_paged_attention_tpu}[backend]
    interpret = jax.default_backend() == "cpu"
    return kernel(q, k.astype(q.dtype), v.astype(q.dtype), pool, layer, token_seq, positions, slot_mapping,
                  block_tables, scale=scale, interpret=interpret)

_MASKED = -1e30
PAGES_PER_CHUNK = 8  # pages each query token reads per loop iteration


def paged_attention_xla(q: jax.Array, pool: jax.Array, layer: jax.Array, token_seq: jax.Array,
                        positions: jax.Array, block_tables: jax.Array, scale: float) -> jax.Array:
    """Causal attention of each query token over its own sequence's pages, with an online softmax.

    q: ``[T, num_heads, head_dim]``; pool: the whole KV pool (see jaxpage.kv_cache), already holding this step's
    K/V, read at ``layer`` page by page (never sliced whole, which would copy a layer per call); token_seq: ``[T]``, the row of ``block_tables`` ``[S, W]`` that
    each token belongs to; positions: ``[T]``. Token t attends to key positions ``<= positions[t]``.
    The loop runs over chunks of pages up to the longest context in the batch (a dynamic trip count), so the
    cost follows the actual lengths while the block-table width stays static.
    Returns ``[T, num_heads, head_dim]`` in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, block_size = pool.shape[3], pool.shape[4]
    group = num_heads // kv_heads
    chunk_tokens = PAGES_PER_CHUNK * block_size
    tables = block_tables[token_seq]  # [T, W]
    pad = -tables.shape[1] % PAGES_PER_CHUNK
    tables = jnp.pad(tables, ((0, 0), (0, pad)))  # padded entries point at the null block and are masked
    q_g = q.reshape(num_tokens, kv_heads, group, head_dim).astype(jnp.float32) * scale

    def body(chunk, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, chunk * PAGES_PER_CHUNK, PAGES_PER_CHUNK, axis=1)
        kv = pool[layer, pages]  # [T, P, 2, kvh, bs, hd]
        kv = kv.transpose(0, 2, 3, 1, 4, 5).reshape(num_tokens, 2, kv_heads, chunk_tokens, head_dim)
        kv = kv.astype(jnp.float32)
        scores = jnp.einsum("tkgd,tkld->tkgl", q_g, kv[:, 0])
        key_pos = chunk * chunk_tokens + jnp.arange(chunk_tokens)
        visible = (key_pos[None, :] <= positions[:, None])[:, None, None, :]
        scores = jnp.where(visible, scores, _MASKED)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("tkgl,tkld->tkgd", p, kv[:, 1])
        return m_new, l, acc

    num_chunks = jnp.max(positions) // chunk_tokens + 1
    init = (jnp.full((num_tokens, kv_heads, group), _MASKED, jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
