"""GGUF files served with their decoder Linears as stored (``quantization="gguf"``): llama.cpp's blocks read
against gguf-py's own quantizer and dequantizer, and SmolLM2's own file (Q4_1) against transformers loading it."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpage import LLM
from jaxpage.models import gguf_quant, quant
from tests.factories import SEED
from tests.reference import assert_logits_close, paged_logits


@pytest.mark.parametrize("ggml_type", list(gguf_quant.TYPES))
def test_blocks_read_as_gguf_dequantizes_them(ggml_type):
    """Blocks written by gguf-py's quantizer: the signed values, scales and zero points read give gguf-py's
    dequantized weights, (value - zero) * scale, to float32 rounding; the values fit their kind."""
    import gguf

    kind = gguf.GGMLQuantizationType[ggml_type]
    w = np.random.default_rng(SEED).normal(size=(24, 96)).astype(np.float32)
    w[3, :32] = 0.75  # a constant block: Q4_1 stores d = 0
    blocks = gguf.quants.quantize(w, kind)
    want = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    got = gguf_quant.stored_values(blocks, ggml_type, w.shape)
    spread = {k: np.repeat(v, gguf_quant.BLOCK, axis=1) for k, v in got.items() if k}
    values = got[""]
    assert np.array_equal(values, np.round(values))
    assert values.min() >= (-8 if gguf_quant.TYPES[ggml_type][0] == "int4" else -128)
    assert values.max() <= (7 if gguf_quant.TYPES[ggml_type][0] == "int4" else 127)
    dequantized = (values - spread.get("_zero_point", 0)) * spread["_scale"]
    np.testing.assert_allclose(dequantized, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_one_type_in_every_decoder_linear_or_refused():
    assert gguf_quant.linear_type({"a": "Q4_1", "b": "Q4_1"}) == "Q4_1"
    for mixed in ({"a": "Q4_K", "b": "Q6_K"}, {"a": "Q4_K"}):
        with pytest.raises(ValueError, match="quantization='gguf' needs one ggml type"):
            gguf_quant.linear_type(mixed)


def test_smollm2_kept_as_q4_1_gives_transformers_logits(hf_smollm2, tmp_path):
    """SmolLM2's own GGUF (Q4_1 decoder Linears) with quantization="gguf": every decoder kernel stays 4-bit (two
    values a byte) with a float32 scale and zero point per block of 32 inputs, and a chat prompt's logits are
    transformers' dequantizing the same file (float32); every KV block comes back."""
    model, tokenizer = hf_smollm2
    llm = LLM(quantization="gguf", cache_dir=str(tmp_path / "cache"), dtype="float32", max_model_len=256,
              kv_cache_memory=32 << 20, progress=False)
    cfg = llm.engine.config.model
    assert (cfg.quantization, cfg.quantized_weights, cfg.quantization_group_size, cfg.quantization_zero_point) \
        == ("gguf", "int4", 32, True)
    leaves = {jax.tree_util.keystr(p): leaf
              for p, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params["layers"])}
    kernels = {k: v for k, v in leaves.items() if k.endswith("['kernel']")}
    assert kernels and all(v.dtype == quant.STORED["int4"] for v in kernels.values())
    for key, kernel in kernels.items():
        scale, zero = (leaves[key.replace("kernel", leaf)] for leaf in ("scale", "zero"))
        assert scale.dtype == zero.dtype == np.float32 and scale.shape == zero.shape
        assert scale.size * 16 == kernel.size  # a block of 32 inputs: 16 bytes
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    import torch

    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].double().numpy()
    assert_logits_close(paged_logits(llm, tokens), want, 1e-4, "Q4_1")
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0"])
def test_smollm2_requantized_to_q8_0_and_q4_0_gives_transformers_logits(ggml_type, tmp_path):
    """SmolLM2's GGUF with its decoder layers requantized by gguf-py to Q8_0 (int8 kept) and Q4_0 (int4, no zero
    points), served kept: the logits are transformers' dequantizing the same file (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpage.models.loader import default_model_path
    from tests.quantized_checkpoints import requantized_gguf

    path = requantized_gguf(default_model_path(), tmp_path / f"smollm2-{ggml_type}.gguf", ggml_type)
    llm = LLM(str(path), quantization="gguf", cache_dir=str(tmp_path / "cache"), dtype="float32",
              max_model_len=256, kv_cache_memory=32 << 20, progress=False)
    cfg = llm.engine.config.model
    assert (cfg.quantized_weights, cfg.quantization_zero_point) == gguf_quant.TYPES[ggml_type]
    tokens = llm.get_tokenizer()("The printing press spread across Europe in the")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].double().numpy()
    assert_logits_close(paged_logits(llm, tokens), want, 1e-4, ggml_type)


def test_gguf_kept_quantized_needs_a_gguf_file(tmp_path):
    from tests.factories import tiny_llama
    from tests.reference import save_random_model

    save_random_model(tiny_llama(), tmp_path / "float", SEED % 2**31)
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file"):
        LLM(str(tmp_path / "float"), cache_dir=str(tmp_path / "cache"), quantization="gguf", max_model_len=64)
