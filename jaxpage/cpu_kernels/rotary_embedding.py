"""vLLM's rotary_embedding as one FFI call on the CPU, on the fused q/k/v output (jaxpage/cpu_kernels/rotary_embedding.cc)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ffi_call

__all__ = ["ROTARY_EMBEDDING", "rotary_embedding"]


def rotary_embedding(y: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """y [T, KVH, G + 2, D] (per KV head its G query heads, then k, then v; float32 or bfloat16, D a multiple of 32),
    cos and sin [T, D / 2] -> (q [T, KVH * G, D], k [T, KVH, D] rotated, rotate-half, and v [T, KVH, D]) in y's
    dtype, computed in float32. CPU only (ROTARY_EMBEDDING chooses)."""
    tokens, kv_heads, width, head_dim = y.shape
    kv = jax.ShapeDtypeStruct((tokens, kv_heads, head_dim), y.dtype)
    q = jax.ShapeDtypeStruct((tokens, kv_heads * (width - 2), head_dim), y.dtype)
    return ffi_call("jaxpage_rotary_embedding", (q, kv, kv))(y, cos.astype(jnp.float32),
                                                                     sin.astype(jnp.float32))


ROTARY_EMBEDDING = CustomOp("rotary_embedding", rotary_embedding,
                            lambda y, cos, sin: y.dtype == jnp.bfloat16 and y.ndim == 4 and y.shape[-1] % 32 == 0,
                            whole_operands=True)
