"""jaxpage against Hugging Face transformers (PyTorch, float32) on small, randomly initialised models.

Every run draws a fresh seed (set JAXPAGE_TEST_SEED to replay one); it is named in every assertion message.

For each architecture variant (MHA, GQA 3:1 and 4:1, MQA, Qwen2 q/k/v bias, Mistral without a window, Llama with
attention_bias; tied and untied embeddings; head_dim 64 and 128) and prompts of 1, block_size-1, block_size and
block_size+1 tokens:
- greedy generation through `LLM.generate` is token-identical to a greedy loop in transformers with full
  recomputation, up to the first step where the reference's two top logits lie within reference.NEAR_TIE (a divergence
  from there on is a near-tie, not a failure);
- teacher-forced logits through the paged path (forward_hidden over a shuffled block table) agree with
  transformers' to REL_TOL relative, row by row;
- eight prompts in one `generate` call (mixed and chunked prefill, different max_tokens) each match their
  single-prompt reference.
An unsupported architecture (GPT-2) is refused with a ValueError that names it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig, Qwen2Config

from jaxpage import LLM, SamplingParams
from jaxpage.models import TokenBatch, compute_logits, forward_hidden, stack_layers, unstack_layers
from tests.factories import SEED, Case, RandomModel, engine_options, random_model
from tests.reference import assert_logits_close_by_position, first_near_tie, hf_greedy

BLOCK_SIZE = 16
PROMPT_LENS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1)
NEW_TOKENS = 20
MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 32  # 8 sequences of <= 3 blocks each, plus the null block: no preemption
ENGINE_OPTIONS = engine_options(block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8,
                                max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
REL_TOL = 1e-4  # teacher-forced logits: max|jax - torch| <= REL_TOL * max|torch| + ATOL, per position
ATOL = 1e-6
TF_TOKENS = 48  # teacher-forced batches are padded to this many tokens

torch.set_num_threads(1)  # tiny matmuls; leaves the other core to XLA


def _common(**kw) -> dict:
    return dict(num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                hidden_act="silu", **kw)


CASES = [
    Case("llama-mha-hd64-untied", LlamaConfig, _common(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64, tie_word_embeddings=False)),
    Case("llama-gqa3to1-hd64-tied", LlamaConfig, _common(
        vocab_size=256, hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, tie_word_embeddings=True)),
    Case("llama-gqa4to1-hd128-untied", LlamaConfig, _common(  # num_heads * head_dim (1024) != hidden_size
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, tie_word_embeddings=False)),
    Case("llama-mqa-hd128-tied", LlamaConfig, _common(
        vocab_size=320, hidden_size=256, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, tie_word_embeddings=True)),
    Case("llama-attnbias-gqa2to1-hd64-untied", LlamaConfig, _common(  # q/k/v and o_proj biases
        vocab_size=288, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, attention_bias=True, tie_word_embeddings=False)),
    Case("qwen2-gqa2to1-hd64-untied", Qwen2Config, _common(
        vocab_size=448, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, tie_word_embeddings=False)),
    Case("qwen2-mqa-hd128-tied", Qwen2Config, _common(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, tie_word_embeddings=True)),
    Case("mistral-gqa4to1-hd64-nowindow-untied", MistralConfig, _common(
        vocab_size=320, hidden_size=128, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, sliding_window=None, tie_word_embeddings=False)),
]


@dataclasses.dataclass
class Built(RandomModel):
    llm: LLM
    prompts: dict  # name -> prompt token ids
    _refs: dict = dataclasses.field(default_factory=dict)

    def ref(self, name: str) -> tuple[list[int], np.ndarray]:
        if name not in self._refs:
            self._refs[name] = hf_greedy(self.hf, self.prompts[name], NEW_TOKENS)
        return self._refs[name]

    def where(self, name: str) -> str:
        return f"[case={self.case.id} prompt={name} len={len(self.prompts[name])} seed={self.seed}]"

    def check_tokens(self, name: str, got: list[int], max_tokens: int = NEW_TOKENS) -> None:
        ref_tokens, step_logits = self.ref(name)
        assert len(got) == max_tokens, f"{self.where(name)} generated {len(got)} tokens, expected {max_tokens}"
        n = min(first_near_tie(step_logits), max_tokens)
        for i in range(n):
            if got[i] != ref_tokens[i]:
                top2 = np.sort(step_logits[i])[-2:]
                pytest.fail(f"{self.where(name)} greedy divergence at step {i} (no near-tie before it): "
                            f"jaxpage {got[i]} vs transformers {ref_tokens[i]} (reference top-2 gap "
                            f"{top2[1] - top2[0]:.3g}, reference logit of jaxpage's token "
                            f"{step_logits[i][got[i]]:.6g} vs max {top2[1]:.6g})\n"
                            f"jaxpage:      {got}\ntransformers: {ref_tokens}")


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def built(request, cache_dir, tmp_path_factory):
    m = random_model(CASES, request.param, tmp_path_factory)
    # every other case unrolls its layers, so both layouts run every engine test below
    llm = LLM(model=str(m.hf_dir), cache_dir=str(cache_dir), scan_layers=CASES.index(m.case) % 2 == 0,
              **ENGINE_OPTIONS)
    rng = np.random.default_rng(m.seed)
    # "a" prompts for the single-prompt tests, "b" extra ones for the batched test
    prompts = {f"{tag}{n}": m.random_prompt(rng, n) for tag in "ab" for n in PROMPT_LENS}
    yield Built(m.case, m.seed, m.hf, m.hf_dir, llm, prompts)
    del llm


def test_engine_matches_config(built):
    """The engine read the architecture as intended (guards the cases against silently testing less)."""
    m, kw = built.llm.engine.config.model, built.case.kwargs
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (
        kw["num_attention_heads"], kw["num_key_value_heads"], kw["head_dim"])
    assert m.tie_word_embeddings == kw["tie_word_embeddings"]
    assert m.qkv_bias == (built.case.config_cls is Qwen2Config or kw.get("attention_bias", False))
    assert ("lm_head" in built.llm.engine.runner.params) == (not kw["tie_word_embeddings"])


@pytest.mark.parametrize("prompt_len", PROMPT_LENS, ids=[f"len{n}" for n in PROMPT_LENS])
def test_greedy_matches_transformers(built, prompt_len):
    name = f"a{prompt_len}"
    out = built.llm.generate([{"prompt_token_ids": built.prompts[name]}],
                             SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert len(out) == 1 and out[0].prompt_token_ids == built.prompts[name], built.where(name)
    built.check_tokens(name, out[0].outputs[0].token_ids)


@functools.partial(jax.jit, static_argnums=0)
def _paged_logits(model_cfg, params, pool, batch):
    hidden, _ = forward_hidden(model_cfg, params, pool, batch)
    return compute_logits(model_cfg, params, hidden)


@pytest.mark.parametrize("prompt_len", PROMPT_LENS, ids=[f"len{n}" for n in PROMPT_LENS])
def test_teacher_forced_logits(built, prompt_len):
    """Prompt plus the reference continuation, all in one prefill through a shuffled block table."""
    check_teacher_forced_logits(built, prompt_len, built.llm.engine.runner.params)


def test_teacher_forced_logits_other_layer_layout(built):
    """The same weights in the other layout than the engine's (stacked and scanned, or unrolled) agree too."""
    params = built.llm.engine.runner.params
    unrolled = unstack_layers(params) is params
    assert unrolled  # on a CPU either way: scan_layers=True loops over one compiled layer from the host
    other = stack_layers(params) if unrolled else unstack_layers(params)
    check_teacher_forced_logits(built, PROMPT_LENS[-1], other)


