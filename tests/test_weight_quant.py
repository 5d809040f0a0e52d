"""int8 weights (``quantization="int8"``, jaxpage.models.quant): the quantizer against a per-channel numpy loop, the
quantized Linear against x . (dequantized kernel), SmolLM2's teacher-forced quality against transformers float32
over 2,048 tokens of varied text, and the option's plumbing.

Every run draws fresh random inputs (set JAXPAGE_TEST_SEED to replay one); the seed is in every message.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpage.testing.quality import SEGMENT, SOURCES, agreement_with_transformers
from jaxpage.config import ModelConfig
from jaxpage.models import abstract_params, cast_weights, quantize_params
from jaxpage.models.layers import Linear
from jaxpage.models.quant import building, int8_dot_weight_only, quantize_int8

SEED = int(os.environ.get("JAXPAGE_TEST_SEED") or random.randrange(2**31))
# prose, Python, a results table of numbers, a protobuf IDL: four kinds of text, SEGMENT tokens each
# Measured on SmolLM2-135M-Instruct (its Q4_1 GGUF) over these 2,048 tokens, the CPU form (int8 activations per
# token): top-1 0.868, mean KL 0.0461 nats (the weight-only form of GPU/TPU: 0.955, 0.0049). The thresholds leave
# a little room for other XLA versions, none for a wrong scale or rounding (a scale off by 1 % costs far more).
MIN_TOP1 = 0.85
MAX_KL = 0.055


def _reference_quantize(w: np.ndarray, in_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """One output channel at a time: scale = absmax / 127 (1 for an all-zero channel), values = round(w / scale)."""
    out_axes = [a for a in range(w.ndim) if a not in in_axes]
    cols = np.moveaxis(w, list(in_axes) + out_axes, range(w.ndim)).reshape(
        int(np.prod([w.shape[a] for a in in_axes])), -1)
    values, scales = np.zeros(cols.shape, np.int8), np.zeros(cols.shape[1], np.float32)
    for c in range(cols.shape[1]):
        absmax = max(abs(float(v)) for v in cols[:, c])
        scales[c] = np.float32(absmax) / np.float32(127) if absmax else 1.0
        values[:, c] = [round(float(np.float32(v) / scales[c])) for v in cols[:, c]]
    out_shape = [w.shape[a] for a in out_axes]
    values = values.reshape([w.shape[a] for a in in_axes] + out_shape)
    return np.moveaxis(values, range(w.ndim), list(in_axes) + out_axes), scales.reshape(out_shape)


@pytest.mark.parametrize("shape, in_axes", [((2, 24, 3, 8), (1,)), ((2, 3, 8, 24), (1, 2)), ((40, 17), (0,))])
def test_quantize_int8_against_a_per_channel_loop(shape, in_axes):
    rng = np.random.default_rng(SEED)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2)).astype(np.float32)
    w[(slice(None),) * (w.ndim - 1) + (0,)] = 0  # an all-zero output channel
    values, scale = quantize_int8(w, in_axes)
    ref_values, ref_scale = _reference_quantize(w, in_axes)
    assert values.dtype == np.int8 and scale.dtype == np.float32, f"seed {SEED}"
    np.testing.assert_array_equal(scale, ref_scale, err_msg=f"seed {SEED}")
    np.testing.assert_array_equal(values, ref_values, err_msg=f"seed {SEED}")
    # round trip: within half a step of its channel
    dequantized = values * np.expand_dims(scale, in_axes)
    assert np.all(np.abs(w - dequantized) <= np.expand_dims(scale, in_axes) * (0.5 + 1e-6)), f"seed {SEED}"


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("in_shape, out_shape", [((24,), (3, 8)), ((3, 8), (24,)), ((64,), (96,))])
def test_quantized_linear_against_x_times_dequantized_kernel(rows, in_shape, out_shape):
    rng = np.random.default_rng(SEED + rows)
    with building("int8"):
        linear = Linear(in_shape, out_shape, (None,) * (len(in_shape) + len(out_shape)))
    num_in = len(in_shape)
    values, scale = quantize_int8((rng.standard_normal(in_shape + out_shape) * 0.1).astype(np.float32),
                                  tuple(range(num_in)))
    linear.kernel[...], linear.scale[...] = jnp.asarray(values), jnp.asarray(scale)
    x = rng.standard_normal((rows, *in_shape)).astype(np.float32)
    dequantized = values.astype(np.float64) * scale
    ref = np.tensordot(x.astype(np.float64), dequantized, axes=num_in)
    # the weight-only form (GPU/TPU) is exact up to float32 rounding
    weight_only = np.asarray(jax.jit(int8_dot_weight_only, static_argnums=3)(x, values, scale, num_in))
    np.testing.assert_allclose(weight_only, ref, rtol=1e-5, atol=1e-5, err_msg=f"seed {SEED}")
    # on the CPU, Linear quantizes x per row: each x element moves by at most half its row's step
    got = np.asarray(linear(jnp.asarray(x)))
    row_step = np.abs(x.reshape(rows, -1)).max(axis=1) / 127
    bound = (row_step / 2)[:, None] * np.abs(dequantized.reshape(-1, scale.size)).sum(axis=0)[None, :]
    err = np.abs(got - ref).reshape(rows, -1)
    assert np.all(err <= bound * (1 + 1e-4) + 1e-5), f"seed {SEED}: max excess {np.max(err - bound):.3g}"


def _tiny_config(**kw) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                       rope_parameters=(), max_position_embeddings=128, qkv_bias=True, o_bias=False, **kw)


def test_quantized_weights_fit_the_quantized_graph_and_a_tied_head_becomes_int8():
    cfg = _tiny_config(tie_word_embeddings=True)
    rng = np.random.default_rng(SEED)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), abstract_params(cfg, "float32"))
    qcfg = dataclasses.replace(cfg, quantization="int8")
    quantized = quantize_params(qcfg, params)
    assert "lm_head" not in params and params["layers"]["mlp"]["gate_up"]["kernel"].dtype == np.float32  # untouched
    on_device = jax.tree.map(lambda a: (a.shape, a.dtype), cast_weights(quantized, "bfloat16"))
    assert on_device == jax.tree.map(lambda a: (a.shape, a.dtype), abstract_params(qcfg, "bfloat16"))
    head = quantized["lm_head"]
    assert np.all(np.abs(head["kernel"] * head["scale"] - params["embed"]["embedding"].T) <= head["scale"] / 2 + 1e-7)


# --- SmolLM2: teacher-forced quality against transformers float32 ---------------------------------------------
@pytest.fixture(scope="module")
def smollm2_int8():
    """(ModelConfig with quantization, int8 weights in a float32 engine) through the loader and its cache."""
    from jaxpage.models import config_from_hf
    from jaxpage.models.loader import default_cache_dir, load_model

    loaded = load_model(None, default_cache_dir(), "int8")
    cfg = dataclasses.replace(config_from_hf(loaded.hf_config), quantization="int8")
    return cfg, cast_weights(loaded.params, "float32")


def test_smollm2_int8_teacher_forced_quality_against_float32(smollm2_int8, hf_smollm2):
    model, tokenizer = hf_smollm2
    cfg, params = smollm2_int8
    top1, kl, top1s, kls = agreement_with_transformers(model, tokenizer, cfg, params, jnp.float32)
    print(f"int8 weights vs float32 over {SEGMENT * len(SOURCES)} tokens: top-1 {top1:.4f}, mean KL {kl:.5f} "
          f"(per source: {[round(t, 4) for t in top1s]}, {[round(k, 5) for k in kls]})")
    assert top1 >= MIN_TOP1 and kl <= MAX_KL, (top1, kl)


# --- the option -------------------------------------------------------------------------------------------------
def test_llm_with_int8_weights_generates():
    from jaxpage import LLM, SamplingParams

    llm = LLM(quantization="int8", dtype="float32", max_num_seqs=1, max_num_batched_tokens=8, max_model_len=64,
              kv_cache_memory=16 << 20, progress=False)
    assert llm.engine.config.model.quantization == "int8"
    assert llm.engine.runner.params["layers"][0]["mlp"]["down"]["kernel"].dtype == jnp.int8  # unrolled on a CPU
    assert llm.engine.runner.params["lm_head"]["scale"].dtype == jnp.float32
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6 and "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("value", ["int4", "INT8", ""])
def test_an_unknown_quantization_is_refused_naming_the_field(value):
    from jaxpage import LLM

    with pytest.raises(ValueError, match=f"quantization={value!r}"):
        LLM(quantization=value, progress=False)


def test_cli_takes_quantization():
    from jaxpage.engine.arg_utils import EngineArgs
    from serving.cli import build_parser

    for command in (["generate", "hi"], ["serve"]):
        ns = build_parser().parse_args([command[0], "--quantization", "int8", *command[1:]])
        assert EngineArgs.from_cli_args(ns).quantization == "int8"
        assert EngineArgs.from_cli_args(build_parser().parse_args(command)).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])


def test_get_model_info_and_v1_models_report_the_quantization():
    import asyncio
    import types

    from jaxpage.engine.config_builder import build_engine_config
    from serving import generation_pb2 as pb
    from serving.grpc_service import GenerationService
    from serving.metrics import Metrics
    from serving.openai_api import OpenAIServing
    from serving.requests import RequestLifecycle

    for quantization, reported in (("int8", "int8"), (None, "")):
        config = build_engine_config(_tiny_config(tie_word_embeddings=True), dtype="float32", block_size=16,
                                     kv_cache_memory=None, num_kv_blocks=8, max_num_seqs=2,
                                     max_num_batched_tokens=16, max_model_len=64, gpu_memory_utilization=0.9,
                                     quantization=quantization)
        requests = RequestLifecycle(Metrics())
        requests.accepting = True
        requests.engine = types.SimpleNamespace(engine=types.SimpleNamespace(config=config, model_name="tiny"))
        info = asyncio.run(GenerationService(requests).GetModelInfo(pb.GetModelInfoRequest(), None))
        assert info.quantization == reported
        models = asyncio.run(OpenAIServing(requests).models())
        assert models.data[0].quantization == quantization and models.data[0].id == "tiny"


@pytest.mark.parametrize("in_shape, groups", [((256,), None), ((256,), 4), ((4, 64), 2)])
def test_fp8_native_product_is_the_float8_math(in_shape, groups):
    """The product a GPU with FP8 runs for an FP8-dynamic or block-FP8 checkpoint (quant.fp8_native_dot): against
    numpy, x quantized to float8 e4m3 with a scale per token (and block of inputs), float8 values multiplied in
    float64, each block's sum times both scales; and within FP8's rounding of the float product."""
    import ml_dtypes

    from jaxpage.models.quant import FP8_MAX, fp8_native_dot

    rng = np.random.default_rng(SEED)
    k, n, g = int(np.prod(in_shape)), 48, groups or 1
    x = rng.standard_normal((5, *in_shape)).astype(np.float32)
    x[1] = 0  # an all-zero token: scale 1
    kernel = np.clip(rng.standard_normal((*in_shape, n)) * 100, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-3, 2e-3, (n,) if groups is None else (g, n)).astype(np.float32)
    got = np.asarray(jax.jit(lambda *a: fp8_native_dot(*a, num_in=len(in_shape)))(x, kernel, scale))
    xs = x.reshape(5, g, k // g)
    x_scale = np.abs(xs).max(axis=-1, keepdims=True) / np.float32(FP8_MAX)
    x_scale = np.where(x_scale == 0, np.float32(1), x_scale)
    xq = (xs / x_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w = kernel.astype(np.float64).reshape(g, k // g, n)
    want = sum((xq[:, i] @ w[i]) * x_scale[:, i] * scale.reshape(g, n)[i] for i in range(g))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(), err_msg=f"seed {SEED}")
    exact = x.reshape(5, k) @ (w * scale.reshape(g, 1, n)).reshape(k, n)
    assert np.abs(got - exact).max() <= 0.08 * np.abs(exact).max(), f"seed {SEED}"


def test_fp8_checkpoints_take_the_float8_product_only_on_a_gpu_with_fp8():
    """A float8 Linear whose scheme quantizes activations lowers for CUDA (the lane's Hopper target) to a float8 x
    float8 dot, and for the CPU to the weights upcast (bfloat16 x bfloat16); a weight-only one (group_size -1)
    upcasts on CUDA too."""
    x = jnp.ones((3, 64), jnp.bfloat16)
    for group_size, native in ((None, True), (32, True), (-1, False)):
        with building("fp8", group_size):
            linear = Linear((64,), (16,), (None, None))
        graph, state = nnx.split(linear)

        def apply(state, x, graph=graph):
            return nnx.merge(graph, state)(x)
        lowered = {p: jax.jit(apply).trace(state, x).lower(lowering_platforms=(p,)).as_text() for p in ("cuda", "cpu")}
        float8_dot = re.compile(r"dot_general.*f8E4M3FN>, tensor<[^>]*f8E4M3FN>")
        assert bool(float8_dot.search(lowered["cuda"])) is native, group_size
        assert not float8_dot.search(lowered["cpu"]), group_size
