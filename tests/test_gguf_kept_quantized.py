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
    """Blocks written by gguf-py's quantizer (the K-quants by tests/gguf_k_quants.py, which gguf-py lacks): the
    signed values, scales and zero points read give gguf-py's dequantized weights, (value - zero) * scale, to
    float32 rounding; the values fit their kind; a symmetric type's zero points are 0."""
    import gguf

    from tests import gguf_k_quants

    kind = gguf.GGMLQuantizationType[ggml_type]
    w = np.random.default_rng(SEED).normal(size=(24, 512)).astype(np.float32)
    w[3, :256] = 0.75  # constant blocks: Q4_1 stores d = 0, a K-quant scales of 0
    w[5, :256] = 0
    blocks = (gguf_k_quants.quantize(w, ggml_type) if ggml_type in gguf_k_quants.QUANTIZERS
              else gguf.quants.quantize(w, kind))
    want = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    stored, group, asymmetric = gguf_quant.TYPES[ggml_type]
    got = gguf_quant.stored_values(blocks, ggml_type, w.shape)
    spread = {k: np.repeat(v, group, axis=1) for k, v in got.items() if k}
    values = got[""]
    assert np.array_equal(values, np.round(values))
    assert values.min() >= (-8 if stored == "int4" else -128)
    assert values.max() <= (7 if stored == "int4" else 127)
    assert asymmetric or not got["_zero_point"].any()
    dequantized = (values - spread["_zero_point"]) * spread["_scale"]
    np.testing.assert_allclose(dequantized, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.abs(want - w).max() < 0.15 * np.abs(w).max()  # the quantizer wrote a fair quantization of w


def test_each_projection_takes_a_kind_holding_all_its_types_or_refused():
    """A mix (Q4_K_M's) groups by fused Linear; each takes the widest kind, smallest group, any zero points."""
    found = gguf_quant.types_by_projection({
        "model.layers.0.self_attn.q_proj.weight": "Q4_K", "model.layers.0.self_attn.v_proj.weight": "Q6_K",
        "model.layers.0.self_attn.o_proj.weight": "Q4_K", "model.layers.1.self_attn.o_proj.weight": "Q4_K",
        "model.layers.0.mlp.down_proj.weight": "Q5_0", "model.layers.1.mlp.gate_proj.weight": "Q4_0"})
    assert found == {"qkv": ["Q4_K", "Q6_K"], "o": ["Q4_K"], "down": ["Q5_0"], "gate_up": ["Q4_0"]}
    fields = gguf_quant.quantized_weights({"quant_method": "gguf", "ggml_types": found})
    assert fields["quantized_projections"] == (("down", "int8", 32, False), ("gate_up", "int4", 32, False),
                                               ("o", "int4", 32, True), ("qkv", "int8", 16, True))
    assert (fields["quantized_weights"], fields["quantization_group_size"], fields["quantization_zero_point"]) \
        == ("int8", 16, True)
    with pytest.raises(ValueError, match="quantization='gguf' keeps the types .* this file's decoder Linears hold "
                                         "Q3_K, Q4_K"):
        gguf_quant.types_by_projection({"model.layers.0.mlp.up_proj.weight": "Q3_K",
                                        "model.layers.0.mlp.down_proj.weight": "Q4_K"})


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
    kind, _, zero = gguf_quant.TYPES[ggml_type]
    assert (cfg.quantized_weights, cfg.quantization_zero_point) == (kind, zero)
    tokens = llm.get_tokenizer()("The printing press spread across Europe in the")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].double().numpy()
    assert_logits_close(paged_logits(llm, tokens), want, 1e-4, ggml_type)


def _kernels_by_projection(llm) -> dict[str, tuple]:
    """Each decoder Linear's (kernel dtype, weights a scale covers, zero points held) in the engine's weights."""
    leaves = {jax.tree_util.keystr(p): leaf
              for p, leaf in jax.tree_util.tree_leaves_with_path(llm.engine.runner.params["layers"])}
    out = {}
    for key, kernel in leaves.items():
        if key.endswith("['kernel']"):
            values = kernel.size * (2 if kernel.dtype == quant.STORED["int4"] else 1)
            group = values // leaves[key.replace("kernel", "scale")].size
            zero = key.replace("kernel", "zero") in leaves
            out.setdefault(key.split("'")[-4], set()).add((kernel.dtype, group, zero))
    return {name: found.pop() for name, found in out.items() if len(found) == 1}


