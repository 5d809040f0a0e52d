"""The TPU compile lane: the real TPU compiler (libtpu, from the test extra), ahead of time, on this CPU.

Nothing here runs on a TPU; it proves that Mosaic and XLA:TPU accept every kernel and engine step we would run
there, and that a step holds no pool-sized temporaries. ``python -m jaxpage.testing.compile_targets`` prints the
whole matrix (every bucket, every chip) as a table.
"""
from __future__ import annotations

import functools
import os
import platform
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpage.testing import compile_targets as ct
from pallas_kernels.decode_attention.tpu import ANY

if platform.system() != "Linux" or platform.machine() != "x86_64":
    pytest.skip("libtpu is built for x86_64 Linux", allow_module_level=True)
if not ct.tpu_runtime_available():  # on x86_64 Linux the test extra installs it: its absence is a failure
    pytest.fail('no TPU runtime: pip install "jax[tpu]==<installed jax>"', pytrace=False)

QUICK = os.environ.get("JAXPAGE_COMPILE_LANE") == "quick"  # the newest-JAX lane's subset
CHIPS = ["v5e"] if QUICK else list(ct.TPU_CHIPS)
KERNELS = [(chip, shape) for chip in CHIPS for shape in ct.kernel_shapes(quick=True)]
KERNELS += [] if QUICK else [("v5e", s) for s in ct.kernel_shapes() if s not in ct.kernel_shapes(quick=True)]


def assert_compiled(r: ct.Compiled) -> None:
    assert r.ok, f"{r.target} {r.name} {r.shape}: {r.error}"
    assert "tpu_custom_call" in r.hlo, "no Mosaic kernel in the program: the Pallas call was interpreted"


@pytest.mark.parametrize("chip,shape", KERNELS, ids=[f"{c}-{s.kernel}-{s}" for c, s in KERNELS])
def test_kernel_compiles(chip, shape):
    assert_compiled(ct.compile_kernel(chip, shape))


def _write_one_row(slot_ref, k_hbm, _pool_in, pool_hbm, sem):
    copy = pltpu.make_async_copy(k_hbm.at[0], pool_hbm.at[slot_ref[0] // 16, :, slot_ref[0] % 16], sem)
    copy.start()
    copy.wait()


def test_the_lane_reports_what_mosaic_rejects():
    """The old ragged kernel's K/V write: one token's row DMA'd into a bfloat16 page in HBM."""
    def kernel(slot, k, pool):
        return pl.pallas_call(
            _write_one_row, out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=ANY)] * 2,
                out_specs=pl.BlockSpec(memory_space=ANY), scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
            input_output_aliases={2: 0})(slot, k, pool)

    s = jax.ShapeDtypeStruct
    r = ct.compile_for(ct.tpu_device("v5e"), "v5e", "bad", "", jax.jit(kernel),
                       (s((1,), jnp.int32), s((1, 2, 128), jnp.bfloat16), s((4, 2, 16, 128), jnp.bfloat16)))
    assert not r.ok and "must be aligned to tiles" in r.error, r


def pool_bytes(config) -> int:
    return int(ct.pool_gib(config) * 2**30)


def least_pool_bytes(config) -> int:
    """The pool's bytes with its values' rows padded to 128 lanes and an int8 pool's scales unpadded: libtpu
    versions tile the small float32 scales differently (0.0.42 pads a page's [KVH, block] to (8, 128), 0.0.50
    less), so an aliased pool is at least this."""
    from jaxpage.attention.kv_cache import bytes_per_block, packs_kv

    m, n, bs = config.model, config.cache.num_kv_blocks, config.cache.block_size
    values = bytes_per_block(m, bs, config.kv_dtype if config.kv_dtype != "int8" else "uint8", 128,
                             packs_kv(m, config.attention_backend)) * n
    scales = m.num_layers * n * 2 * m.num_kv_heads * bs * 4 if config.kv_dtype == "int8" else 0
    return values + scales


