"""oneDNN's matmul as an XLA FFI call on the CPU, for bfloat16 weights, and the weights' packed layout.

XLA:CPU has no native bfloat16 dot: it converts both operands to float32 for every call (a [32, 576] x [576, 1536]
bfloat16 dot ran at ~2x float32's time here), where oneDNN's avx512_bf16 brgemm kernels read bfloat16 directly.
With plain weights the kernel reorders them into its own blocked layout inside every call; weights packed once
into that layout (``pack``, as vLLM's CPU backend prepacks its oneDNN weights) skip it.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ONEDNN, cpu_flags, ffi_call, library

__all__ = ["DENSE", "available", "bfloat16_matmul", "dense", "fast_bfloat16", "matmul", "pack", "packs"]


def available() -> bool:
    """Whether oneDNN's library (ONEDNN) is built and its matmul registered with XLA."""
    return library(ONEDNN) is not None


def matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, packed: bool = False,
           gemv_rows: int | None = None) -> jax.Array:
    """x [..., K] . w [K, N] (or w [N, K] with ``transposed``) -> [..., N] in x's dtype, float32 accumulation;
    ``packed``: w holds ``pack``'s bytes (its shape and ``transposed`` still name K and N); ``gemv_rows``: the
    most rows of a packed bfloat16 product that packed_gemv.cc computes (at most 8), oneDNN's kernel the rest.
    By default (None) ``default_gemv_rows()``, and up to ``default_timed_rows()`` rows the faster of the two by
    their measured times (jaxpage/cpu_kernels/timed_choice.h). CPU only, and only where ``available()``."""
    n = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], n), x.dtype)
    rows, timed = (default_gemv_rows(), default_timed_rows()) if gemv_rows is None else (gemv_rows, 0)
    return ffi_call("jaxpage_onednn_matmul", out, ONEDNN)(x, w, transposed=int(transposed), packed=int(packed),
                                                         gemv_rows=int(rows), timed_rows=int(timed))


@functools.cache
def default_gemv_rows() -> int:
    """Rows up to which packed_gemv.cc runs instead of oneDNN's matmul: 8 without AMX (an AMD EPYC: oneDNN's
    kernel was slower there up to 8 rows), 2 with AMX. There oneDNN's AMX kernel is the faster from 3 rows while
    the core's AMX runs at its full speed (SmolLM2's products at 3 rows 0.94x the kernel's time, at 8 rows
    0.67-0.70x), and the kernel at 1-2 rows (0.87x, 0.95x); on the shared VM measured, AMX also ran at half speed
    for minutes at a time, where the kernel slowed 13-31% (benchmarks/RESULTS.md, "AMX's two speeds")."""
    return 2 if _amx() else 8


@functools.cache
def default_timed_rows() -> int:
    """Rows up to which a default product takes whichever of packed_gemv.cc and oneDNN's kernel ran faster on its
    shape lately (jaxpage/cpu_kernels/timed_choice.h): 8 on an AMX CPU, whose AMX kernel has two speeds, 0 elsewhere (and
    with ``JAXPAGE_CPU_TIMED_PRODUCTS=0``, for a kernel choice that depends on the shapes only). Both kernels
    round float32 sums to bfloat16, but not in the same order, so a timed product may differ in the last bit."""
    return 8 if _amx() and os.environ.get("JAXPAGE_CPU_TIMED_PRODUCTS", "1") != "0" else 0


def _amx() -> bool:
    return "amx_bf16" in cpu_flags().split()


@functools.cache
def fast_bfloat16() -> bool:
    """Whether bfloat16 runs faster than float32 here: oneDNN's matmul available on a CPU with bfloat16 dot
    instructions (avx512_bf16 or AMX)."""
    return available() and bool(set(cpu_flags().split()) & {"avx512_bf16", "amx_bf16"})


BFLOAT16_ISAS = ({"avx512_bf16"}, {"amx_bf16"}, {"avx_ne_convert"}, {"avx512f", "avx512bw", "avx512vl", "avx512dq"})


@functools.cache
def bfloat16_matmul() -> bool:
    """Whether oneDNN's bfloat16 matmul runs here: the library available on a CPU of an ISA its bfloat16 kernels
    take (AVX-512 core and up, AMX, AVX2 with avx_ne_convert). On an AVX2-only CPU it cannot make the primitive,
    so bfloat16 products stay XLA's."""
    flags = set(cpu_flags().split())
    return available() and any(isa <= flags for isa in BFLOAT16_ISAS)


@functools.cache
def packs(k: int, n: int, dtype) -> bool:
    """Whether [k, n] weights of ``dtype`` are packed: bfloat16, where the library is available and the packed
    layout pads nothing (so a packed kernel keeps its array's shape and dtype)."""
    lib = library(ONEDNN)
    if lib is None or np.dtype(dtype) != jax.numpy.bfloat16 or not bfloat16_matmul():
        return False
    lib.jaxpage_onednn_packed_bytes.restype = ctypes.c_int64
    size = lib.jaxpage_onednn_packed_bytes(ctypes.c_int64(k), ctypes.c_int64(n))
    return size == k * n * np.dtype(dtype).itemsize


def pack(w: np.ndarray, *, transposed: bool = False) -> np.ndarray:
    """Plain bfloat16 weights (2-D: [K, N], or [N, K] with ``transposed``) in the packed layout: a new array of
    the same shape and dtype whose bytes only ``matmul(..., packed=True)`` reads."""
    w = np.ascontiguousarray(w)
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    assert packs(k, n, w.dtype), (w.shape, w.dtype)
    out = np.empty_like(w)
    status = library(ONEDNN).jaxpage_onednn_pack(w.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                           ctypes.c_int64(k), ctypes.c_int64(n), int(transposed))
    if status:
        raise RuntimeError(f"oneDNN could not pack weights of shape {w.shape}")
    return out


def dense(x: jax.Array, kernel: jax.Array, *, num_in: int, transposed: bool = False,
          packed: bool = False) -> jax.Array:
    """x [..., *in] . kernel [*in, *out] (kernel [out, in] with ``transposed``, one axis each) as one ``matmul``
    over the flattened axes."""
    out_shape = kernel.shape[:1] if transposed else kernel.shape[num_in:]
    k, n = math.prod(x.shape[x.ndim - num_in:]), math.prod(out_shape)
    flat = kernel.reshape((n, k) if transposed else (k, n))
    y = matmul(x.reshape(-1, k), flat, transposed=transposed, packed=packed)
    return y.reshape(*x.shape[:x.ndim - num_in], *out_shape)


DENSE = CustomOp("dense", dense, lambda x, kernel, **params: x.dtype == kernel.dtype == jnp.bfloat16
                 and bfloat16_matmul(), library=ONEDNN)
