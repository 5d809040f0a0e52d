"""The pure-jnp reference of the ragged paged-attention kernels (tpu.py, gpu.py beside it): write the batch's K/V,
then attend, per token."""
from __future__ import annotations

import jax

from pallas_kernels.common import check_ragged_args
from pallas_kernels.decode_attention.reference import paged_decode_attention_reference
from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.packed import is_packed, pack_pool, unpack_pool


def ragged_paged_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array, layer,
                                     token_seq: jax.Array, positions: jax.Array, slot_mapping: jax.Array,
                                     block_tables: jax.Array, *, scale: float,
                                     soft_cap: float | None = None, window=0) -> tuple[jax.Array, jax.Array]:
    """A flat mixed batch (prefill chunks and decodes): write its K/V, then causal paged attention per token.

    q: [T, H, D]; k, v: [T, KVH, D]; pool: the whole KV pool, written and read at ``layer``; token_seq [T]: the
    row of block_tables [S, W] each token belongs to; positions [T]: token t attends to the key positions
    ``<= positions[t]`` (and ``> positions[t] - window`` when window > 0) of its own sequence; slot_mapping [T]: where token t's K/V go. First every token's K/V
    is written to its slot (write_kv_reference), then every token attends over its sequence's pages
    (jaxpage.attention.backends.paged_attention_xla). Returns (out [T, H, D] in q's dtype, the updated pool).
    """
    check_ragged_args(q, k, v, pool, layer, token_seq, positions, slot_mapping, block_tables, scale, soft_cap,
                      window)
    if is_packed(pool):  # the reference reads and writes the unpacked layout: a copy of the whole pool
        out, pool = ragged_paged_attention_reference(q, k, v, unpack_pool(pool), layer, token_seq, positions,
                                                     slot_mapping, block_tables, scale=scale, soft_cap=soft_cap,
                                                     window=window)
        return out, pack_pool(pool)
    pool = write_kv_reference(pool, layer, k, v, slot_mapping)
    out = paged_decode_attention_reference(q, pool, layer, block_tables[token_seq], positions + 1,
                                           scale=scale, soft_cap=soft_cap, window=window)
    return out, pool

