"""Lowers every GPU kernel and the whole engine step (attention_backend="pallas_gpu") for CUDA, on this CPU.

    python -m jaxpage.testing.cuda_lowering [--no-compile]   # the table: kernel or step, shape, target, result, time

With 4 or more devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``) the table also lowers
Llama-3-8B's step at tensor_parallel_size=4 (the Triton kernel under ``shard_map``, the all-reduces) and SmolLM2's
multi-LoRA step at tensor_parallel_size=3 (its one-device LoRA step is always lowered).

``jax.export`` with ``platforms=["cuda"]`` runs the Pallas Triton lowering (Pallas -> Triton IR, carried in the
``__gpu$xla.gpu.triton`` custom call, whose export safety check is disabled): a kernel that does not lower fails
here, without a GPU. With pip ``triton`` installed (the ``cuda-compile`` extra), each kernel's IR then goes
through Triton's own compiler down to a cubin (ptxas) for sm80 and sm90, and its shared memory is checked
against the GPU's limit. That compiler is pip Triton's, not the one inside XLA's CUDA build (a close version,
not the same). JAX >= 0.11 lowers for the abstract GPU named by ``cuda_target`` (A100: sm80, H100: sm90);
JAX 0.10 ignores it and lowers for sm90, its fallback without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import jax
import jax.numpy as jnp
from jax import export

from jaxpage.distributed.parallel import MODEL_AXIS

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGETS = {"sm80": "NVIDIA A100", "sm90": "NVIDIA H100"}
# JAX >= 0.11 reads the target GPU of a Triton lowering from the abstract mesh's device (module present there)
TARGET_HONOURED = importlib.util.find_spec("jax._src.pallas.triton.gpu_info") is not None


@dataclasses.dataclass(frozen=True)
class LoweringCase:
    what: str  # the kernel or "step"
    shape: str
    fn: Callable
    args: tuple  # jax.ShapeDtypeStruct pytrees
    tensor_parallel_size: int = 1  # > 1: fn is the jitted step over a mesh of that many devices


@contextlib.contextmanager
def cuda_target(target: str, tensor_parallel_size: int = 1):
    """Lower Triton kernels for ``target`` ("sm80" or "sm90") without a GPU; at a TP size > 1, on that many GPUs
    (the engine's mesh axis, whose abstract devices the step's own mesh context then keeps)."""
    device = jax.sharding.AbstractDevice(device_kind=TARGETS[target], num_cores=None, platform="gpu")
    if tensor_parallel_size == 1:
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    else:
        mesh = jax.sharding.AbstractMesh((tensor_parallel_size,), (MODEL_AXIS,),
                                         axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(case: LoweringCase, target: str = "sm90") -> str:
    """The exported module's text (StableHLO with the Triton custom calls)."""
    fn = case.fn if case.tensor_parallel_size > 1 else jax.jit(case.fn)  # a TP step comes jitted, on its mesh
    with cuda_target(target, case.tensor_parallel_size):  # the engine step takes the compiled kernels
        exported = export.export(fn, platforms=["cuda"],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*case.args)
    return exported.mlir_module()


# --- Triton's own compiler, from the IR to a cubin (pip triton: a CPU-only compiler with ptxas inside) ------
SHARED_MEMORY_BYTES = {"sm80": 166912, "sm90": 232448}  # the most shared memory a block may use: A100, H100
TRITON_OPTIONS = {"num_warps": 4, "num_stages": 2}  # the kernels' defaults


