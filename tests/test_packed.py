"""The packed KV layout (head_dim 64 on the pallas_tpu backend: K and V of a token in one 128-lane row): when the
engine packs, the bytes a block costs on a TPU, the pool, its block moves and its sharding.

The TPU kernel on the packed layout against the reference is in test_pallas_kernels.py (``-packed`` cases); SmolLM2's
greedy tokens through the pallas_tpu backend (a packed pool) against the XLA path and transformers in
test_backends.py; the packed kernel and steps through libtpu in test_compile_tpu.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from transformers import LlamaConfig

from jaxpage.attention import kv_cache
from jaxpage.attention.block_moves import BlockMoves, store_blocks
from jaxpage.attention.kv_cache import (
    allocate_kv_pool,
    bytes_per_block,
    host_kv_pool,
    packs_kv,
    pool_block_size,
)
from jaxpage.distributed.parallel import MODEL_AXIS, pool_spec
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.models import config_from_hf
from pallas_kernels import ragged_paged_attention_reference
from pallas_kernels.packed import pack, pack_pool, unpack, unpack_pool
from pallas_kernels.quant import ScaledPool, pool_parts

SMOLLM2 = config_from_hf(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192))
LLAMA_D128 = config_from_hf(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def engine_config(backend, **kw):
    options = {"dtype": "bfloat16", "block_size": 16, "kv_cache_memory": None, "num_kv_blocks": None,
               "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024, "gpu_memory_utilization": 0.9}
    return build_engine_config(SMOLLM2, attention_backend=backend, **{**options, **kw})


def test_packs_only_head_dim_64_on_the_tpu_backend():
    assert SMOLLM2.head_dim == 64 and LLAMA_D128.head_dim == 128
    assert packs_kv(SMOLLM2, "pallas_tpu")
    assert not any(packs_kv(SMOLLM2, b) for b in ("xla", "pallas_gpu"))
    assert not packs_kv(LLAMA_D128, "pallas_tpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "float8_e4m3fn"])
def test_a_packed_block_costs_its_real_bytes_on_a_tpu(dtype):
    """Unpacked, a head_dim-64 row takes 128 lanes on a TPU: twice the values' bytes. Packed, the values take
    exactly their bytes (what the same block costs on a CPU); an int8 pool's scales keep their (8, 128) tiles."""
    for block_size in (16, 32, 64):
        real = bytes_per_block(SMOLLM2, block_size, dtype)
        tpu = bytes_per_block(SMOLLM2, block_size, dtype, lanes=128)
        packed = bytes_per_block(SMOLLM2, block_size, dtype, lanes=128, packed=True)
        values = 30 * 2 * 3 * block_size * 64 * jnp.dtype(dtype).itemsize
        scales = 30 * 2 * 8 * max(block_size, 128) * 4 if dtype == "int8" else 0
        assert (tpu, packed) == (2 * values + scales, values + scales)
        assert packed == real + scales - (30 * 2 * 3 * block_size * 4 if dtype == "int8" else 0)


def test_the_budget_on_a_tpu_holds_twice_the_blocks_when_packed(monkeypatch):
    """The KV budget counts the real bytes of a block: on a TPU (128 lanes), pallas_tpu's packed SmolLM2 pool
    holds twice the blocks the XLA path's unpacked one does in the same bytes."""
    monkeypatch.setattr(kv_cache, "memory_lanes", lambda: 128)
    budget = 1 << 30
    packed, unpacked = (engine_config(b, kv_cache_memory=budget).cache.num_kv_blocks for b in ("pallas_tpu", "xla"))
    assert packed == budget // bytes_per_block(SMOLLM2, 16, "bfloat16", lanes=128, packed=True)
    assert packed == 2 * unpacked


def test_pack_and_unpack_are_inverse_and_put_k_then_v_in_a_row():
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.standard_normal((2, 5, 2, 3, 16, 64)), jnp.float32)
    packed = pack(values)
    assert packed.shape == (2, 5, 3, 16, 128)
    np.testing.assert_array_equal(packed[1, 4, 2, 7, :64], values[1, 4, 0, 2, 7])
    np.testing.assert_array_equal(packed[1, 4, 2, 7, 64:], values[1, 4, 1, 2, 7])
    np.testing.assert_array_equal(unpack(packed), values)


