"""Ahead-of-time compilation for real TPU chips with the real compiler (libtpu), on a machine without one.

    python -m jaxpage.testing.compile_targets [--chips v5e v6e v5p] [--quick] [--json out.json]
    python -m jaxpage.testing.compile_targets --blocks   # SmolLM2's KV blocks per GiB on a TPU, unpacked and packed
    python -m jaxpage.testing.compile_targets --chips v6e --warmup smollm2-135m llama-3-8b [--threads N] [--cache-dir D]
                                                     # an engine's whole warm-up, compiled as the runner does

For each chip: every TPU kernel over the shapes the engine can produce, then the whole jitted engine step
(``attention_backend="pallas_tpu"``, bfloat16) at every warm-up bucket for SmolLM2-135M and a Llama-3-8B-shaped
config, a Qwen3-30B-A3B-shaped MoE block, and SmolLM2's multi-LoRA step (4 slots of rank 16) on one chip and at
TP 3. The arguments are shapes placed on a device of a TPU topology
(``jax.experimental.topologies``), so nothing is allocated and no weights are needed. Prints one table row per
compile: compiled or the compiler's message, compile time, and for engine steps the per-chip memory from
``memory_analysis()``. Needs the TPU runtime: ``pip install "jax[tpu]==<installed jax>"`` (the test extra has it).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

# v5p is a megacore chip (two TensorCores behind one device), so it exercises the kernels' parallel grid axes
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several processes may compile at once
TPU_CHIPS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1"}
TP_TOPOLOGIES = {"v5e": "v5e:2x4", "v6e": "v6e:2x4"}  # 8 chips, for tensor-parallel steps


def tpu_runtime_available() -> bool:
    try:
        tpu_device("v5e")
        return True
    except Exception:  # no libtpu, or a libtpu that cannot describe topologies
        return False


@functools.cache
def tpu_device(chip: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=TPU_CHIPS[chip]).devices[0]


@functools.cache
def tpu_mesh(chip: str, tp: int):
    """A tensor-parallel mesh over the first ``tp`` chips of an 8-chip topology."""
    from jax.experimental import topologies

    from jaxpage.distributed.parallel import make_mesh

    return make_mesh(tp, topologies.get_topology_desc(platform="tpu", topology_name=TP_TOPOLOGIES[chip]).devices)


@dataclasses.dataclass
class Compiled:
    target: str
    name: str
    shape: str
    ok: bool
    seconds: float
    error: str = ""
    memory: dict = dataclasses.field(default_factory=dict)  # bytes: arguments, outputs, aliased, temporaries, code
    cost: dict = dataclasses.field(default_factory=dict)  # cost_analysis(): flops, bytes accessed (what XLA counts)
    hlo: str = dataclasses.field(default="", repr=False)  # the optimized HLO, for checks on what was compiled


def compile_for(where, target: str, name: str, shape: str, jitted, args, details: bool = True) -> Compiled:
    """Lowers and compiles ``jitted(*args)`` for ``where``, a device or a mesh (``jitted`` then says every
    argument's sharding); ``args`` is a pytree of ShapeDtypeStructs. details: the memory, the cost and the HLO
    text of the compiled program too (else just whether it compiled, and how long it took)."""
    on_mesh = isinstance(where, Mesh)
    sharding = None if on_mesh else SingleDeviceSharding(where)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    start = time.perf_counter()
    try:
        with contextlib.nullcontext() if on_mesh else jax.default_device(where):
            compiled = jitted.lower(*placed).compile()
    except Exception as e:  # the compiler's message is the result
        return Compiled(target, name, shape, False, time.perf_counter() - start, _first_line(e))
    seconds = time.perf_counter() - start
    if not details:
        return Compiled(target, name, shape, True, seconds)
    stats = compiled.memory_analysis()
    memory = {key: getattr(stats, f"{key}_size_in_bytes", 0)
              for key in ("argument", "output", "alias", "temp", "generated_code")}
    return Compiled(target, name, shape, True, seconds, memory=memory, cost=_cost(compiled), hlo=compiled.as_text())


def _cost(compiled) -> dict:
    """The compiler's own count of the program's flops and bytes accessed (custom calls such as Pallas kernels
    count only what their cost estimate says)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without a cost model
        return {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost or {}
    return {key: float(cost[key]) for key in ("flops", "bytes accessed") if key in cost}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines()]
    for line in lines:  # an XLA status such as RESOURCE_EXHAUSTED names the cause best
        if re.match(r"[A-Z_]{6,}: ", line):
            return line[:300]
    for line in lines:  # newer XLA adds "See https://openxla.org/xla/errors/..." lines, which say nothing here
        if ("Mosaic" in line or "rror" in line) and "openxla.org/xla/errors" not in line:
            return line[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------- kernels

@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One kernel call's shapes: a layer of a pool of ``num_blocks`` blocks, ``tokens`` query tokens (ragged) or
    sequences (decode), block tables ``width`` pages wide."""

    kernel: str  # "ragged" or "decode"
    dtype: str
    block_size: int
    head_dim: int
    kv_heads: int
    group: int  # query heads per KV head
    tokens: int
    width: int = 32
    num_blocks: int = 512
    windowed: bool = False  # a traced sliding window (an extra int32 argument) and Gemma 2's soft cap
    kv: str = "auto"  # the KV cache's dtype: auto (dtype), int8 (with scales) or fp8

    @property
    def packed(self) -> bool:
        """The pool in the packed layout, as the engine's pallas_tpu backend lays it out (the ragged kernel)."""
        from jaxpage.attention.kv_cache import packs_kv

        return self.kernel == "ragged" and packs_kv(SimpleNamespace(head_dim=self.head_dim), "pallas_tpu")

    def __str__(self):
        return (f"{self.dtype} bs{self.block_size} d{self.head_dim} kvh{self.kv_heads} g{self.group} "
                f"T{self.tokens}" + (" window softcap" if self.windowed else "")
                + ("" if self.kv == "auto" else f" kv {self.kv}") + (" packed" if self.packed else ""))

    def call(self):
        """(fn, abstract args, donated argnums) of this kernel call, as the engine makes it."""
        import pallas_kernels
        from jaxpage.attention.kv_cache import abstract_kv_pool
        from jaxpage.config import kv_storage_dtype

        dtype, i32 = jnp.dtype(self.dtype), jnp.int32
        s = jax.ShapeDtypeStruct
        model = SimpleNamespace(num_layers=2, num_kv_heads=self.kv_heads, head_dim=self.head_dim)
        pool = abstract_kv_pool(model, self.num_blocks, self.block_size, kv_storage_dtype(self.kv, dtype),
                                self.packed)
        q = s((self.tokens, self.kv_heads * self.group, self.head_dim), dtype)
        tables = s((self.tokens, self.width), i32)
        scale = self.head_dim ** -0.5
        if self.kernel == "decode":
            fn, args, donate = pallas_kernels.paged_decode_attention_tpu, (q, pool, s((), i32), tables,
                                                                         s((self.tokens,), i32)), ()
        else:
            kv = s((self.tokens, self.kv_heads, self.head_dim), dtype)
            vec = s((self.tokens,), i32)
            fn, args, donate = pallas_kernels.ragged_paged_attention_tpu, (q, kv, kv, pool, s((), i32), vec, vec,
                                                                          vec, tables), (3,)
        if not self.windowed:
            return functools.partial(fn, scale=scale), args, donate
        windowed = lambda *a: fn(*a[:-1], window=a[-1], scale=scale, soft_cap=50.0)  # noqa: E731
        return windowed, args + (s((), i32),), donate


def kernel_shapes(quick: bool = False) -> list[KernelShape]:
    """Block sizes 16/32/64, head_dim 64 and 128, KV heads 1/2/8, GQA ratios 1-8, bfloat16 and float32, several
    token buckets: each value appears, with SmolLM2's (d64, kvh3, g3) and Llama-3-8B's (d128, kvh8, g4). The
    ragged kernel's head_dim-64 shapes take the packed pool (block 16/32/64; bfloat16, float32, int8, fp8)."""
    shapes = []
    for kernel in ("ragged", "decode"):
        shapes += [KernelShape(kernel, "bfloat16", 16, 128, 8, 4, 64),  # Llama-3-8B
                   KernelShape(kernel, "bfloat16", 16, 64, 3, 3, 48),  # SmolLM2
                   KernelShape(kernel, "float32", 16, 64, 3, 3, 16),
                   KernelShape(kernel, "bfloat16", 16, 128, 8, 2, 64, windowed=True),  # Mistral/Gemma-like
                   KernelShape(kernel, "bfloat16", 32, 64, 3, 3, 48, kv="int8")]  # 8-bit pools: 32-row tiles
        if quick:
            continue
        shapes += [KernelShape(kernel, "bfloat16", 32, 128, 1, 8, 8),
                   KernelShape(kernel, "bfloat16", 64, 64, 2, 1, 128),
                   KernelShape(kernel, "float32", 32, 128, 8, 1, 32),
                   KernelShape(kernel, "float32", 64, 128, 2, 2, 256),
                   KernelShape(kernel, "bfloat16", 16, 64, 1, 6, 512),
                   KernelShape(kernel, "float32", 16, 128, 2, 5, 24),
                   KernelShape(kernel, "bfloat16", 64, 128, 8, 7, 96),
                   KernelShape(kernel, "bfloat16", 32, 128, 8, 4, 64, kv="fp8"),
                   KernelShape(kernel, "bfloat16", 32, 128, 8, 4, 64, kv="int8"),
                   KernelShape(kernel, "float32", 64, 64, 3, 3, 32),  # packed (ragged): block 64, 8-bit KV
                   KernelShape(kernel, "bfloat16", 64, 64, 3, 3, 64, kv="int8"),
                   KernelShape(kernel, "bfloat16", 32, 64, 3, 3, 48, kv="fp8")]
    return shapes


def compile_kernel(chip: str, shape: KernelShape) -> Compiled:
    fn, args, donate = shape.call()
    return compile_for(tpu_device(chip), chip, f"{shape.kernel}_paged_attention_tpu", str(shape),
                       jax.jit(fn, donate_argnums=donate), args)


# ------------------------------------------------------------------------------------------------ engine step

def smollm2_config():
    """SmolLM2-135M-Instruct's shapes (the embedded default model), without reading its file."""
    from transformers import LlamaConfig

    from jaxpage.models import config_from_hf

    return config_from_hf(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        rms_norm_eps=float(np.float32(1e-5))))  # the GGUF file stores it as a float32


def llama3_8b_config():
    from transformers import LlamaConfig

    from jaxpage.models import config_from_hf

    return config_from_hf(LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0))


