"""Presence, frequency and repetition penalties, against plain-loop references of vLLM's definitions: the
sampler's penalized logits over steps (each sequence's tokens kept on the device, new ones sent each step, slots
reused), and greedy generation on the real model against transformers' logits with the penalties applied. The
logit bias (OpenAI's logit_bias) against logits + bias, as the input rows holding it are reused."""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage import SamplingParams
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.distributed.vocab_shard import VocabShard
from jaxpage.sequence import Sequence, SequenceGroup
from jaxpage.worker.input_batch import InputBatch, build_batch
from jaxpage.worker.sampler import (
    _apply_penalties,
    is_plain_greedy,
    plain_greedy,
    plain_greedy_on_device,
    sample,
)
from tests.compiles import CompileCounter
from tests.reference import NEAR_TIE, hf_logits
from tests.fake_engine import stand_in_engine as make_engine


def penalized(logits: np.ndarray, token_ids: list[int], num_prompt: int, p: SamplingParams) -> np.ndarray:
    """vLLM's penalties, token by token: repetition over prompt and output tokens (divide a positive logit,
    multiply a negative one), frequency times each output token's count and presence once per output token."""
    out = np.array(logits, np.float64)
    for token in set(token_ids):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token, count in collections.Counter(token_ids[num_prompt:]).items():
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


PARAMS = [SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=0.7),
          SamplingParams(presence_penalty=-0.4), SamplingParams(),  # none: its row stays as it was
          SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
          SamplingParams(frequency_penalty=2.0, presence_penalty=0.5)]


def test_penalties_over_steps_match_the_reference_as_slots_are_reused():
    """Six sequences, at most four a step (max_num_seqs 4: four slots), in changing subsets: each slot is
    reclaimed and rewritten, each sequence's tokens reach the device by whole rows and by single appends."""
    config = make_engine(max_num_seqs=4, max_model_len=64).config
    vocab, rng = config.model.vocab_size, np.random.default_rng(0)
    state = InputBatch(config)
    seqs, groups = [], []
    for i, p in enumerate(PARAMS):
        prompt = rng.integers(0, vocab, int(rng.integers(3, 12))).tolist()
        seqs.append(Sequence(i, prompt, len(prompt), 64))
        groups.append(SequenceGroup(str(i), [seqs[-1]], p, i))
    subsets = [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 0], [4, 5, 0], [1, 2, 3, 4], [5, 3], [0, 1, 2, 3],
               [5, 4, 3, 2], [1, 0]]
    checked_rows = 0
    for subset in subsets:
        scheduled = []
        for i in subset:
            seq = seqs[i]
            seq.token_ids.append(int(rng.integers(0, vocab)))  # a token sampled since the last time it ran
            new = 1 if seq.num_computed_tokens else seq.num_tokens
            seq.num_computed_tokens = seq.num_tokens - new
            table = [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4]
            scheduled.append(ScheduledSeq(seq, new, groups[i], True, block_ids=table))
        batch, sampling = build_batch(config, scheduled, (), state)
        logits = rng.normal(size=(len(sampling.temperature), vocab)).astype(np.float32) * 3
        ours = np.asarray(_apply_penalties(jnp.asarray(logits), sampling, VocabShard(vocab, vocab)))
        for row, i in enumerate(subset):
            ref = penalized(logits[row], seqs[i].token_ids, seqs[i].num_prompt_tokens, PARAMS[i])
            np.testing.assert_allclose(ours[row], ref, rtol=1e-6, atol=1e-6, err_msg=f"sequence {i}")
            checked_rows += 1
        for seq in (seqs[i] for i in subset):
            seq.num_computed_tokens = seq.num_tokens
    assert checked_rows == sum(map(len, subsets))


def test_logit_bias_matches_logits_plus_bias_as_rows_are_reused():
    """Sixteen sequences, four a step, every other one biased (bans and boosts, with or without a forced token),
    so that rows of biased sequences are taken back and rewritten for unbiased ones: greedy tokens are
    argmax(logits + bias), the reported log-probabilities the unbiased ones."""
    config = make_engine(max_num_seqs=4, max_model_len=64).config
    vocab, rng = config.model.vocab_size, np.random.default_rng(1)
    state, sample_jitted = InputBatch(config), jax.jit(sample)
    for start in range(0, 16, 4):
        scheduled, biases = [], []
        for i in range(start, start + 4):
            ids = rng.choice(vocab, 5, replace=False).tolist()
            bias = {0: dict(zip(ids, (-100, 8, -3, 5, 100))), 2: dict(zip(ids, (-100, 8, -3, 5)))}.get(i % 4, {})
            prompt = rng.integers(0, vocab, 5).tolist()
            seq = Sequence(i, prompt, len(prompt), 64)
            params = SamplingParams(temperature=0, logit_bias=bias)
            scheduled.append(ScheduledSeq(seq, len(prompt), SequenceGroup(str(i), [seq], params, i), True,
                                          block_ids=[i + 1]))
            biases.append(bias)
        batch, sampling = build_batch(config, scheduled, (), state)
        logits = rng.normal(size=(len(sampling.temperature), vocab)).astype(np.float32) * 3
        sampled = sample_jitted(jnp.asarray(logits), sampling)
        for row, bias in enumerate(biases):
            ref = logits[row].astype(np.float64)
            ref[list(bias)] += list(bias.values())
            token = int(sampled.tokens[row])
            assert token == int(np.argmax(ref)), (start, row, bias)
            shifted = logits[row].astype(np.float64) - logits[row].max()
            np.testing.assert_allclose(float(sampled.logprobs[row]), shifted[token] - np.log(np.exp(shifted).sum()),
                                       rtol=1e-5, atol=1e-5)


