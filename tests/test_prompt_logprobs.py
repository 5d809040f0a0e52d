"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) against transformers' float32 log-softmax.

At every prompt position, within 1e-4: the prompt token's own log-probability and the top N (their ids, where
the reference has no near-tie), the first entry None; on SmolLM2 and on a tiny random Llama (both the host
layer loop and the fused step), with prompts longer than the token budget (chunked prefill: the position whose
next token opens the next chunk included), beside requests that ask for none, with n = 2, after a prefix-cache
hit (a request that asks reads no cached block, others still do) and through recompute preemptions; every
block back. Bad values are refused naming the field.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpage import LLM, SamplingParams
from tests.factories import SEED, engine_options, tiny_llama
from tests.reference import save_random_model

ATOL = 1e-4
NEAR_TIE = 1e-3


def reference(model, ids: list[int]) -> np.ndarray:
    """transformers' float32 log-softmax at every position [len(ids), V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def check(entries, ids: list[int], ref: np.ndarray, k: int, context: str = "") -> None:
    """entries (RequestOutput.prompt_logprobs) against the reference: the first None, then at each position the
    prompt token's own log-probability and the top k (ids where the reference's k + 1 best are apart)."""
    assert entries is not None and len(entries) == len(ids) and entries[0] is None, context
    for i, (token, entry) in enumerate(zip(ids[1:], entries[1:])):
        row = ref[i]
        assert abs(entry[token] - row[token]) <= ATOL, (context, i, entry[token], row[token])
        best = np.argsort(-row)[:k + 1]
        top = sorted(entry.items(), key=lambda item: -item[1])[:k]
        assert len(entry) in (k, k + 1) and all(abs(v - row[t]) <= ATOL for t, v in entry.items()), (context, i)
        if np.all(np.diff(-row[best]) > NEAR_TIE):
            assert [t for t, _ in top] == best[:k].tolist(), (context, i, top, best)


def test_bad_values_are_refused_naming_the_field():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_smollm2_at_every_position_beside_other_requests(smollm2, hf_smollm2):
    """A 150-token prompt over SmolLM2's 64-token budget (three chunks), with 3 top ids, beside a short prompt with
    prompt_logprobs 0 and one that asks for none, and n = 2 sampled: every position as transformers'."""
    tokenizer = smollm2.get_tokenizer()
    long = tokenizer("The history of the printing press begins in the fifteenth century. " * 12)["input_ids"][:150]
    short = tokenizer("Paris is the capital of")["input_ids"]
    outs = smollm2.generate(
        [{"prompt_token_ids": long}, {"prompt_token_ids": short}, {"prompt_token_ids": short}],
        [SamplingParams(prompt_logprobs=3, max_tokens=2, n=2, temperature=1.0, seed=1),
         SamplingParams(prompt_logprobs=0, max_tokens=2, temperature=0), SamplingParams(max_tokens=2, temperature=0)])
    check(outs[0].prompt_logprobs, long, reference(hf_smollm2[0], long), 3, "long")
    check(outs[1].prompt_logprobs, short, reference(hf_smollm2[0], short), 0, "short")
    assert outs[2].prompt_logprobs is None and len(outs[0].outputs) == 2
    assert smollm2.stats()["num_free_blocks"] == smollm2.stats()["num_blocks"]


def test_smollm2_after_a_prefix_cache_hit(smollm2, hf_smollm2):
    """The same prompt three times: cached by the first, which asks for nothing; the second asks for prompt
    logprobs and gets every position (it read no cached block); the third asks for none and hits the cache."""
    ids = smollm2.get_tokenizer()("A prefix-cache hit must not drop a single position of the prompt. " * 5)["input_ids"]
    assert len(ids) > 2 * smollm2.engine.config.cache.block_size
    greedy = SamplingParams(max_tokens=1, temperature=0)
    smollm2.generate({"prompt_token_ids": ids}, greedy)
    hits = smollm2.stats()["prefix_cache_hits"]
    [out] = smollm2.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    check(out.prompt_logprobs, ids, reference(hf_smollm2[0], ids), 1, "after a hit")
    assert smollm2.stats()["prefix_cache_hits"] == hits
    smollm2.generate({"prompt_token_ids": ids}, greedy)
    assert smollm2.stats()["prefix_cache_hits"] > hits


@pytest.fixture(scope="module", params=[True, False], ids=["layer-loop", "fused-step"])
def tiny(request, tmp_path_factory):
    """(LLM, transformers model) of a tiny random Llama: a 16-token budget, 9 blocks of 16 tokens (preemptions);
    scan_layers on (the CPU's host layer loop) or off (the fused step, unrolled)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_random_model(tiny_llama(), path, seed=SEED)
    llm = LLM(str(path), cache_dir=str(tmp_path_factory.mktemp("cache")),
              **engine_options(max_model_len=128, scan_layers=request.param))
    return llm, model


def test_tiny_model_chunked_with_preemptions(tiny):
    """Three prompts of 40-50 tokens (each in 3-4 chunks of the 16-token budget) and 30 new tokens each, more than
    the 9-block pool holds (recompute preemptions): every position as transformers', every block back."""
    llm, model = tiny
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 47, 50)]
    params = SamplingParams(prompt_logprobs=5, max_tokens=30, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs):
        check(out.prompt_logprobs, p, reference(model, p), 5, f"seed {SEED}, {len(p)} tokens")
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
