"""Checkpoints published in compressed-tensors' format (what llm-compressor writes; tests/quantized_checkpoints.py
makes them with compressed-tensors' own presets and compressor): served with their weights as stored, against
transformers loading the same directory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpage import LLM
from jaxpage.models import quant
from tests.factories import SEED, engine_options, tiny_llama
from tests.quantized_checkpoints import load_reference, save_compressed
from tests.reference import assert_logits_close, paged_logits, save_random_model

OPTIONS = engine_options(num_kv_blocks=12, max_model_len=64)
STORED = {"W8A8": jnp.int8, "FP8_DYNAMIC": jnp.float8_e4m3fn}
ARCHS = {"llama": lambda: tiny_llama(), "qwen2": lambda: _qwen2()}  # qwen2: q/k/v biases, a tied head


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


@pytest.fixture(scope="module", params=[(s, a) for s in STORED for a in ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def checkpoint(request, tmp_path_factory):
    scheme, arch = request.param
    root = tmp_path_factory.mktemp(f"{scheme}-{arch}")
    model = save_random_model(ARCHS[arch](), root / "float", SEED % 2**31)
    save_compressed(model, root / "quantized", scheme)
    return scheme, root / "quantized", load_reference(root / "quantized"), root


def _reference_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def test_weights_stay_quantized_and_the_logits_are_transformers(checkpoint, monkeypatch):
    """The decoder Linears keep the checkpoint's int8 or float8 values on the device, each with its scale; with
    the weight-only product (the GPU/TPU form) the logits are transformers' on the decompressed weights."""
    scheme, path, reference, root = checkpoint
    monkeypatch.setattr(quant, "CPU_DOT", quant.int8_dot_weight_only)
    llm = LLM(str(path), cache_dir=str(root / "cache"), **OPTIONS)
    model = llm.engine.config.model
    assert (model.quantization, model.quantized_weights) == ("compressed-tensors", scheme == "W8A8" and "int8" or "fp8")
    kernels = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params["layers"])
               if p[-1].key == "kernel"]
    assert kernels and all(k.dtype == STORED[scheme] for k in kernels)
    tokens = np.random.default_rng(SEED).integers(0, 256, 40).tolist()
    assert_logits_close(paged_logits(llm, tokens), _reference_logits(reference, tokens), 1e-4, scheme)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def _per_token_int8_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """Every decoder Linear's input quantized per token to int8 as vLLM's dynamic W8A8 kernel does it (absmax /
    127, round half to even) and dequantized: the scheme's activation rule over transformers' forward."""
    def hook(_, args):
        x = args[0]
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
        return (torch.round(x / scale).clamp(-127, 127) * scale,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook)
    return model


def test_w8a8_with_per_token_activations_on_the_cpu_is_the_schemes_math(checkpoint):
    """The CPU's int8 product quantizes each token's activations (W8A8's dynamic per-token scheme, vLLM's rule):
    its logits are transformers' decompressed model with the same rule applied to every decoder Linear's input."""
    scheme, path, _, root = checkpoint
    if scheme != "W8A8":
        pytest.skip("FP8's product is weight-only on the CPU (the test above)")
    reference = _per_token_int8_inputs(load_reference(path))
    llm = LLM(str(path), cache_dir=str(root / "cache"), **OPTIONS)
    tokens = np.random.default_rng(SEED + 1).integers(0, 256, 40).tolist()
    assert_logits_close(paged_logits(llm, tokens), _reference_logits(reference, tokens), 2e-3, scheme)


def test_schemes_not_served_are_refused_naming_the_field(tmp_path):
    """W4A16 (pack-quantized int4) is refused at load naming quantization_config.format; the engine's own int8
    over a quantized checkpoint is refused naming quantization."""
    model = save_random_model(tiny_llama(), tmp_path / "float", SEED % 2**31)
    save_compressed(model, tmp_path / "w4a16", "W4A16")
    with pytest.raises(ValueError, match="quantization_config.format='pack-quantized' is not served"):
        LLM(str(tmp_path / "w4a16"), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    save_compressed(model, tmp_path / "w8a8", "W8A8")
    with pytest.raises(ValueError, match="quantization='int8' differs from the checkpoint's quant_method"):
        LLM(str(tmp_path / "w8a8"), cache_dir=str(tmp_path / "cache"), quantization="int8", **OPTIONS)


@pytest.mark.parametrize("scheme", list(STORED))
def test_smollm2_as_published_gives_transformers_logits(scheme, hf_smollm2, tmp_path, monkeypatch):
    """SmolLM2 quantized by compressed-tensors' preset (W8A8 int8, FP8 dynamic), its tied head left float: with
    the weight-only product a chat prompt's logits are transformers' on the same directory; W8A8's per-token
    activations on the CPU (SmolLM2's outlier activations make them lossy) keep most greedy choices of the float
    model. (Two W8A8 implementations do not agree closely on SmolLM2: one activation rounded the other way
    moves a whole quantum of an outlier-sized scale; on the random models above they agree to 2e-3.)"""
    model, tokenizer = hf_smollm2
    save_compressed(model, tmp_path / "smollm2", scheme)
    tokenizer.save_pretrained(tmp_path / "smollm2")
    llm = LLM(str(tmp_path / "smollm2"), cache_dir=str(tmp_path / "cache"), dtype="float32", max_model_len=256,
              kv_cache_memory=32 << 20, progress=False)
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    dynamic = paged_logits(llm, tokens)
    monkeypatch.setattr(quant, "CPU_DOT", quant.int8_dot_weight_only)
    reference = _reference_logits(load_reference(tmp_path / "smollm2"), tokens)
    assert_logits_close(paged_logits(llm, tokens), reference, 1e-4, scheme)
    agreement = (dynamic.argmax(-1) == _reference_logits(model, tokens).argmax(-1)).mean()
    assert agreement >= 0.75, f"{scheme}: top-1 agreement with float {agreement:.3f}"
