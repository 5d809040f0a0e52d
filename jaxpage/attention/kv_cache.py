"""The paged KV pool: its one layout, its size, and how tokens are written to and read from it.

Layout: ``[num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]``.
- Page-major: one page (block) of every layer is one contiguous run, K and V side by side, which is what the
  TPU kernel copies with one DMA per page and what swapping and copy-on-write move.
- Within a page, each KV head's K (and V) is a contiguous ``[block_size, head_dim]`` tile, which is what a
  GPU split-K decode kernel loads per head.
- The layer axis leads so the model's ``lax.scan`` over layers carries the whole pool and updates it in place.
Block 0 is the null block: padding tokens write there and padded block-table entries point there.

Packed (``packs_kv``: the ``pallas_tpu`` backend and head_dim 64): ``[num_layers, num_blocks, num_kv_heads,
block_size, 2 * head_dim]``, a token's K and V side by side in one row of 128 lanes (pallas_kernels.packed). A
TPU tiles the last two axes of the row-major pool by (8, 128): unpacked, a head_dim-64 row would take 128 lanes
and a block twice its bytes. Still page-major with one contiguous run per page, so block moves are unchanged.
Every other backend and head_dim keeps the layout above; the pool's rank tells which it is.

Quantized (``kv_cache_dtype`` int8 or fp8, see pallas_kernels.quant): the values keep this layout in the
stored dtype; int8's per-(token, KV head) float32 scales are a second array of the same layout less head_dim,
``[num_layers, num_blocks, 2, num_kv_heads, block_size]``, travelling with the values as one ``ScaledPool``
pytree: allocated, donated, laid out, copied and swapped together.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxpage.config import ModelConfig
from jaxpage.distributed.parallel import pool_spec, with_mesh
from jaxpage.utils import cdiv
from pallas_kernels.packed import PACKED_LANES
from pallas_kernels.quant import ScaledPool

NULL_BLOCK = 0


def packs_kv(model: ModelConfig, backend: str) -> bool:
    """Whether the pool is packed: on the TPU kernel's backend (resolved), when K and V fill 128 lanes."""
    return backend == "pallas_tpu" and 2 * model.head_dim == PACKED_LANES


def kv_pool_shape(model: ModelConfig, num_blocks: int, block_size: int, packed: bool = False) -> tuple[int, ...]:
    if packed:
        return (model.num_layers, num_blocks, model.num_kv_heads, block_size, 2 * model.head_dim)
    return (model.num_layers, num_blocks, 2, model.num_kv_heads, block_size, model.head_dim)


def pool_block_size(pool) -> int:
    """The tokens a block of ``pool`` (either layout; a ScaledPool's values) holds."""
    values = jax.tree.leaves(pool)[0]
    return values.shape[3 if values.ndim == 5 else 4]


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def bytes_per_block(model: ModelConfig, block_size: int, dtype, lanes: int = 1, packed: bool = False) -> int:
    """A block's bytes in memory (an int8 pool's scales included), the minor axis padded to a multiple of
    ``lanes`` (on a TPU, 128: the row-major layout tiles the last two axes by (8, 128), so an unpacked head_dim
    64 takes 128 lanes, a packed one (K and V: ``2 * head_dim``) its own 128, and a page's int8 scales
    ``[KVH, block_size]`` take whole (8, 128) tiles)."""
    rows, minor = ((model.num_kv_heads * block_size, 2 * model.head_dim) if packed
                   else (2 * model.num_kv_heads * block_size, model.head_dim))
    padded = model.num_layers * rows * _round_up(minor, lanes)
    scales = 0
    if jnp.dtype(dtype) == jnp.int8:
        sublanes = 8 if lanes > 1 else 1
        scales = model.num_layers * 2 * _round_up(model.num_kv_heads, sublanes) * _round_up(block_size, lanes) * 4
    return padded * jnp.dtype(dtype).itemsize + scales


def memory_lanes() -> int:
    return 128 if jax.default_backend() == "tpu" else 1


def device_bytes_per_block(model: ModelConfig, block_size: int, dtype, packed: bool = False, shards: int = 1) -> int:
    """A block's bytes on each device in the device's memory layout (``memory_lanes``); shards: the devices the
    pool is split over by KV head."""
    return bytes_per_block(model, block_size, dtype, memory_lanes(), packed) // shards


def num_blocks_for_budget(per_block: int, block_size: int, budget_bytes: int, max_model_len: int,
                          budget_name: str = "kv_cache_memory", per_device: bool = False) -> int:
    """How many blocks (null block included) a byte budget holds at ``per_block`` bytes a block (every pool's
    that has these block ids: the target's and a draft model's); refuses one too small for a full sequence.
    budget_name: the option the budget came from; per_device: it is each device's of a sharded pool."""
    needed_blocks = cdiv(max_model_len, block_size) + 1
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < needed_blocks:
        raise ValueError(
            f"{budget_name}: a KV budget of {budget_bytes} bytes{' per device' if per_device else ''} holds "
            f"{num_blocks} KV blocks, but one sequence of max_model_len={max_model_len} tokens needs "
            f"{needed_blocks} (null block included), that is {needed_blocks * per_block} bytes ({per_block} bytes "
            f"per block of {block_size} tokens); raise {budget_name} or lower max_model_len")
    return num_blocks


