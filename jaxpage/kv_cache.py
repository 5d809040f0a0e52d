"""The paged KV pool: its one layout, its size, and how tokens are written to and read from it.

Layout: ``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]``.
- Page-major: one page (block) of every layer is one contiguous run, K and V side by side, which is what the
  TPU kernel copies with one DMA per page and what swapping and copy-on-write move.
- Within a page, each KV head's K (and V) is a contiguous ``[block_size, head_dim]`` tile, which is what a
  GPU split-K decode kernel loads per head.
- The layer axis leads so the model's ``lax.scan`` over layers carries the whole pool and updates it in place.
Block 0 is the null block: padding tokens write there and padded block-table entries point there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pallas_kernels.reference import write_kv  # noqa: F401 (the one K/V write, shared with the kernels)

if TYPE_CHECKING:  # annotations only: config imports this module to size the pool
    from jaxpage.config import ModelConfig

NULL_BLOCK = 0


def kv_pool_shape(model: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model.num_layers, num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)


def bytes_per_block(model: ModelConfig, block_size: int, dtype, lanes: int = 1) -> int:
    """A block's bytes in memory, each row of head_dim values padded to a multiple of ``lanes`` (on a TPU, 128:
    the pool's row-major layout tiles [block_size, head_dim] by (8, 128), so head_dim 64 takes 128 lanes)."""
    padded = model.num_layers * 2 * model.num_kv_heads * block_size * (-(-model.head_dim // lanes) * lanes)
    return padded * jnp.dtype(dtype).itemsize


def memory_lanes() -> int:
    return 128 if jax.default_backend() == "tpu" else 1


def num_blocks_for_budget(model: ModelConfig, block_size: int, dtype, budget_bytes: int,
                          max_model_len: int, shards: int = 1) -> int:
    """How many blocks (null block included) a byte budget holds; refuses one too small for a full sequence.
    shards: the devices the pool is split over by KV head (the budget is each one's)."""
    per_block = bytes_per_block(model, block_size, dtype, memory_lanes()) // shards
    needed_blocks = -(-max_model_len // block_size) + 1
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < needed_blocks:
        raise ValueError(
            f"kv_cache_memory={budget_bytes} bytes{' per device' if shards > 1 else ''} holds {num_blocks} KV blocks, but one sequence of "
            f"max_model_len={max_model_len} tokens needs {needed_blocks} (null block included), that is "
            f"{needed_blocks * per_block} bytes ({per_block} bytes per block of {block_size} tokens); "
            f"raise kv_cache_memory or lower max_model_len")
    return num_blocks


def device_kv_budget(memory_fraction: float, devices=None) -> int | None:
    """A fraction of the memory still free after the weights on each of ``devices`` (default: device 0), the
    least of them: a sharded pool takes the same bytes on every device. None where a device does not say."""
    free = []
    for device in devices or jax.devices()[:1]:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return int(min(free) * memory_fraction)


def _shardings(where) -> tuple[object, object]:
    """(the pool's sharding, other arrays' sharding) on ``where``: a device (None: the default one), or a mesh
    (the pool split by KV head over its model axis, everything else replicated)."""
    if isinstance(where, Mesh):
        from jaxpage.parallel import POOL_SPEC

        return NamedSharding(where, POOL_SPEC), NamedSharding(where, PartitionSpec())
    device = SingleDeviceSharding(where or jax.devices()[0])
    return device, device


def pool_format(where=None) -> Format:
    """Where the pool lives and its layout in memory: row-major, which the TPU kernels' DMAs address. Every
    function that takes the pool is compiled with this format (``jit_on_pool``): left to choose, XLA:TPU picks
    another layout for a small head_dim and relayouts the whole pool around each kernel call. ``where``: a
    device or a tensor-parallel mesh (each device's shard row-major)."""
    return Format(Layout(major_to_minor=tuple(range(6))), _shardings(where)[0])


def allocate_kv_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype, where=None) -> jax.Array:
    shape = kv_pool_shape(model, num_blocks, block_size)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=pool_format(where))()


def jit_on_pool(fn, num_args: int, pool_arg: int, returns: str, where=None, arg_shardings: dict | None = None):
    """``jax.jit(fn)`` with argument ``pool_arg`` (of ``num_args``) the pool in ``pool_format``. returns:
    "pool" (fn returns the updated pool), "pair" (returns ``(result, pool)``), both with the pool donated,
    "result" (fn only reads the pool) or "blocks" (returns blocks of the pool, sharded as it is). where: a
    device or a mesh (fn then traced under it); arg_shardings: other arguments' shardings by position (else on
    the device, or replicated)."""
    from jaxpage.parallel import with_mesh

    pool_sharding, other = _shardings(where)
    pool, arg_shardings = pool_format(where), arg_shardings or {}
    in_shardings = tuple(pool if i == pool_arg else arg_shardings.get(i, other) for i in range(num_args))
    out_shardings = {"pool": pool, "pair": (other, pool), "result": other, "blocks": pool_sharding}[returns]
    donate = () if returns in ("result", "blocks") else (pool_arg,)
    fn = with_mesh(fn, where if isinstance(where, Mesh) else None)
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)


def copy_blocks(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies whole pages ``src[i] -> dst[i]`` in every layer (copy-on-write, swap-in)."""
    return pool.at[:, dst].set(pool[:, src])
