"""A step's LoRA deltas on the CPU as an FFI call (lora_delta.cc): each token against its own adapter's A and B."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import available, ffi_call

__all__ = ["LORA_DELTA", "available", "lora_delta"]


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, *in], a [S, *in, R], b [S, R, *out] (every slot; a and b of one dtype), slots [T] (each token's slot,
    0: none) -> [T, *out] in x's dtype: (x[t] . a[slots[t]]) . b[slots[t]]. CPU only (LORA_DELTA chooses)."""
    flat_x, flat_a = x.reshape(x.shape[0], -1), a.reshape(a.shape[0], -1, a.shape[-1])
    flat_b = b.reshape(*b.shape[:2], -1)
    out = jax.ShapeDtypeStruct((x.shape[0], flat_b.shape[-1]), x.dtype)
    delta = ffi_call("jaxpage_lora_delta", out)(flat_x, flat_a, flat_b, jnp.asarray(slots, jnp.int32))
    return delta.reshape(*x.shape[:1], *b.shape[2:])


LORA_DELTA = CustomOp("lora_delta", lora_delta,
                      lambda x, a, b, slots: x.dtype in (jnp.float32, jnp.bfloat16) and a.dtype in (jnp.float32,
                                                                                                jnp.bfloat16))
