"""vLLM's SiluAndMul as one FFI call on the CPU (jaxpage/cpu_kernels/silu_and_mul.cc)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ffi_call

__all__ = ["SILU_AND_MUL", "silu_and_mul"]


def silu_and_mul(x: jax.Array) -> jax.Array:
    """x [..., 2, I] (gate, then up; float32 or bfloat16, I a multiple of 16) -> silu(gate) * up [..., I] in x's
    dtype, computed in float32. CPU only (SILU_AND_MUL chooses)."""
    *lead, two, width = x.shape
    rows = x.reshape(-1, two, width)
    out = jax.ShapeDtypeStruct((rows.shape[0], width), x.dtype)
    return ffi_call("jaxpage_silu_and_mul", out)(rows).reshape(*lead, width)


SILU_AND_MUL = CustomOp("silu_and_mul", silu_and_mul,
                        lambda x: x.dtype == jnp.bfloat16 and x.shape[-1] % 16 == 0, whole_operands=True)
