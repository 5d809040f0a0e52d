"""GPTQ, AWQ and block-scaled FP8 checkpoints served with their weights as stored. tests/quantized_checkpoints.py
writes GPTQ and AWQ from a compressed-tensors checkpoint's integers (the layouts as GPTQModel and AutoAWQ define
them), so transformers loading that compressed-tensors checkpoint is the reference. (The writers were checked once
against GPTQModel 7.7.0 under transformers 5.25, which loads all four formats here: dequantized weights equal to
float16's rounding of the scales, 5.5e-4; GPTQModel is not a test dependency, as it asks for torch >= 2.14.1.)
FP8 with block scales is written from the float model (absmax per block), and transformers dequantizing it on the
CPU is its reference."""
from __future__ import annotations

import json
import re

import grpc
import jax
import numpy as np
import pytest
import torch

from jaxpage import LLM, SamplingParams
from jaxpage.models import quant
from jaxpage.testing.launch import wait_serving
from serving import generation_pb2 as pb
from serving.generation_pb2_grpc import GenerationStub
from tests.factories import SEED, engine_options, tiny_llama
from tests.quantized_checkpoints import load_reference, save_awq, save_compressed, save_fp8_blocks, save_gptq
from tests.reference import assert_logits_close, paged_logits, save_random_model
from tests.servers import ENGINE_FLAGS, START_TIMEOUT, start_http

OPTIONS = engine_options(num_kv_blocks=12, max_model_len=64)
# published form -> (the compressed-tensors scheme its integers come from, a writer, jaxpage's stored kind, zeros)
FORMS = {
    "gptq-4bit-sym": ("W4A16", lambda src, dst: save_gptq(src, dst), "int4", False),
    "gptq-4bit-asym": ("W4A16_ASYM", lambda src, dst: save_gptq(src, dst), "int4", True),
    "gptq_v2-4bit-asym": ("W4A16_ASYM", lambda src, dst: save_gptq(src, dst, "gptq_v2"), "int4", True),
    "gptq-8bit-channel": ("W8A8", lambda src, dst: save_gptq(src, dst), "int8", False),
    "awq-gemm": ("W4A16_ASYM", save_awq, "int4", True),
}


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


ARCHS = {"llama": tiny_llama, "qwen2": _qwen2}  # qwen2: q/k/v biases beside the packed weights, a tied head


def _reference_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def _published(root, form: str, model) -> tuple:
    scheme, write, _, _ = FORMS[form]
    save_compressed(model, root / scheme, scheme, group_size=32)
    write(root / scheme, root / form)
    return root / form, load_reference(root / scheme)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("form", list(FORMS))
def test_published_weights_stay_quantized_and_the_logits_are_transformers(form, arch, tmp_path):
    """Each decoder Linear keeps the checkpoint's integers on the device (int4 two a byte, or int8), a scale per
    group of 32 inputs (per channel for GPTQ's group_size -1) and zero points where asymmetric; the logits are
    transformers' on the compressed-tensors checkpoint of the same integers, with the engine's own CPU product
    (weight-only for all of them, 8-bit per channel included: GPTQ does not quantize activations)."""
    model = save_random_model(ARCHS[arch](), tmp_path / "float", SEED % 2**31)
    path, reference = _published(tmp_path, form, model)
    llm = LLM(str(path), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    cfg = llm.engine.config.model
    _, _, kind, zeros = FORMS[form]
    assert (cfg.quantization, cfg.quantized_weights, cfg.quantization_zero_point) == (
        form.split("-")[0].removesuffix("_v2"), kind, zeros)
    linears = {}
    for p, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params["layers"]):
        linears.setdefault(p[:-1], {})[p[-1].key] = leaf
    linears = [leaves for leaves in linears.values() if "kernel" in leaves]
    assert linears and all(m["kernel"].dtype == quant.STORED[kind] for m in linears)
    for m in linears:
        assert ("zero" in m) == zeros
        assert (m["scale"].size * 16 == m["kernel"].size if kind == "int4"  # 32 inputs: 16 bytes a scale
                else m["scale"].size * 64 <= m["kernel"].size), {k: v.shape for k, v in m.items()}
    tokens = np.random.default_rng(SEED).integers(0, 256, 40).tolist()
    assert_logits_close(paged_logits(llm, tokens), _reference_logits(reference, tokens), 1e-4, form)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


