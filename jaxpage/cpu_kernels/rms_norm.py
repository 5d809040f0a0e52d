"""vLLM's rms_norm and fused_add_rms_norm as FFI calls on the CPU (jaxpage/cpu_kernels/rms_norm.cc)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ffi_call

__all__ = ["FUSED_ADD_RMS_NORM", "RMS_NORM", "fused_add_rms_norm", "rms_norm"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D] / rms(x) * weight [D] in x's dtype (float32 or bfloat16, weight the same; D a multiple of 16),
    computed in float32. CPU only (RMS_NORM chooses)."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    return ffi_call("jaxpage_rms_norm", out)(rows, weight, eps=np.float32(eps)).reshape(x.shape)


def fused_add_rms_norm(x: jax.Array, h: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(r, rms_norm(r)) for the residual r = x + h in x's dtype: one pass over the rows."""
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    residual, normed = ffi_call("jaxpage_fused_add_rms_norm", (out, out))(
        rows, h.reshape(rows.shape), weight, eps=np.float32(eps))
    return residual.reshape(x.shape), normed.reshape(x.shape)


def _takes(x: jax.Array, *rest: jax.Array, **params) -> bool:
    """bfloat16 rows (and weight) of a multiple of 16 values: where the kernel beat XLA's fusion."""
    return all(a.dtype == jnp.bfloat16 for a in (x, *rest)) and x.shape[-1] % 16 == 0


RMS_NORM = CustomOp("rms_norm", rms_norm, _takes, whole_operands=True)
FUSED_ADD_RMS_NORM = CustomOp("fused_add_rms_norm", fused_add_rms_norm, _takes, whole_operands=True)
