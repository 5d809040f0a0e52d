"""CPU kernels: oneDNN's bfloat16 matmul (jaxpage.cpu_kernels.onednn) against float32 math, the in-place bfloat16 K/V
write (jaxpage.cpu_kernels.kv_write) against the rows it was given, and bfloat16 SmolLM2 against transformers float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpage.cpu_kernels import kv_write, onednn
from jaxpage.models.layers import dense
from jaxpage.attention.kv_write import write_kv

needs_onednn = pytest.mark.skipif(not onednn.bfloat16_matmul(), reason="oneDNN or a C++ compiler is missing, or "
                                  "the CPU has no ISA for its bfloat16 matmul (AVX-512, AMX)")
needs_kernels = pytest.mark.skipif(not kv_write.available(), reason="no C++ compiler")

CASES = [  # x shape, kernel shape, contracted axes, transposed
    ((5, 576), (576, 9, 64), 1, False),  # q/k/v-like: several output axes
    ((3, 9, 64), (9, 64, 576), 2, False),  # o-like: several input axes
    ((4, 576), (1000, 576), 1, True),  # tied LM head: embedding rows
    ((0, 64), (64, 8), 1, False),  # an empty bucket
]


@needs_onednn
@pytest.mark.parametrize("x_shape,k_shape,num_in,transposed", CASES)
def test_onednn_dense_equals_float32_math_to_bfloat16_rounding(x_shape, k_shape, num_in, transposed):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal(k_shape), jnp.bfloat16)
    fn = jax.jit(lambda x, k: dense(x, k, num_in, transposed=transposed))
    if x.size:  # XLA drops an empty product before it reaches the call
        assert "custom_call_target=\"jaxpage_onednn_matmul\"" in fn.lower(x, kernel).compile().as_text()
    y = np.asarray(fn(x, kernel), np.float32)
    k32 = np.asarray(kernel, np.float32)
    ref = np.tensordot(np.asarray(x, np.float32), k32.T if transposed else k32, axes=num_in)
    assert y.shape == ref.shape
    # float32 accumulation, one rounding to bfloat16 (8 significant bits) at the end
    np.testing.assert_allclose(y, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max(initial=1))


@needs_onednn
@pytest.mark.parametrize("x_shape,k_shape,num_in", [((5, 576), (576, 9, 64), 1), ((3, 9, 64), (9, 64, 576), 2),
                                                    ((40, 1536), (1536, 576), 1), ((1, 576), (576, 3072), 1),
                                                    ((2, 576), (576, 192), 1), ((8, 1536), (1536, 576), 1),
                                                    ((7, 576), (576, 960), 1), ((9, 576), (576, 192), 1)])
def test_packed_dense_equals_float32_math_to_bfloat16_rounding(x_shape, k_shape, num_in):
    """Weights packed once into oneDNN's blocked layout (weight_packing): the packed matmul reads them as the
    plain kernel's values (float32 math on the plain kernel is the reference), at every row count: up to 8 rows
    through packed_gemv.cc (in fours, the last group short), above that oneDNN's own kernel."""
    from jaxpage.models.weight_packing import pack_kernel

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.bfloat16)
    kernel = np.asarray(jnp.asarray(rng.standard_normal(k_shape), jnp.bfloat16))
    packed = pack_kernel(kernel[None], num_in, len(k_shape) - num_in)[0]  # one layer of a stack
    assert packed.shape == kernel.shape and packed.dtype == kernel.dtype
    assert np.mean(packed.view(np.uint16) != kernel.view(np.uint16)) > 0.5  # the bytes did move
    y = np.asarray(jax.jit(lambda x, k: dense(x, k, num_in, packed=True))(x, jnp.asarray(packed)), np.float32)
    ref = np.tensordot(np.asarray(x, np.float32), np.asarray(kernel, np.float32), axes=num_in)
    np.testing.assert_allclose(y, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max(initial=1))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("gemv_rows", [8, 0])