def test_the_reference_on_a_packed_pool_is_the_reference_on_the_unpacked_one():
    """What the kernel tests compare against: the reference reads and writes a packed pool as the same pool
    unpacked (an int8 pool's scales untouched by the layout)."""
    rng = np.random.default_rng(1)
    values = jnp.asarray(rng.integers(-127, 128, (2, 4, 2, 1, 16, 64)), jnp.int8)
    pool = ScaledPool(values, jnp.asarray(rng.random((2, 4, 2, 1, 16)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 1, 64)), jnp.float32) for _ in range(2))
    batch = (jnp.int32(1), jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32),
             jnp.arange(16, 20, dtype=jnp.int32), jnp.array([[1, 2]], jnp.int32))
    out, ref_pool = ragged_paged_attention_reference(q, k, v, pool, *batch, scale=0.125)
    packed_out, packed_pool = ragged_paged_attention_reference(q, k, v, pack_pool(pool), *batch, scale=0.125)
    np.testing.assert_array_equal(packed_out, out)
    assert packed_pool.values.ndim == 5
    for part, ref_part in zip(pool_parts(unpack_pool(packed_pool)), pool_parts(ref_pool)):
        np.testing.assert_array_equal(part, ref_part)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_packed_pool_allocation_and_block_moves(dtype):
    """The engine's packed pool (and host swap space) in kv_pool_shape; copy-on-write and swap out/in move whole
    packed pages (an int8 pool's scales with them), against the same moves on numpy arrays."""
    model = config_from_hf(LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1))
    assert model.head_dim == 64
    zeros = allocate_kv_pool(model, 6, 16, dtype, packed=True)
    assert pool_parts(zeros)[0].shape == (2, 6, 1, 16, 128) and pool_block_size(zeros) == 16
    assert pool_block_size(allocate_kv_pool(model, 6, 16, dtype)) == 16
    rng = np.random.default_rng(2)
    arrays = [rng.integers(-127, 128, (2, 6, 1, 16, 128)).astype(np.float32)]
    arrays += [rng.random((2, 6, 2, 1, 16)).astype(np.float32)] if dtype == jnp.int8 else []
    arrays[0] = arrays[0].astype(np.int8) if dtype == jnp.int8 else arrays[0].astype(jnp.bfloat16)
    pool = jax.device_put(ScaledPool(*map(jnp.asarray, arrays)) if dtype == jnp.int8 else jnp.asarray(arrays[0]))
    moves = BlockMoves.jit(dtype=dtype, packed=True)
    pool = moves.copy(pool, np.array([1, 2], np.int32), np.array([4, 5], np.int32))
    for a in arrays:
        a[:, [4, 5]] = a[:, [1, 2]]
    host = host_kv_pool(model, 3, 16, dtype, packed=True)
    assert jax.tree.map(lambda h: h.shape, host) == jax.tree.map(lambda a: (2, 3) + a.shape[2:], pool)
    jax.tree.map(lambda h, g: store_blocks(h, g, np.array([2, 0])), host, moves.gather(pool, np.array([4, 3], np.int32)))
    pool = moves.scatter(pool, np.array([1, 3], np.int32), jax.tree.map(lambda h: h[:, [2, 0]], host))
    for a in arrays:
        a[:, [1, 3]] = a[:, [4, 3]]
    for part, a in zip(jax.tree.leaves(pool), arrays):
        np.testing.assert_array_equal(np.asarray(part.astype(jnp.float32)), a.astype(np.float32))


def test_tensor_parallelism_splits_the_packed_pool_by_kv_head():
    assert pool_spec(jnp.bfloat16, packed=True) == P(None, None, MODEL_AXIS, None, None)
    spec = pool_spec(jnp.int8, packed=True)
    assert (spec.values, spec.scales) == (P(None, None, MODEL_AXIS, None, None), P(None, None, None, MODEL_AXIS, None))
    assert pool_spec(jnp.bfloat16) == P(None, None, None, MODEL_AXIS, None, None)  # unpacked: unchanged


def test_the_xla_path_refuses_a_packed_pool_by_name():
    from jaxpage.attention.backends import write_and_attend

    pool = pack_pool(jnp.zeros((1, 2, 2, 1, 16, 64)))
    q, kv = jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64))
    with pytest.raises(ValueError, match="the XLA attention path reads the unpacked pool"):
        write_and_attend("xla", q, kv, kv, pool, jnp.int32(0), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                         jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), scale=0.125)