def llama3_70b_config():
    from transformers import LlamaConfig

    from jaxpage.models import config_from_hf

    return config_from_hf(LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
        rope_theta=500000.0))


MODELS = {"smollm2-135m": smollm2_config, "llama-3-8b": llama3_8b_config, "llama-3-70b": llama3_70b_config}


def engine_config(model: str, backend: str = "pallas_tpu", num_kv_blocks: int = 2048, num_layers: int | None = None,
                  **options):
    """The engine's defaults (block 16, 64 sequences, 512 batched tokens, bfloat16) for ``model``'s shapes
    (``num_layers``: fewer layers, for a quicker compile of the same layer)."""
    from jaxpage.engine.config_builder import build_engine_config

    kw = dict(dtype="bfloat16", block_size=16, kv_cache_memory=None, num_kv_blocks=num_kv_blocks,
              max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096, gpu_memory_utilization=0.9,
              attention_backend=backend)
    shapes = MODELS[model]()
    if num_layers:
        shapes = dataclasses.replace(shapes, num_layers=num_layers, layer_types=shapes.layer_types[:num_layers])
    config = build_engine_config(shapes, **{**kw, **options})
    # built on this CPU for a TPU: the CPU's packed bfloat16 weights (weight_packing) are not the chip's
    return dataclasses.replace(config, onednn_packed_weights=False)