def test_few_row_packed_products_on_either_kernel(rows, gemv_rows):
    """A few rows against packed bfloat16 weights run on packed_gemv.cc up to ``gemv_rows`` and on oneDNN's kernel
    above (the default depends on the CPU: 2 with AMX, 8 without); forced either way, each equals float32 math
    to bfloat16 rounding."""
    from jaxpage.cpu_kernels import onednn

    rng = np.random.default_rng(rows)
    kernel = np.asarray(jnp.asarray(rng.standard_normal((1536, 576)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((rows, 1536)), jnp.bfloat16)
    packed = jnp.asarray(onednn.pack(kernel))
    y = jax.jit(lambda x, w: onednn.matmul(x, w, packed=True, gemv_rows=gemv_rows))(x, packed)
    ref = np.asarray(x, np.float32) @ np.asarray(kernel, np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


@needs_onednn
@pytest.mark.parametrize("rows", [3, 8])
def test_timed_products_equal_float32_math_whichever_kernel_runs(rows, monkeypatch):
    """Up to ``timed_rows`` rows the product runs packed_gemv.cc or oneDNN's kernel by their measured times; the
    first calls of a shape alternate the two, and every call equals float32 math to bfloat16 rounding."""
    from jaxpage.cpu_kernels import onednn

    rng = np.random.default_rng(rows)
    kernel = np.asarray(jnp.asarray(rng.standard_normal((576, 1536)), jnp.bfloat16))
    packed = jnp.asarray(onednn.pack(kernel))
    monkeypatch.setattr(onednn, "default_timed_rows", lambda: 8)
    fn = jax.jit(lambda x, w: onednn.matmul(x, w, packed=True))
    assert "timed_rows = 8" in fn.lower(jnp.zeros((rows, 576), jnp.bfloat16), packed).as_text()
    for _ in range(40):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.bfloat16)
        ref = np.asarray(x, np.float32) @ np.asarray(kernel, np.float32)
        np.testing.assert_allclose(np.asarray(fn(x, packed), np.float32), ref, rtol=2 ** -8,
                                   atol=1e-3 * np.abs(ref).max())


@needs_onednn
def test_timed_choice_takes_the_faster_kernel_and_follows_a_switch():
    """jaxpage/cpu_kernels/timed_choice.h on the AMX VM's times (SmolLM2's 8-row products, ms: packed_gemv.cc 23.7 and
    oneDNN 15.9 in a fast spell, 27.5 and 33.1 in a slow one): after its warming calls it runs the faster kernel,
    tries the other every 32nd call, and when the spell changes it follows within two tries; with tries due 0 ms
    after the last instead of an hour, every call after the warming ones is a try."""
    import ctypes

    from jaxpage.cpu_kernels.library import ONEDNN, library

    lib = library(ONEDNN)
    lib.jaxpage_timed_choice_new.restype = ctypes.c_void_p
    lib.jaxpage_timed_choice_new.argtypes = [ctypes.c_int64]
    lib.jaxpage_timed_choice_step.argtypes = [ctypes.c_void_p, ctypes.c_double, ctypes.c_int]
    lib.jaxpage_timed_choice_free.argtypes = [ctypes.c_void_p]
    choice, eager = lib.jaxpage_timed_choice_new(3_600_000), lib.jaxpage_timed_choice_new(0)
    try:
        fast, slow = {0: 23.7, 1: 15.9}, {0: 27.5, 1: 33.1}
        warm = [lib.jaxpage_timed_choice_step(choice, -1.0, 0)]
        for _ in range(3):
            warm.append(lib.jaxpage_timed_choice_step(choice, fast[warm[-1]], warm[-1]))
        assert warm == [0, 1, 0, 1]  # the kernels alternate while they warm
        pick = warm[-1]
        for spell, faster in ((fast, 1), (slow, 0), (fast, 1), (slow, 0)):
            picks = []
            for _ in range(320):
                pick = lib.jaxpage_timed_choice_step(choice, spell[pick], pick)
                picks.append(pick)
            settled = picks[64:]
            assert settled.count(1 - faster) == pytest.approx(len(settled) / 32, abs=1.5), spell
        picks = [lib.jaxpage_timed_choice_step(eager, -1.0, 0)]
        for _ in range(40):
            picks.append(lib.jaxpage_timed_choice_step(eager, fast[picks[-1]], picks[-1]))
        assert picks[4:] == [0] * 37  # oneDNN (1) is the faster, and each call is a try of the other
    finally:
        lib.jaxpage_timed_choice_free(choice)
        lib.jaxpage_timed_choice_free(eager)


@needs_onednn
def test_independent_matmuls_of_one_shape_run_at_once():
    """XLA:CPU runs independent ops of a program on its threads at once: oneDNN primitives of one shape executed
    together shared the library's scratchpad and crashed (a segfault at 8-32 rows, before the scratchpad became
    the caller's); each product still equals float32 math."""
    from jaxpage.models.weight_packing import pack_kernel

    rng = np.random.default_rng(4)
    kernels = [np.asarray(jnp.asarray(rng.standard_normal((576, 1536)), jnp.bfloat16)) for _ in range(12)]
    packed = [jnp.asarray(pack_kernel(k[None], 1, 1)[0]) for k in kernels]
    fn = jax.jit(lambda x, *ks: [dense(x, k, 1, packed=True) for k in ks])
    for rows in (16, 24):
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.bfloat16)
        for _ in range(4):
            ys = fn(x, *packed)
        for y, k in zip(ys, kernels):
            ref = np.asarray(x, np.float32) @ np.asarray(k, np.float32)
            np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max())


@needs_onednn
def test_linears_pack_only_where_the_layout_pads_nothing():
    """A kernel whose packed layout would pad (a 1000-wide output, an 8-wide one) stays plain: a packed kernel
    keeps its shape, so its bytes must fit it exactly."""
    from jaxpage.models.weight_packing import linear_packs

    assert linear_packs((576,), (3, 5, 64)) and linear_packs((1536,), (576,))
    assert not linear_packs((576,), (1000,)) and not linear_packs((64,), (8,))


@needs_onednn
def test_other_platforms_lower_xla_dot():
    x, kernel = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 8), jnp.bfloat16)
    for platform in ("cuda", "tpu"):
        text = jax.jit(lambda x, k: dense(x, k, 1)).trace(x, kernel).lower(lowering_platforms=(platform,)).as_text()
        assert "jaxpage_onednn_matmul" not in text and "dot_general" in text