def test_greedy_with_penalties_matches_transformers_and_compiles_nothing(smollm2, hf_smollm2):
    model, tokenizer = hf_smollm2
    prompt = tokenizer("The cat sat on the mat. The cat sat on the mat. The cat", add_special_tokens=True)["input_ids"]
    penalties = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.4, presence_penalty=0.3)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    counter = CompileCounter()
    counter.active = True
    outs = smollm2.generate([{"prompt_token_ids": prompt}] * 2, [penalties, plain])
    counter.active = False
    assert counter.events == [], f"compiled while serving: {counter.events}"
    for out, p in zip(outs, (penalties, plain)):
        ids = list(prompt)
        for step, token in enumerate(out.outputs[0].token_ids):
            ref = penalized(hf_logits(model, ids)[-1], ids, len(prompt), p)
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] < NEAR_TIE:
                break  # a near-tie in the reference: the rest may differ
            assert token == int(np.argmax(ref)), f"step {step} with {p}"
            ids.append(token)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids, "the penalties changed nothing"
    assert smollm2.engine.block_pool.num_free == smollm2.engine.config.cache.num_kv_blocks - 1



def test_plain_greedy_rows_take_the_short_sampler_with_sample_s_tokens_and_logprobs():
    """The step samples a batch of plain greedy rows with ``plain_greedy`` (argmax, log-softmax at it):
    such batches are recognised on the host (the layer loop) and on the device (one program) alike, any row asking for more (randomness, a penalty, a bias, a ban
    under min_tokens, top logprobs, a grammar's bitmask) sends the batch to ``sample``; and the short path's
    tokens and log-probabilities are the numpy reference's and ``sample``'s, ties to the lowest id included."""
    config = make_engine(max_num_seqs=4, max_model_len=64).config
    vocab, rng = config.model.vocab_size, np.random.default_rng(2)
    others = {"random": SamplingParams(temperature=0.8), "penalty": SamplingParams(temperature=0, presence_penalty=0.5),
              "repetition": SamplingParams(temperature=0, repetition_penalty=1.2),
              "bias": SamplingParams(temperature=0, logit_bias={3: 2.0}),
              "min_tokens": SamplingParams(temperature=0, min_tokens=4), "top": SamplingParams(temperature=0, logprobs=2)}

    def batch_of(params: list[SamplingParams], bitmask=None):
        scheduled = []
        for i, p in enumerate(params):
            seq = Sequence(i, rng.integers(0, vocab, 5).tolist(), 5, 64)
            scheduled.append(ScheduledSeq(seq, 5, SequenceGroup(str(i), [seq], p, i), True, block_ids=[i + 1]))
        return build_batch(config, scheduled, (2,), InputBatch(config), bitmask)[1]

    greedy = SamplingParams(temperature=0)
    on_device = jax.jit(plain_greedy_on_device)  # the one-program step's choice: the host's, on every batch
    plain = batch_of([greedy] * 3)
    assert is_plain_greedy(plain) and bool(on_device(plain))
    for name, p in others.items():
        batch = batch_of([greedy, p, greedy])
        assert not is_plain_greedy(batch) and not bool(on_device(batch)), name
    words = -(-vocab // 32)
    grammar = batch_of([greedy] * 3, np.where(np.arange(words) == 0, 5, -1)[None].repeat(3, 0))
    assert not is_plain_greedy(grammar) and not bool(on_device(grammar))
    logits = rng.normal(size=(len(plain.temperature), vocab)).astype(np.float32) * 3
    logits[1, [7, 11]] = logits[1].max() + 1  # a tie: the lower id wins, as jnp.argmax
    short, full = jax.jit(plain_greedy)(jnp.asarray(logits)), jax.jit(sample)(jnp.asarray(logits), plain)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    reference = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(short.tokens), np.argmax(logits, axis=1))
    np.testing.assert_array_equal(np.asarray(short.tokens), np.asarray(full.tokens))
    np.testing.assert_allclose(np.asarray(short.logprobs), reference[np.arange(len(logits)), np.argmax(logits, 1)],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(short.logprobs), np.asarray(full.logprobs), rtol=1e-6, atol=1e-6)