REFUSALS = {  # (form, edit of quantization_config) -> the field the refusal names
    ("gptq-4bit-sym", "desc_act", True): "quantization_config.desc_act",
    ("gptq-4bit-sym", "bits", 3): "quantization_config.bits",
    ("gptq-4bit-asym", "group_size", -1): "quantization_config.sym",
    ("gptq-4bit-sym", "checkpoint_format", "marlin"): "quantization_config.checkpoint_format",
    ("gptq-4bit-sym", "lm_head", True): "quantization_config.lm_head",
    ("awq-gemm", "version", "gemv"): "quantization_config.version",
    ("awq-gemm", "zero_point", False): "quantization_config.zero_point",
    ("awq-gemm", "quant_method", "bitsandbytes"): "quantization_config.quant_method",
    ("fp8-block", "weight_block_size", None): "quantization_config.weight_block_size",
    ("fp8-block", "activation_scheme", "static"): "quantization_config.activation_scheme",
}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    model = save_random_model(tiny_llama(), root / "float", SEED % 2**31)
    paths = {form: _published(root, form, model)[0] for form in ("gptq-4bit-sym", "gptq-4bit-asym", "awq-gemm")}
    save_fp8_blocks(model, root / "fp8-block", (32, 32))
    return root, dict(paths, **{"fp8-block": root / "fp8-block"})


@pytest.mark.parametrize("form,field,value", list(REFUSALS), ids=lambda v: str(v))
def test_schemes_not_served_are_refused_naming_the_field(form, field, value, published, tmp_path):
    """A GPTQ or AWQ scheme not served is refused at load naming its quantization_config field; an unknown
    quant_method is refused with the methods served."""
    _, paths = published
    config_file = paths[form] / "config.json"
    published_text = config_file.read_text()
    config = json.loads(published_text)
    config["quantization_config"][field] = value
    config_file.write_text(json.dumps(config))
    try:
        with pytest.raises(ValueError, match=re.escape(REFUSALS[(form, field, value)])) as refused:
            LLM(str(paths[form]), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    finally:
        config_file.write_text(published_text)
    if field == "quant_method":
        assert all(m in str(refused.value) for m in ("compressed-tensors", "gptq", "awq")), refused.value


def test_gptq_tensors_that_contradict_the_config_are_refused(tmp_path):
    """Inputs assigned to groups out of their order (g_idx of an activation-ordered checkpoint) and zero points
    other than 2**(bits - 1) under sym=True are refused naming the tensor, not served wrong."""
    from safetensors.torch import load_file, save_file

    model = save_random_model(tiny_llama(), tmp_path / "float", SEED % 2**31)
    path, _ = _published(tmp_path, "gptq-4bit-sym", model)
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    for tensor, edit, message in ((".g_idx", lambda t: t.flip(0), "g_idx"),
                                  (".qzeros", lambda t: t ^ 1, "qzeros")):
        edited = dict(state, **{name + tensor: edit(state[name + tensor]).contiguous()})
        save_file(edited, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=re.escape(name + tensor[:0]) + ".*" + message):
            LLM(str(path), cache_dir=str(tmp_path / f"cache{tensor}"), **OPTIONS)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp8_with_block_scales_stays_float8_and_the_logits_are_transformers(arch, tmp_path):
    """Block-scaled FP8 (blocks of 32 x 32): each decoder Linear keeps its float8 e4m3 weights and a scale per
    (group of 32 inputs, output channel); the logits are transformers' dequantizing the same directory."""
    from transformers import AutoModelForCausalLM

    model = save_random_model(ARCHS[arch](), tmp_path / "float", SEED % 2**31)
    save_fp8_blocks(model, tmp_path / "fp8", (32, 32))
    llm = LLM(str(tmp_path / "fp8"), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    cfg = llm.engine.config.model
    assert (cfg.quantization, cfg.quantized_weights, cfg.quantization_group_size) == ("fp8", "fp8", 32)
    kernels = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params["layers"])
               if p[-1].key == "kernel"]
    assert kernels and all(k.dtype == quant.STORED["fp8"] for k in kernels)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    tokens = np.random.default_rng(SEED).integers(0, 256, 40).tolist()
    assert_logits_close(paged_logits(llm, tokens), _reference_logits(reference, tokens), 1e-4, arch)