def test_float32_dense_stays_xla():
    x, kernel = jnp.ones((2, 64)), jnp.ones((64, 8))
    assert "jaxpage_onednn_matmul" not in jax.jit(lambda x, k: dense(x, k, 1)).lower(x, kernel).as_text()


def test_bfloat16_kv_write_keeps_the_pool_bfloat16():
    """XLA:CPU turned a bfloat16 scatter into float32 (or, on its bits, uint16) copies of the whole pool; the write
    is the in-place FFI call, and writes exactly the given rows."""
    pool = jnp.zeros((4, 64, 2, 2, 16, 8), jnp.bfloat16)  # layers, blocks, k/v, kv heads, block size, head dim
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.bfloat16)
    slots = jnp.asarray([17, 18, 100], jnp.int32)
    fn = jax.jit(write_kv, static_argnums=1)
    compiled = fn.lower(pool, 2, k, v, slots).compile().as_text()
    assert "f32[4,64,2,2,16,8]" not in compiled and "u16[4,64,2,2,16,8]" not in compiled
    assert ("jaxpage_write_kv" in compiled) == kv_write.available()
    out = np.asarray(fn(pool, 2, k, v, slots), np.float32)
    for t, slot in enumerate([17, 18, 100]):
        np.testing.assert_array_equal(out[2, slot // 16, 0, :, slot % 16], np.asarray(k[t], np.float32))
        np.testing.assert_array_equal(out[2, slot // 16, 1, :, slot % 16], np.asarray(v[t], np.float32))
    assert np.count_nonzero(out) == np.count_nonzero(np.asarray(k)) + np.count_nonzero(np.asarray(v))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_block_moves_of_a_narrow_float_pool_copy_blocks_in_place(dtype):
    """Copy-on-write copies, swap-out gathers and swap-in scatters of a bfloat16/float8 pool: exactly numpy's
    moves, and no float32 (or integer) copy of the whole pool in the compiled moves (XLA:CPU made one per call)."""
    from jaxpage.attention.block_moves import BlockMoves

    device = jax.devices()[0]
    moves = BlockMoves.jit(device, jnp.dtype(dtype))
    rng = np.random.default_rng(4)
    shape = (3, 12, 2, 2, 16, 8)  # layers, blocks, k/v, kv heads, block size, head dim
    ref = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    src, dst = np.asarray([5, 7, 0, 0], np.int32), np.asarray([9, 2, 0, 0], np.int32)  # padded with the null block
    for fn, args in ((moves.copy, (src, dst)), (moves.gather, (src,))):
        text = fn.lower(jnp.asarray(ref), *args).compile().as_text()
        assert ("jaxpage_take_blocks" in text) == kv_write.available()
        assert not any(f"{t}[3,12,2,2,16,8]" in text.replace(f"{jnp.dtype(dtype).name}[3,12", "")
                       for t in ("f32", "u16", "u8", "s8"))
    gathered = np.asarray(moves.gather(jnp.asarray(ref), src))
    np.testing.assert_array_equal(gathered.view(np.uint8), ref[:, src].view(np.uint8))
    expected = ref.copy()
    expected[:, dst] = ref[:, src]  # the null block onto itself changes nothing
    copied = np.asarray(moves.copy(jnp.asarray(ref), src, dst))
    np.testing.assert_array_equal(copied.view(np.uint8), expected.view(np.uint8))
    data = rng.standard_normal((3, 4, 2, 2, 16, 8)).astype(np.float32).astype(dtype)
    scattered = np.asarray(moves.scatter(jnp.asarray(ref), np.asarray([3, 4, 11, 0], np.int32), jnp.asarray(data)))
    expected = ref.copy()
    expected[:, [3, 4, 11, 0]] = data
    np.testing.assert_array_equal(scattered.view(np.uint8), expected.view(np.uint8))


# --- bfloat16 SmolLM2 against transformers float32 ---------------------------------------------------------------
# measured 2026-12-01: top-1 0.963, KL 0.0012 (int8 weights: 0.872, 0.047); the bars leave room for rounding
MIN_TOP1_BF16 = 0.94
MAX_KL_BF16 = 0.005


def test_smollm2_bfloat16_teacher_forced_quality_against_float32(hf_smollm2):
    """bfloat16 weights, activations and KV pool (oneDNN matmuls on weights packed at load, as the engine runs
    them, where available) against transformers float32, teacher-forced over the quantization tests' 2,048
    tokens of varied text."""
    from jaxpage.testing.quality import SEGMENT, SOURCES, agreement_with_transformers
    from jaxpage.config import StepModelConfig
    from jaxpage.models import cast_weights, config_from_hf
    from jaxpage.models.loader import default_cache_dir, load_model
    from jaxpage.models.weights import pack_params

    model, tokenizer = hf_smollm2
    loaded = load_model(None, default_cache_dir(), None)
    cfg = StepModelConfig.of(config_from_hf(loaded.hf_config), None, onednn.bfloat16_matmul())
    params = cast_weights(pack_params(cfg, loaded.params), "bfloat16")
    top1, kl, top1s, kls = agreement_with_transformers(model, tokenizer, cfg, params, jnp.bfloat16)
    print(f"bfloat16 vs float32 over {SEGMENT * len(SOURCES)} tokens: top-1 {top1:.4f}, mean KL {kl:.5f} "
          f"(per source: {[round(t, 4) for t in top1s]}, {[round(k, 5) for k in kls]})")
    assert top1 >= MIN_TOP1_BF16 and kl <= MAX_KL_BF16, (top1, kl)


def test_bfloat16_attention_gathers_pages_without_converting_the_pool():
    """The XLA path's page gather from a bfloat16 pool: XLA:CPU converted the whole pool to float32 to gather."""
    from jaxpage.attention.backends import paged_attention_xla, take_pages

    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.standard_normal((3, 40, 2, 2, 16, 8)), jnp.bfloat16)
    pages = pool.reshape(120, 2, 2, 16, 8)
    rows = jnp.asarray([5, 0, 119, 200, -3], jnp.int32)  # out of range clips, as jnp.take's mode="clip"
    np.testing.assert_array_equal(np.asarray(jax.jit(take_pages)(pages, rows), np.float32),
                                  np.asarray(jnp.take(pages, rows, axis=0, mode="clip"), np.float32))
    q = jnp.asarray(rng.standard_normal((4, 4, 8)), jnp.bfloat16)
    tables = jnp.asarray([[1, 2, 3]] * 4, jnp.int32)
    fn = jax.jit(lambda q, pool: paged_attention_xla(q, pool, jnp.int32(1), jnp.arange(4, dtype=jnp.int32),
                                                     jnp.asarray([3, 10, 20, 40], jnp.int32), tables, 0.3))
    compiled = fn.lower(q, pool).compile().as_text()
    assert ("jaxpage_gather_rows" in compiled) == kv_write.available()
    assert not any(f"{t}[120,2,2,16,8]" in compiled or f"{t}[3,40,2,2,16,8]" in compiled for t in ("f32", "u16"))
    f32 = fn(q.astype(jnp.float32), pool.astype(jnp.float32))  # the same values, read from a float32 pool
    np.testing.assert_allclose(np.asarray(fn(q, pool), np.float32), np.asarray(f32), rtol=2 ** -7, atol=2 ** -7)


POOL_DTYPES = ["float32", "bfloat16", "fp8", "int8"]


def _pool_of(kind: str, values: np.ndarray):
    from pallas_kernels.quant import ScaledPool, quantize

    if kind == "int8":
        return ScaledPool(*quantize(jnp.asarray(values), jnp.int8))
    if kind == "fp8":
        return quantize(jnp.asarray(values), jnp.float8_e4m3fn)[0]
    return jnp.asarray(values, kind)


@needs_kernels
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(64, 9, 3, 16), (128, 4, 1, 8), (16, 2, 2, 4),
                                                             (48, 12, 2, 32)])
@pytest.mark.parametrize("window,soft_cap", [(0, None), (7, None), (0, 5.0)])
def test_paged_attention_kernel_equals_the_dense_reference(pool_dtype, head_dim, heads, kv_heads, block_size,
                                                            window, soft_cap):
    """A mixed flat batch (a decode, a prompt chunk longer than one query tile, a one-token sequence, padding)
    through the CPU kernel, against the jnp reference that attends each token over its dense context."""
    from jaxpage.cpu_kernels.paged_attention import paged_attention
    from pallas_kernels.quant import pool_parts
    from pallas_kernels.decode_attention.reference import paged_decode_attention_reference

    rng = np.random.default_rng(head_dim + window)
    num_blocks, width = 40, 10
    pool = _pool_of(pool_dtype, rng.standard_normal((2, num_blocks, 2, kv_heads, block_size, head_dim)))
    tables = jnp.asarray(rng.permutation(num_blocks)[:3 * width].reshape(3, width), jnp.int32)
    seq = np.array([0] + [1] * 21 + [2] + [0] * 3, np.int32)  # last three: padding
    pos = np.array([37] + list(range(10, 31)) + [0] + [0] * 3, np.int32)
    q_dtype = jnp.float32 if pool_dtype == "float32" else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((len(seq), heads, head_dim)), q_dtype)
    got = jax.jit(lambda q, pool: paged_attention(q, pool, 1, seq, pos, tables, 0.125, window, soft_cap))(q, pool)
    values, scales = pool_parts(pool)
    dense = values.astype(jnp.float32) if scales is None else values.astype(jnp.float32) * scales[..., None]
    want = paged_decode_attention_reference(q.astype(jnp.float32), dense, 1, tables[seq], jnp.asarray(pos) + 1,
                                            scale=0.125, soft_cap=soft_cap, window=window)
    tolerance = 1e-5 if q_dtype == jnp.float32 else 2 ** -7  # bfloat16 output: one rounding
    np.testing.assert_allclose(np.asarray(got, np.float32)[:23], np.asarray(want)[:23], rtol=tolerance,
                               atol=tolerance)


