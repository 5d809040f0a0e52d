"""The fused projections (QKVParallelLinear, MergedColumnParallelLinear) against the separate matmuls they
replace, their int8 scales against the separate ones', and their layout under tensor parallelism: the split of
the KV head slots over the devices gives each device its own q|k|v heads (KV heads replicated as vLLM does)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.layers import MergedColumnParallelLinear, QKVParallelLinear
from jaxpage.models.quant import quantize_int8
from tests.factories import SEED

D, HD = 16, 4


def _set(param, value) -> None:
    param[...] = jnp.asarray(value)


def test_fused_qkv_gives_the_three_projections_with_their_biases():
    rng = np.random.default_rng(SEED)
    h, kvh = 8, 2
    q, k, v = (rng.standard_normal((D, n, HD)).astype(np.float32) for n in (h, kvh, kvh))
    bq, bk, bv = (rng.standard_normal((n, HD)).astype(np.float32) for n in (h, kvh, kvh))
    layer = QKVParallelLinear(D, h, kvh, HD, bias=True)
    _set(layer.kernel, QKVParallelLinear.fuse(q, k, v))
    _set(layer.bias, QKVParallelLinear.fuse(bq, bk, bv))
    x = rng.standard_normal((5, D)).astype(np.float32)
    for got, w, b in zip(layer.split(layer(jnp.asarray(x))), (q, k, v), (bq, bk, bv)):
        np.testing.assert_allclose(np.asarray(got), np.einsum("td,dhk->thk", x, w) + b, rtol=1e-5, atol=1e-5)


def test_fused_gate_up_gives_both_projections():
    rng = np.random.default_rng(SEED)
    gate, up = (rng.standard_normal((D, 24)).astype(np.float32) for _ in range(2))
    layer = MergedColumnParallelLinear(D, 24, 2)
    _set(layer.kernel, MergedColumnParallelLinear.fuse(gate, up))
    x = rng.standard_normal((3, D)).astype(np.float32)
    for got, w in zip(layer.split(layer(jnp.asarray(x))), (gate, up)):
        np.testing.assert_allclose(np.asarray(got), x @ w, rtol=1e-5, atol=1e-5)


def test_int8_scales_of_the_fused_kernels_are_the_separate_kernels_scales_fused():
    rng = np.random.default_rng(SEED)
    q, k, v = (rng.standard_normal((D, n, HD)).astype(np.float32) for n in (4, 2, 2))
    values, scale = quantize_int8(QKVParallelLinear.fuse(q, k, v), (0,))
    separate = [quantize_int8(w, (0,)) for w in (q, k, v)]
    np.testing.assert_array_equal(values, QKVParallelLinear.fuse(*[s[0] for s in separate]))
    np.testing.assert_array_equal(scale, QKVParallelLinear.fuse(*[s[1] for s in separate]))
    gate, up = (rng.standard_normal((D, 12)).astype(np.float32) for _ in range(2))
    _, scale = quantize_int8(MergedColumnParallelLinear.fuse(gate, up), (0,))
    np.testing.assert_array_equal(scale, np.stack([quantize_int8(w, (0,))[1] for w in (gate, up)]))


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 4, 2), (8, 2, 4), (4, 1, 2), (8, 4, 8), (9, 3, 3)])
def test_each_device_of_a_tp_split_holds_its_own_heads(heads, kv_heads, tp):
    """The slots axis split in tp equal parts (what NamedSharding over the model axis does): part s holds the
    query heads s * heads / tp onwards and the KV heads the old layout's repeat put in its slots."""
    rng = np.random.default_rng(SEED)
    q, k, v = (rng.standard_normal((3, D, n, HD)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
    slots = max(kv_heads, tp)  # parallel.kv_head_slots
    fused = QKVParallelLinear.replicate_kv_heads(QKVParallelLinear.fuse(q, k, v), slots)  # [3 layers, ...]
    assert fused.shape == (3, D, slots, heads // slots + 2, HD)
    layer = QKVParallelLinear(D, heads // tp, slots // tp, HD)  # one device's layer: its heads and slots
    per_q, per_kv = heads // tp, slots // tp
    repeated = [np.repeat(a, slots // kv_heads, axis=-2) for a in (k, v)]
    for s, part in enumerate(np.split(fused, tp, axis=-3)):
        got_q, got_k, got_v = layer.split(part)
        np.testing.assert_array_equal(got_q, q[..., s * per_q:(s + 1) * per_q, :])
        for got, want in zip((got_k, got_v), repeated):
            np.testing.assert_array_equal(got, want[..., s * per_kv:(s + 1) * per_kv, :])
