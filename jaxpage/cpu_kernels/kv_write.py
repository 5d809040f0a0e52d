"""The K/V write into the paged pool (in place), the pool's page gather and its whole-block moves as FFI calls on
the CPU, for 8- and 16-bit float pools.

XLA:CPU has no bfloat16 or float8 scatter: it converts the whole pool to float32 around one (~0.9 s a layer for
SmolLM2's 1 GiB default pool), or, scattering the pool's bits as integers, copies it twice through the bitcasts
(~0.6 s); a gather of its pages likewise converts the whole pool. These copy the T new rows and the pages read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import available, ffi_call

__all__ = ["GATHER_ROWS", "PUT_BLOCKS", "TAKE_BLOCKS", "WRITE_KV", "available", "gather_rows", "needs_kernel",
           "put_blocks", "take_blocks", "write_kv"]


def needs_kernel(dtype) -> bool:
    """Whether XLA:CPU's scatter cannot write this pool dtype in place (floats narrower than 32 bits)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def write_kv(values: jax.Array, k: jax.Array, v: jax.Array, *, layer, slots: jax.Array) -> jax.Array:
    """values [L, NB, 2, KVH, BS, D] with k and v [T, KVH, D] written at ``slots`` [T] of ``layer`` (the pool is
    aliased to the result: donated, it is written in place). CPU only (the ops below choose)."""
    out = jax.ShapeDtypeStruct(values.shape, values.dtype)
    call = ffi_call("jaxpage_write_kv", out, input_output_aliases={0: 0})
    return call(values, k.astype(values.dtype), v.astype(values.dtype), jnp.asarray(slots, jnp.int32),
                jnp.asarray(layer, jnp.int32))


def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """``jnp.take(table, rows, axis=0, mode="clip")``. CPU only (the ops below choose)."""
    out = jax.ShapeDtypeStruct((*rows.shape, *table.shape[1:]), table.dtype)
    return ffi_call("jaxpage_gather_rows", out)(table, jnp.asarray(rows, jnp.int32))


def take_blocks(values: jax.Array, blocks: jax.Array) -> jax.Array:
    """``values[:, blocks]`` of a pool leaf [L, NB, ...] (ids clipped). CPU only (the ops below choose)."""
    out = jax.ShapeDtypeStruct((values.shape[0], blocks.shape[0], *values.shape[2:]), values.dtype)
    return ffi_call("jaxpage_take_blocks", out)(values, jnp.asarray(blocks, jnp.int32))


def put_blocks(values: jax.Array, blocks: jax.Array, data: jax.Array) -> jax.Array:
    """``values.at[:, blocks].set(data)`` of a pool leaf [L, NB, ...] (out-of-range ids dropped; the pool aliased to
    the result: donated, it is written in place). CPU only (the ops below choose)."""
    out = jax.ShapeDtypeStruct(values.shape, values.dtype)
    call = ffi_call("jaxpage_put_blocks", out, input_output_aliases={0: 0})
    return call(values, jnp.asarray(blocks, jnp.int32), data.astype(values.dtype))


def _narrow(values: jax.Array, *rest, **params) -> bool:
    return needs_kernel(values.dtype)


WRITE_KV = CustomOp("write_kv", write_kv, _narrow)
GATHER_ROWS = CustomOp("gather_rows", gather_rows, _narrow)
TAKE_BLOCKS = CustomOp("take_blocks", take_blocks, _narrow)  # on one device's pool only (attention/block_moves.py)
PUT_BLOCKS = CustomOp("put_blocks", put_blocks, _narrow)