@needs_kernels
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (96, 8, 1), (128, 4, 2)])
def test_paged_attention_over_shared_prefix_pages_equals_the_dense_reference(head_dim, heads, kv_heads):
    """bfloat16 decodes of several sequences over the same leading blocks (vLLM's cascade attention), one of them
    shorter than the shared blocks, and prompt chunks with full pages behind them: on an AMX CPU the kernel takes
    these pages as tile products (prefix_tiles.h), elsewhere its fold; both against the dense jnp reference."""
    from jaxpage.cpu_kernels.paged_attention import paged_attention
    from pallas_kernels.decode_attention.reference import paged_decode_attention_reference

    rng = np.random.default_rng(head_dim)
    num_blocks, width, block_size = 64, 8, 16
    pool = jnp.asarray(rng.standard_normal((2, num_blocks, 2, kv_heads, block_size, head_dim)), jnp.bfloat16)
    own = rng.permutation(np.arange(5, num_blocks))[:6 * (width - 5)].reshape(6, width - 5)
    tables = np.concatenate([np.tile(np.arange(5), (6, 1)), own], axis=1)  # blocks 0-4 shared by all six
    tables[5, 2:5] = own[5, :3]  # the last shares only two
    seq = np.array([0, 1, 2, 3, 4, 5] + [1] * 40 + [2] * 3 + [0] * 2, np.int32)  # last two: padding
    pos = np.array([80, 95, 123, 70, 101, 127] + list(range(20, 60)) + [124, 125, 126] + [0] * 2, np.int32)
    tables = jnp.asarray(tables, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(seq), heads, head_dim)), jnp.bfloat16)
    got = jax.jit(lambda q, pool: paged_attention(q, pool, 1, seq, pos, tables, 0.125))(q, pool)
    want = paged_decode_attention_reference(q.astype(jnp.float32), pool.astype(jnp.float32), 1, tables[seq],
                                            jnp.asarray(pos) + 1, scale=0.125)
    np.testing.assert_allclose(np.asarray(got, np.float32)[:-2], np.asarray(want)[:-2], rtol=2 ** -7, atol=2 ** -7)


