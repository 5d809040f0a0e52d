"""vLLM's SiluAndMul as one FFI call on the CPU (jaxpage/cpu_kernels/silu_and_mul.cc)."""
from __future__ import annotations

import jax

from jaxpage.cpu_kernels.library import available

__all__ = ["available", "silu_and_mul"]


def silu_and_mul(x: jax.Array) -> jax.Array:
    """x [..., 2, I] (gate, then up; float32 or bfloat16, I a multiple of 16) -> silu(gate) * up [..., I] in x's
    dtype, computed in float32. CPU only, and only where ``available()``."""
    *lead, two, width = x.shape
    rows = x.reshape(-1, two, width)
    out = jax.ShapeDtypeStruct((rows.shape[0], width), x.dtype)
    return jax.ffi.ffi_call("jaxpage_silu_and_mul", out)(rows).reshape(*lead, width)
