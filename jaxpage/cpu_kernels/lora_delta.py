"""A step's LoRA deltas on the CPU as an FFI call (lora_delta.cc): each token against its own adapter's A and B."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels.library import available

__all__ = ["available", "lora_delta", "supports"]


def supports(x: jax.Array, a: jax.Array) -> bool:
    """Whether the kernel takes these tokens and slots (and is built)."""
    return x.dtype in (jnp.float32, jnp.bfloat16) and a.dtype in (jnp.float32, jnp.bfloat16) and available()


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, K], a [S, K, R], b [S, R, N] (every slot; a and b of one dtype), slots [T] (each token's slot, 0:
    none) -> [T, N] in x's dtype: (x[t] . a[slots[t]]) . b[slots[t]]. CPU only, and only where ``supports``."""
    out = jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), x.dtype)
    return jax.ffi.ffi_call("jaxpage_lora_delta", out)(x, a, b, jnp.asarray(slots, jnp.int32))