@contextlib.contextmanager
def capture_triton_ir():
    """Collects the Triton IR (text) of every kernel lowered inside; it goes through a private module of JAX's
    Pallas Triton lowering, the one way to the IR before it is serialised into the custom call."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules: list[str] = []

    def spy(*args, **kw):
        result = lower(*args, **kw)
        modules.append(result.module.operation.get_asm())
        return result

    registration.lowering.lower_jaxpr_to_triton_module = spy
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def compile_triton_ir(ttir: str, target: str) -> dict:
    """Triton IR -> TTGIR -> LLVM -> PTX -> cubin (ptxas) for ``target``, on the CPU; the cubin's shared memory."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless it is set; 1 is its default
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttir"
        path.write_text(ttir)
        kernel = triton.compile(str(path), target=GPUTarget("cuda", int(target[2:]), 32), options=TRITON_OPTIONS)
    return {"cubin_bytes": len(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared}


def compile_for_cuda(case: LoweringCase, target: str) -> list[dict]:
    """Lowers the case and compiles each of its Triton kernels to a cubin for ``target``."""
    jax.clear_caches()  # a cached lowering emits no Triton IR to capture
    with capture_triton_ir() as modules:
        lower_for_cuda(case, target)
    return [compile_triton_ir(ttir, target) for ttir in modules]


# --- the cases --------------------------------------------------------------------------------------------
# (block_size, head_dim, kv_heads, query heads per KV head, dtype): SmolLM2's and Llama-3-8B's heads, and more
KERNEL_SHAPES = [(16, 64, 3, 3, "bfloat16"), (16, 128, 8, 4, "bfloat16"), (32, 128, 8, 4, "float32"),
                 (64, 128, 8, 8, "bfloat16"), (32, 64, 2, 1, "float32"), (64, 64, 4, 2, "float32"),
                 (16, 128, 4, 16, "bfloat16")]
TOKEN_COUNTS = (8, 48, 512)  # ragged: tokens in the step; decode: sequences
NUM_BLOCKS, WIDTH = 1024, 64  # pool blocks and block-table width (64 pages: 1k-4k tokens of context)


def kernel_cases() -> list[LoweringCase]:
    from pallas_kernels import paged_decode_attention_gpu, ragged_paged_attention_gpu

    cases = []
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    for bs, hd, kvh, ratio, dtype in KERNEL_SHAPES:
        arr = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))  # noqa: E731,B023
        pool = arr(2, NUM_BLOCKS, 2, kvh, bs, hd)
        for n in TOKEN_COUNTS:
            shape = f"bs{bs} d{hd} kvh{kvh} g{ratio} {dtype} n{n}"
            decode = functools.partial(paged_decode_attention_gpu, scale=hd ** -0.5)
            cases.append(LoweringCase("paged_decode_attention_gpu", shape, decode,
                                      (arr(n, kvh * ratio, hd), pool, i32(), i32(n, WIDTH), i32(n))))
            ragged = functools.partial(ragged_paged_attention_gpu, scale=hd ** -0.5)
            seqs = min(n, 256)
            cases.append(LoweringCase("ragged_paged_attention_gpu", shape, ragged,
                                      (arr(n, kvh * ratio, hd), arr(n, kvh, hd), arr(n, kvh, hd), pool, i32(),
                                       i32(n), i32(n), i32(n), i32(seqs, WIDTH))))
    return cases + windowed_cases(cases) + quantized_cases(cases)


def quantized_cases(cases: list[LoweringCase]) -> list[LoweringCase]:
    """int8 (with scales) and fp8 KV pools, on SmolLM2's heads at 48 tokens."""
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.config import kv_storage_dtype

    out = []
    for case, kv in ((c, kv) for c in cases if c.shape == "bs16 d64 kvh3 g3 bfloat16 n48" for kv in ("int8", "fp8")):
        pool = case.args[1 if case.what == "paged_decode_attention_gpu" else 3]
        _, blocks, _, kvh, bs, hd = pool.shape
        model = SimpleNamespace(num_layers=2, num_kv_heads=kvh, head_dim=hd)
        quantized = abstract_kv_pool(model, blocks, bs, kv_storage_dtype(kv, pool.dtype))
        args = tuple(quantized if a is pool else a for a in case.args)
        out.append(LoweringCase(case.what, f"{case.shape} kv {kv}", case.fn, args))
    return out


def windowed_cases(cases: list[LoweringCase]) -> list[LoweringCase]:
    """A traced sliding window (one more int32 argument) and Gemma 2's soft cap, on SmolLM2's and Llama-3-8B's
    heads at 48 tokens."""
    out = []
    for case in cases:
        if case.shape in ("bs16 d64 kvh3 g3 bfloat16 n48", "bs16 d128 kvh8 g4 bfloat16 n48"):
            fn = case.fn  # a partial with scale set
            windowed = lambda *a, fn=fn: fn(*a[:-1], window=a[-1], soft_cap=50.0)  # noqa: E731
            out.append(LoweringCase(case.what, case.shape + " window softcap", windowed,
                                    case.args + (jax.ShapeDtypeStruct((), jnp.int32),)))
    return out