def check_step(chip, model, num_tokens, config):
    r = ct.compile_step(chip, model, num_tokens, config)
    assert r.ok, f"{chip} {model} T{num_tokens}: {r.error}"
    # the pool is donated and aliased, never copied: temporaries below half its size (a copy is all of it; it was
    # 6x, once). Not less: the packed head_dim-64 pool is half the bytes, and a T512 step's own activations on
    # newer libtpu (v5p, 151 MB) pass an eighth of SmolLM2's packed pool
    assert r.memory["alias"] >= least_pool_bytes(config), r.memory
    assert r.memory["temp"] < pool_bytes(config) / 2, r.memory
    return r


@functools.cache
def smollm2(backend="pallas_tpu"):
    return ct.engine_config("smollm2-135m", backend=backend)


def _lane_buckets(buckets: list[int]) -> list[int]:
    """The smallest and largest buckets (quick), and a middle one (the main lane); every bucket is compiled by
    ``python -m jaxpage.testing.compile_targets``, the suite keeps to the ends and the middle for time."""
    return sorted({buckets[0], buckets[-1]} | (set() if QUICK else {buckets[len(buckets) // 2]}))


@pytest.mark.parametrize("num_tokens", _lane_buckets(smollm2().token_buckets()))
def test_smollm2_step_compiles_for_v5e_at_lane_buckets(num_tokens):
    assert_compiled(check_step("v5e", "smollm2-135m", num_tokens, smollm2()))


@pytest.mark.parametrize("chip", ["v6e", "v5p"])
def test_smollm2_step_compiles_for_other_chips(chip):
    assert_compiled(check_step(chip, "smollm2-135m", smollm2().token_buckets()[-1], smollm2()))


def test_int8_kv_step_compiles_for_v5e():
    """An int8 KV cache (values and scales, both donated and aliased) at the smallest bucket."""
    config = ct.engine_config("smollm2-135m", block_size=32, kv_cache_dtype="int8")
    assert_compiled(check_step("v5e", "smollm2-135m", config.token_buckets()[0], config))


@pytest.mark.parametrize("weights", ["int8", "fp8", "int4", "fp8-block", "gguf-q4_1"])
def test_a_quantized_checkpoints_step_compiles_for_v5e_and_v6e(weights):
    """A quantized checkpoint's stored weights (int8 W8A8, FP8 dynamic, W4A16 / GPTQ / AWQ in groups of 64 with
    zero points, FP8 in blocks of 64 inputs, GGUF Q4_1 in blocks of 32) in SmolLM2's step at the smallest bucket: the kernels' arguments
    take a byte a weight (int4: a byte two weights)."""
    config = ct.checkpoint_quant_config(weights)
    stored, inputs = {"int8": ("s8", 576), "fp8": ("f8e4m3fn", 576), "int4": ("u8", 288),
                      "fp8-block": ("f8e4m3fn", 576), "gguf-q4_1": ("u8", 288)}[weights]
    for chip in ("v5e", "v6e"):
        r = check_step(chip, "smollm2-135m", config.token_buckets()[0], config)
        assert_compiled(r)
        assert f"{stored}[30,{inputs},3,5,64]" in r.hlo and f"{stored}[30,{inputs * 8 // 3},576]" in r.hlo


def test_a_gguf_q4_k_m_step_compiles_with_each_projection_as_stored():
    """A GGUF Q4_K_M file kept (random_model's "gguf-q4_k_m": q/k/v and down int8 in groups of 16, o and gate/up
    int4 in groups of 32, zero points throughout) in SmolLM2's step at the smallest bucket on a v5e: each kernel
    among the arguments in its own stored form."""
    config = ct.checkpoint_quant_config("gguf-q4_k_m")
    r = check_step("v5e", "smollm2-135m", config.token_buckets()[0], config)
    assert_compiled(r)
    for kernel in ("s8[30,576,3,5,64]", "s8[30,1536,576]", "u8[30,288,2,1536]", "u8[30,9,32,576]",
                   "f32[30,36,3,5,64]", "f32[30,96,576]", "f32[30,18,2,1536]"):
        assert kernel in r.hlo, kernel


V5E_HBM = 16 << 30


def test_llama3_8b_w4a16_fits_one_v5e_with_a_kv_pool():
    """Llama-3-8B as a W4A16 checkpoint (int4 in groups of 64 with zero points, head and embeddings bfloat16)
    compiles for one v5e with a 4 GiB KV pool (2,048 blocks of 16 tokens) and the program's arguments, outputs
    and temporaries within the chip's 16 GiB; with its bfloat16 weights (16 GB) the same step is refused by the
    compiler for want of HBM."""
    config = ct.checkpoint_quant_config("int4", "llama-3-8b", num_kv_blocks=2048)
    r = check_step("v5e", "llama-3-8b", config.token_buckets()[0], config)
    assert_compiled(r)
    m = r.memory
    assert m["argument"] + m["output"] - m["alias"] + m["temp"] < V5E_HBM, m
    assert "u8[32,2048,8,6,128]" in r.hlo  # q/k/v: 4,096 inputs packed to 2,048 bytes
    float_config = ct.engine_config("llama-3-8b", num_kv_blocks=2048)
    refused = ct.compile_step("v5e", "llama-3-8b", float_config.token_buckets()[0], float_config)
    assert not refused.ok and "RESOURCE_EXHAUSTED" in refused.error, refused.error


def test_llama3_8b_gguf_q4_k_m_kept_fits_one_v5e_with_a_kv_pool():
    """Llama-3-8B as a GGUF Q4_K_M file kept as stored (int8 and int4 by projection, float32 scales and zero
    points per group; embeddings and head bfloat16) compiles for one v5e with a 4 GiB KV pool (2,048 blocks of 16
    tokens), arguments, outputs and temporaries within the chip's 16 GiB."""
    config = ct.checkpoint_quant_config("gguf-q4_k_m", "llama-3-8b", num_kv_blocks=2048)
    r = check_step("v5e", "llama-3-8b", config.token_buckets()[0], config)
    assert_compiled(r)
    m = r.memory
    assert m["argument"] + m["output"] - m["alias"] + m["temp"] < V5E_HBM, m
    assert "u8[32,2048,2,14336]" in r.hlo and "s8[32,14336,4096]" in r.hlo  # gate/up int4, down int8


def test_xla_path_step_holds_no_pool_copy():
    """The XLA attention path on a TPU writes K/V with the TPU write kernel: XLA's scatter relayouts the pool."""
    check_step("v5e", "smollm2-135m", 8, smollm2("xla"))


def test_llama3_8b_step_compiles_for_v6e():
    """The largest bucket (the whole matrix: python -m jaxpage.testing.compile_targets)."""
    config = ct.engine_config("llama-3-8b")
    assert_compiled(check_step("v6e", "llama-3-8b", config.token_buckets()[-1], config))


def test_qwen3_moe_block_compiles_for_v5e():
    """The experts' ragged_dot lowers to XLA:TPU's grouped matmul, not to dense matmuls over every expert (at 8
    tokens, top-8 of 128 experts, those would hold 128 x 64 x 768 bfloat16 rows: 12 MiB)."""
    r = ct.compile_moe_layer("v5e", 8)
    assert r.ok, r.error
    assert "ragged_dot" in r.hlo
    assert r.memory["temp"] < 4 << 20, r.memory


def test_shapes_are_the_real_models():
    """The lane's SmolLM2 config is the GGUF file's, and abstract_params has the loaded weights' shapes."""
    from jaxpage.models import abstract_params, config_from_hf
    from jaxpage.models.loader import default_cache_dir, load_model

    loaded = load_model(None, default_cache_dir())
    assert ct.smollm2_config() == config_from_hf(loaded.hf_config)
    shapes = jax.tree.map(lambda a: a.shape, abstract_params(ct.smollm2_config(), "float32"))
    assert shapes == jax.tree.map(lambda a: a.shape, loaded.params)


def test_block_moves_compile_in_place():
    """Copy-on-write and swap move whole blocks of the pool in its format: no relayout, no pool-sized temporary."""
    for r in ct.compile_block_moves("v5e", "smollm2-135m", smollm2()):
        assert r.ok, f"{r.name}: {r.error}"
        assert r.memory["temp"] < pool_bytes(smollm2()) / 100, (r.name, r.memory)


@pytest.mark.parametrize("tp", [1, ct.LORA_TP])
def test_smollm2_lora_step_compiles_for_v5e(tp):
    """Multi-LoRA (4 slots of rank 16 in every decoder Linear, smallest bucket) on one chip and over 3 chips
    (SmolLM2's 9 heads, 3 KV heads): the pool still donated and aliased, the slots among the arguments (each
    chip's at least its share of them), the chips all-reduce at TP 3, the adapters' reductions in the base's
    collectives."""
    from jaxpage.models import abstract_params

    config = ct.lora_config(tp)
    r = ct.compile_step("v5e", "smollm2-135m", config.token_buckets()[0], config)
    assert_compiled(r)
    lora = sum(a.size * a.dtype.itemsize for path, a in jax.tree_util.tree_leaves_with_path(
        abstract_params(config.step_model, config.dtype)) if path[-1].key in ("lora_a", "lora_b"))
    assert lora > 0 and r.memory["argument"] >= (lora + least_pool_bytes(config)) // tp, r.memory
    assert r.memory["alias"] >= least_pool_bytes(config) // tp, r.memory
    assert tp == 1 or "all-reduce" in r.hlo
    # a row-parallel Linear's x @ A reduction [T, slots, rank] rides in its base product's [T, hidden] all-reduce
    results = [line.split(" all-reduce(")[0] for line in r.hlo.splitlines() if " all-reduce(" in line]
    lora_reductions = [shapes for shapes in results if f",{config.step_model.max_lora_rank}]" in shapes]
    base = f"[{config.token_buckets()[0]},{config.model.hidden_size}]"
    assert tp == 1 or (lora_reductions and all(base in shapes for shapes in lora_reductions)), lora_reductions


def test_speculative_verify_and_draft_steps_compile_for_v5e():
    """Speculative decoding with a draft model (SmolLM2's shapes drafting for themselves, 4 drafts) at the
    smallest bucket: the target's verify step (each row's drafts for the penalties [S, 4], the drafts' q
    [S, vocab] float32 for rejection sampling, among its parameters) and the draft's step (q among its outputs)
    compile, each pool donated and aliased. The n-gram verify step's inputs are a subset of the first's
    (``python -m jaxpage.testing.compile_targets`` compiles it too)."""
    target, draft = ct.spec_configs("draft_model")
    seqs, vocab = target.num_seqs_for(target.token_buckets()[0]), target.model.vocab_size
    for config in (target, draft):
        r = check_step("v5e", "smollm2-135m", config.token_buckets()[0], config)
        assert_compiled(r)
        params, results = r.hlo[r.hlo.index("ENTRY"):].split("\n", 1)[0].split(" -> ")
        q = f"f32[{seqs},{vocab}]"
        assert (q in params, q in results) == ((True, False) if config is target else (False, True)), config.sampler_returns_probs
        assert (f"s32[{seqs},{ct.SPEC_TOKENS}]" in params) == (config is target)


def test_eagle3_verify_step_and_head_passes_compile_for_v5e():
    """Speculative decoding with an EAGLE-3 head (SmolLM2's shapes, 32,000 draft tokens, 4 drafts): the target's
    verify step (scanned layers) returns the three layers' hidden states of every token [T, 3 x 576] beside the
    drafts' q among its parameters; the head's pass from the target's hidden states and from its own compile,
    q [S, vocab] float32 among their outputs, the head's pool donated and aliased."""
    target, draft, head = ct.eagle3_configs()
    r = check_step("v5e", "smollm2-135m", target.token_buckets()[0], target)
    assert_compiled(r)
    params, results = r.hlo[r.hlo.index("ENTRY"):].split("\n", 1)[0].split(" -> ")
    num_tokens, seqs, vocab = target.token_buckets()[0], target.num_seqs_for(target.token_buckets()[0]), 49152
    assert f"bf16[{num_tokens},{3 * 576}]" in results and f"f32[{seqs},{vocab}]" in params
    for r in ct.compile_eagle3_steps("v5e")[1:]:
        assert_compiled(r)
        rows = draft.num_seqs_for(draft.token_buckets()[0])
        assert f"f32[{rows},{vocab}]" in r.hlo[r.hlo.index("ENTRY"):].split("\n", 1)[0].split(" -> ")[1], r.shape
        assert r.memory["alias"] > 0, r.memory


def test_llama3_70b_step_compiles_tensor_parallel_on_eight_v5e_chips():
    """TP=8 over a v5e:2x4 topology with 4 of Llama-3-70B's 80 layers (the same compiled layer in a scan; the
    whole model is benchmarks/RESULTS.md's table): the weights and the pool are split 8 ways (each chip's
    arguments are an eighth of the total and a replicated embedding), the chips all-reduce."""
    from jaxpage.models import abstract_params

    config = ct.engine_config("llama-3-70b", num_layers=4, tensor_parallel_size=8)
    r = ct.compile_step("v5e", "llama-3-70b", config.token_buckets()[0], config)
    assert_compiled(r)
    assert "all-reduce" in r.hlo
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract_params(config.step_model, config.dtype)))
    embedding = config.model.vocab_size * config.model.hidden_size * 2
    assert r.memory["alias"] >= pool_bytes(config) // 8, r.memory
    assert r.memory["argument"] <= (weights + pool_bytes(config)) // 8 + embedding, r.memory
    assert_no_vocabulary_collective(r.hlo, config.model.vocab_size // 8)


def assert_no_vocabulary_collective(hlo: str, vocab_slice: int) -> None:
    """The chips exchange no logits: no collective has a dimension as long as a chip's slice of the vocabulary
    (the layers' are [tokens, hidden]; the sampler's [rows, 1] reductions and [rows, 20, tp] top-k candidates)."""
    shapes = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
                        r"(?:-start)?\(", hlo)
    assert shapes and all(int(d) < vocab_slice for s in shapes for d in filter(None, s.split(","))), shapes


def test_llama3_70b_whole_step_with_int8_weights_fits_eight_v5e_chips():
    """All 80 layers, int8 weights (per-channel scales), TP=8 on v5e:2x4: each chip's weights, its eighth of the
    pool and the temporaries fit a 16 GiB chip (15.75 GiB usable), which the bfloat16 weights (16.4 GiB a chip)
    cannot (benchmarks/RESULTS.md)."""
    config = ct.engine_config("llama-3-70b", tensor_parallel_size=8, quantization="int8")
    r = ct.compile_step("v5e", "llama-3-70b", config.token_buckets()[0], config)
    assert_compiled(r)
    assert r.memory["alias"] >= pool_bytes(config) // 8, r.memory
    assert r.memory["argument"] + r.memory["temp"] < 15.75 * 2**30, r.memory
    assert_no_vocabulary_collective(r.hlo, config.model.vocab_size // 8)


def test_the_warmup_compiles_every_program_for_v6e():
    """The runner's warm-up list (steps, async scheduling's substitutions) compiled for a chip as the runner
    compiles it (one thread on a TPU: ``warmup.compile_threads``), here for a 2-layer SmolLM2 at 16 tokens."""
    config = ct.engine_config("smollm2-135m", num_layers=2, max_num_batched_tokens=16, max_num_seqs=16)
    w = ct.compile_warmup("v6e", "smollm2-135m", config)
    assert w.threads == 1
    failed = [f"{p.name} {p.shape}: {p.error}" for p in w.programs if not p.ok]
    assert not failed, failed
    steps = sorted(p.shape for p in w.programs if p.name.startswith("step"))
    assert w.buckets == [8, 16] and steps == ["T16", "T8"]
    assert sum(p.name == "substitute" for p in w.programs) == 4  # each bucket after a step of 8 or 16 rows