def compile_step(chip: str, model: str, num_tokens: int, config=None) -> Compiled:
    """The whole jitted engine step of one bucket (the runner's own function and inputs), pool donated; at the
    config's tensor_parallel_size > 1, over that many chips of an 8-chip topology."""
    from jaxpage.attention.kv_cache import abstract_kv_pool, packs_kv
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, jit_step

    config = config or engine_config(model)
    tp = config.parallel.tensor_parallel_size
    where = tpu_mesh(chip, tp) if tp > 1 else tpu_device(chip)
    params = abstract_params(config.step_model, config.dtype)
    pool = abstract_kv_pool(config.model, config.cache.num_kv_blocks, config.cache.block_size, config.kv_dtype,
                            packs_kv(config.model, config.attention_backend))
    batch, sampling = abstract_step_inputs(config, num_tokens)
    shape = (f"{config.attention_backend} T{num_tokens} pool {pool_gib(config) / tp:.2f} GiB/chip"
             + (f" TP{tp} L{config.model.num_layers}" if tp > 1 else "")
             + (f" LoRA {config.lora.max_loras}x{config.lora.max_lora_rank}" if config.lora else "")
             + ("" if config.cache.kv_cache_dtype == "auto" else f" kv {config.cache.kv_cache_dtype}")
             + (f" weights {config.model.quantization}" if config.model.quantization else "")
             + (f" verify {config.speculative_config.method} k{config.num_draft_tokens}" if config.num_draft_tokens
                else "") + (" draft (returns q)" if config.sampler_returns_probs else ""))
    return compile_for(where, chip, f"step {model}", shape, jit_step(config, where), (params, pool, batch, sampling))