def gpu_engine_config(model, dtype: str, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                      num_kv_blocks: int, **options):
    """An engine config on the Pallas GPU backend (block 16, a fixed pool) for ``model``'s shapes."""
    from jaxpage.engine.config_builder import build_engine_config

    return build_engine_config(model, dtype=dtype, block_size=16, kv_cache_memory=None, num_kv_blocks=num_kv_blocks,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=max_model_len, gpu_memory_utilization=0.9,
                               attention_backend="pallas_gpu", **options)


def step_cases(buckets=None) -> list[LoweringCase]:
    """The jitted engine step of SmolLM2-135M (bfloat16 and float32) and Llama-3-8B (bfloat16), shapes only:
    the smallest, a middle and the largest token bucket."""
    from jaxpage.testing.random_model import LLAMA3_8B, SMOLLM2_135M, param_shapes
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.worker.step import abstract_step_inputs, step

    cases = []
    for name, model, dtype, max_len, seqs, tokens, kv in (
            ("SmolLM2-135M", SMOLLM2_135M, "bfloat16", 2048, 64, 256, "auto"),
            ("SmolLM2-135M", SMOLLM2_135M, "float32", 2048, 64, 256, "auto"),
            ("Llama-3-8B", LLAMA3_8B, "bfloat16", 8192, 256, 512, "auto"),
            ("SmolLM2-135M", SMOLLM2_135M, "bfloat16", 2048, 64, 256, "int8")):
        config = gpu_engine_config(model, dtype, max_len, seqs, tokens, 8192, kv_cache_dtype=kv)
        pool = abstract_kv_pool(model, config.cache.num_kv_blocks, 16, config.kv_dtype)
        all_buckets = config.token_buckets()
        default = (all_buckets[0],) if kv != "auto" else (all_buckets[0], all_buckets[len(all_buckets) // 2],
                                                          all_buckets[-1])
        for num_tokens in buckets or default:
            batch, sampling = abstract_step_inputs(config, num_tokens)
            kv_name = "" if kv == "auto" else f" kv {kv}"
            cases.append(LoweringCase("step", f"{name} {dtype}{kv_name} T{num_tokens} "
                                      f"S{config.num_seqs_for(num_tokens)}",
                                      functools.partial(step, config),
                                      (param_shapes(model, jnp.dtype(dtype)), pool, batch, sampling)))
    return cases


def layer_loop_cases() -> list[LoweringCase]:
    """The GPU's step as it runs on one device (step.LAYER_LOOP): the layer loop's one
    compiled decoder layer (``run_layer``, over one layer's own weights) of SmolLM2-135M and Llama-3-8B in
    bfloat16, at the largest token bucket; the stages around it hold no kernel of ours."""
    from jaxpage.testing.random_model import LLAMA3_8B, SMOLLM2_135M, param_shapes
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.models import begin_layers, run_layer, top_weights
    from jaxpage.models.attention import layer_constants
    from jaxpage.worker.step import abstract_step_inputs

    cases = []
    for name, model, max_len, seqs, tokens in (("SmolLM2-135M", SMOLLM2_135M, 2048, 64, 256),
                                               ("Llama-3-8B", LLAMA3_8B, 8192, 256, 512)):
        config = gpu_engine_config(model, "bfloat16", max_len, seqs, tokens, 8192)
        params, num_tokens = param_shapes(model, jnp.bfloat16), config.token_buckets()[-1]
        batch, _ = abstract_step_inputs(config, num_tokens)
        x, shared = jax.eval_shape(functools.partial(begin_layers, model, backend="pallas_gpu", block_size=16),
                                   top_weights(params), batch)
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["layers"])
        consts = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layer_constants(model))
        pool = abstract_kv_pool(model, config.cache.num_kv_blocks, 16, config.kv_dtype)
        cases.append(LoweringCase("layer", f"{name} bfloat16 layer T{num_tokens}",
                                  functools.partial(run_layer, model, backend="pallas_gpu"),
                                  (layer, consts, x, pool, batch, shared)))
    return cases


