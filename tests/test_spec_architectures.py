"""Speculative decoding on every architecture of the model layer (issue 26): a tiny random model of each (Llama, and
``factories.ARCHITECTURES``: q/k norms, biases, soft caps, sliding windows, local RoPE, MoE experts), drafting for
itself with the draft_model method, gives transformers' greedy tokens (up to a near tie of the reference's) with
every draft accepted, and every block comes back. Every draft is verified, so each architecture's verify step (a
chunk of k + 1 query tokens per row, the drafts' rows sampled) runs on every step. The n-gram and suffix methods
differ only in their host-side proposals, and use the same verify step (tests/test_spec_decode.py runs them on
Llama, tests/test_structured_outputs.py and test_spec_decode.py on SmolLM2)."""
from __future__ import annotations

import random

import pytest
import transformers

from jaxpage import LLM, SamplingParams
from tests.factories import ARCHITECTURES, SEED, engine_options, tiny_llama
from tests.reference import assert_greedy_matches, hf_greedy, save_random_model

NEW_TOKENS = 24


@pytest.mark.parametrize("name", ["LlamaConfig", *sorted(ARCHITECTURES)])
def test_self_drafted_greedy_tokens_equal_transformers(name, tmp_path_factory):
    config = tiny_llama() if name == "LlamaConfig" else getattr(transformers, name)(**ARCHITECTURES[name][0])
    path = tmp_path_factory.mktemp(name)
    model = save_random_model(config, path, SEED)
    rng = random.Random(SEED + 7)
    prompt = [rng.randrange(1, config.vocab_size) for _ in range(18)]
    ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
    llm = LLM(str(path), cache_dir=str(tmp_path_factory.mktemp("cache")), **engine_options(num_kv_blocks=16),
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert_greedy_matches(ours, ref, ref_logits, f"seed {SEED}, {name}")
    stats = llm.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert accepted == drafted >= NEW_TOKENS // 2, (drafted, accepted)
    assert stats["num_free_blocks"] == stats["num_blocks"]