def checkpoint_quant_config(weights: str, model_name: str = "smollm2-135m", **engine_options):
    """``model_name``'s engine over a quantized checkpoint whose decoder Linears store ``weights``
    (random_model.PUBLISHED_SCHEMES: "int8" or "fp8" with a scale per output channel, "int4" (W4A16, GPTQ, AWQ)
    in groups of 64 columns with zero points, "fp8-block" float8 with a scale per 64 columns)."""
    from jaxpage.testing.random_model import published_quantized

    config = engine_config(model_name, **engine_options)
    return dataclasses.replace(config, model=published_quantized(config.model, weights))


LORA_OPTIONS = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16}  # the compile lanes' multi-LoRA engine
LORA_TP = 3  # SmolLM2's 9 heads and 3 KV heads over 3 chips


def lora_config(tp: int = 1):
    """SmolLM2's engine with multi-LoRA (4 adapter slots of rank 16 in every decoder Linear) at TP ``tp``."""
    return engine_config("smollm2-135m", tensor_parallel_size=tp, **LORA_OPTIONS)


def compile_lora_steps(chip: str) -> list[Compiled]:
    """SmolLM2's LoRA step at its smallest bucket on one chip and at TP 3 (the slots sharded as their
    projections: column-parallel B split on its outputs, row-parallel A on its inputs)."""
    return [compile_step(chip, "smollm2-135m", config.token_buckets()[0], config)
            for config in (lora_config(), lora_config(LORA_TP))]


SPEC_TOKENS = 4  # the compile lanes' speculative engines: 4 drafts a row


