"""Whole-block moves on the KV pool: copy-on-write copies on the device, and swaps between the device pool and
the host's swap space (``kv_cache.host_kv_pool``). Each moves whole pages of every layer, an int8 pool's scales
with their values, and is jitted with the pool in its one format (``kv_cache.jit_on_pool``)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpage.cpu_kernels import kv_write
from jaxpage.attention.kv_cache import NULL_BLOCK, jit_on_pool, pool_format


def padded_ids(ids: list[int], size: int) -> np.ndarray:
    """Block (or host slot) ids padded with the null block to a move call's fixed size."""
    out = np.full(size, NULL_BLOCK, np.int32)
    out[:len(ids)] = ids
    return out


def padded_chunks(src: list[int], dst: list[int], size: int):
    """``src`` -> ``dst`` in move calls of ``size`` ids each: (padded src, padded dst, ids in the call)."""
    for i in range(0, len(src), size):
        yield padded_ids(src[i:i + size], size), padded_ids(dst[i:i + size], size), len(src[i:i + size])


def take(a: jax.Array, blocks: jax.Array, one_device: bool = False) -> jax.Array:
    """Blocks [n] of every layer of one pool leaf [L, NB, ...] -> [L, n, ...]. With ``one_device`` (a mesh's pool is
    split: the FFI call would see one device's part as the pool) an 8- or 16-bit pool's blocks move by the CPU's
    FFI copy (kv_write.TAKE_BLOCKS, PUT_BLOCKS: XLA:CPU's gather and scatter converted the whole pool to float32,
    ~0.75 s for SmolLM2's 1 GiB)."""
    portable = lambda a, b: a[:, b]  # noqa: E731
    return kv_write.TAKE_BLOCKS(portable, a, blocks) if one_device else portable(a, blocks)


def put(a: jax.Array, blocks: jax.Array, data: jax.Array, one_device: bool = False) -> jax.Array:
    """One pool leaf with ``data`` [L, n, ...] written into its ``blocks`` (in place when donated)."""
    portable = lambda a, b, d: a.at[:, b].set(d)  # noqa: E731
    return kv_write.PUT_BLOCKS(portable, a, blocks, data) if one_device else portable(a, blocks, data)


def copy_blocks(pool, src: jax.Array, dst: jax.Array, one_device: bool = False):
    """Copies whole pages ``src[i] -> dst[i]`` (with their scales) in every layer (copy-on-write, swap-in)."""
    return jax.tree.map(lambda a: put(a, dst, take(a, src, one_device), one_device), pool)


def _gather_blocks(pool, blocks: jax.Array, one_device: bool = False):
    return jax.tree.map(lambda a: take(a, blocks, one_device), pool)  # an int8 pool's scales move with their blocks


def _scatter_blocks(pool, blocks: jax.Array, data, one_device: bool = False):
    return jax.tree.map(lambda a, d: put(a, blocks, d, one_device), pool, data)


def store_blocks(host: np.ndarray, gathered: jax.Array, blocks: np.ndarray) -> None:
    """A swap-out into host memory: the first len(blocks) gathered blocks (the rest is padding), shard by shard:
    a process stores the KV heads of its own devices (all of them, unless several processes share the mesh)."""
    for shard in gathered.addressable_shards:
        host[(slice(None), blocks, *shard.index[2:])] = np.asarray(shard.data)[:, :len(blocks)]


def load_blocks(host: np.ndarray, sharding, blocks: np.ndarray) -> jax.Array:
    """A swap-in's data: host blocks as a device array sharded as the pool is, each device's part from its own
    process's host memory."""
    data = host[:, blocks]
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


@dataclasses.dataclass(frozen=True)
class BlockMoves:
    """Whole-block moves on the pool, jitted with the pool in its format: copy-on-write copies, swap-out gathers
    and swap-in scatters."""

    copy: object
    gather: object
    scatter: object
    blocks_sharding: object  # of gathered blocks (as the pool's; a ScaledPool of two for an int8 pool)

    @classmethod
    def jit(cls, where=None, dtype=None, packed: bool = False) -> "BlockMoves":
        """On a device or a mesh; swapped blocks travel split as the pool is (each device's KV heads). dtype:
        the pool's stored dtype (an int8 pool is values and scales); packed: the pool's layout (whole pages
        either way)."""
        sharding = jax.tree.map(lambda f: f.sharding, pool_format(where, dtype, packed),
                                is_leaf=lambda x: hasattr(x, "sharding"))
        on_pool = functools.partial(jit_on_pool, where=where, dtype=dtype, packed=packed)
        mode = {"one_device": not isinstance(where, Mesh)}
        return cls(on_pool(functools.partial(copy_blocks, **mode), 3, 0, "pool"),
                   on_pool(functools.partial(_gather_blocks, **mode), 2, 0, "blocks"),
                   on_pool(functools.partial(_scatter_blocks, **mode), 3, 0, "pool", arg_shardings={2: sharding}),
                   sharding)

    def swap_out(self, pool, host, src: np.ndarray, dst: np.ndarray) -> None:
        """Device blocks ``src`` (padded) into the host pool's blocks ``dst`` (as many as are real)."""
        jax.tree.map(functools.partial(store_blocks, blocks=dst), host, self.gather(pool, src))

    def swap_in(self, pool, host, src: np.ndarray, dst: np.ndarray):
        """Host blocks ``src`` into device blocks ``dst`` (both padded); returns the updated (donated) pool."""
        data = jax.tree.map(functools.partial(load_blocks, blocks=src), host, self.blocks_sharding)
        return self.scatter(pool, dst, data)