def test_smollm2_as_q4_k_m_kept_gives_transformers_logits(tmp_path):
    """SmolLM2 requantized as llama.cpp's Q4_K_M lays it out (576-column rows fall back to Q5_0 / Q8_0; ffn_down,
    1,536 columns, Q4_K and Q6_K by layer), served kept: each fused Linear stored in the kind that holds all its
    tensors (down: int8 in groups of 16 with zero points), and the logits are transformers' dequantizing the same
    file (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpage.models.loader import default_model_path
    from tests.gguf_k_quants import q4_k_m
    from tests.quantized_checkpoints import requantized_gguf

    path = requantized_gguf(default_model_path(), tmp_path / "smollm2-q4_k_m.gguf", q4_k_m(30))
    llm = LLM(str(path), quantization="gguf", cache_dir=str(tmp_path / "cache"), dtype="float32",
              max_model_len=256, kv_cache_memory=32 << 20, progress=False)
    assert llm.engine.config.model.quantized_projections == (
        ("down", "int8", 16, True), ("gate_up", "int8", 32, False), ("o", "int8", 32, False),
        ("qkv", "int8", 32, False))
    assert _kernels_by_projection(llm) == {"qkv": (np.int8, 32, False), "o": (np.int8, 32, False),
                                           "gate_up": (np.int8, 32, False), "down": (np.int8, 16, True)}
    tokens = llm.get_tokenizer()("The printing press spread across Europe in the")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].double().numpy()
    assert_logits_close(paged_logits(llm, tokens), want, 1e-4, "Q4_K_M")
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def _mixed_k_quants(name: str, cols: int) -> str:
    """Every K-quant, int4 where a Linear's tensors allow it: gate_up all Q4_K (int4), qkv Q4_K + Q6_K, o Q5_K,
    down Q4_K then Q6_K by layer."""
    layer, tensor = int(name.split(".")[1]), name.split(".")[2]
    return {"attn_v": "Q6_K", "attn_output": "Q5_K",
            "ffn_down": "Q4_K" if layer == 0 else "Q6_K"}.get(tensor, "Q4_K")


def test_k_quants_kept_int4_give_the_dequantized_files_logits(tmp_path):
    """A random Llama whose rows are multiples of 256, written as llama.cpp lays it out and requantized to a mix
    of K-quants: kept (gate_up int4 in groups of 32 with zero points, the others int8) its logits are those of the
    same file dequantized to float by gguf-py (float32); greedy tokens agree."""
    from jaxpage import SamplingParams
    from tests.factories import tiny_llama
    from tests.gguf_writer import write_gguf
    from tests.quantized_checkpoints import requantized_gguf
    from tests.reference import save_random_model

    save_random_model(tiny_llama(hidden_size=256, intermediate_size=512, head_dim=64), tmp_path / "hf", SEED % 2**31)
    float_file = write_gguf(tmp_path / "hf", tmp_path / "float.gguf", "llama")
    path = requantized_gguf(float_file, tmp_path / "mixed.gguf", _mixed_k_quants)
    options = dict(cache_dir=str(tmp_path / "cache"), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
                   progress=False)
    kept, dequantized = LLM(str(path), quantization="gguf", **options), LLM(str(path), **options)
    assert _kernels_by_projection(kept) == {"qkv": (np.int8, 16, True), "o": (np.int8, 32, True),
                                            "gate_up": (quant.STORED["int4"], 32, True), "down": (np.int8, 16, True)}
    tokens = np.random.default_rng(SEED).integers(1, 256, 40).tolist()
    assert_logits_close(paged_logits(kept, tokens), paged_logits(dequantized, tokens), 1e-4, "K-quants")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": tokens[:n]} for n in (5, 17, 40)]
    assert ([o.outputs[0].token_ids for o in kept.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in dequantized.generate(prompts, greedy)])


def test_gguf_kept_quantized_needs_a_gguf_file(tmp_path):
    from tests.factories import tiny_llama
    from tests.reference import save_random_model

    save_random_model(tiny_llama(), tmp_path / "float", SEED % 2**31)
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file"):
        LLM(str(tmp_path / "float"), cache_dir=str(tmp_path / "cache"), quantization="gguf", max_model_len=64)