def tp_step_case(tp: int = 4) -> LoweringCase:
    """Llama-3-8B's jitted engine step (bfloat16, smallest bucket) at tensor_parallel_size ``tp``, over the
    first ``tp`` devices (forced CPU devices stand in for the GPUs: only their number is lowered into the
    module)."""
    from jaxpage.testing.random_model import LLAMA3_8B
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.distributed.parallel import placement
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, jit_step

    config = gpu_engine_config(LLAMA3_8B, "bfloat16", 4096, 64, 256, 1024, tensor_parallel_size=tp)
    num_tokens = config.token_buckets()[0]
    batch, sampling = abstract_step_inputs(config, num_tokens)
    args = (abstract_params(config.step_model, config.dtype),
            abstract_kv_pool(config.model, config.cache.num_kv_blocks, 16, config.kv_dtype), batch, sampling)
    return LoweringCase("step", f"Llama-3-8B bfloat16 T{num_tokens} TP{tp}", jit_step(config, placement(config)),
                        args, tp)


LORA_OPTIONS = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16}  # the compile lanes' multi-LoRA engine


def lora_step_case(tp: int = 1) -> LoweringCase:
    """SmolLM2-135M's jitted engine step with multi-LoRA (4 adapter slots of rank 16 in every decoder Linear;
    bfloat16, smallest bucket) at tensor_parallel_size ``tp`` (3: its 9 heads and 3 KV heads over the first 3
    devices, the slots sharded as their projections)."""
    from jaxpage.testing.random_model import SMOLLM2_135M
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.distributed.parallel import placement
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, jit_step, step

    config = gpu_engine_config(SMOLLM2_135M, "bfloat16", 2048, 64, 256, 1024, tensor_parallel_size=tp,
                               **LORA_OPTIONS)
    num_tokens = config.token_buckets()[0]
    batch, sampling = abstract_step_inputs(config, num_tokens)
    args = (abstract_params(config.step_model, config.dtype),
            abstract_kv_pool(config.model, config.cache.num_kv_blocks, 16, config.kv_dtype), batch, sampling)
    fn = jit_step(config, placement(config)) if tp > 1 else functools.partial(step, config)
    return LoweringCase("step", f"SmolLM2-135M bfloat16 LoRA 4x16 T{num_tokens}" + (f" TP{tp}" if tp > 1 else ""),
                        fn, args, tp)


def checkpoint_quant_case(weights: str) -> LoweringCase:
    """SmolLM2-135M's jitted engine step over a quantized checkpoint's stored ``weights`` (random_model's
    PUBLISHED_SCHEMES: "int8" or "fp8", every decoder Linear's kernel in that dtype with its scale; "int4", two
    values a byte, scales and zero points per 64 columns; "fp8-block", float8 with a scale per 64 columns;
    bfloat16, smallest bucket)."""
    from jaxpage.testing.random_model import SMOLLM2_135M, published_quantized
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, step

    model = published_quantized(SMOLLM2_135M, weights)
    config = gpu_engine_config(model, "bfloat16", 2048, 64, 256, 1024)
    num_tokens = config.token_buckets()[0]
    batch, sampling = abstract_step_inputs(config, num_tokens)
    args = (abstract_params(config.step_model, config.dtype),
            abstract_kv_pool(config.model, config.cache.num_kv_blocks, 16, config.kv_dtype), batch, sampling)
    return LoweringCase("step", f"SmolLM2-135M bfloat16 {model.quantization} {weights} T{num_tokens}",
                        functools.partial(step, config), args)


SPEC_TOKENS = 4  # the lanes' speculative engine: SmolLM2's shapes drafting for themselves, 4 drafts a row


def spec_step_cases() -> list[LoweringCase]:
    """SmolLM2-135M's steps with a draft model of its own shapes (bfloat16, smallest bucket): the target's verify
    step (the drafts and their q [S, vocab] among its inputs: rejection sampling) and the draft's (q among its
    outputs)."""
    from jaxpage.testing.random_model import SMOLLM2_135M
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.engine.config_builder import draft_engine_config
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, step

    spec = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": SPEC_TOKENS}
    target = gpu_engine_config(SMOLLM2_135M, "bfloat16", 2048, 64, 256, 1024, speculative_config=spec,
                               draft_model=SMOLLM2_135M)
    cases = []
    for what, config in (("verify", target), ("draft", draft_engine_config(target, SMOLLM2_135M))):
        num_tokens = config.token_buckets()[0]
        batch, sampling = abstract_step_inputs(config, num_tokens)
        args = (abstract_params(config.step_model, config.dtype),
                abstract_kv_pool(config.model, config.cache.num_kv_blocks, 16, config.kv_dtype), batch, sampling)
        cases.append(LoweringCase("step", f"SmolLM2-135M bfloat16 {what} draft_model k{SPEC_TOKENS} T{num_tokens}",
                                  functools.partial(step, config), args))
    return cases


