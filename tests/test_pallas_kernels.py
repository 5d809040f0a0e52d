"""The Pallas paged-attention kernels against their pure-jnp references, on CPU through the Pallas interpreters.

Every case draws fresh random inputs (the seed is in every failure message; set KERNEL_TEST_SEED to replay one)
and is built to catch reads and writes in the wrong place:
- block tables are a random permutation of distinct block ids, padded with the null block (0);
- every slot that no sequence owns up to its length is NaN: the null block, the tail of each sequence's last
  page, unused blocks, and every other layer. A kernel that reads a key it should not, or multiplies a masked
  value instead of selecting it away, returns NaN;
- outputs start as NaN (both interpreters fill fresh buffers with NaN; test_interpreters_poison_outputs pins
  that down), so an element the kernel never writes fails the finiteness check.
Batches mix lengths 1, block multiples, block multiples +- 1, the maximum and empty rows (length 0).
Windowed cases run one compiled kernel over several sliding windows (shorter than a block, crossing page
boundaries, longer than every context) and, as the sliding-window memory manager does, put the null block (NaN)
in the table for every page wholly before the window, so a kernel that reads one fails.
Tolerances: float32 1e-5, bfloat16 1e-2, relative to the output and to the size of the terms it sums (the
reference's attention over |V|: sum_i p_i |v_i| / l): a bfloat16 kernel rounds its matmul operands (the
probabilities, and K/V dequantized from an 8-bit pool) to bfloat16, an error relative to each term p_i v_i. Where
the few keys of a short window cancel, the output is far smaller than its terms, and so may its error not be.
Quantized KV cases (``kv`` int8 or fp8) quantize the poisoned pool with quant.quantize (a NaN row gives a NaN
int8 scale, a NaN fp8 value), and the reference reads it dequantizing first; the same tolerances apply, as
kernel and reference read the same quantized values.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    paged_decode_attention_gpu,
    paged_decode_attention_reference,
    paged_decode_attention_tpu,
    ragged_paged_attention_gpu,
    ragged_paged_attention_reference,
    ragged_paged_attention_tpu,
    write_kv_tpu,
)
from pallas_kernels.packed import pack_pool, unpack_pool
from jaxpage.config import STORED_DTYPES
from pallas_kernels.quant import pool_parts, quantize, with_parts
from pallas_kernels.kv_write.reference import write_kv_reference

_InterpretParams = getattr(pltpu, "InterpretParams", None) or pltpu.TPUInterpretParams
SIM = _InterpretParams()  # the TPU simulator: checks DMAs, semaphores and out-of-bounds reads
SIM_2_CORES = _InterpretParams(num_cores_or_threads=2, detect_races=True)  # megacore: 2 cores, race detector
NUM_LAYERS, LAYER = 2, 1


def fresh_rng():
    seed = int(os.environ.get("KERNEL_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
    return np.random.default_rng(seed), f"seed={seed} (KERNEL_TEST_SEED={seed} replays it)"


def compile_jitted(fn, *args):
    """jit, compiled without XLA's backend optimisations: most of a case's time is compiling the interpreted
    kernel, and -O0 compiles several times faster (results are the same math)."""
    lowered = jax.jit(fn).lower(*args)
    try:
        return lowered.compile({"xla_backend_optimization_level": 0})
    except Exception:  # an XLA that no longer knows the option
        return lowered.compile()


def run_jitted(fn, *args):
    return compile_jitted(fn, *args)(*args)


WINDOWS = (5, 20, 33, 10_000)  # < block_size, crossing pages, > every context (every case has block_size 16)


def drop_dead_pages(tables, first_positions, window, block_size):
    """The null block for each row's pages wholly before the window of its first query position."""
    tables = np.array(tables)
    if window:
        for row, first in enumerate(first_positions):
            dead = max(0, first - window + 1) // block_size
            tables[row, :dead] = 0
    return tables


def tolerance(dtype) -> float:
    return 1e-5 if dtype == jnp.float32 else 1e-2


def assert_matches(out, ref, dtype, msg, rows=slice(None), terms=None):
    """|out - ref| <= tol * (|ref| + terms) elementwise; ``terms`` the reference's attention over |V| (default 1:
    the inputs' values are of magnitude ~1)."""
    out, ref = np.asarray(out.astype(jnp.float32))[rows], np.asarray(ref.astype(jnp.float32))[rows]
    assert np.isfinite(out).all(), f"NaN/inf in outputs (unwritten, or a masked value leaked); {msg}"
    assert np.isfinite(ref).all(), f"reference not finite; {msg}"
    terms = np.ones_like(ref) if terms is None else np.asarray(terms.astype(jnp.float32))[rows]
    assert np.isfinite(terms).all() and (terms >= 0).all(), f"reference over |V| not finite and >= 0; {msg}"
    tol = tolerance(dtype)
    excess = np.abs(out - ref) - tol * (np.abs(ref) + terms)
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (f"{np.count_nonzero(excess > 0)} of {excess.size} elements differ by more than "
                                f"{tol} * (|ref| + terms); worst at {worst}: {out[worst]} vs {ref[worst]}, terms "
                                f"{terms[worst]}; {msg}")


def with_abs_values(pool):
    """The pool with |V| in its values' half (an int8 pool's scales are >= 0; NaN stays NaN)."""
    values, scales = pool_parts(pool)
    abs_v = jnp.abs(values[:, :, 1].astype(jnp.float32)).astype(values.dtype)
    return with_parts(values.at[:, :, 1].set(abs_v), scales)


def random_pool(rng, num_blocks, kv_heads, block_size, head_dim, dtype):
    shape = (NUM_LAYERS, num_blocks, 2, kv_heads, block_size, head_dim)
    return rng.standard_normal(shape).astype(np.float32), np.zeros(shape[1:2] + shape[4:5], bool)