def spec_configs(method: str = "draft_model") -> tuple:
    """SmolLM2's engine verifying drafts of ``method`` (draft_model: SmolLM2's own shapes drafting, as it
    drafts for itself in tests/test_spec_draft_model.py): its EngineConfig, and the draft's (None for n-gram).
    The target's step carries each row's drafts for the penalties (and for draft_model the drafts' q for
    rejection sampling); the draft's step returns q."""
    from jaxpage.engine.config_builder import draft_engine_config

    spec = {"method": method, "num_speculative_tokens": SPEC_TOKENS}
    if method != "draft_model":
        return engine_config("smollm2-135m", speculative_config=spec), None
    draft = smollm2_config()
    target = engine_config("smollm2-135m", speculative_config={**spec, "model": "smollm2-135m"}, draft_model=draft)
    return target, draft_engine_config(target, draft)


def compile_spec_steps(chip: str, methods=("ngram", "draft_model")) -> list[Compiled]:
    """The speculative steps of ``spec_configs`` at their smallest bucket: each method's verify step, and the
    draft model's own step."""
    configs = [c for method in methods for c in spec_configs(method) if c is not None]
    return [compile_step(chip, "smollm2-135m", config.token_buckets()[0], config) for config in configs]


def eagle3_configs():
    """SmolLM2's engine with an EAGLE-3 head of its own shapes (one layer, 32,000 draft tokens, vLLM's default
    layers 2, 15, 27): the target's EngineConfig (its step also returns those layers' hidden states), the head's,
    and the head (jaxpage.models.eagle3.Eagle3Config)."""
    from jaxpage.engine.config_builder import draft_engine_config
    from jaxpage.models.eagle3 import Eagle3Config

    shapes = smollm2_config()
    n = shapes.num_layers
    head = Eagle3Config(dataclasses.replace(shapes, num_layers=1, layer_types=shapes.layer_types[:1],
                                            tie_word_embeddings=False), 32000, (2, n // 2, n - 3), shapes.hidden_size)
    spec = {"method": "eagle3", "model": "smollm2-135m-eagle3", "num_speculative_tokens": SPEC_TOKENS}
    target = engine_config("smollm2-135m", speculative_config=spec, draft_model=head.model,
                           aux_hidden_layers=head.aux_layer_ids)
    return target, draft_engine_config(target, head.model), head


def head_step_args(config, head, from_target: bool, num_tokens: int) -> tuple:
    """The abstract inputs of the EAGLE-3 head's pass of one bucket (jaxpage.worker.eagle3_runner.head_step)."""
    from jaxpage.attention.kv_cache import abstract_kv_pool, packs_kv
    from jaxpage.models.eagle3 import abstract_head_params
    from jaxpage.worker.step import abstract_step_inputs

    batch, sampling = abstract_step_inputs(config, num_tokens)
    width = head.aux_width if from_target else config.model.hidden_size
    return (abstract_head_params(head, config.dtype),
            abstract_kv_pool(config.model, config.cache.num_kv_blocks, config.cache.block_size, config.kv_dtype,
                             packs_kv(config.model, config.attention_backend)),
            batch, jax.ShapeDtypeStruct((num_tokens, width), jnp.float32), sampling)


def compile_eagle3_steps(chip: str) -> list[Compiled]:
    """``eagle3_configs`` at their smallest bucket: the target's verify step (returning the auxiliary hidden
    states) and the head's two passes (from the target's hidden states, and from its own)."""
    target, draft, head = eagle3_configs()
    num_tokens = draft.token_buckets()[0]
    out = [compile_step(chip, "smollm2-135m", target.token_buckets()[0], target)]
    from jaxpage.attention.kv_cache import jit_on_pool, packs_kv
    from jaxpage.worker.eagle3_runner import head_step

    for from_target in (True, False):
        jitted = jit_on_pool(functools.partial(head_step, draft, head, from_target), 5, 1, "pair", tpu_device(chip),
                             None, draft.kv_dtype, packs_kv(draft.model, draft.attention_backend))
        out.append(compile_for(tpu_device(chip), chip, "eagle3 head smollm2-135m",
                               f"T{num_tokens} from {'target' if from_target else 'head'}", jitted,
                               head_step_args(draft, head, from_target, num_tokens)))
    return out


def compile_block_moves(chip: str, model: str, config=None) -> list[Compiled]:
    """The runner's copy-on-write copy and swap gather/scatter of whole blocks, on the pool in its format."""
    from jaxpage.attention.block_moves import BlockMoves
    from jaxpage.attention.kv_cache import abstract_kv_pool, packs_kv

    config = config or engine_config(model)
    packed = packs_kv(config.model, config.attention_backend)
    moves = BlockMoves.jit(tpu_device(chip), config.kv_dtype, packed)
    pool = abstract_kv_pool(config.model, config.cache.num_kv_blocks, config.cache.block_size, config.kv_dtype, packed)
    ids = jax.ShapeDtypeStruct((config.scheduler.max_num_seqs,), jnp.int32)
    data = abstract_kv_pool(config.model, config.scheduler.max_num_seqs, config.cache.block_size, config.kv_dtype,
                            packed)
    return [compile_for(tpu_device(chip), chip, f"{name} {model}", f"{config.scheduler.max_num_seqs} blocks", fn, args)
            for name, fn, args in (("copy blocks", moves.copy, (pool, ids, ids)),
                                   ("swap-out gather", moves.gather, (pool, ids)),
                                   ("swap-in scatter", moves.scatter, (pool, ids, data)))]


@dataclasses.dataclass
class Warmup:
    """One engine's whole warm-up compiled for a chip: every program (``Compiled``), and the wall time of
    compiling them on ``threads`` threads, block moves included."""

    target: str
    model: str
    threads: int
    buckets: list
    seconds: float
    programs: list


def compile_warmup(chip: str, model: str, config=None, threads: int | None = None) -> Warmup:
    """Every program an engine of ``config`` compiles before serving (``warmup.warmup_programs``: the step of each
    bucket, async scheduling's substitutions), compiled for ``chip`` on ``threads`` threads the way the runner
    does (``warmup.compile_all``), then the block moves."""
    from jaxpage.attention.kv_cache import abstract_kv_pool, packs_kv
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import jit_step, substitute_placeholders
    from jaxpage.worker.warmup import compile_all, compile_threads, program_inputs, warmup_programs

    config = config or engine_config(model)
    where = tpu_device(chip)
    params = abstract_params(config.step_model, config.dtype)
    pool = abstract_kv_pool(config.model, config.cache.num_kv_blocks, config.cache.block_size, config.kv_dtype,
                            packs_kv(config.model, config.attention_backend))
    step = jit_step(config, where)
    substitute = jax.jit(substitute_placeholders, out_shardings=SingleDeviceSharding(where))
    programs = warmup_programs(config, substitutes=config.scheduler.async_scheduling)
    threads = threads or compile_threads(len(programs), "tpu")

    def one(p):
        if p.kind == "step":
            return compile_for(where, chip, f"step {model}", f"T{p.num_tokens}", step,
                               (params, pool, *program_inputs(config, p)), details=False)
        return compile_for(where, chip, "substitute", f"T{p.num_tokens} S{p.num_sampled}", substitute,
                           program_inputs(config, p), details=False)

    start = time.perf_counter()
    compiled = list(compile_all(one, programs, threads).values()) + compile_block_moves(chip, model, config)
    return Warmup(chip, model, threads, config.token_buckets(), time.perf_counter() - start, compiled)


def qwen3_moe_30b_config():
    """Qwen3-30B-A3B's shapes: 128 experts of width 768, top-8, hidden 2048."""
    from transformers import Qwen3MoeConfig

    from jaxpage.models import config_from_hf

    return config_from_hf(Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False))


def compile_moe_layer(chip: str, num_tokens: int, dtype: str = "bfloat16") -> Compiled:
    """One Qwen3-30B-A3B MoE block (router, top-k, the experts' grouped matmuls) over ``num_tokens`` tokens."""
    from flax import nnx

    from jaxpage.models.moe import MoE

    cfg = qwen3_moe_30b_config()
    graph, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, round_weights=True)))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(dtype)), nnx.to_pure_dict(state))
    x = jax.ShapeDtypeStruct((num_tokens, cfg.hidden_size), jnp.dtype(dtype))
    return compile_for(tpu_device(chip), chip, "moe block qwen3-30b-a3b", f"{dtype} T{num_tokens}",
                       jax.jit(lambda p, x: nnx.merge(graph, p)(x)), (params, x))