@needs_kernels
def test_cpu_step_attends_with_the_kernel_and_other_platforms_keep_xla():
    """The XLA backend's attention on a CPU is the kernel's FFI call; lowered for a GPU it stays XLA's ops."""
    from jaxpage.attention.backends import write_and_attend

    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.standard_normal((2, 8, 2, 1, 4, 16)), jnp.bfloat16)
    q, k = jnp.ones((3, 2, 16), jnp.bfloat16), jnp.ones((3, 1, 16), jnp.bfloat16)
    i32 = lambda *a: jnp.asarray(a, jnp.int32)  # noqa: E731
    step = jax.jit(lambda q, k, pool: write_and_attend("xla", q, k, k, pool, jnp.int32(0), i32(0, 0, 1),
                                                       i32(0, 1, 0), i32(0, 1, 4), jnp.asarray([[0], [1]], jnp.int32),
                                                       0.25))
    assert "jaxpage_paged_attention" in step.lower(q, k, pool).as_text()
    cuda = jax.export.export(step, platforms=["cuda"])(q, k, pool).mlir_module()
    assert "jaxpage_paged_attention" not in cuda


LORA_CASES = [  # x shape, a shape, b shape, contracted axes: the Linears' forms, ranks and widths of every kind
    ((37, 576), (5, 576, 48), (5, 48, 3, 320), 1),  # q/k/v-like: 3 parts of rank 16, several output axes
    ((21, 3, 64), (4, 3, 64, 24), (4, 24, 100), 2),  # o-like: several input axes; rank 8 x 3, a narrow output
    ((1, 256), (3, 256, 16), (3, 16, 1536), 1),  # one token
]


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape,a_shape,b_shape,num_in", LORA_CASES)
def test_lora_delta_kernel_equals_the_one_hot_form(x_shape, a_shape, b_shape, num_in, dtype):
    """The CPU's grouped LoRA kernel against the XLA one-hot form over every slot (float32 math): tokens of every
    slot, slot 0 (no adapter: zeros) among them, in any order."""
    from jaxpage.models.lora_slots import LoRAMapping, lora_delta

    rng = np.random.default_rng(7)
    slots = a_shape[0]
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    a[0], b[0] = 0, 0  # slot 0 holds no adapter
    x = rng.standard_normal(x_shape).astype(np.float32)
    mapping = LoRAMapping(jnp.asarray(rng.integers(0, slots, x_shape[0]), jnp.int32), jnp.arange(slots, dtype=jnp.int32))
    cast = lambda t: jnp.asarray(t, dtype)  # noqa: E731
    grouped = jax.jit(lambda x, a, b, m: lora_delta(x, a, b, m, num_in, grouped=True))
    assert "jaxpage_lora_delta" in grouped.lower(cast(x), cast(a), cast(b), mapping).as_text()
    ours = np.asarray(grouped(cast(x), cast(a), cast(b), mapping), np.float32)
    f32 = lambda t: np.asarray(cast(t), np.float32)  # noqa: E731 (the inputs as rounded to dtype)
    ref = np.asarray(lora_delta(jnp.asarray(f32(x)), jnp.asarray(f32(a)), jnp.asarray(f32(b)), mapping, num_in))
    assert ours.shape == ref.shape and not (ref[np.asarray(mapping.token_indices) == 0]).any()
    scale = np.abs(ref).max()
    tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5  # bfloat16: one rounding of the output (and of nothing else)
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * scale)
    cuda = jax.export.export(grouped, platforms=["cuda"])(cast(x), cast(a), cast(b), mapping).mlir_module()
    assert "jaxpage_lora_delta" not in cuda


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,vocab,cap", [(1, 49152, None), (33, 1000, None), (5, 77, 30.0)])
def test_greedy_pick_kernel_equals_the_numpy_argmax_and_log_softmax(dtype, rows, vocab, cap):
    """The plain greedy sampler on the CPU (jaxpage/cpu_kernels/greedy_pick.cc, through ``plain_greedy``): the first
    largest logit's id (ties to the lowest id, as numpy's argmax) and the float64 log-softmax at it, from the LM
    head's raw output (bfloat16 or float32, soft-capped first where the model caps), and its XLA lowering for
    another platform keeps XLA's ops."""
    from jaxpage.worker.sampler import plain_greedy

    rng = np.random.default_rng(rows + vocab)
    raw = jnp.asarray(rng.standard_normal((rows, vocab)) * 4, dtype)
    raw = raw.at[rows - 1, [3, vocab - 2]].set(raw[rows - 1].max() + 1)  # a tie: the lower id wins
    out = jax.jit(lambda x: plain_greedy(x, cap))(raw)
    logits = np.asarray(raw, np.float64)
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    logits = np.asarray(logits.astype(np.float32), np.float64)  # the kernel's float32 values
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    tokens = np.argmax(logits, axis=1)
    np.testing.assert_array_equal(np.asarray(out.tokens), tokens)
    assert out.tokens[rows - 1] == 3
    np.testing.assert_allclose(np.asarray(out.logprobs), log_softmax[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)
    lowered = jax.jit(lambda x: plain_greedy(x, cap)).trace(raw).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxpage_greedy_pick" not in lowered
    assert "jaxpage_greedy_pick" in jax.jit(lambda x: plain_greedy(x, cap)).lower(raw).as_text()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(32, 2, 1536), (384, 2, 1536), (3, 5, 2, 48), (0, 2, 16)])
