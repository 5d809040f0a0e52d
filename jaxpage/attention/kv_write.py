"""The one K/V write into the paged pool, and which implementation each platform runs.

- CPU, 8- and 16-bit float pools with the CPU kernels built: the in-place FFI write (jaxpage/cpu_kernels/kv_write.py);
  XLA:CPU has no narrow-float scatter and would copy the pool around one.
- TPU, a block size the kernel's tiles divide: the Pallas write (pallas_kernels/kv_write/tpu.py); XLA:TPU would
  relayout the whole pool around a scatter.
- Elsewhere (GPU, float32 or int8 pools on a CPU): the jnp scatter (pallas_kernels/kv_write/reference.py).
The Pallas ragged kernels write K/V themselves, inside their attention pass.
"""
from __future__ import annotations

import jax

from jaxpage.cpu_kernels import kv_write as cpu_kv_write
from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.kv_write.tpu import tile_rows, write_kv_tpu
from pallas_kernels.quant import pool_parts, quantize, with_parts


def write_kv(pool: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """New K/V [T, KVH, D] written into their slots (block * block_size + offset) of ``layer``; returns the pool."""
    branches = {}
    values, scales = pool_parts(pool)
    if scales is None and cpu_kv_write.WRITE_KV.enabled(values):
        branches["cpu"] = _write_on_cpu
    if pool.shape[4] % tile_rows(pool.dtype) == 0:  # else not lowerable for a TPU (build_engine_config refuses it)
        branches["tpu"] = write_kv_tpu
    if not branches:
        return write_kv_reference(pool, layer, k, v, slot_mapping)
    return jax.lax.platform_dependent(pool, layer, k, v, slot_mapping, **branches, default=write_kv_reference)


def _write_on_cpu(pool, layer, k, v, slot_mapping):
    """K and V passed apart (no stack of the two), each quantized as the reference's stack is."""
    values, _ = pool_parts(pool)
    k, v = quantize(k, pool.dtype)[0], quantize(v, pool.dtype)[0]
    return with_parts(cpu_kv_write.write_kv(values, k, v, layer=layer, slots=slot_mapping), None)