def pool_gib(config) -> float:
    from jaxpage.attention.kv_cache import bytes_per_block, packs_kv

    per_block = bytes_per_block(config.model, config.cache.block_size, config.kv_dtype, lanes=128,
                                packed=packs_kv(config.model, config.attention_backend))
    return per_block * config.cache.num_kv_blocks / 2**30


def blocks_per_gib(model: str = "smollm2-135m") -> list[dict]:
    """KV blocks a GiB holds on a TPU (128 lanes), unpacked (the XLA path) and packed (pallas_tpu, head_dim 64),
    per block size and KV dtype: arithmetic from ``bytes_per_block``."""
    from jaxpage.attention.kv_cache import bytes_per_block

    shapes = MODELS[model]()
    rows = []
    for kv in ("bfloat16", "float32", "int8", "float8_e4m3fn"):
        for block_size in (16, 32, 64):
            unpacked, packed = (bytes_per_block(shapes, block_size, kv, lanes=128, packed=p) for p in (False, True))
            rows.append({"kv": kv, "block_size": block_size, "unpacked": 2**30 / unpacked,
                         "packed": 2**30 / packed, "ratio": unpacked / packed})
    return rows


# ---------------------------------------------------------------------------------------------------- the table

# Llama-3-8B in bfloat16 (16 GB of weights) does not fit a 16 GiB v5e chip: its row there is the compiler's
# out-of-memory message, which is the point (that model needs the scale-out issue's tensor parallelism).
STEP_TARGETS = {"smollm2-135m": ("v5e", "v6e", "v5p"), "llama-3-8b": ("v5e", "v6e", "v5p")}
# at tensor_parallel_size=8, on 8 chips; (model, weights) -> chips: bfloat16 weights, or int8 ones ("int8")
TP_STEP_TARGETS = {("llama-3-70b", None): ("v5e", "v6e"), ("llama-3-70b", "int8"): ("v5e",)}