def test_silu_and_mul_kernel_equals_the_float64_gated_silu(dtype, shape):
    """vLLM's SiluAndMul on the CPU (jaxpage/cpu_kernels/silu_and_mul.cc, alone and through the MLP's
    ``fused_gated_activation``, which takes it for bfloat16): silu(gate) * up against float64 numpy, rounded once to the dtype (large gates of both signs included, where
    exp overflows one way; 384 rows run on the whole team), and its lowering for another platform keeps XLA's
    ops."""
    from jaxpage.cpu_kernels.silu_and_mul import silu_and_mul
    from jaxpage.models.layers import fused_gated_activation

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape) * 3
    x.reshape(-1)[: min(x.size, 4)] = [-120.0, 120.0, -9.0, 30.0][: min(x.size, 4)]
    x = jnp.asarray(x, dtype)
    got = jax.jit(lambda y: fused_gated_activation("silu", y))(x)
    gate, up = (np.asarray(x, np.float64)[..., i, :] for i in (0, 1))
    want = gate / (1 + np.exp(-gate)) * up
    assert got.dtype == x.dtype and got.shape == shape[:-2] + shape[-1:]
    tol = 2 ** -8 if dtype == "bfloat16" else 1e-6  # bfloat16: the one rounding of the output
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=1e-30)
    np.testing.assert_allclose(np.asarray(jax.jit(silu_and_mul)(x), np.float64), want, rtol=tol, atol=1e-30)
    if dtype == "bfloat16" and shape[0]:
        lowered = jax.jit(lambda y: fused_gated_activation("silu", y)).lower(x).as_text()
        assert "jaxpage_silu_and_mul" in lowered
        cuda = jax.jit(lambda y: fused_gated_activation("silu", y)).trace(x).lower(lowering_platforms=("cuda",))
        assert "jaxpage_silu_and_mul" not in cuda.as_text()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,kv_heads,group,head_dim", [(5, 3, 3, 64), (600, 3, 3, 64), (4, 2, 1, 32),
                                                            (0, 3, 3, 64)])