@pytest.fixture(scope="module")
def smollm2_published(hf_smollm2, tmp_path_factory):
    """SmolLM2 as GPTQ and AWQ directories in groups of 64 (its 576 columns are not a multiple of the usual 128),
    beside the compressed-tensors checkpoints of their integers, and as FP8 in blocks of 64 x 64; each with its
    tokenizer."""
    model, tokenizer = hf_smollm2
    root = tmp_path_factory.mktemp("smollm2")
    for form in ("gptq-4bit-sym", "awq-gemm"):
        scheme, write, _, _ = FORMS[form]
        if not (root / scheme).exists():
            save_compressed(model, root / scheme, scheme)
        write(root / scheme, root / form)
    save_fp8_blocks(model, root / "fp8-block", (64, 64))
    for form in ("gptq-4bit-sym", "awq-gemm", "fp8-block"):
        tokenizer.save_pretrained(root / form)
    return root


SMOLLM2_FORMS = {"gptq-4bit-sym": ("int4", 0.5), "awq-gemm": ("int4", 0.5), "fp8-block": ("fp8", 0.75)}


@pytest.mark.parametrize("form", list(SMOLLM2_FORMS))
def test_smollm2_as_gptq_awq_and_fp8_gives_transformers_logits(form, smollm2_published, hf_smollm2, monkeypatch):
    """SmolLM2 as GPTQ, AWQ and block-scaled FP8 checkpoints: a chat prompt's logits are transformers' (on the
    compressed-tensors checkpoint of the same integers; FP8: dequantizing the directory itself), and the greedy
    choices mostly the float model's (data-free 4-bit min-max weights lose more than 8-bit ones)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = hf_smollm2
    root = smollm2_published
    llm = LLM(str(root / form), cache_dir=str(root / f"cache-{form}"), dtype="float32", max_model_len=256,
              kv_cache_memory=32 << 20, progress=False)
    kind, floor = SMOLLM2_FORMS[form]
    assert llm.engine.config.model.quantized_weights == kind
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    monkeypatch.setattr(quant, "CPU_DOT", quant.int8_dot_weight_only)
    got = paged_logits(llm, tokens)
    reference = (AutoModelForCausalLM.from_pretrained(root / form, dtype=torch.float32).eval() if kind == "fp8"
                 else load_reference(root / FORMS[form][0]))
    assert_logits_close(got, _reference_logits(reference, tokens), 1e-4, form)
    agreement = (got.argmax(-1) == _reference_logits(model, tokens).argmax(-1)).mean()
    assert agreement >= floor, f"{form}: top-1 agreement with float {agreement:.3f}"


def test_a_server_of_an_awq_checkpoint_reports_its_scheme_and_serves_it(smollm2_published, tmp_path):
    """`jaxpage serve` of SmolLM2 as AWQ: /v1/models and GetModelInfo say awq, int4 weights in groups of 64 with
    zero points; a greedy completion through the OpenAI client is the offline engine's on the same directory."""
    path = smollm2_published / "awq-gemm"
    server = start_http(["-m", "serving.cli", "serve", "--model", str(path), *ENGINE_FLAGS, "--num-kv-blocks", "64"],
                        tmp_path / "server.log")
    try:
        wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
        card = server.client().models.list().data[0].model_extra
        assert (card["quantization"], card["quantized_weights"], card["quantization_group_size"],
                card["quantization_zero_point"]) == ("awq", "int4", 64, True), card
        with grpc.insecure_channel(server.target) as channel:
            info = GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.quantization, info.quantized_weights, info.quantization_group_size,
                info.quantization_zero_point) == ("awq", "int4", 64, True), info
        got = server.client().completions.create(model=server.client().models.list().data[0].id,
                                                 prompt="The capital of France is", max_tokens=8, temperature=0)
        assert server.all_blocks_free()
    finally:
        server.stop()
    llm = LLM(str(path), cache_dir=str(tmp_path / "cache"), dtype="float32", max_model_len=512, progress=False)
    want = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert got.choices[0].text == want.outputs[0].text
