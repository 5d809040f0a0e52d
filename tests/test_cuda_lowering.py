"""The CUDA lowering lane: every GPU kernel, over the shapes the engine makes, and the whole jitted engine step
with attention_backend="pallas_gpu" lower for CUDA here, on the CPU (jax.export, platforms=["cuda"]); a kernel
that no longer lowers fails this file. See jaxpage/testing/cuda_lowering.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention.gpu import triton_params

from jaxpage.testing.cuda_lowering import (SHARED_MEMORY_BYTES, TARGET_HONOURED, TARGETS, TRITON_CALL, LoweringCase,
                                      compile_for_cuda, kernel_cases, layer_loop_cases, lower_for_cuda, run_case,
                                      spec_step_cases, step_cases, eagle3_step_cases)

KERNELS = kernel_cases()
STEPS = step_cases()
TARGET_LIST = list(TARGETS) if TARGET_HONOURED else ["sm90"]  # JAX 0.10 lowers for sm90 whatever is asked


def triton_calls(text: str) -> int:
    return text.count(f"@{TRITON_CALL}")


@pytest.mark.parametrize("target", TARGET_LIST)
@pytest.mark.parametrize("case", KERNELS, ids=lambda c: f"{c.what}-{c.shape.replace(' ', '-')}")
def test_kernel_lowers_to_one_triton_call(case, target):
    text = lower_for_cuda(case, target)
    assert triton_calls(text) == 1, "not lowered through Triton (interpreted?)"
    if case.what == "ragged_paged_attention_gpu":  # the pool is updated in place, not copied
        assert "output_operand_aliases" in text


@pytest.mark.parametrize("case", STEPS, ids=lambda c: c.shape.replace(" ", "-"))
def test_engine_step_lowers_with_the_triton_kernel(case):
    text = lower_for_cuda(case, TARGET_LIST[-1])
    assert triton_calls(text) == 1, "the layers' scan body holds one Triton attention call"
    assert case.args[1].shape[0] == (32 if "Llama" in case.shape else 30)  # the pool has every layer


@pytest.mark.parametrize("case", layer_loop_cases(), ids=lambda c: c.shape.split()[0])
def test_gpu_layer_loop_layer_lowers_with_the_triton_kernel(case):
    """What a GPU runs per layer (the host layer loop): one Triton attention call, over one layer's weights."""
    text = lower_for_cuda(case, TARGET_LIST[-1])
    assert triton_calls(text) == 1
    hidden = 576 if "SmolLM2" in case.shape else 4096
    assert f"tensor<{hidden}x2x" in text  # gate_up [D, 2, F]: one layer's own weights, no layer axis to slice
    assert "stablehlo.while" not in text  # no scan over layers (the fused step lowers its scan to a while loop)


def test_lora_step_lowers_with_the_triton_kernel():
    """SmolLM2's step with 4 LoRA slots of rank 16 (smallest bucket): one Triton attention call, the slots among
    the arguments (q/k/v's A [layers, 1 + 4 slots, 576, 3 x 16]; the TP 3 case: tests/test_tensor_parallel.py)."""
    from jaxpage.testing.cuda_lowering import lora_step_case

    text = lower_for_cuda(lora_step_case(), TARGET_LIST[-1])
    assert triton_calls(text) == 1
    assert "tensor<30x5x576x48xbf16>" in text


@pytest.mark.parametrize("weights, stored, inputs", [("int8", "i8", 576), ("fp8", "f8E4M3FN", 576),
                                                     ("int4", "ui8", 288), ("fp8-block", "f8E4M3FN", 576),
                                                     ("gguf-q4_1", "ui8", 288)])
def test_a_quantized_checkpoints_step_lowers_with_its_stored_weights(weights, stored, inputs):
    """SmolLM2's step over a quantized checkpoint (int8 W8A8, FP8 dynamic, W4A16 packed two a byte, FP8 in
    blocks of 64 inputs, a GGUF's Q4_1 kept):
    one Triton attention call, the decoder kernels among the arguments in their stored dtype (q/k/v fused
    [layers, 576, 3, 5, 64]; int4's input axis halved)."""
    from jaxpage.testing.cuda_lowering import checkpoint_quant_case

    text = lower_for_cuda(checkpoint_quant_case(weights), TARGET_LIST[-1])
    assert triton_calls(text) == 1
    assert f"tensor<30x{inputs}x3x5x64x{stored}>" in text and f"tensor<30x{inputs * 8 // 3}x576x{stored}>" in text


