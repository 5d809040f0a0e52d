"""Gathers and scatters of low-precision floats through their bits.

XLA:CPU has no bfloat16 (or float16, float8) gather or scatter: its float normalization converts the whole operand
to float32 around the op, so one K/V write into a bfloat16 pool, or one page gather from it, copied the whole pool
(measured: ~20 s per SmolLM2 decode step with a 1 GiB pool, the converts hoisted out of the attention's loop).
Moving elements only moves bits, so these run on the unsigned integers of the same width instead: the same result
on every backend, the pool read and written in place.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_UINT = {1: jnp.uint8, 2: jnp.uint16}


def _uint(dtype) -> jnp.dtype | None:
    """The unsigned integer to move ``dtype`` as, or None where XLA moves it natively."""
    dtype = jnp.dtype(dtype)
    return _UINT.get(dtype.itemsize) if jnp.issubdtype(dtype, jnp.floating) else None


def scatter_set(array: jax.Array, index, updates: jax.Array, **at_options) -> jax.Array:
    """``array.at[index].set(updates)``."""
    uint = _uint(array.dtype)
    if uint is None:
        return array.at[index].set(updates.astype(array.dtype), **at_options)
    bits = jax.lax.bitcast_convert_type(array, uint)
    new = jax.lax.bitcast_convert_type(updates.astype(array.dtype), uint)
    return jax.lax.bitcast_convert_type(bits.at[index].set(new, **at_options), array.dtype)


def take(array: jax.Array, indices: jax.Array, **take_options) -> jax.Array:
    """``jnp.take(array, indices, ...)``."""
    uint = _uint(array.dtype)
    if uint is None:
        return jnp.take(array, indices, **take_options)
    rows = jnp.take(jax.lax.bitcast_convert_type(array, uint), indices, **take_options)
    return jax.lax.bitcast_convert_type(rows, array.dtype)
