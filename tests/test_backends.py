"""End to end: every attention backend gives the real model's greedy tokens (Pallas ones interpreted here)."""
from __future__ import annotations

import pytest

from jaxpage import LLM, SamplingParams
from tests.reference import assert_greedy_matches

NEW_TOKENS = 12  # interpreted kernels are slow on the CPU: a short, real check


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_smollm2_greedy_tokens_equal_xla_and_transformers(backend, smollm2, hf_smollm2, hf_smollm2_greedy):
    _, tokenizer = hf_smollm2
    prompts = ["The capital of France is", "Les couleurs de l'arc-en-ciel sont"]  # two sequences in one batch
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(attention_backend=backend, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256,
              dtype="float32", kv_cache_memory=64 << 20, progress=False)
    assert llm.engine.config.attention_backend == backend
    # SmolLM2's head_dim 64: the pallas_tpu backend packs K and V into one 128-lane row (pallas_kernels.packed)
    assert llm.engine.runner.kv_pool.ndim == (5 if backend == "pallas_tpu" else 6)
    ours = llm.generate(prompts, params)
    xla = smollm2.generate(prompts, params)
    for prompt, out, ref_out in zip(prompts, ours, xla):
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids, prompt
        ref, ref_logits = hf_smollm2_greedy(tokenizer(prompt)["input_ids"], NEW_TOKENS)
        assert_greedy_matches(out.outputs[0].token_ids, ref, ref_logits, context=f"{backend}: {prompt}")


def test_unknown_backend_is_refused():
    from jaxpage.attention.backends import resolve_backend

    with pytest.raises(ValueError, match="attention_backend='cuda'"):
        resolve_backend("cuda")
    assert resolve_backend("auto") == "xla"  # on this CPU