def test_rotary_embedding_kernel_splits_qkv_and_equals_the_float64_rope(dtype, tokens, kv_heads, group, head_dim):
    """vLLM's rotary_embedding on the CPU (jaxpage/cpu_kernels/rotary_embedding.cc) over the fused q/k/v output [T, KVH,
    G + 2, D]: q and k rotated (rotate-half) against float64 numpy, rounded once to the dtype (600 tokens run on the
    whole team), v the same bits as its slice; through ``Attention.rotated_qkv`` (bfloat16, no q/k norms) the CPU
    lowering calls it and a CUDA lowering keeps XLA's ops."""
    from jaxpage.cpu_kernels.rotary_embedding import rotary_embedding
    from jaxpage.config import ModelConfig
    from jaxpage.models.attention import Attention
    from jaxpage.models.rope import rope_tables

    rng = np.random.default_rng(tokens + head_dim)
    y = jnp.asarray(rng.standard_normal((tokens, kv_heads, group + 2, head_dim)) * 2, dtype)
    inv_freq = 10000.0 ** -(np.arange(0, head_dim, 2) / head_dim)
    cos, sin = rope_tables(jnp.asarray(rng.integers(0, 4096, tokens), jnp.int32), inv_freq[None])
    cos, sin = cos[0], sin[0]
    q, k, v = jax.jit(rotary_embedding)(y, cos, sin)
    y64, c64, s64 = (np.asarray(a, np.float64) for a in (y, cos, sin))

    def rope(x):  # [T, heads, D]
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([x1 * c64[:, None] - x2 * s64[:, None], x2 * c64[:, None] + x1 * s64[:, None]], -1)

    tol = 2 ** -8 if dtype == "bfloat16" else 1e-5
    want_q = rope(y64[:, :, :group].reshape(tokens, kv_heads * group, head_dim))
    assert q.shape == want_q.shape and k.shape == v.shape == (tokens, kv_heads, head_dim) and q.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(q, np.float64), want_q, rtol=tol, atol=tol * 8)
    np.testing.assert_allclose(np.asarray(k, np.float64), rope(y64[:, :, group]), rtol=tol, atol=tol * 8)
    np.testing.assert_array_equal(np.asarray(v, np.float64), y64[:, :, group + 1])
    if dtype == "bfloat16" and tokens and head_dim == 64:
        cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
                          num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                          rope_theta=1e4, rope_parameters=(), max_position_embeddings=4096,
                          tie_word_embeddings=False, qkv_bias=False, o_bias=False)
        layer = Attention(cfg)
        fn = jax.jit(layer.rotated_qkv)
        assert "jaxpage_rotary_embedding" in fn.lower(y, cos, sin).as_text()
        assert "jaxpage_rotary_embedding" not in fn.trace(y, cos, sin).lower(lowering_platforms=("cuda",)).as_text()
        got_q, got_k, got_v = fn(y, cos, sin)
        np.testing.assert_allclose(np.asarray(got_q, np.float64), want_q, rtol=tol, atol=tol * 8)
        np.testing.assert_allclose(np.asarray(got_k, np.float64), rope(y64[:, :, group]), rtol=tol, atol=tol * 8)
        np.testing.assert_array_equal(np.asarray(got_v, np.float64), y64[:, :, group + 1])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(0, 64), (1, 576), (96, 576), (1024, 576), (3, 9, 128)])
def test_rms_norm_kernels_equal_the_float64_norm(dtype, shape):
    """vLLM's rms_norm and fused_add_rms_norm on the CPU (jaxpage/cpu_kernels/rms_norm.cc, alone and through ``RMSNorm``,
    which takes them for bfloat16): against float64 numpy of the residual as the dtype stores it (x + h rounded
    once), normed and rounded once (1,024 rows on the whole team); and their lowering for another platform keeps
    XLA's ops."""
    from jaxpage.cpu_kernels.rms_norm import fused_add_rms_norm, rms_norm
    from jaxpage.models.layers import RMSNorm

    rng = np.random.default_rng(sum(shape))
    x, h = (jnp.asarray(rng.standard_normal(shape) * s, dtype) for s in (3.0, 0.5))
    weight = jnp.asarray(rng.standard_normal(shape[-1]), dtype)
    norm = RMSNorm(shape[-1], 1e-5)
    norm.weight = nnx.Param(weight)  # the model loads its norms in the dtype

    def want(r):
        r = np.asarray(r, np.float64)
        return r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + 1e-5) * np.asarray(weight, np.float64)
    tol = 2 ** -8 if dtype == "bfloat16" else 1e-5  # bfloat16: the one rounding of the output
    check = lambda got, r: np.testing.assert_allclose(np.asarray(got, np.float64), want(r), rtol=tol, atol=1e-6)
    check(jax.jit(lambda x: rms_norm(x, weight, 1e-5))(x), x)
    check(jax.jit(norm)(x), x)
    residual = x + h  # in the dtype: rounded once
    for r, normed in (jax.jit(lambda x, h: fused_add_rms_norm(x, h, weight, 1e-5))(x, h),
                      jax.jit(norm.add_and_norm)(x, h)):
        assert r.dtype == normed.dtype == x.dtype and r.shape == normed.shape == x.shape
        np.testing.assert_array_equal(np.asarray(r, np.float64), np.asarray(residual, np.float64))
        check(normed, residual)
    if dtype == "bfloat16" and shape[0]:
        assert "jaxpage_fused_add_rms_norm" in jax.jit(norm.add_and_norm).lower(x, h).as_text()
        cuda = jax.jit(norm.add_and_norm).trace(x, h).lower(lowering_platforms=("cuda",)).as_text()
        assert "jaxpage_" not in cuda