def eagle3_step_cases() -> list[LoweringCase]:
    """SmolLM2-135M's steps with an EAGLE-3 head of its shapes (compile_targets.eagle3_configs, bfloat16, smallest
    bucket) on the Pallas GPU backend: the target's verify step (the three layers' hidden states among its
    outputs) and the head's pass from the target's hidden states and from its own (q among their outputs)."""
    from jaxpage.testing.compile_targets import eagle3_configs, head_step_args
    from jaxpage.worker.eagle3_runner import head_step
    from jaxpage.attention.kv_cache import abstract_kv_pool
    from jaxpage.models import abstract_params
    from jaxpage.worker.step import abstract_step_inputs, step

    target, draft, head = (dataclasses.replace(c, attention_backend="pallas_gpu") if i < 2 else c
                           for i, c in enumerate(eagle3_configs()))
    num_tokens = target.token_buckets()[0]
    args = (abstract_params(target.step_model, target.dtype),
            abstract_kv_pool(target.model, target.cache.num_kv_blocks, 16, target.kv_dtype),
            *abstract_step_inputs(target, num_tokens))
    cases = [LoweringCase("step", f"SmolLM2-135M bfloat16 verify eagle3 k{target.num_draft_tokens} T{num_tokens}",
                          functools.partial(step, target), args)]
    for from_target in (True, False):
        source = "target" if from_target else "head"
        cases.append(LoweringCase("step", f"SmolLM2-135M bfloat16 head-from-{source} eagle3 T{num_tokens}",
                                  functools.partial(head_step, draft, head, from_target),
                                  head_step_args(draft, head, from_target, draft.token_buckets()[0])))
    return cases


def run_case(case: LoweringCase, target: str, compile_ir: bool = False) -> dict:
    """One lowering (and, with compile_ir, Triton's compilation of its kernels): ok, seconds, Triton calls in
    the module and the kernels' shared memory, or the error."""
    started = time.perf_counter()
    try:
        with capture_triton_ir() as modules:
            text = lower_for_cuda(case, target)
        row = {"ok": True, "triton_calls": text.count(f"@{TRITON_CALL}")}
        if compile_ir:
            row["shared_bytes"] = max(compile_triton_ir(ttir, target)["shared_bytes"] for ttir in modules)
            row["ok"] = row["shared_bytes"] <= SHARED_MEMORY_BYTES[target]
            row["error"] = None if row["ok"] else f"needs {row['shared_bytes']} bytes of shared memory"
    except Exception as e:  # noqa: BLE001 (the table reports any failure)
        row = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {**row, "seconds": time.perf_counter() - started}


def table(targets=None, compile_ir: bool = False) -> list[dict]:
    """Every case for every target; the rows main() prints (and the lead's compile_targets can print)."""
    targets = targets or (list(TARGETS) if TARGET_HONOURED else ["sm90"])
    rows = []
    cases = kernel_cases() + step_cases() + layer_loop_cases() + [lora_step_case()] + spec_step_cases()
    for case in cases + ([tp_step_case(4), lora_step_case(3)] if len(jax.devices()) >= 4 else []):
        for target in targets:
            rows.append({"what": case.what, "shape": case.shape, "target": target,
                         **run_case(case, target, compile_ir)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        default=importlib.util.find_spec("triton") is not None,
                        help="also compile each kernel to a cubin with pip triton (default: when installed)")
    args = parser.parse_args(argv)
    what = "Triton IR" + (" -> cubin (pip triton)" if args.compile else "")
    print(f"JAX {jax.__version__}: CUDA lowering, {what}{'' if TARGET_HONOURED else ', IR for sm90 (fallback)'}")
    print(f"{'what':<28} {'shape':<40} {'target':<6} {'result':<28} {'seconds':>7}")
    failed = 0
    for row in table(compile_ir=args.compile):
        if row["ok"]:
            shared = f", {row['shared_bytes'] / 1024:.0f} KiB smem" if "shared_bytes" in row else ""
            result = f"OK ({row['triton_calls']} Triton{shared})"
        else:
            result = row["error"]
        failed += not row["ok"]
        print(f"{row['what']:<28} {row['shape']:<40} {row['target']:<6} {result:<28} {row['seconds']:>7.2f}")
    print("all lowered" + (" and compiled" if args.compile else "") if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
