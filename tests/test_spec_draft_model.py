"""Speculative decoding's draft_model method (issue 26): a draft model of the target's vocabulary proposes k tokens
a step from its own runner and pool (the target's block ids), each drawn from its distribution q, which the
target's step verifies by rejection sampling. The sampler's rule against the target's law (chi-square; without
the residual's correction the same check fails); a tiny random Llama target with a bad draft (a tiny Llama of
other random weights) and a perfect one (itself): greedy tokens equal to a run without speculation, the perfect
draft accepted (nearly) always, greedy and sampled, the bad draft's proposals its own greedy continuation of the
target's tokens after rollbacks and preemptions (so its K/V follow the target's), every block back after aborts;
SmolLM2 drafting for itself (the only local model of its tokenizer): its greedy tokens, every draft accepted."""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from scipy import stats

from jaxpage.config import SpeculativeConfig
from jaxpage.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxpage.structured.manager import bitmask_words
from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch, sample
from tests.factories import TINY_LLAMA, engine_options, tiny_llama

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


def _sampling(rows: int, vocab: int, temperature: float, draft_ids=None, draft_probs=None) -> SamplingBatch:
    """Rows of one temperature, seeds 0..rows-1 at output index 0, no truncation, penalties or masks."""
    zeros, ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    return SamplingBatch(
        np.full(rows, temperature, np.float32), np.zeros(rows, np.int32), ones, zeros,
        np.arange(rows, dtype=np.uint32), np.zeros(rows, np.int32), zeros, zeros, ones, np.full((1, 8), -1, np.int32),
        np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.full((rows, MAX_BANNED), -1, np.int32),
        np.bool_(False), np.full((rows, bitmask_words(vocab)), -1, np.int32),
        np.full((rows, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((rows, MAX_LOGIT_BIAS), np.float32), None,
        draft_ids, draft_probs)


def test_rejection_sampling_of_drawn_drafts_gives_the_target_distribution():
    """Drafts drawn from a bad q (its mass where p has little), verified by the step's sampler: the emitted token
    follows p (chi-square over 20,000 seeded rows), a draft is accepted with probability sum(min(p, q)), and
    without the residual's correction (a rejected draft's token drawn from p afresh) the same check fails. The
    sampler's q of a draft model (with_probs) is the softmax at the row's temperature."""
    p = np.array([1.0, 8, 4, 3, 2, 2] + [0.2] * 18)
    q = np.array([6.0, 1, 1, 1, 4, 0.5] + [0.1] * 18)
    p, q = p / p.sum(), q / q.sum()
    vocab, n = len(p), 20_000
    drafts = np.random.default_rng(0).choice(vocab, size=n, p=q).astype(np.int32)
    logits = np.tile(np.log(p).astype(np.float32), (n, 1))
    batch = _sampling(n, vocab, 1.0, drafts, np.tile(q.astype(np.float32), (n, 1)))
    out = np.asarray(jax.jit(sample)(logits, batch).tokens)
    assert stats.chisquare(np.bincount(out, minlength=vocab), p * n).pvalue > 1e-4
    accepted, rate = out == drafts, np.minimum(p, q).sum()
    assert abs(accepted.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / n)
    fresh = np.asarray(jax.jit(sample)(logits, _sampling(n, vocab, 1.0)).tokens)  # draws from p, no draft
    assert stats.chisquare(np.bincount(fresh, minlength=vocab), p * n).pvalue > 1e-4
    wrong = np.where(accepted, drafts, fresh)
    assert stats.chisquare(np.bincount(wrong, minlength=vocab), p * n).pvalue < 1e-6
    q_out = jax.jit(sample, static_argnums=2)(logits[:4], _sampling(4, vocab, 0.7), True).probs
    expected = np.exp(np.log(p) / 0.7)
    np.testing.assert_allclose(np.asarray(q_out), np.tile(expected / expected.sum(), (4, 1)), rtol=1e-5)


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
# kv_cache_memory of the engines with a draft: blocks of both pools (the bad draft's: 12 of 8 + 4 KiB, few enough
# to preempt; the perfect draft's: 42 of 2 x 8 KiB, where the target alone would get 85)
BUDGETS = {"bad": 150_000, "perfect": 700_000}


@pytest.fixture(scope="module")
def llms(models):
    """Engines over the target: without speculation, with the bad draft (a pool small enough to preempt), with
    itself as the draft; those two sized by kv_cache_memory (BUDGETS)."""
    from jaxpage import LLM

    target, draft, _, cache = models
    plain = LLM(str(target), cache_dir=cache, **OPTIONS)
    bad, perfect = (LLM(str(target), cache_dir=cache, speculative_config=draft_config(path),
                        **{**OPTIONS, "num_kv_blocks": None, "kv_cache_memory": BUDGETS[name]})
                    for name, path in (("bad", draft), ("perfect", target)))
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


def _block_bytes(num_layers: int) -> int:
    """A float32 block of 16 tokens of a tiny Llama of that many layers: K and V of each KV head."""
    head_dim = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    return num_layers * 2 * TINY_LLAMA["num_key_value_heads"] * 16 * head_dim * 4


def test_the_drafts_pool_counts_in_kv_cache_memory(llms):
    """With a draft model, kv_cache_memory holds blocks of both pools (the draft's has the target's block ids):
    the device holds no more KV bytes than the budget."""
    _, bad, perfect = llms
    for llm, budget, draft_layers in ((bad, BUDGETS["bad"], 1), (perfect, BUDGETS["perfect"], 2)):
        engine, per_block = llm.engine, _block_bytes(2) + _block_bytes(draft_layers)
        assert engine.config.cache.num_kv_blocks == budget // per_block
        pools = (engine.runner.kv_pool, engine.drafter.runner.kv_pool)
        held = sum(a.nbytes for pool in pools for a in jax.tree.leaves(pool))
        assert held == engine.config.cache.num_kv_blocks * per_block <= budget


def _counts(llm) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_greedy_tokens_equal_those_without_speculation(llms):
    """Both drafts: the same greedy tokens (and log-probabilities) as without speculation; the perfect draft's
    drafts are all accepted, the bad draft's partly; the bad draft's small pool preempts; every block is back."""
    plain, bad, perfect = llms
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = plain.generate(_prompts(), greedy)
    for spec in (bad, perfect):
        before = _counts(spec)
        got = spec.generate(_prompts(), greedy)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        for e, g in zip(expected, got):
            assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-3)
        drafted, accepted = (a - b for a, b in zip(_counts(spec), before))
        assert drafted > 0 and (accepted == drafted if spec is perfect else accepted < drafted)
    assert bad.stats()["num_preemptions"] > 0
    for spec in (bad, perfect):
        s = spec.stats()
        assert s["num_free_blocks"] == s["num_blocks"]


def test_sampled_drafts_of_the_same_model_are_accepted(llms):
    """Sampling (temperature 0.9, top-k 5): the perfect draft's q is the target's p, so min(1, p/q) accepts
    (nearly) every draft; accepting only drafts equal to the target's own draw would accept sum(p^2) of them.
    The bad draft's run ends every request at its length with every block back."""
    _, bad, perfect = llms
    params = [SamplingParams(temperature=0.9, top_k=5, seed=i, max_tokens=16, ignore_eos=True) for i in range(6)]
    before = _counts(perfect)
    perfect.generate(_prompts(), params)
    drafted, accepted = (a - b for a, b in zip(_counts(perfect), before))
    assert drafted > 20 and accepted >= 0.97 * drafted, (accepted, drafted)
    out = bad.generate(_prompts(), params)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    s = bad.stats()
    assert s["num_free_blocks"] == s["num_blocks"]


def test_proposals_are_the_drafts_own_continuation_after_rollbacks(llms, models):
    """The bad draft, greedy (its drafts often rejected, the K/V of both models rolled back, and preempted in its
    small pool): each proposal is the draft model's own greedy continuation of the sequence as it stood (from an
    engine of the draft model alone), so the draft's K/V held exactly the sequence's accepted tokens at every
    step."""
    from jaxpage import LLM

    _, bad, _ = llms
    drafter, seen = bad.engine.drafter, []
    propose = drafter.propose

    def recording(scheduled):
        scheduled = propose(scheduled)
        seen.extend((list(s.seq.token_ids), list(s.spec_token_ids)) for s in scheduled if s.spec_token_ids)
        return scheduled

    drafter.propose = recording
    try:
        bad.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    finally:
        del drafter.propose
    assert len(seen) > 8
    _, draft, _, cache = models
    alone = LLM(str(draft), cache_dir=cache, **OPTIONS)
    expected = alone.generate([{"prompt_token_ids": ids} for ids, _ in seen],
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
    without speculation, (nearly) every draft accepted."""
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
    # the same model, greedy: a draft is rejected only where the two programs' float32 logits tie differently
    assert s["spec_decode_num_draft_tokens"] > 0
    assert s["spec_decode_num_accepted_tokens"] >= 0.95 * s["spec_decode_num_draft_tokens"], s
