"""Quantized KV cache: the one quantize (on K/V write) and dequantize (on page load) of every backend.

- ``int8``: symmetric, one float32 scale per (token, KV head) row of head_dim values: ``scale = max|x| / 127``.
  The pool is then a ``ScaledPool``: the int8 values in the engine's one layout
  ``[L, N, 2, KVH, block_size, D]`` and the scales in the same layout less head_dim, ``[L, N, 2, KVH,
  block_size]``, so every index of a page (a DMA, a gather, a block copy) applies to both.
- ``fp8`` (e4m3): one per-tensor scale of 1.0 (vLLM's default without calibration; K/V of the models served
  here stay far inside e4m3's range of +-448): the pool is a plain ``float8_e4m3fn`` array, no scales.
- Otherwise the pool is a plain array in the model's dtype, and these helpers are casts.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

INT8_MAX = 127.0
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class ScaledPool:
    """An int8 pool with its per-(token, KV head) scales; ``shape``/``dtype``/``ndim`` are the values'."""

    values: jax.Array
    scales: jax.Array

    shape = property(lambda self: self.values.shape)
    dtype = property(lambda self: self.values.dtype)
    ndim = property(lambda self: self.values.ndim)


jax.tree_util.register_dataclass(ScaledPool, data_fields=["values", "scales"], meta_fields=[])


def pool_parts(pool) -> tuple[jax.Array, jax.Array | None]:
    """(values, scales), scales None for a pool without them."""
    return (pool.values, pool.scales) if isinstance(pool, ScaledPool) else (pool, None)


def with_parts(values, scales=None):
    return values if scales is None else ScaledPool(values, scales)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(FP8))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """x [..., D] -> (values [..., D] in ``dtype``, scales [...] float32 for int8, else None)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        x = x.astype(jnp.float32)
        scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)[..., None]
        return jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
    if dtype == FP8:  # e4m3fn has no infinity: saturate rather than overflow to NaN
        return jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8), None
    return x.astype(dtype), None


def dequantize(values: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """values [..., D] (and scales [...]) -> [..., D] in ``dtype``."""
    if scales is None:
        return values.astype(dtype)
    return (values.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


def split_scales(refs: tuple, quantized: bool) -> tuple:
    """A kernel's refs after the pool: (the scales' ref or None, the rest). A kernel takes the scales right
    after the pool, and only when the pool has them."""
    return (refs[0], refs[1:]) if quantized else (None, refs)


def scale_operands(scales) -> tuple:
    """The scales as the kernel operands that follow the pool: none for a pool without them."""
    return () if scales is None else (scales,)