def run(chips: list[str], quick: bool, tp_only: bool = False, tp_weights=("bfloat16", "int8")) -> list[Compiled]:
    results = []
    for chip in [] if tp_only else chips:
        for shape in kernel_shapes(quick):
            results.append(_report(compile_kernel(chip, shape)))
    for model, model_chips in {} if tp_only else STEP_TARGETS.items():
        config = engine_config(model)
        buckets = config.token_buckets()
        for chip in (c for c in chips if c in model_chips):
            for num_tokens in ([buckets[0], buckets[-1]] if quick else buckets):
                results.append(_report(compile_step(chip, model, num_tokens, config)))
            results += [_report(r) for r in compile_block_moves(chip, model, config)]
    for chip in [] if tp_only else chips:
        results.append(_report(compile_moe_layer(chip, 512)))
        results += [_report(r) for r in compile_lora_steps(chip)]
        results += [_report(r) for r in compile_spec_steps(chip)]
        results += [_report(r) for r in compile_eagle3_steps(chip)]
    return results + run_tp(chips, tp_weights)


def run_tp(chips: list[str], weights=("bfloat16", "int8")) -> list[Compiled]:
    """The tensor-parallel steps (TP=8), at the smallest and the largest bucket, with the ``weights`` asked for."""
    results = []
    for (model, quantization), model_chips in TP_STEP_TARGETS.items():
        if (quantization or "bfloat16") not in weights:
            continue
        config = engine_config(model, tensor_parallel_size=8, quantization=quantization)
        for chip in (c for c in chips if c in model_chips):
            for num_tokens in (config.token_buckets()[0], config.token_buckets()[-1]):
                results.append(_report(compile_step(chip, model, num_tokens, config)))
    return results


