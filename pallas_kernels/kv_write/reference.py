"""The K/V write as a jnp scatter: the reference the TPU kernel (tpu.py beside it) and the CPU FFI kernel match,
and the write on every platform that has neither (jaxpage.attention.kv_write chooses)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import pool_parts, quantize, with_parts


def write_kv_reference(pool: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatters new K/V [T, KVH, D] into their slots (block * block_size + offset) of ``layer`` (quantized when
    the pool is)."""
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
    return with_parts(values.at[at].set(kv), None if scales is None else scales.at[at].set(kv_scales))