_THREADS_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxpage.cpu_kernels import onednn
from jaxpage.cpu_kernels.greedy_pick import greedy_pick
from jaxpage.cpu_kernels.paged_attention import paged_attention
rng = np.random.default_rng(0)
kernel = np.asarray(jnp.asarray(rng.standard_normal((1536, 576)), jnp.bfloat16))
out = {"kernel": np.asarray(kernel, np.float32)}
for rows in (1, 5, 8, 24):
    x = jnp.asarray(rng.standard_normal((rows, 1536)), jnp.bfloat16)
    for packed, w in ((True, jnp.asarray(onednn.pack(kernel))), (False, jnp.asarray(kernel))):
        for gemv_rows in (0, 8):
            y = jax.jit(lambda x, w: onednn.matmul(x, w, packed=packed, gemv_rows=gemv_rows))(x, w)
            out[f"x{rows}"] = np.asarray(x, np.float32)
            out[f"matmul{rows}_{packed}_{gemv_rows}"] = np.asarray(y, np.float32)
pool = jnp.asarray(rng.standard_normal((1, 12, 2, 3, 16, 64)), jnp.bfloat16)
tables = jnp.asarray(rng.permutation(12).reshape(4, 3), jnp.int32)
for tokens in (4, 20):
    q = jnp.asarray(rng.standard_normal((tokens, 9, 64)), jnp.bfloat16)
    seq = jnp.asarray(np.arange(tokens) % 4, jnp.int32)
    pos = jnp.asarray(rng.integers(0, 48, tokens), jnp.int32)
    out[f"attention{tokens}"] = np.asarray(jax.jit(lambda q: paged_attention(q, pool, 0, seq, pos, tables, 0.125, 0,
                                                                             None))(q), np.float32)
for rows in (3, 17):
    tokens, logprobs = jax.jit(greedy_pick)(jnp.asarray(rng.standard_normal((rows, 4096)), jnp.float32))
    out[f"greedy{rows}"] = np.concatenate([np.asarray(tokens, np.float32), np.asarray(logprobs)])
import ctypes
from jaxpage.cpu_kernels.library import library
threads = library().jaxpage_kernel_threads
out["threads"] = np.array([threads(ctypes.c_int64(rows)) for rows in (1, 8, 9, 24)])
np.savez(sys.argv[1], **out)
"""


@needs_onednn
def test_kernels_give_the_same_bits_on_one_thread_and_on_all(tmp_path):
    """The kernels run calls of up to JAXPAGE_CPU_SERIAL_ROWS rows (default 0) on one OpenMP thread
    (jaxpage/cpu_kernels/threads.h): each call's result is the same bit for bit whatever the team, for products (packed on
    either kernel, and plain), the attention and the greedy pick, at row counts on both sides of 8; the
    products also equal float32 math to bfloat16 rounding."""
    import os
    import subprocess
    import sys

    runs = {}
    for serial_rows in ("0", "1000"):  # never one thread; always one thread
        path = tmp_path / f"serial{serial_rows}.npz"
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # libgomp's default team
        env.update(JAXPAGE_CPU_SERIAL_ROWS=serial_rows, JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(path)], env=env, check=True, timeout=600)
        runs[serial_rows] = dict(np.load(path))
    cores = len(os.sched_getaffinity(0))  # libgomp's team: the cores this process may run on
    assert runs["0"].pop("threads").tolist() == [cores] * 4 and runs["1000"].pop("threads").tolist() == [1] * 4
    assert runs["0"].keys() == runs["1000"].keys()
    for name, value in runs["0"].items():
        np.testing.assert_array_equal(value, runs["1000"][name], err_msg=name)
    for name, y in runs["0"].items():
        if name.startswith("matmul"):
            x = runs["0"][f"x{name[6:].split('_')[0]}"]
            ref = x @ runs["0"]["kernel"]
            np.testing.assert_allclose(y, ref, rtol=2 ** -8, atol=1e-3 * np.abs(ref).max(), err_msg=name)


@needs_kernels
def test_a_custom_op_chooses_its_kernel_in_one_place():
    """CustomOp: the kernel (here the RMS norm's) only for operands it supports, only in a CPU lowering, and for a
    kernel reading its operands whole not under a mesh that splits them; the portable form everywhere else, with
    the same values."""
    import jax.sharding as shd

    from jaxpage.cpu_kernels.rms_norm import RMS_NORM

    def portable(x, w):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (normed * w.astype(jnp.float32)).astype(x.dtype)

    def op(x, w):
        return RMS_NORM(portable, x, w, eps=1e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.ones((64,), jnp.bfloat16)
    assert "jaxpage_rms_norm" in jax.jit(op).lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(jax.jit(op)(x, w), np.float32), np.asarray(portable(x, w), np.float32),
                               rtol=2 ** -7)
    assert "jaxpage_rms_norm" not in jax.jit(op).lower(x[:, :40], w[:40]).as_text()  # not a multiple of 16
    assert "jaxpage_rms_norm" not in jax.jit(op).lower(x.astype(jnp.float32), w.astype(jnp.float32)).as_text()
    assert "jaxpage_" not in jax.jit(op).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    if len(jax.devices()) > 1:
        mesh = jax.make_mesh((2,), ("model",), axis_types=(shd.AxisType.Explicit,))
        with jax.sharding.use_mesh(mesh):
            assert "jaxpage_rms_norm" not in jax.jit(op).lower(x, w).as_text()
