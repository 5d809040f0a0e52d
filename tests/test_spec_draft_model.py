"""Speculative decoding's draft_model method (issue 26): a draft model of the target's vocabulary proposes k tokens
a step from its own runner and pool (the target's block ids). A tiny random Llama target with a bad draft (a
tiny Llama of other random weights) and a perfect one (itself): greedy and seeded tokens equal to a run without
speculation, the perfect draft always accepted, the draft's proposals its own greedy continuation of the
target's tokens after rollbacks and preemptions (so its K/V follow the target's), every block back after aborts;
SmolLM2 drafting for itself (the only local model of its tokenizer): its greedy tokens, every draft accepted."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxpage.config import SpeculativeConfig
from jaxpage.sampling_params import SamplingParams
from tests.factories import engine_options, tiny_llama

K = 3


def draft_config(path, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("options, field", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "speculative_config.draft_tensor_parallel_size"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "speculative_config.model"),
])
def test_bad_draft_model_config_is_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(options)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, bad draft of the same vocabulary, a draft of another vocabulary, cache directory)."""
    from tests.reference import save_random_model

    paths = [tmp_path_factory.mktemp(name) for name in ("target", "draft", "other-vocab")]
    seed = random.randrange(2**31)
    save_random_model(tiny_llama(), paths[0], seed=seed)
    save_random_model(tiny_llama(num_hidden_layers=1), paths[1], seed=seed + 1)
    save_random_model(tiny_llama(vocab_size=128, num_hidden_layers=1), paths[2], seed=seed + 2)
    return (*paths, str(tmp_path_factory.mktemp("cache")))


OPTIONS = engine_options(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=40)


@pytest.fixture(scope="module")
def llms(models):
    """Engines over the target: without speculation, with the bad draft (a pool small enough to preempt), with
    itself as the draft."""
    from jaxpage import LLM

    target, draft, _, cache = models
    plain = LLM(str(target), cache_dir=cache, **OPTIONS)
    bad = LLM(str(target), cache_dir=cache, speculative_config=draft_config(draft),
              **{**OPTIONS, "num_kv_blocks": 12})
    perfect = LLM(str(target), cache_dir=cache, speculative_config=draft_config(target), **OPTIONS)
    return plain, bad, perfect


def _prompts(n: int = 6) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(0, 256, 5 + 7 * i)]} for i in range(n)]


def test_a_draft_of_another_vocabulary_or_path_is_refused(models):
    from jaxpage import LLM

    target, _, other, cache = models
    for path, message in ((other, "vocabulary"), (target / "missing", "does not exist")):
        with pytest.raises(ValueError, match=f"speculative_config.model.*{message}"):
            LLM(str(target), cache_dir=cache, speculative_config=draft_config(path), **OPTIONS)


def _counts(llm) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_greedy_and_seeded_tokens_equal_those_without_speculation(llms):
    """Both drafts: the same greedy and seeded tokens (and log-probabilities) as without speculation; the perfect
    draft's greedy drafts are all accepted, the bad draft's partly; the bad draft's small pool preempts; every
    block is back."""
    plain, bad, perfect = llms
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_k=5, seed=i, max_tokens=12, ignore_eos=True, logprobs=1)
              for i in range(6)]
    for params in (greedy, seeded):
        expected = plain.generate(_prompts(), params)
        for spec in (bad, perfect):
            before = _counts(spec)
            got = spec.generate(_prompts(), params)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
            for e, g in zip(expected, got):
                assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-3)
            drafted, accepted = (a - b for a, b in zip(_counts(spec), before))
            if spec is perfect and params is greedy:
                assert drafted > 0 and accepted == drafted
            elif spec is bad:
                assert 0 <= accepted < drafted
    assert bad.stats()["num_preemptions"] > 0
    for spec in (bad, perfect):
        s = spec.stats()
        assert s["num_free_blocks"] == s["num_blocks"]


def test_proposals_are_the_drafts_own_continuation_after_rollbacks(llms):
    """The perfect draft under sampling (its argmax drafts rejected often, the K/V of both models rolled back):
    each proposal is the target's own greedy continuation of the sequence as it stood (from the engine without
    speculation), so the draft's K/V held exactly the sequence's accepted tokens at every step."""
    plain, _, perfect = llms
    drafter, seen = perfect.engine.drafter, []
    propose = drafter.propose

    def recording(scheduled):
        propose(scheduled)
        seen.extend((list(s.seq.token_ids), list(s.spec_token_ids)) for s in scheduled if s.spec_token_ids)

    drafter.propose = recording
    try:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True) for i in range(4)]
        perfect.generate(_prompts(4), params)
    finally:
        del drafter.propose
    assert len(seen) > 8
    expected = plain.generate([{"prompt_token_ids": ids} for ids, _ in seen],
                              [SamplingParams(temperature=0.0, max_tokens=len(d), ignore_eos=True) for _, d in seen])
    assert [d for _, d in seen] == [o.outputs[0].token_ids for o in expected]


def test_aborts_return_every_block(llms):
    _, bad, _ = llms
    engine = bad.engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for step in range(12):
        engine.step()
        if step in (2, 5, 8):
            engine.abort_request(f"abort-{step // 3}")
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s["num_free_blocks"] == s["num_blocks"]


def test_smollm2_drafting_for_itself_gives_its_greedy_tokens(smollm2):
    """SmolLM2 with itself as the draft (no smaller model of its tokenizer is here): the tokens of the engine
    without speculation, every draft accepted."""
    from jaxpage import LLM
    from jaxpage.models.loader import default_model_path
    from tests.factories import SMOLLM2_OPTIONS

    spec = LLM(**SMOLLM2_OPTIONS, speculative_config=draft_config(default_model_path(), k=4))
    tokenizer = smollm2.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
               for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected, got = smollm2.generate(prompts, params), spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    s = spec.stats()
    assert s["spec_decode_num_draft_tokens"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