def as_pool(pool: np.ndarray, dtype, kv: str):
    """The float pool in q's dtype ("auto"), or quantized to int8 (with scales) or fp8."""
    if kv == "auto":
        return jnp.asarray(pool, dtype)
    return with_parts(*quantize(jnp.asarray(pool, jnp.float32), STORED_DTYPES[kv]))


def kv_suffix(kv: str) -> str:
    return "" if kv == "auto" else f"-kv_{kv}"


def assign_pages(rng, lengths, block_size, width, num_spare=3):
    """Distinct random blocks for each sequence's pages (a permutation), 0 past them; ``owned[b, off]`` marks
    the slots some sequence holds below its length."""
    pages = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(pages) + num_spare
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(lengths), width), np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    start = 0
    for row, (n, p) in enumerate(zip(lengths, pages)):
        tables[row, :p] = ids[start:start + p]
        start += p
        for pos in range(n):
            owned[tables[row, pos // block_size], pos % block_size] = True
    return tables, owned, num_blocks


def poison(pool, owned):
    """NaN everywhere but the owned slots of LAYER."""
    keep = np.zeros(pool.shape, bool)
    keep[LAYER] = owned[:, None, None, :, None]
    return np.where(keep, pool, np.nan)


# ----------------------------------------------------------------------------------------------------- decode

@dataclasses.dataclass(frozen=True)
class DecodeCase:
    dtype: str
    block_size: int
    ratio: int  # query heads per KV head
    head_dim: int
    kv_heads: int
    width: int  # pages per block-table row (max length = width * block_size)
    soft_cap: float | None = None
    gpu: tuple = ()  # extra keywords for the GPU kernel: split-K shapes
    tpu: tuple = ()  # extra keywords for the TPU kernel
    windows: tuple = (0,)  # sliding windows, each run through the one compiled kernel
    kv: str = "auto"  # the KV cache's dtype: auto (q's), int8 or fp8

    def __str__(self):
        extra = "".join(f"-{k}{v}" for k, v in self.gpu + self.tpu)
        cap = f"-cap{self.soft_cap}" if self.soft_cap else ""
        win = "-windows" if self.windows != (0,) else ""
        return (f"{self.dtype}-bs{self.block_size}-g{self.ratio}-d{self.head_dim}-kvh{self.kv_heads}"
                f"-w{self.width}{cap}{win}{kv_suffix(self.kv)}{extra}")

    def lengths(self, rng):
        bs, w = self.block_size, self.width
        lens = [w * bs, 0, 1, bs - 1, bs, bs + 1, min(w, 3) * bs - 1]
        return [int(x) for x in rng.permutation(lens)]


DECODE_CASES = [
    DecodeCase("float32", 16, 1, 64, 2, 4),
    DecodeCase("float32", 16, 3, 128, 1, 5),
    DecodeCase("float32", 32, 4, 64, 2, 3, gpu=(("pages_per_split", 1),), tpu=(("pages_per_compute_block", 1),)),
    DecodeCase("float32", 64, 8, 128, 1, 2),
    DecodeCase("float32", 16, 4, 64, 1, 9, soft_cap=1.5,
               gpu=(("pages_per_split", 2), ("pages_per_compute_block", 1)), tpu=(("pages_per_compute_block", 2),)),
    DecodeCase("float32", 16, 8, 64, 2, 6, gpu=(("pages_per_split", 4), ("pages_per_compute_block", 2)),
               tpu=(("pages_per_compute_block", 4),)),
    DecodeCase("bfloat16", 16, 4, 128, 2, 4),
    DecodeCase("bfloat16", 32, 1, 64, 1, 3, gpu=(("pages_per_split", 1),)),
    DecodeCase("bfloat16", 64, 3, 64, 2, 2, soft_cap=2.0),
    DecodeCase("bfloat16", 16, 8, 64, 1, 7, gpu=(("pages_per_split", 2),), tpu=(("pages_per_compute_block", 3),)),
    DecodeCase("bfloat16", 32, 8, 128, 2, 3, soft_cap=1.5),
    DecodeCase("float32", 16, 4, 64, 2, 6, windows=WINDOWS,
               gpu=(("pages_per_split", 2), ("pages_per_compute_block", 1)), tpu=(("pages_per_compute_block", 2),)),
    DecodeCase("bfloat16", 16, 2, 64, 1, 5, soft_cap=2.0, windows=WINDOWS),
    DecodeCase("float32", 16, 4, 64, 2, 5, kv="int8", gpu=(("pages_per_split", 2), ("pages_per_compute_block", 1)),
               tpu=(("pages_per_compute_block", 2),)),
    DecodeCase("bfloat16", 32, 3, 128, 1, 3, kv="int8", soft_cap=2.0, windows=WINDOWS),
    DecodeCase("bfloat16", 16, 4, 64, 2, 4, kv="fp8"),
    DecodeCase("float32", 32, 2, 64, 1, 3, kv="fp8", windows=WINDOWS, tpu=(("pages_per_compute_block", 1),)),
]


def make_decode_inputs(case: DecodeCase, rng):
    dtype = jnp.dtype(case.dtype)
    lengths = case.lengths(rng)
    tables, owned, num_blocks = assign_pages(rng, lengths, case.block_size, case.width)
    pool, _ = random_pool(rng, num_blocks, case.kv_heads, case.block_size, case.head_dim, dtype)
    q = rng.standard_normal((len(lengths), case.kv_heads * case.ratio, case.head_dim))
    return (jnp.asarray(q, dtype), as_pool(poison(pool, owned), dtype, case.kv), jnp.int32(LAYER),
            jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


def check_decode(kernel, case: DecodeCase, **kw):
    rng, msg = fresh_rng()
    args = make_decode_inputs(case, rng)
    scale = case.head_dim ** -0.5

    def with_window(fn):
        return lambda *a: fn(*a[:-1], window=a[-1], scale=scale, soft_cap=case.soft_cap)

    ours = compile_jitted(with_window(functools.partial(kernel, **kw)), *args, jnp.int32(0))
    ref_fn = compile_jitted(with_window(paged_decode_attention_reference), *args, jnp.int32(0))
    for window in case.windows:
        lengths = np.asarray(args[4])
        tables = jnp.asarray(drop_dead_pages(args[3], lengths - 1, window, case.block_size))
        windowed = args[:3] + (tables, args[4], jnp.int32(window))
        out, ref = ours(*windowed), ref_fn(*windowed)
        terms = ref_fn(windowed[0], with_abs_values(windowed[1]), *windowed[2:])
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_matches(out, ref, args[0].dtype, f"{case}; window={window}; lengths={lengths.tolist()}; {msg}",
                       terms=terms)


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_gpu_decode_matches_reference(case):
    check_decode(paged_decode_attention_gpu, case, interpret=True, **dict(case.gpu))


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_tpu_decode_matches_reference(case):
    check_decode(paged_decode_attention_tpu, case, interpret=True, **dict(case.tpu))


SIM_DECODE_CASES = [
    (DecodeCase("float32", 16, 4, 64, 2, 3, tpu=(("pages_per_compute_block", 2),), windows=(20,)), SIM_2_CORES),
    (DecodeCase("bfloat16", 16, 3, 128, 1, 2), SIM),
]


@pytest.mark.parametrize("case,params", SIM_DECODE_CASES, ids=[f"{c}-cores{p.num_cores_or_threads}" for c, p in SIM_DECODE_CASES])
def test_tpu_decode_in_tpu_simulator(case, params):
    check_decode(paged_decode_attention_tpu, case, interpret=params, **dict(case.tpu))
    assert not races_found(), "the TPU simulator found a data race between cores"


def races_found() -> bool:
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as sim
    except ImportError:  # moved in a later JAX: the simulator still printed any race it found
        return False
    return bool(sim.races is not None and sim.races.races_found)


# ----------------------------------------------------------------------------------------------------- ragged

@dataclasses.dataclass(frozen=True)
class RaggedCase:
    dtype: str
    block_size: int
    ratio: int
    head_dim: int
    kv_heads: int
    width: int
    soft_cap: float | None = None
    # "distinct": padding tokens belong to an all-null row and take null slots 0, 1, ...; "engine": as
    # jaxpage.worker.input_batch.build_batch pads: token_seq 0 (the FIRST sequence's row), position 0, slot 0
    padding: str = "distinct"
    mix: str = "mixed"  # "mixed": decodes then prompt chunks; "one": a single prompt chunk; "long": decodes
    # then prompt chunks of 40+ tokens (several query blocks of the GPU kernel, not aligned to them)
    kw: tuple = ()  # extra keywords for the TPU kernel
    gpu: tuple = ()  # extra keywords for the GPU kernel
    windows: tuple = (0,)  # sliding windows, each run through the one compiled kernel
    kv: str = "auto"  # the KV cache's dtype: auto (q's), int8 or fp8
    packed: bool = False  # the pool in the packed layout (pallas_kernels.packed): K and V in one row

    def __str__(self):
        extra = "".join(f"-{k}{v}" for k, v in self.kw + self.gpu)
        cap = f"-cap{self.soft_cap}" if self.soft_cap else ""
        win = "-windows" if self.windows != (0,) else ""
        return (f"{self.dtype}-bs{self.block_size}-g{self.ratio}-d{self.head_dim}-kvh{self.kv_heads}"
                f"-w{self.width}{cap}{win}-pad_{self.padding}-{self.mix}{kv_suffix(self.kv)}{extra}"
                + ("-packed" if self.packed else ""))

    def sequences(self, rng):
        """(tokens already in the pool, new tokens) per sequence: decodes first, then prompt chunks."""
        bs, max_len = self.block_size, self.width * self.block_size
        if self.mix == "one":  # with engine padding, the padding tokens continue this sequence's run
            return [(bs - 1, min(bs + 2, max_len - bs + 1))]
        if self.mix == "long":
            assert max_len >= 62, "long chunks need 62 positions"
            decodes = [(max_len - 1, 1), (bs - 1, 1), (0, 1)]
            chunks = [(0, 45), (bs + 3, 41), (5, 2), (max_len - 47, 47)]
            return [decodes[i] for i in rng.permutation(len(decodes))] + chunks
        decodes = [(max_len - 1, 1), (bs - 1, 1), (bs, 1), (2 * bs - 2, 1), (0, 1)]
        chunks = [(0, bs + 1), (bs - 1, min(bs + 2, max_len - bs + 1)), (0, 3)]
        return [decodes[i] for i in rng.permutation(len(decodes))] + chunks


RAGGED_CASES = [
    RaggedCase("float32", 16, 1, 64, 2, 4),
    RaggedCase("float32", 16, 3, 128, 1, 3, kw=(("queries_per_block", 8),), gpu=(("new_tokens_per_block", 4),)),
    RaggedCase("float32", 32, 4, 64, 2, 3, kw=(("pages_per_compute_block", 1),), gpu=(("pages_per_compute_block", 1),)),
    RaggedCase("float32", 64, 8, 64, 1, 2, padding="engine"),
    RaggedCase("float32", 16, 4, 128, 2, 5, soft_cap=1.5, kw=(("kv_heads_per_block", 1), ("pages_per_compute_block", 2)),
               gpu=(("pages_per_compute_block", 2),)),
    RaggedCase("float32", 16, 8, 64, 1, 4, kw=(("queries_per_block", 32), ("pages_per_compute_block", 3))),
    RaggedCase("bfloat16", 16, 4, 64, 2, 4),
    RaggedCase("bfloat16", 32, 1, 128, 2, 3, padding="engine", kw=(("kv_heads_per_block", 1),)),
    RaggedCase("bfloat16", 64, 3, 64, 1, 2, soft_cap=2.0, gpu=(("new_tokens_per_block", 32),)),
    RaggedCase("float32", 16, 4, 64, 2, 3, padding="engine", mix="one", kw=(("queries_per_block", 8),)),
    RaggedCase("bfloat16", 16, 8, 128, 1, 3, kw=(("queries_per_block", 8), ("pages_per_compute_block", 2)),
               gpu=(("pages_per_compute_block", 1), ("new_tokens_per_block", 8))),
    RaggedCase("float32", 16, 4, 64, 2, 5, windows=WINDOWS, kw=(("queries_per_block", 8), ("pages_per_compute_block", 2)),
               gpu=(("pages_per_compute_block", 1), ("new_tokens_per_block", 4))),
    RaggedCase("bfloat16", 16, 2, 64, 1, 4, soft_cap=1.5, padding="engine", windows=WINDOWS),
    # 8-bit pools on TPU: block_size a multiple of 32 (write_kv_tpu moves whole (32, 128) tiles)
    RaggedCase("float32", 32, 4, 64, 2, 3, kv="int8", kw=(("queries_per_block", 8),), gpu=(("new_tokens_per_block", 4),)),
    RaggedCase("bfloat16", 32, 2, 128, 1, 3, kv="int8", soft_cap=1.5, padding="engine", windows=WINDOWS),
    RaggedCase("bfloat16", 32, 4, 64, 2, 3, kv="fp8", kw=(("pages_per_compute_block", 1),)),
    RaggedCase("float32", 32, 1, 64, 1, 3, kv="fp8", padding="engine", windows=WINDOWS),
]


# The packed layout (head_dim 64: K and V in one 128-lane row), as the engine's pallas_tpu backend lays out
# SmolLM2 (9 heads over 3 KV heads): decodes and prompt chunks, long chunks over several query blocks, engine
# padding, head blocks, pages per chunk, windows with a soft cap, 8-bit pools.
PACKED_RAGGED_CASES = [
    RaggedCase("float32", 16, 3, 64, 3, 4, packed=True),
    RaggedCase("float32", 32, 2, 64, 2, 3, kw=(("kv_heads_per_block", 1), ("pages_per_compute_block", 1)),
               packed=True),
    RaggedCase("bfloat16", 16, 2, 64, 1, 4, soft_cap=1.5, padding="engine", windows=WINDOWS, packed=True),
    RaggedCase("float32", 32, 4, 64, 2, 3, kv="int8", kw=(("queries_per_block", 8),), packed=True),
    RaggedCase("bfloat16", 64, 3, 64, 3, 2, kv="int8", padding="engine", packed=True),
    RaggedCase("bfloat16", 32, 2, 64, 2, 3, kv="fp8", kw=(("pages_per_compute_block", 1),), packed=True),
    RaggedCase("float32", 16, 2, 64, 1, 5, mix="long", kw=(("pages_per_compute_block", 2),), packed=True),
]


@pytest.mark.parametrize("case", PACKED_RAGGED_CASES, ids=str)
def test_tpu_ragged_on_the_packed_layout_matches_reference(case):
    check_ragged(ragged_paged_attention_tpu, case, interpret=True)


# Long prompt chunks for the GPU kernel's query blocks (8, 16 and the default 64 rows' worth of tokens).
LONG_RAGGED_CASES = [
    RaggedCase("float32", 16, 4, 64, 2, 5, mix="long", gpu=(("queries_per_block", 8),)),
    RaggedCase("bfloat16", 32, 3, 128, 1, 3, padding="engine", mix="long",
               gpu=(("queries_per_block", 16), ("new_tokens_per_block", 8))),
    RaggedCase("float32", 16, 1, 64, 1, 4, soft_cap=1.5, mix="long", gpu=(("pages_per_compute_block", 2),)),
    RaggedCase("float32", 16, 2, 64, 1, 5, mix="long", windows=WINDOWS, gpu=(("queries_per_block", 8),)),
    RaggedCase("float32", 16, 4, 64, 2, 5, mix="long", kv="int8", gpu=(("queries_per_block", 8),)),
]


def make_ragged_inputs(case: RaggedCase, rng, tokens_multiple=16):
    dtype = jnp.dtype(case.dtype)
    bs = case.block_size
    seqs = case.sequences(rng)
    tables, owned, num_blocks = assign_pages(rng, [c + n for c, n in seqs], bs, case.width)
    owned_before = np.zeros_like(owned)  # slots holding K/V from earlier steps
    token_seq, positions, slots = [], [], []
    for row, (context, new) in enumerate(seqs):
        for pos in range(context + new):
            slot = (tables[row, pos // bs], pos % bs)
            if pos < context:
                owned_before[slot] = True
            else:
                token_seq.append(row), positions.append(pos), slots.append(slot[0] * bs + slot[1])
    num_valid = len(token_seq)
    num_pad = -num_valid % tokens_multiple or tokens_multiple  # always some padding
    pad_row = len(seqs)  # an all-null table row
    tables = np.concatenate([tables, np.zeros((1, case.width), np.int32)])
    for j in range(num_pad):
        if case.padding == "distinct":
            token_seq.append(pad_row), positions.append(0), slots.append(j % bs)
        else:
            token_seq.append(0), positions.append(0), slots.append(0)
    pool, _ = random_pool(rng, num_blocks, case.kv_heads, bs, case.head_dim, dtype)
    t, h = len(token_seq), case.kv_heads * case.ratio
    q, k, v = (rng.standard_normal((t, heads, case.head_dim)) for heads in (h, case.kv_heads, case.kv_heads))
    pool = as_pool(poison(pool, owned_before), dtype, case.kv)
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            pack_pool(pool) if case.packed else pool, jnp.int32(LAYER), jnp.asarray(token_seq, jnp.int32),
            jnp.asarray(positions, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(tables))
    return args, num_valid


def check_ragged(kernel, case: RaggedCase, interpret, tokens_multiple=16):
    rng, msg = fresh_rng()
    args, num_valid = make_ragged_inputs(case, rng, tokens_multiple)
    scale = case.head_dim ** -0.5
    kw = dict(case.kw if kernel is ragged_paged_attention_tpu else case.gpu)

    def with_window(fn):
        return lambda *a: fn(*a[:-1], window=a[-1], scale=scale, soft_cap=case.soft_cap)

    ours = compile_jitted(with_window(functools.partial(kernel, interpret=interpret, **kw)), *args, jnp.int32(0))
    ref_fn = compile_jitted(with_window(ragged_paged_attention_reference), *args, jnp.int32(0))
    token_seq, positions = np.asarray(args[5]), np.asarray(args[6])
    first_positions = [positions[token_seq == row].min(initial=0) for row in range(args[8].shape[0])]
    for window in case.windows:
        tables = jnp.asarray(drop_dead_pages(args[8], first_positions, window, case.block_size))
        windowed = args[:8] + (tables, jnp.int32(window))
        abs_pool = pack_pool(with_abs_values(unpack_pool(args[3]))) if case.packed else with_abs_values(args[3])
        terms, _ = ref_fn(*args[:2], jnp.abs(args[2]), abs_pool, *windowed[4:])
        compare_ragged(case, kernel, ours(*windowed), ref_fn(*windowed), args[0].dtype, num_valid,
                       f"{case}; window={window}; T={args[0].shape[0]}, {num_valid} valid; {msg}", terms)


def compare_ragged(case, kernel, ours, ref, dtype, num_valid, msg, terms):
    """Outputs of padding tokens are compared only for the TPU kernel with distinct padding slots: the GPU
    kernel's padding tokens (all at position 0 of one run) attend each other, unlike the reference's."""
    (out, pool), (ref_out, ref_pool) = ours, ref
    compare_padding = case.padding == "distinct" and kernel is ragged_paged_attention_tpu
    assert out.shape == ref_out.shape
    assert_matches(out, ref_out, dtype, msg, rows=slice(None if compare_padding else num_valid), terms=terms)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all(), f"padding outputs not finite; {msg}"
    assert jax.tree.structure(pool) == jax.tree.structure(ref_pool), msg
    assert pool.shape == ref_pool.shape, msg  # packed stays packed
    if case.packed:  # compared slot by slot in the unpacked layout's axes
        pool, ref_pool = unpack_pool(pool), unpack_pool(ref_pool)
    for part, ref_part in zip(pool_parts(pool), pool_parts(ref_pool)):  # values, then an int8 pool's scales
        if part is not None:
            compare_pools(case, part, ref_part, msg)


def compare_pools(case, pool, ref_pool, msg):
    assert pool.shape == ref_pool.shape and pool.dtype == ref_pool.dtype, msg
    pool, ref_pool = np.asarray(pool.astype(jnp.float32)), np.asarray(ref_pool.astype(jnp.float32))
    if case.padding == "distinct":  # every slot of the pool is determined
        np.testing.assert_array_equal(pool, ref_pool, err_msg=f"pool differs; {msg}")
    else:  # padding tokens collide on null slot 0: that slot is unspecified
        np.testing.assert_array_equal(pool[:, 1:], ref_pool[:, 1:], err_msg=f"pool differs; {msg}")
        np.testing.assert_array_equal(pool[:, 0, :, :, 1:], ref_pool[:, 0, :, :, 1:], err_msg=f"null block; {msg}")


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
def test_tpu_ragged_matches_reference(case):
    check_ragged(ragged_paged_attention_tpu, case, interpret=True)


@pytest.mark.parametrize("case", RAGGED_CASES + LONG_RAGGED_CASES, ids=str)
def test_gpu_ragged_matches_reference(case):
    check_ragged(ragged_paged_attention_gpu, case, interpret=True)


SIM_RAGGED_CASES = [
    (RaggedCase("float32", 16, 2, 64, 2, 2, kw=(("kv_heads_per_block", 1), ("queries_per_block", 8)),
                windows=(20,)), SIM_2_CORES),  # the other cases simulate window 0
    (RaggedCase("bfloat16", 16, 4, 128, 1, 2, padding="engine", kw=(("pages_per_compute_block", 1),)), SIM),
    (RaggedCase("float32", 16, 3, 64, 2, 2, kw=(("kv_heads_per_block", 1), ("queries_per_block", 8)), packed=True),
     SIM_2_CORES),  # two cores writing their own KV head of the same packed pages
]


@pytest.mark.parametrize("case,params", SIM_RAGGED_CASES, ids=[f"{c}-cores{p.num_cores_or_threads}" for c, p in SIM_RAGGED_CASES])
def test_tpu_ragged_in_tpu_simulator(case, params):
    check_ragged(ragged_paged_attention_tpu, case, interpret=params, tokens_multiple=8)
    assert not races_found(), "the TPU simulator found a data race between cores"


# ------------------------------------------------------------------------------------- semantics and plumbing

@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_ragged_reference_is_the_engines_attention(kv):
    """The references (NaN-safe masking) equal jaxpage's own write_kv + paged_attention_xla on finite inputs,
    quantized pools included."""
    from jaxpage.attention.backends import paged_attention_xla
    from jaxpage.attention.kv_write import write_kv

    rng, msg = fresh_rng()
    case = RaggedCase("float32", 16, 4, 64, 2, 3, kv=kv)
    args, num_valid = make_ragged_inputs(case, rng)
    pool = jax.tree.map(jnp.nan_to_num, args[3])
    ref_out, ref_pool = run_jitted(functools.partial(ragged_paged_attention_reference, scale=0.125), *args[:3], pool,
                                   *args[4:])

    def engine(q, k, v, pool, layer, token_seq, positions, slots, tables):
        pool = write_kv(pool, layer, k, v, slots)
        return paged_attention_xla(q, pool, layer, token_seq, positions, tables, scale=0.125), pool

    engine_out, engine_pool = run_jitted(engine, *args[:3], pool, *args[4:])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                                            np.asarray(b.astype(jnp.float32)), err_msg=msg),
                 ref_pool, engine_pool)
    np.testing.assert_allclose(np.asarray(ref_out), np.asarray(engine_out), rtol=1e-5, atol=1e-5, err_msg=msg)


@pytest.mark.parametrize("pairs_per_chunk,query_tile,shuffled",
                         [(None, None, False), (7, None, False), (7, 3, False), (None, 1, False), (None, None, True)])
def test_engine_attention_on_a_heavy_tailed_batch(pairs_per_chunk, query_tile, shuffled, monkeypatch):
    """Decodes of very different lengths plus prompt chunks: the (tile, page) pairs span many loop chunks,
    (7 pairs per chunk) a tile's pages are split across chunk boundaries, (tiles of 3) tiles hold several
    sequences' tokens and padding rows, (1) every token is its own tile, (shuffled) one tile holds tokens of
    one sequence apart from each other (as the engine's padding tokens read row 0); equal to the reference."""
    import jaxpage.attention.backends as attention

    if pairs_per_chunk:
        monkeypatch.setattr(attention, "PAIRS_PER_CHUNK", pairs_per_chunk)
    if query_tile:
        monkeypatch.setattr(attention, "QUERY_TILE", query_tile)
    rng, msg = fresh_rng()
    bs, width, kv_heads, ratio, head_dim = 16, 40, 2, 3, 64
    decodes = [(int(n), 1) for n in np.minimum(rng.lognormal(4.5, 1.0, 12).astype(int), width * bs - 1)]
    chunks = [(int(rng.integers(200, 300)), int(rng.integers(40, 60))), (0, int(rng.integers(1, 17)))]
    seqs = decodes + chunks
    tables, _, num_blocks = assign_pages(rng, [c + n for c, n in seqs], bs, width)
    token_seq = np.concatenate([np.full(n, row) for row, (_, n) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs]).astype(np.int32)
    if shuffled:
        order = rng.permutation(len(token_seq))
        token_seq, positions = token_seq[order], positions[order]
    pool = rng.standard_normal((NUM_LAYERS, num_blocks, 2, kv_heads, bs, head_dim)).astype(np.float32)
    q = rng.standard_normal((len(token_seq), kv_heads * ratio, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((len(token_seq), kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    slots = tables[token_seq, positions // bs] * bs + positions % bs
    args = tuple(jnp.asarray(a) for a in (q, k, v, pool)) + (jnp.int32(LAYER),) + tuple(
        jnp.asarray(a) for a in (token_seq, positions, slots, tables))
    ref_out, _ = run_jitted(functools.partial(ragged_paged_attention_reference, scale=0.125), *args)
    pool_written = jax.jit(attention.write_kv)(args[3], args[4], args[1], args[2], args[7])
    out = jax.jit(functools.partial(attention.paged_attention_xla, scale=0.125))(
        args[0], pool_written, args[4], args[5], args[6], args[8])
    assert sum(p // bs + 1 for p in positions) > 8 * (pairs_per_chunk or attention.PAIRS_PER_CHUNK), msg
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5, err_msg=msg)


def test_engine_attention_with_per_layer_windows_and_soft_cap():
    """A model with a full and a windowed layer: one plan per window (page_pairs_by_window), each layer's
    selected by a traced index inside lax.scan, as write_and_attend's XLA path runs them; soft-capped logits.
    The windowed layer's keys wholly before every window are NaN: reading one (rather than skipping its page)
    makes the output NaN, since the XLA path multiplies V by zero weights. Equal to the reference per layer."""
    from jaxpage.attention.backends import page_pairs_by_window, select_pairs, write_and_attend

    rng, msg = fresh_rng()
    bs, width, kv_heads, ratio, head_dim, window, cap = 16, 24, 2, 2, 64, 37, 1.5
    seqs = [(int(n), 1) for n in rng.integers(0, width * bs - 1, 8)] + [(200, 40), (0, 9), (30, 5)]
    tables, _, num_blocks = assign_pages(rng, [c + n for c, n in seqs], bs, width)
    token_seq = np.concatenate([np.full(n, row) for row, (_, n) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs]).astype(np.int32)
    pool = rng.standard_normal((NUM_LAYERS, num_blocks, 2, kv_heads, bs, head_dim)).astype(np.float32)
    for row, (context, _) in enumerate(seqs):  # the windowed layer (1): pages no query of the row sees
        pool[1, tables[row, :max(0, context - window + 1) // bs]] = np.nan
    q, k, v = (rng.standard_normal((len(token_seq), h, head_dim)).astype(np.float32)
               for h in (kv_heads * ratio, kv_heads, kv_heads))
    slots = tables[token_seq, positions // bs] * bs + positions % bs
    data = tuple(jnp.asarray(a) for a in (token_seq, positions, slots, tables))
    windows = jnp.asarray([0, window], jnp.int32)

    def model(q, k, v, pool, token_seq, positions, slots, tables):
        plans = page_pairs_by_window(token_seq, positions, tables, bs, windows)

        def layer_fn(pool, layer):
            out, pool = write_and_attend("xla", q, k, v, pool, layer, token_seq, positions, slots, tables,
                                         0.125, pairs=select_pairs(plans, layer), window=windows[layer],
                                         soft_cap=cap)
            return pool, out
        return jax.lax.scan(layer_fn, pool, jnp.arange(NUM_LAYERS, dtype=jnp.int32))[1], plans.num_chunks

    outs, num_chunks = run_jitted(model, q, k, v, jnp.asarray(pool), *data)
    for layer in range(NUM_LAYERS):
        ref, _ = run_jitted(functools.partial(ragged_paged_attention_reference, scale=0.125, soft_cap=cap,
                                              window=int(windows[layer])),
                            q, k, v, jnp.asarray(pool), jnp.int32(layer), *data)
        assert_matches(outs[layer], ref, jnp.float32, f"layer {layer}; {msg}")
    assert num_chunks[1] < num_chunks[0], f"the window's plan walks fewer pairs; {msg}"


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_write_and_attend_passes_window_and_soft_cap_to_the_kernels(backend):
    """The engine's entry point, jitted with a traced window, equals the reference (kernels interpreted here)."""
    from jaxpage.attention.backends import write_and_attend

    rng, msg = fresh_rng()
    case = RaggedCase("float32", 16, 2, 64, 2, 4)
    args, num_valid = make_ragged_inputs(case, rng)
    q, k, v, pool, layer, token_seq, positions, slots, tables = args
    pool = jnp.nan_to_num(pool)

    def engine(window, pool):
        return write_and_attend(backend, q, k, v, pool, layer, token_seq, positions, slots, tables, 0.125,
                                window=window, soft_cap=1.5)

    out, _ = run_jitted(engine, jnp.int32(20), pool)
    ref, _ = ragged_paged_attention_reference(q, k, v, pool, layer, token_seq, positions, slots, tables,
                                              scale=0.125, soft_cap=1.5, window=20)
    full, _ = ragged_paged_attention_reference(q, k, v, pool, layer, token_seq, positions, slots, tables,
                                               scale=0.125)
    assert_matches(out, ref, jnp.float32, msg, rows=slice(num_valid))
    assert not np.allclose(np.asarray(ref[:num_valid]), np.asarray(full[:num_valid]), atol=1e-3), msg


def test_kernels_take_a_traced_layer_inside_scan():
    """As in the model: the pool is carried through lax.scan over layers, the layer index is traced."""
    rng, msg = fresh_rng()
    case = RaggedCase("float32", 16, 2, 64, 1, 2)
    args, _ = make_ragged_inputs(case, rng)
    q, k, v, pool, _, token_seq, positions, slots, tables = args
    pool = jnp.nan_to_num(pool)
    lens = jnp.asarray([1, 17, 0, 32], jnp.int32)
    dec_tables = tables[:4]

    def run(ragged, decode, pool):
        def layer_fn(pool, layer):
            out, pool = ragged(q, k, v, pool, layer, token_seq, positions, slots, tables, scale=0.125)
            dec = decode(q[:4], pool, layer, dec_tables, lens, scale=0.125)
            return pool, (out, dec)
        return jax.lax.scan(layer_fn, pool, jnp.arange(NUM_LAYERS, dtype=jnp.int32))

    kernels = functools.partial(run, functools.partial(ragged_paged_attention_tpu, interpret=True),
                                functools.partial(paged_decode_attention_gpu, interpret=True))
    pool_out, (out, dec) = run_jitted(kernels, pool)
    ref_pool, (ref_out, ref_dec) = run_jitted(
        functools.partial(run, ragged_paged_attention_reference, paged_decode_attention_reference), pool)
    np.testing.assert_array_equal(np.asarray(pool_out), np.asarray(ref_pool), err_msg=msg)
    assert_matches(out, ref_out, jnp.float32, msg)
    assert_matches(dec, ref_dec, jnp.float32, msg)


@pytest.mark.parametrize("interpret", [True, SIM], ids=["interpret", "tpu_simulator"])
def test_interpreters_poison_outputs(interpret):
    """The finiteness checks above prove every element is written only because fresh outputs start as NaN."""
    def writes_nothing(x_ref, o_ref):
        pass

    out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         interpret=interpret)(jnp.zeros((8, 128), jnp.float32))
    assert np.isnan(np.asarray(out)).all()


def test_bad_arguments_are_refused_at_the_call():
    rng, _ = fresh_rng()
    q, pool, layer, tables, lens = make_decode_inputs(DECODE_CASES[0], rng)
    for kernel in (paged_decode_attention_gpu, paged_decode_attention_tpu, paged_decode_attention_reference):
        with pytest.raises(ValueError, match="dtype"):
            kernel(q.astype(jnp.bfloat16), pool, layer, tables, lens, scale=0.125)
        with pytest.raises(ValueError, match="num_heads"):
            kernel(jnp.concatenate([q, q[:, :1]], axis=1), pool, layer, tables, lens, scale=0.125)
        with pytest.raises(ValueError, match="context_lens"):
            kernel(q, pool, layer, tables, lens[:2], scale=0.125)
        with pytest.raises(ValueError, match="pool"):
            kernel(q, pool[LAYER], layer, tables, lens, scale=0.125)
    args, _ = make_ragged_inputs(RAGGED_CASES[0], rng)
    for kernel in (ragged_paged_attention_tpu, ragged_paged_attention_gpu, ragged_paged_attention_reference):
        with pytest.raises(ValueError, match="slot_mapping"):
            kernel(*args[:7], args[7][:-1], args[8], scale=0.125)
        with pytest.raises(ValueError, match="k must be"):
            kernel(args[0], args[1][:, :1], *args[2:], scale=0.125)


@pytest.mark.parametrize("dtype,block_size", [("float32", 8), ("bfloat16", 16), ("bfloat16", 32), ("int8", 32),
                                              ("fp8", 32)])
@pytest.mark.parametrize("interpret", [True, SIM], ids=["interpret", "tpu_simulator"])
def test_tpu_kv_write_matches_reference(dtype, block_size, interpret):
    """Random slots, many sharing a tile of rows (runs of a prompt chunk) and some the same slot (padding):
    every slot of the pool ends as the reference's scatter leaves it, NaN-poisoned rows around included."""
    rng, msg = fresh_rng()
    num_blocks, kv_heads, head_dim = 6, 2, 64
    pool = np.where(rng.random((NUM_LAYERS, num_blocks, 2, kv_heads, block_size, head_dim)) < 0.1, np.nan,
                    rng.standard_normal((NUM_LAYERS, num_blocks, 2, kv_heads, block_size, head_dim)))
    run = 1 + block_size + int(rng.integers(1, block_size))  # a chunk crossing a page
    start = int(rng.integers(block_size, 2 * block_size))
    others = np.setdiff1d(np.arange(1, num_blocks * block_size), np.arange(start, start + run))
    slots = np.concatenate([np.arange(start, start + run), rng.choice(others, 5, replace=False),
                            np.zeros(4, int)]).astype(np.int32)  # then scattered decodes, then padding in slot 0
    k, v = (rng.standard_normal((len(slots), kv_heads, head_dim)) for _ in range(2))
    k[-4:] = v[-4:] = 1.0  # padding tokens write equal rows, so the scatter's "some one wins" is determined
    kv, dtype = (dtype, "float32") if dtype in STORED_DTYPES else ("auto", dtype)  # int8, fp8: float32 K/V
    args = (as_pool(pool, dtype, kv), jnp.int32(LAYER), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(slots))
    ours = run_jitted(functools.partial(write_kv_tpu, interpret=interpret), *args)
    ref = run_jitted(write_kv_reference, *args)
    for part, ref_part in zip(pool_parts(ours), pool_parts(ref)):  # values, then an int8 pool's scales
        if part is not None:
            np.testing.assert_array_equal(np.asarray(part.astype(jnp.float32)), np.asarray(ref_part.astype(jnp.float32)),
                                          err_msg=f"slots={slots.tolist()}; {msg}")


# ---------------------------------------------------------------------- the TPU kernel's K/V write in one pass

# Prompt chunks of 40+ tokens span several of the TPU kernel's query blocks (16 tokens): a later block reads the
# K/V an earlier one wrote, and tiles of rows and pages are shared across blocks (8-bit pools: 32-row tiles).
TPU_LONG_RAGGED_CASES = [
    RaggedCase("float32", 16, 4, 64, 2, 5, mix="long"),
    RaggedCase("bfloat16", 32, 3, 128, 1, 3, padding="engine", mix="long", kw=(("queries_per_block", 8),)),
    RaggedCase("float32", 16, 2, 64, 1, 5, mix="long", windows=WINDOWS, kw=(("pages_per_compute_block", 2),)),
    RaggedCase("bfloat16", 32, 2, 64, 2, 3, mix="long", kv="int8", kw=(("kv_heads_per_block", 1),)),
]


@pytest.mark.parametrize("case", TPU_LONG_RAGGED_CASES, ids=str)
def test_tpu_ragged_writes_long_chunks_across_query_blocks(case):
    check_ragged(ragged_paged_attention_tpu, case, interpret=True)


def test_tpu_ragged_writes_long_chunks_in_tpu_simulator_on_two_cores():
    """Two cores take a KV head each (the parallel grid axis) and write their heads of the same pages; query
    blocks run in order on each: the simulator's DMA, semaphore and race checks."""
    case = RaggedCase("float32", 16, 2, 64, 2, 4, mix="long", kw=(("kv_heads_per_block", 1), ("queries_per_block", 8)))
    check_ragged(ragged_paged_attention_tpu, case, interpret=SIM_2_CORES, tokens_multiple=8)
    assert not races_found(), "the TPU simulator found a data race between cores"


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_tpu_ragged_is_one_kernel_that_writes_the_pool(kv):
    """One Pallas call writes the K/V and attends (no separate write kernel), its pool output aliased to the
    pool operand, so under jit with the pool donated the write is in place."""
    rng, _ = fresh_rng()
    case = RaggedCase("float32" if kv == "auto" else "bfloat16", 32, 2, 64, 2, 3, kv=kv)
    args, _ = make_ragged_inputs(case, rng)
    jaxpr = jax.make_jaxpr(functools.partial(ragged_paged_attention_tpu, scale=0.125, interpret=True))(*args)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1, [e.params.get("name") for e in calls]
    aliases = dict(calls[0].params["input_output_aliases"])
    aliased = [(calls[0].invars[i].aval, calls[0].outvars[o].aval) for i, o in aliases.items()]
    assert sorted(a.shape for a, _ in aliased) == sorted(x.shape for x in jax.tree.leaves(args[3])), aliases
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in aliased), aliased