def device_kv_budget(memory_fraction: float, weight_bytes: int, devices=None) -> int | None:
    """The KV pool's bytes on each of ``devices`` (default: device 0) for ``gpu_memory_utilization``, as vLLM
    means it: that fraction of the device's memory (JAX's ``bytes_limit``) less what is in use there and less
    the weights still to be placed on it (``weight_bytes``, each device's); the least over the devices (a
    sharded pool takes the same bytes on each). None where a device does not say; a ValueError naming
    gpu_memory_utilization where nothing is left."""
    budgets = []
    for device in devices or jax.devices()[:1]:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        budget = int(limit * memory_fraction) - in_use - weight_bytes
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={memory_fraction}: {memory_fraction} of the device's {limit} bytes leaves "
                f"nothing for the KV cache after the {weight_bytes} bytes of weights and the {in_use} bytes in use; "
                f"raise gpu_memory_utilization or set kv_cache_memory")
        budgets.append(budget)
    return min(budgets)


def _shardings(where, dtype=None, packed: bool = False) -> tuple[object, object]:
    """(the pool's sharding -- a ScaledPool of two for an int8 pool --, other arrays' sharding) on ``where``: a
    device (None: the default one), or a mesh (the pool split by KV head over its model axis, everything else
    replicated)."""
    if isinstance(where, Mesh):
        pool = jax.tree.map(lambda spec: NamedSharding(where, spec), pool_spec(dtype, packed),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
        return pool, NamedSharding(where, PartitionSpec())
    device = SingleDeviceSharding(where or jax.devices()[0])
    return (ScaledPool(device, device) if _scaled(dtype) else device), device


def _scaled(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) == jnp.int8


def pool_format(where=None, dtype=None, packed: bool = False):
    """Where the pool lives and its layout in memory: row-major, which the TPU kernels' DMAs address. Every
    function that takes the pool is compiled with this format (``jit_on_pool``): left to choose, XLA:TPU picks
    another layout for a small head_dim and relayouts the whole pool around each kernel call. ``where``: a
    device or a tensor-parallel mesh (each device's shard row-major). For an int8 pool (``dtype``), a
    ScaledPool of the values' and the scales' formats; packed: the packed layout's (one axis fewer)."""
    sharding = _shardings(where, dtype, packed)[0]
    values = Layout(major_to_minor=tuple(range(5 if packed else 6)))
    if not _scaled(dtype):
        return Format(values, sharding)
    return ScaledPool(Format(values, sharding.values), Format(Layout(major_to_minor=tuple(range(5))), sharding.scales))


def allocate_kv_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype, where=None,
                     packed: bool = False):
    """Zeros in ``dtype`` (the stored dtype: int8 gives a ScaledPool with float32 scales)."""
    zeros = functools.partial(_zeros_pool, jnp, model, num_blocks, block_size, dtype, packed)
    return jax.jit(zeros, out_shardings=pool_format(where, dtype, packed))()


def abstract_kv_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype, packed: bool = False):
    """The pool's shapes and dtypes (ShapeDtypeStructs; a ScaledPool of them for int8), for ahead-of-time lowering."""
    return jax.eval_shape(functools.partial(_zeros_pool, jnp, model, num_blocks, block_size, dtype, packed))


def host_kv_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype, packed: bool = False):
    """The swap space in host memory: the device pool's arrays (scales included) as numpy zeros."""
    return _zeros_pool(np, model, num_blocks, block_size, dtype, packed)


def _zeros_pool(xp, model, num_blocks, block_size, dtype, packed):
    """The values in ``kv_pool_shape``; an int8 pool's scales ``[L, N, 2, KVH, block_size]`` in either layout."""
    shape = kv_pool_shape(model, num_blocks, block_size, packed)
    if _scaled(dtype):
        scales = kv_pool_shape(model, num_blocks, block_size)[:-1]
        return ScaledPool(xp.zeros(shape, jnp.int8), xp.zeros(scales, jnp.float32))
    return xp.zeros(shape, dtype)


def jit_on_pool(fn, num_args: int, pool_arg: int, returns: str, where=None, arg_shardings: dict | None = None,
                dtype=None, packed: bool = False, compiler_options: dict | None = None):
    """``jax.jit(fn)`` with argument ``pool_arg`` (of ``num_args``) the pool (of stored ``dtype``) in
    ``pool_format``. returns: "pool" (fn returns the updated pool), "pair" (returns ``(result, pool)``), both with
    the pool donated, "result" (fn only reads the pool) or "blocks" (returns blocks of the pool, sharded as it
    is). where: a device or a mesh (fn then traced under it); arg_shardings: other arguments' shardings by
    position (else on the device, or replicated); packed: the pool's layout; compiler_options: XLA's, for its
    executables."""
    pool_sharding, other = _shardings(where, dtype, packed)
    pool, arg_shardings = pool_format(where, dtype, packed), arg_shardings or {}
    in_shardings = tuple(pool if i == pool_arg else arg_shardings.get(i, other) for i in range(num_args))
    out_shardings = {"pool": pool, "pair": (other, pool), "result": other, "blocks": pool_sharding}[returns]
    donate = () if returns in ("result", "blocks") else (pool_arg,)
    fn = with_mesh(fn, where if isinstance(where, Mesh) else None)
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate,
                   compiler_options=compiler_options)
