"""Gemma 2 and Gemma 3 (text) against transformers (PyTorch, float32, eager attention) on small random models.

Each architecture runs with its features on: sliding windows of 8 tokens under prompts of up to 29 tokens and
generations that cross them, local/global layer mixes, GQA or MQA, query_pre_attn_scalar != head_dim, scaled
embeddings, (1 + w) norms; Gemma 2 with attention and final logit soft caps and tied embeddings, Gemma 3 with q/k
norms, its own local RoPE base and linearly scaled global RoPE, untied. For each:
- greedy tokens through `LLM.generate` (three prompts in one call: chunked and mixed prefill) equal transformers'
  up to the reference's first near-tie (tests.reference);
- teacher-forced logits through a shuffled block table agree to REL_TOL relative, on the XLA path and on one
  Pallas backend (interpreted here), whose greedy tokens match too;
- a GGUF file written with the ``gguf`` package from the same weights, as llama.cpp's converter writes Gemma
  (norms stored as 1 + w, no q/k permutation), loads to the same config (but the query scale: llama.cpp's) and
  weights, and generates transformers' tokens with its layers unrolled (the other tests scan them).

Set JAXPAGE_TEST_SEED to replay a run's seed (named in every failure).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig

from jaxpage import LLM, SamplingParams
from jaxpage.models import architecture, stack_layers
from tests.factories import Case, RandomModel, engine_options, random_model
from tests.gguf_writer import write_gguf
from tests.reference import assert_greedy_matches, assert_logits_close, hf_greedy, hf_logits, paged_logits

WINDOW = 8
PROMPT_LENS = (3, 21, 29)
NEW_TOKENS = 16
PALLAS_TOKENS = 10  # interpreted kernels are slow on the CPU
REL_TOL = 1e-4
EPS = 2.0 ** -20  # exactly representable in the GGUF file's float32, so both loads read the same config
ENGINE_OPTIONS = engine_options(block_size=8, num_kv_blocks=40, max_num_batched_tokens=32)
SLIDING, FULL = "sliding_attention", "full_attention"

torch.set_num_threads(1)


CASES = [
    Case("gemma2-softcaps-gqa2to1-tied", Gemma2Config, dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=[SLIDING, FULL, SLIDING, FULL], attn_logit_softcapping=5.0, final_logit_softcapping=20.0,
        max_position_embeddings=128, rms_norm_eps=EPS, rope_theta=10000.0, tie_word_embeddings=True),
        "pallas_tpu", "gemma2"),
    Case("gemma3-qknorm-localrope-linear-mqa-untied", Gemma3TextConfig, dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=48, sliding_window=WINDOW,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL], max_position_embeddings=128, rms_norm_eps=EPS,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=False), "pallas_gpu", "gemma3"),
]


@dataclasses.dataclass
class Built(RandomModel):
    llm: LLM
    prompts: dict  # length -> prompt token ids
    _refs: dict = dataclasses.field(default_factory=dict)

    def ref(self, n: int, new_tokens: int = NEW_TOKENS):
        if (n, new_tokens) not in self._refs:
            self._refs[n, new_tokens] = hf_greedy(self.hf, self.prompts[n], new_tokens)
        return self._refs[n, new_tokens]

    def where(self, n: int, what: str = "") -> str:
        return f"[case={self.case.id} prompt len={n} seed={self.seed}{' ' + what if what else ''}]"

    def check_greedy(self, llm: LLM, lens: tuple[int, ...], new_tokens: int, what: str = "") -> None:
        outs = llm.generate([{"prompt_token_ids": self.prompts[n]} for n in lens],
                            SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        for n, out in zip(lens, outs):
            ref, ref_logits = self.ref(n, new_tokens)
            assert_greedy_matches(out.outputs[0].token_ids, ref, ref_logits, context=self.where(n, what))

    def check_logits(self, llm: LLM, n: int, backend: str) -> None:
        seq = self.prompts[n] + self.ref(n)[0]
        assert_logits_close(paged_logits(llm, seq, seed=self.seed, backend=backend), hf_logits(self.hf, seq),
                            REL_TOL, context=self.where(n, f"teacher-forced, {backend}"))


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def built(request, cache_dir, tmp_path_factory):
    m = random_model(CASES, request.param, tmp_path_factory)
    llm = LLM(model=str(m.hf_dir), cache_dir=str(cache_dir), **ENGINE_OPTIONS)
    rng = np.random.default_rng(m.seed)
    yield Built(m.case, m.seed, m.hf, m.hf_dir, llm, {n: m.random_prompt(rng, n) for n in PROMPT_LENS})
    del llm


def test_config_read_with_every_feature(built):
    m, kw = built.llm.engine.config.model, built.case.kwargs
    windows = [WINDOW if t == SLIDING else 0 for t in kw["layer_types"]]
    assert m.layer_windows().tolist() == windows
    assert m.query_pre_attn_scalar == kw["query_pre_attn_scalar"] != m.head_dim
    assert (m.attn_logit_softcap, m.final_logit_softcap) == (
        kw.get("attn_logit_softcapping"), kw.get("final_logit_softcapping"))
    assert m.qk_norm == (built.case.config_cls is Gemma3TextConfig)
    assert m.num_kv_heads < m.num_heads and m.hidden_act == "gelu_pytorch_tanh"
    assert ("lm_head" in built.llm.engine.runner.params) == (not kw["tie_word_embeddings"])
    if m.qk_norm:
        assert dict(m.local_rope_parameters) == {"rope_type": "default", "rope_theta": 10000.0}
        assert dict(m.rope_parameters) == {"rope_type": "linear", "factor": 4.0}


def test_greedy_matches_transformers_xla(built):
    built.check_greedy(built.llm, PROMPT_LENS, NEW_TOKENS, "xla")


@pytest.mark.parametrize("n", PROMPT_LENS[1:])
def test_teacher_forced_logits_xla(built, n):
    built.check_logits(built.llm, n, "xla")


def test_pallas_backend_matches_transformers(built, cache_dir):
    backend = built.case.pallas_backend
    llm = LLM(model=str(built.hf_dir), cache_dir=str(cache_dir), attention_backend=backend, **ENGINE_OPTIONS)
    assert llm.engine.config.attention_backend == backend
    built.check_greedy(llm, PROMPT_LENS[1:2], PALLAS_TOKENS, backend)
    built.check_logits(llm, PROMPT_LENS[-1], backend)


def test_gguf_loads_same_config_weights_and_tokens(built, cache_dir, tmp_path):
    """Same weights and config, except the query scale: llama.cpp's Gemma files hold no query_pre_attn_scalar
    and llama.cpp scales by head_dim (hidden/heads for the 27B models), so the reference here does too."""
    path = tmp_path / f"{built.case.id}.gguf"
    write_gguf(built.hf_dir, path, built.case.gguf_arch)
    llm = LLM(model=str(path), cache_dir=str(cache_dir), scan_layers=False, **ENGINE_OPTIONS)  # layers unrolled
    cfg, hf_cfg = llm.engine.config.model, built.llm.engine.config.model
    assert cfg.query_pre_attn_scalar == cfg.head_dim
    assert dataclasses.replace(cfg, query_pre_attn_scalar=hf_cfg.query_pre_attn_scalar) == hf_cfg
    ours, theirs = dict(_leaves(stack_layers(llm.engine.runner.params))), dict(_leaves(stack_layers(built.llm.engine.runner.params)))
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(theirs[name]), rtol=0, atol=1e-7, err_msg=name)
    ref_model = type(built.hf).from_pretrained(built.hf_dir, query_pre_attn_scalar=cfg.head_dim,
                                               attn_implementation="eager", dtype=torch.float32).eval()
    n = PROMPT_LENS[1]
    out = llm.generate([{"prompt_token_ids": built.prompts[n]}],
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    ref, ref_logits = hf_greedy(ref_model, built.prompts[n], NEW_TOKENS)
    assert_greedy_matches(out.outputs[0].token_ids, ref, ref_logits, context=built.where(n, "gguf"))


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, tree


@pytest.mark.parametrize("arch,layers,full_layers,scalar", [
    ("gemma2", 4, [1, 3], 32), ("gemma2", 46, list(range(1, 46, 2)), 64 // 4),
    ("gemma3", 12, [5, 11], 32), ("gemma3", 62, list(range(5, 62, 6)), 64 // 4)])
def test_gguf_fields_follow_llama_cpp_without_keys(arch, layers, full_layers, scalar):
    """Files without a pattern key: llama.cpp's every 2nd (Gemma 2) or 6th (Gemma 3) layer global, as
    transformers' default layer_types; the 27B models (46, 62 layers) scale queries by hidden_size / heads."""
    metadata = {f"{arch}.block_count": layers, f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 64,
                f"{arch}.attention.key_length": 32}
    fields = architecture("gemma2" if arch == "gemma2" else "gemma3_text").gguf_fields(metadata)
    assert [i for i, t in enumerate(fields["layer_types"]) if t == FULL] == full_layers
    assert fields["query_pre_attn_scalar"] == scalar
    config_cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    assert fields["layer_types"] == config_cls(num_hidden_layers=layers).layer_types


