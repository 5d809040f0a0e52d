"""Qwen3, Mixtral and Qwen3-MoE against transformers (PyTorch, float32) on small, randomly initialised models.

Every run draws a fresh seed (set JAXPAGE_TEST_SEED to replay one); it is named in every assertion message.

For each architecture (GQA, head_dim != hidden / heads, tied or untied embeddings, q/k norms, top-2 of 4 or 8
experts), loaded from its Hugging Face directory (XLA attention, scanned layers) and from a GGUF file of the same
weights in llama.cpp's layout (a Pallas backend, interpreted, unrolled layers):
- greedy tokens through `LLM.generate` equal transformers' up to the reference's first near-tie;
- teacher-forced logits through the paged path agree with transformers' to REL_TOL, row by row;
- both loads give the same config and the same weights.
Mixtral with a sliding window shorter than the sequence matches too. The MoE block alone (top-3 of 8, Qwen3-MoE
without renormalised weights) matches transformers' block, and Qwen3-MoE configs with dense layers are refused.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

from jaxpage import LLM, SamplingParams
from jaxpage.models import config_from_hf, stack_layers
from jaxpage.models.moe import MoE
from tests.factories import SEED, Case, RandomModel, engine_options, random_model
from tests.gguf_writer import write_gguf
from tests.reference import (
    assert_greedy_matches,
    assert_logits_close_by_position,
    hf_greedy,
    hf_logits,
    paged_logits,
    save_random_model,
)

PROMPT_LEN = 17  # one block and one token
NEW_TOKENS = 10
# a 16-token budget: two compiled steps per engine, and the 17-token prompt's prefill is chunked
ENGINE_OPTIONS = engine_options(num_kv_blocks=16, max_num_seqs=2)
REL_TOL, ATOL = 1e-4, 1e-6

torch.set_num_threads(1)


def _common(**kw) -> dict:
    return dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-6, hidden_act="silu", hidden_size=64,
                num_attention_heads=4, head_dim=32, **kw)


CASES = [
    Case("qwen3-gqa2to1-hd32-tied-bias", Qwen3Config, _common(
        vocab_size=256, intermediate_size=128, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True),
        gguf_arch="qwen3", pallas_backend="pallas_tpu"),
    Case("mixtral-gqa4to1-top2of4-untied", MixtralConfig, _common(
        vocab_size=320, intermediate_size=64, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False), gguf_arch="llama", pallas_backend="pallas_gpu"),
    Case("qwen3moe-gqa2to1-top2of8-tied", Qwen3MoeConfig, _common(  # llama.cpp always renormalises the top-k
        vocab_size=256, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True), gguf_arch="qwen3moe",
        pallas_backend="pallas_tpu"),
]


@dataclasses.dataclass
class Built(RandomModel):
    llm: LLM  # from the Hugging Face directory, XLA attention
    gguf_llm: LLM  # from the GGUF file, a Pallas backend
    prompt: list[int]
    ref_tokens: list[int]
    ref_step_logits: np.ndarray

    def where(self) -> str:
        return f"[case={self.case.id} seed={self.seed}]"

    def check_tokens(self, got: list[int]) -> None:
        assert_greedy_matches(got, self.ref_tokens, self.ref_step_logits, context=self.where())

    def check_logits(self, got: np.ndarray, expected: np.ndarray) -> None:
        assert_logits_close_by_position(got, expected, REL_TOL, ATOL, context=self.where())


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def built(request, cache_dir, tmp_path_factory):
    m = random_model(CASES, request.param, tmp_path_factory)
    gguf_path = write_gguf(m.hf_dir, tmp_path_factory.mktemp(f"{m.case.id}-gguf") / "model.gguf", m.case.gguf_arch)
    llm = LLM(model=str(m.hf_dir), cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    gguf_llm = LLM(model=str(gguf_path), cache_dir=str(cache_dir), attention_backend=m.case.pallas_backend,
                   scan_layers=False, **ENGINE_OPTIONS)
    prompt = m.random_prompt(np.random.default_rng(m.seed), PROMPT_LEN)
    yield Built(m.case, m.seed, m.hf, m.hf_dir, llm, gguf_llm, prompt, *hf_greedy(m.hf, prompt, NEW_TOKENS))
    del llm, gguf_llm


def _greedy(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_engine_read_the_architecture(built):
    m, kw = built.llm.engine.config.model, built.case.kwargs
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (4, kw["num_key_value_heads"], 32)
    assert m.tie_word_embeddings == kw["tie_word_embeddings"]
    assert m.qk_norm == (built.case.config_cls is not MixtralConfig)
    assert m.num_experts == kw.get("num_experts", kw.get("num_local_experts", 0))
    assert m.layer_windows().max() == 0
    if m.num_experts:
        experts = stack_layers(built.llm.engine.runner.params)["layers"]["mlp"]["gate"]["kernel"]
        assert experts.shape == (2, m.num_experts, 64, kw.get("moe_intermediate_size", kw["intermediate_size"]))


def test_greedy_matches_transformers(built):
    built.check_tokens(_greedy(built.llm, built.prompt))


def test_teacher_forced_logits(built):
    seq = built.prompt + built.ref_tokens
    built.check_logits(paged_logits(built.llm, seq, seed=built.seed), hf_logits(built.hf, seq))


def test_gguf_load_is_the_same_model(built):
    """The GGUF file's config and weights are the directory's (its rms_norm_eps is stored as a float32)."""
    ours, theirs = built.gguf_llm.engine.config.model, built.llm.engine.config.model
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    a, b = (stack_layers(llm.engine.runner.params) for llm in (built.gguf_llm, built.llm))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{built.where()} {path}")


def test_gguf_pallas_greedy_matches_transformers(built):
    built.check_tokens(_greedy(built.gguf_llm, built.prompt))


def test_gguf_pallas_teacher_forced_logits(built):
    seq = built.prompt + built.ref_tokens
    got = paged_logits(built.gguf_llm, seq, seed=built.seed, backend=built.case.pallas_backend)
    built.check_logits(got, hf_logits(built.hf, seq))


def test_mixtral_sliding_window_matches_transformers(cache_dir, tmp_path):
    """A window of 8 tokens, shorter than the 27-token sequence, in every layer (Hugging Face directory, XLA)."""
    case = dataclasses.replace(CASES[1], id="mixtral-window8", kwargs={**CASES[1].kwargs, "sliding_window": 8})
    hf_config = MixtralConfig(**case.kwargs)
    model = save_random_model(hf_config, tmp_path, SEED)
    llm = LLM(model=str(tmp_path), cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    assert llm.engine.config.model.layer_windows().tolist() == [8, 8]
    prompt = [int(t) for t in np.random.default_rng(SEED).integers(0, hf_config.vocab_size, PROMPT_LEN)]
    built = Built(case, SEED, model, tmp_path, llm, None, prompt, *hf_greedy(model, prompt, NEW_TOKENS))
    built.check_tokens(_greedy(llm, prompt))
    seq = prompt + built.ref_tokens
    built.check_logits(paged_logits(llm, seq, seed=SEED), hf_logits(model, seq))

MOE_BLOCKS = {  # top-3 of 8 experts; Qwen3-MoE without renormalised top-k weights
    "mixtral": (MixtralConfig, dict(intermediate_size=48, num_local_experts=8)),
    "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                       norm_topk_prob=False)),
}


@pytest.mark.parametrize("model_type", list(MOE_BLOCKS))
def test_moe_block_matches_transformers(model_type):
    import importlib

    config_cls, kw = MOE_BLOCKS[model_type]
    hf_config = config_cls(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_experts_per_tok=3, **kw)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    block_cls = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock"}[model_type]
    gen = torch.Generator().manual_seed(SEED)
    block = getattr(modeling, block_cls)(hf_config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        x = torch.randn(1, 37, 64, generator=gen)
        expected = block(x)[0].numpy()

    cfg = config_from_hf(hf_config)
    f = cfg.moe_intermediate_size
    gate_up, down = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
    ours = MoE(cfg)
    ours.router.kernel[...] = block.gate.weight.detach().numpy().T
    ours.gate.kernel[...] = gate_up[:, :f].transpose(0, 2, 1)
    ours.up.kernel[...] = gate_up[:, f:].transpose(0, 2, 1)
    ours.down.kernel[...] = down.transpose(0, 2, 1)
    got = np.asarray(ours(x[0].numpy()))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                               err_msg=f"seed={SEED}")


@pytest.mark.parametrize("dense", [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)])
def test_qwen3_moe_with_dense_layers_is_refused(dense):
    hf_config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **dense)
    with pytest.raises(ValueError, match="dense MLP layers"):
        config_from_hf(hf_config)