def run_warmup(chip: str, model: str, threads: int | None) -> Warmup:
    w = compile_warmup(chip, model, threads=threads)
    steps = [p for p in w.programs if p.name.startswith("step")]
    slowest = max(w.programs, key=lambda p: p.seconds)
    failed = [f"{p.name} {p.shape}: {p.error}" for p in w.programs if not p.ok]
    print(f"| {chip} | {model} | {len(w.buckets)} buckets {w.buckets[0]}-{w.buckets[-1]} | {w.threads} | "
          f"{len(w.programs)} | {w.seconds:.1f} s | {sum(p.seconds for p in w.programs):.1f} s | "
          f"{sum(p.seconds for p in steps):.1f} s | {slowest.name} {slowest.shape} {slowest.seconds:.1f} s | "
          f"{'; '.join(failed) or 'all compiled'} |", flush=True)
    return w


def _report(r: Compiled) -> Compiled:
    memory = (f"args {r.memory['argument'] / 2**30:.2f} GiB, temp {r.memory['temp'] / 2**20:.0f} MiB"
              if r.ok else r.error)
    print(f"| {r.target} | {r.name} | {r.shape} | {'compiled' if r.ok else 'FAILED'} | {r.seconds:.1f} s | {memory} |",
          flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", nargs="+", default=list(TPU_CHIPS), choices=list(TPU_CHIPS))
    parser.add_argument("--quick", action="store_true", help="a few kernel shapes, first and last bucket only")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--tp-only", action="store_true", help="only the tensor-parallel (TP=8) steps")
    parser.add_argument("--tp-weights", nargs="+", default=["bfloat16", "int8"], choices=["bfloat16", "int8"],
                        help="the TP steps' weights")
    parser.add_argument("--warmup", nargs="+", choices=list(STEP_TARGETS), metavar="MODEL",
                        help="only each model's whole engine warm-up (every program the runner compiles before "
                        "serving), on --threads threads, per chip")
    parser.add_argument("--threads", type=int, help="--warmup's compile threads (default: the runner's)")
    parser.add_argument("--cache-dir", help="the persistent compilation cache's directory (as the engine's: a "
                        "second run with the same directory shows a restart)")
    parser.add_argument("--blocks", action="store_true", help="only SmolLM2's KV blocks per GiB on a TPU, unpacked "
                        "and packed (arithmetic, no compile)")
    args = parser.parse_args()
    if args.blocks:
        print("| KV | block | blocks/GiB unpacked | packed | packed / unpacked |\n| --- | --- | --- | --- | --- |")
        for r in blocks_per_gib():
            print(f"| {r['kv']} | {r['block_size']} | {r['unpacked']:,.0f} | {r['packed']:,.0f} | {r['ratio']:.2f}x |")
        return
    if args.cache_dir:
        from jaxpage.worker.compile_cache import enable_compilation_cache

        enable_compilation_cache(args.cache_dir)
    if args.warmup:
        print("| chip | model | buckets | threads | programs | warm-up wall | compiles summed | steps summed | "
              "slowest | result |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        warmups = [run_warmup(chip, model, args.threads) for model in args.warmup for chip in args.chips
                   if chip in STEP_TARGETS[model]]
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(w) for w in warmups], f, indent=1)
        return
    print("| chip | kernel / step | shape | result | compile | memory per chip (arguments incl. weights and "
          "pool; temporaries) |\n| --- | --- | --- | --- | --- | --- |")
    results = run(args.chips, args.quick, args.tp_only, args.tp_weights)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in dataclasses.asdict(r).items() if k != "hlo"} for r in results], f, indent=1)
    failed = sum(not r.ok for r in results if not r.error.startswith("RESOURCE_EXHAUSTED"))
    print(f"{len(results)} compiles, {failed} failed (out-of-memory rows not counted)")


if __name__ == "__main__":
    main()