def per_group_gain(cfg, tokens: int, block_size: int = 16) -> float:
    """KV blocks a sequence of ``tokens`` holds with one pool (every layer keeps every block) over those with one
    pool per layer group (vLLM's hybrid KV cache manager: a local layer keeps only the ceil(W / bs) + 1 blocks its
    window can still see). The arithmetic of the deleted benchmarks/hybrid_kv.py (in git history)."""
    windows = cfg.layer_windows()
    blocks = -(-tokens // block_size)
    per_group = blocks * int((windows == 0).sum())
    for w in set(windows[windows > 0].tolist()):
        per_group += min(blocks, -(-w // block_size) + 1) * int((windows == w).sum())
    return blocks * cfg.num_layers / per_group


def test_hybrid_kv_per_group_pools_bounds():
    """Per-group pools save nothing up to the window and approach layers / global layers beyond it (Gemma 2 9B:
    1:1 local:global, window 4096; Gemma 3 12B: 5:1, window 1024; as published)."""
    from jaxpage.models import config_from_hf

    common = dict(vocab_size=1024, max_position_embeddings=32768)
    gemma2 = config_from_hf(Gemma2Config(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                         num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                         sliding_window=4096, **common))
    gemma3 = config_from_hf(Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                             num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                             sliding_window=1024, **common))
    assert per_group_gain(gemma3, 1024) == per_group_gain(gemma2, 4096) == 1.0
    assert 5 < per_group_gain(gemma3, 32768) < 6
    assert 1.5 < per_group_gain(gemma2, 32768) < 2
