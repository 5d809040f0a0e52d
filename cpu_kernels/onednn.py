"""oneDNN's matmul as an XLA FFI call on the CPU, for bfloat16 weights.

XLA:CPU has no native bfloat16 dot: it converts both operands to float32 for every call (a [32, 576] x [576, 1536]
bfloat16 dot ran at ~2x float32's time here), where oneDNN's avx512_bf16 brgemm kernels read bfloat16 directly.
"""
from __future__ import annotations

import jax

from cpu_kernels.library import available

__all__ = ["available", "matmul"]


def matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x [..., K] . w [K, N] (or w [N, K] with ``transposed``) -> [..., N] in x's dtype, float32 accumulation.
    CPU only, and only where ``available()``."""
    n = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), x.dtype)
    return jax.ffi.ffi_call("jaxpage_onednn_matmul", out)(x, w, transposed=int(transposed))
