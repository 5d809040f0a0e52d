"""Paged attention on the CPU as an FFI call (paged_attention.cc): every pool dtype, the XLA path's semantics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ffi_call
from pallas_kernels.quant import pool_parts

__all__ = ["PAGED_ATTENTION", "paged_attention"]

MAX_HEAD_DIM = 256  # the kernel's head_dim: a multiple of 16 (its vectors' lanes) up to this


def _takes(q: jax.Array, *rest, **params) -> bool:
    """Whether the kernel takes these queries [T, H, D]."""
    dim = q.shape[-1]
    return q.dtype in (jnp.float32, jnp.bfloat16) and dim % 16 == 0 and dim <= MAX_HEAD_DIM


def paged_attention(q: jax.Array, pool, layer, token_seq: jax.Array, positions: jax.Array, block_tables: jax.Array,
                    scale: float, window=0, soft_cap: float | None = None) -> jax.Array:
    """``backends.paged_attention_xla``'s result (q [T, H, D] float32 or bfloat16 -> [T, H, D] in q's dtype),
    read from the pool in place. CPU only (PAGED_ATTENTION chooses)."""
    values, scales = pool_parts(pool)
    scales = jnp.zeros((0,), jnp.float32) if scales is None else scales.astype(jnp.float32)
    call = ffi_call("jaxpage_paged_attention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return call(q, values, scales, i32(layer), i32(token_seq), i32(positions), i32(block_tables), i32(window),
                scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))


PAGED_ATTENTION = CustomOp("paged_attention", paged_attention, _takes)