def test_a_gguf_q4_k_m_step_lowers_with_each_projection_as_stored():
    """SmolLM2's step over a GGUF Q4_K_M file kept (q/k/v and down int8 in groups of 16, o and gate/up int4 in
    groups of 32): one Triton attention call, each kernel among the arguments in its own stored form."""
    from jaxpage.testing.cuda_lowering import checkpoint_quant_case

    text = lower_for_cuda(checkpoint_quant_case("gguf-q4_k_m"), TARGET_LIST[-1])
    assert triton_calls(text) == 1
    for kernel in ("30x576x3x5x64xi8", "30x1536x576xi8", "30x288x2x1536xui8", "30x9x32x576xui8"):
        assert f"tensor<{kernel}>" in text, kernel


def _main_signature(case) -> tuple[str, str]:
    """The lowered step's (arguments, results) of its main function; one Triton attention call in it."""
    text = lower_for_cuda(case, TARGET_LIST[-1])
    assert triton_calls(text) == 1
    signature = text[text.index("func.func public @main"):].split("\n", 1)[0]
    args, results = signature.split(") -> (", 1)
    return args, results


@pytest.mark.parametrize("case", spec_step_cases(), ids=lambda c: c.shape.split()[2])
def test_speculative_verify_and_draft_steps_lower_with_the_triton_kernel(case):
    """A draft model's target (rejection sampling: the drafts' q [S, vocab] float32 among its inputs) and the
    draft (q among its outputs), SmolLM2's shapes at the smallest bucket: one Triton attention call each."""
    args, results = _main_signature(case)
    signature = args + results
    q = f"tensor<{case.args[3].temperature.shape[0]}x49152xf32>"
    assert (q in args, q in results) == ((True, False) if "verify" in case.shape else (False, True)), signature[-300:]


@pytest.mark.parametrize("case", eagle3_step_cases(), ids=lambda c: c.shape.split()[2])
def test_eagle3_verify_step_and_head_passes_lower_with_the_triton_kernel(case):
    """An EAGLE-3 head's target (the three layers' hidden states [T, 3 x 576] among its outputs) and the head's two
    passes (q among their outputs), SmolLM2's shapes at the smallest bucket: one Triton attention call each."""
    _, results = _main_signature(case)
    if "verify" in case.shape:
        assert f"tensor<{case.args[2].token_ids.shape[0]}x1728xbf16>" in results, results[-300:]
    else:
        assert f"tensor<{case.args[4].temperature.shape[0]}x49152xf32>" in results, results[-300:]


def test_a_kernel_that_does_not_lower_fails_the_lane():
    """Triton blocks must have power-of-two shapes: the lowering refuses a (3, 5) block, and run_case says so."""
    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def fn(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **triton_params(4, 2))(x)

    row = run_case(LoweringCase("bad", "3x5", fn, (jax.ShapeDtypeStruct((3, 5), jnp.float32),)), TARGET_LIST[-1])
    assert not row["ok"] and "power of 2" in row["error"], row


def test_the_triton_deprecation_is_not_shown_to_users():
    """JAX >= 0.11 warns at each Triton lowering; pallas_kernels filters that one warning (a user who turns
    every DeprecationWarning on still does not see it). On JAX 0.10 there is no such warning to see."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    code = "from jaxpage.testing.cuda_lowering import kernel_cases, lower_for_cuda; lower_for_cuda(kernel_cases()[1])"
    proc = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Triton backend is deprecated" not in proc.stderr


# --- Triton's compiler down to a cubin, with pip triton (the cuda-compile extra); both targets whatever the JAX
COMPILED = [c for c in KERNELS if c.shape.removesuffix(" window softcap") in ("bs16 d64 kvh3 g3 bfloat16 n48",
                                                                              "bs16 d128 kvh8 g4 bfloat16 n48")]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="pip triton (extra cuda-compile) compiles the Triton IR to a cubin")


@needs_triton
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("case", COMPILED, ids=lambda c: f"{c.what}-{c.shape.replace(' ', '-')}")
def test_kernel_compiles_to_a_cubin(case, target):
    """SmolLM2's and Llama-3-8B's heads in bfloat16, with and without a window and soft cap: IR -> PTX -> cubin,
    within the GPU's shared memory."""
    [kernel] = compile_for_cuda(case, target)
    assert kernel["cubin_bytes"] > 0
    assert 0 < kernel["shared_bytes"] <= SHARED_MEMORY_BYTES[target]


@needs_triton
def test_a_kernel_too_big_for_shared_memory_fails_the_lane():
    """512 keys of K and V per step (32 pages of 16) in bfloat16, double-buffered, do not fit an H100's block."""
    from pallas_kernels import paged_decode_attention_gpu

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    fn = functools.partial(paged_decode_attention_gpu, scale=0.1, pages_per_compute_block=32)
    case = LoweringCase("decode", "512 keys a step", fn, (bf16(8, 32, 128), bf16(1, 1024, 2, 8, 16, 128), i32(),
                                                          i32(8, 64), i32(8)))
    row = run_case(case, "sm90", compile_ir=True)
    assert not row["ok"] and row["shared_bytes"] > SHARED_MEMORY_BYTES["sm90"], row