def check_teacher_forced_logits(built, prompt_len, params):
    name = f"a{prompt_len}"
    seq = built.prompts[name] + built.ref(name)[0]
    with torch.no_grad():
        expected = built.hf(torch.tensor([seq]), use_cache=False).logits[0].float().numpy()

    cfg = built.llm.engine.config
    bs, t = cfg.cache.block_size, len(seq)
    rng = np.random.default_rng(built.seed + prompt_len)
    table = rng.permutation(np.arange(1, cfg.cache.num_kv_blocks))[:-(-t // bs)].astype(np.int32)
    positions = np.arange(t, dtype=np.int32)
    # Row 0 is the sequence; padding up to TF_TOKENS (one compile for every length) writes to the null block
    # and belongs to row 1, an all-null table row, as the engine pads its batches.
    pad = TF_TOKENS - t
    block_tables = np.zeros((2, cfg.max_blocks_per_seq), np.int32)
    block_tables[0, :len(table)] = table
    batch = TokenBatch(
        token_ids=np.asarray(seq + [0] * pad, np.int32),
        positions=np.concatenate([positions, np.zeros(pad, np.int32)]),
        slot_mapping=np.concatenate([table[positions // bs] * bs + positions % bs, np.zeros(pad, np.int32)]),
        token_seq=np.concatenate([np.zeros(t, np.int32), np.ones(pad, np.int32)]),
        block_tables=block_tables, logits_indices=np.zeros(2, np.int32))
    pool = jnp.zeros_like(built.llm.engine.runner.kv_pool)
    got = np.asarray(_paged_logits(cfg.step_model, params, pool, batch))[:t]
    assert_logits_close_by_position(got, expected, REL_TOL, ATOL,
                                    context=f"{built.where(name)} (block table {table.tolist()})")


def test_batched_mixed_prefill_matches_single(built):
    """Eight prompts in one generate call: 98 prompt tokens over a 64-token budget, so the first steps mix
    whole prefills, a chunked prefill and decodes; max_tokens differ so sequences finish at different steps."""
    names = ["a17", "b1", "a15", "b16", "a1", "b17", "a16", "b15"]
    max_tokens = [NEW_TOKENS, 9, NEW_TOKENS, 14, 5, NEW_TOKENS, 1, 17]
    outs = built.llm.generate(
        [{"prompt_token_ids": built.prompts[n]} for n in names],
        [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in max_tokens])
    assert len(outs) == len(names)
    for name, k, out in zip(names, max_tokens, outs):
        assert out.prompt_token_ids == built.prompts[name], f"{built.where(name)} outputs out of order"
        built.check_tokens(name, out.outputs[0].token_ids, max_tokens=k)


def test_unsupported_architecture_is_refused(tmp_path, cache_dir):
    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="gpt2"):
        LLM(model=str(tmp_path), cache_dir=str(cache_dir), **ENGINE_OPTIONS)
