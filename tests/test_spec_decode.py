"""Speculative decoding (issue 26), n-gram first: the config and its flag, the n-gram proposer, the rejection
sampler's law against the target's (a wrong correction fails the same check), greedy and seeded tokens of a tiny
random Llama equal to a run without speculation, and, over the block-accounting harness's fake runner with
drafts it accepts for a while and then rejects, every stop rule inside an accepted run, rollbacks that return
every block, and outputs equal to a run without speculation."""
from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from scipy import stats

from jaxpage.config import SpeculativeConfig
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jaxpage.spec_decode.ngram_proposer import propose_ngram
from jaxpage.spec_decode.rejection_sampler import emitted_tokens
from jaxpage.structured.manager import bitmask_words
from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch, sample
from tests.factories import engine_options, tiny_llama
from tests.fake_engine import (
    VOCAB,
    check_all_free,
    make_engine,
    play,
    run_checked,
    scenarios,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
# One fixed tiny model: the checks that some drafts are accepted and some rejected hold for most random models, not
# every one (a random seed failed CI once with no draft of the fp8 pool accepted).
MODEL_SEED = 1234


# --- the config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("options, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "draft": 1}, "speculative_config"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 0},
     "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2},
     "suffix_decoding_min_token_prob"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "speculative_config.disable_by_batch_size"),
])
def test_bad_speculative_config_is_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(options)


def test_speculative_config_flag_and_vllm_defaults():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 4}']))
    assert SpeculativeConfig.from_dict(args.speculative_config) == SpeculativeConfig("ngram", 4, 5, 5)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1]"])
    engine = make_engine(num_kv_blocks=20, speculative=2)
    assert engine.async_scheduling and engine.config.speculative_config.num_speculative_tokens == 2
    assert make_engine(num_kv_blocks=20).scheduler.drafts is None  # off by default


def test_ngram_proposer_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [7, 1]  # the latest of two 3-gram hits
    assert propose_ngram([5, 1, 2, 8, 6, 2], 1, 3, 3) == [8, 6, 2]  # only a 1-gram occurred before
    assert propose_ngram([5, 1, 2, 8, 6, 2], 2, 3, 3) == []  # no 2-gram did
    assert propose_ngram([4, 4, 4], 1, 2, 5) == [4]  # what follows the match, up to the end
    assert propose_ngram([1, 2], 1, 3, 0) == []


# --- the rejection sampler's law --------------------------------------------------------------------
def _sampling(rows: int, vocab: int, temperature: float, seeds: np.ndarray, steps: np.ndarray) -> SamplingBatch:
    zeros, ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
    return SamplingBatch(
        np.full(rows, temperature, np.float32), np.zeros(rows, np.int32), ones, zeros, seeds.astype(np.uint32),
        steps.astype(np.int32), zeros, zeros, ones, np.full((1, 8), -1, np.int32), np.zeros(rows, np.int32),
        np.zeros(rows, np.int32), np.full((rows, MAX_BANNED), -1, np.int32), np.bool_(False),
        np.full((rows, bitmask_words(vocab)), -1, np.int32), np.full((rows, MAX_LOGIT_BIAS), -1, np.int32),
        np.zeros((rows, MAX_LOGIT_BIAS), np.float32))


def test_rejection_sampling_gives_the_target_distribution():
    """A deliberately bad draft (a token of probability 0.05) and a good one (0.4), verified as the engine does: the
    target's token sampled at each draft position by the step's sampler (its seed's key at that output index),
    then rejection_sampler.emitted_tokens. The first emitted token follows the target's law (chi-square), the
    draft is accepted with probability p(draft), and the token after an accepted draft follows the target's law
    too. A sampler without the residual's correction (accept with p(draft), else the target's token drawn
    afresh) fails the same test."""
    p = np.array([1.0, 8, 4, 3, 2, 2] + [0.2] * 18)  # a vocabulary of 24 (the sampler's top 20 need 20)
    p /= p.sum()
    vocab, n = len(p), 20_000
    logits = np.tile(np.log(p).astype(np.float32), (2 * n, 1))
    seeds = np.repeat(np.arange(n), 2)  # row 2i: request i's draft position (output index 0), 2i + 1: after it
    steps = np.tile([0, 1], n)
    drawn = np.asarray(jax.jit(sample)(logits, _sampling(2 * n, vocab, 1.0, seeds, steps)).tokens).reshape(n, 2)
    for draft in (0, 1):
        out = [emitted_tokens([draft], list(row)) for row in drawn.tolist()]
        first = np.bincount([o[0] for o in out], minlength=vocab)
        assert stats.chisquare(first, p * n).pvalue > 1e-4, (draft, first)
        accepted = np.array([len(o) == 2 for o in out])
        assert abs(accepted.mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
        after = np.bincount([o[1] for o in out if len(o) == 2], minlength=vocab)
        assert stats.chisquare(after, p * after.sum()).pvalue > 1e-4, (draft, after)
    rng = np.random.default_rng(0)  # the wrong sampler: no residual, so the draft's token is drawn too often
    wrong = np.where(rng.random(n) < p[0], 0, drawn[:, 0])
    assert stats.chisquare(np.bincount(wrong, minlength=vocab), p * n).pvalue < 1e-6


# --- a tiny random Llama, with and without speculation ------------------------------------------------
@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """Three engines over the same tiny random Llama: without speculation, with n-gram speculation of 3 tokens
    and with suffix decoding of up to 3 (async scheduling, the default, in each)."""
    from jaxpage import LLM
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_model(tiny_llama(), path, seed=MODEL_SEED)
    cache = str(tmp_path_factory.mktemp("cache"))
    options = engine_options(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=40)
    return (LLM(str(path), cache_dir=cache, **options),
            LLM(str(path), cache_dir=cache, speculative_config=NGRAM, **options),
            LLM(str(path), cache_dir=cache, speculative_config=SUFFIX, **options))


def _prompts() -> list[dict]:
    """Prompts with repeats, so that the n-gram lookup finds drafts (some right, some wrong)."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(5):
        motif = [int(t) for t in rng.integers(0, 256, 3 + i)]
        out.append({"prompt_token_ids": (motif * (4 + i))[:30] + [int(t) for t in rng.integers(0, 256, i)]})
    return out


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_and_seeded_tokens_equal_those_without_speculation(llms, method):
    plain, spec = llms[0], llms[1 if method == "ngram" else 2]
    before = spec.stats()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_k=3, seed=i, max_tokens=16, ignore_eos=True, logprobs=1)
              for i in range(5)]
    for params in (greedy, seeded):
        expected, got = plain.generate(_prompts(), params), spec.generate(_prompts(), params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        for e, g in zip(expected, got):
            assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-3)
    after = spec.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)  # some drafts accepted, some rejected
    assert sum(after["spec_decode_num_accepted_tokens_per_pos"]) == after["spec_decode_num_accepted_tokens"]
    assert after["num_free_blocks"] == after["num_blocks"]


def test_penalized_rows_speculate_and_keep_the_tokens_of_a_run_without(smollm2, smollm2_ngram):
    """Frequency, presence and repetition penalties with n-gram drafts on SmolLM2, over outputs that repeat one
    token until its penalty outweighs it: each draft position's penalties count the drafts before it
    (SamplingBatch.history_extra), so greedy and seeded tokens and log-probabilities equal the shared engine's
    without speculation, and penalized rows speculate (drafts accepted). Without the drafts counted, 4 of these
    5 cases end elsewhere (checked)."""
    prompts = ["Laughing: ha ha ha ha ha ha ha ha ha ha ha ha", "Count: 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,"]
    before = smollm2_ngram.engine.stats()["spec_decode_num_accepted_tokens"]
    for temperature, frequency in ((0.0, 0.8), (0.0, 1.0), (0.0, 1.2), (0.7, 0.4), (0.7, 0.8)):
        params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=24, frequency_penalty=frequency,
                                 presence_penalty=0.1, repetition_penalty=1.05, logprobs=1) for seed in range(2)]
        expected, got = smollm2.generate(prompts, params), smollm2_ngram.generate(prompts, params)
        for e, g in zip(expected, got):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids, (temperature, frequency, e.outputs[0].text)
            assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-3)
    stats = smollm2_ngram.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] - before >= 20
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_pools_speculate_with_the_tokens_of_a_run_without(kv_cache_dtype, tmp_path_factory):
    """n-gram speculation over an int8 (values and scales) or fp8 KV pool: a verification's K/V, written and
    rolled back in the quantized pool, gives the greedy and seeded tokens of the same pool without speculation."""
    from jaxpage import LLM
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp(f"tiny-llama-{kv_cache_dtype}")
    save_random_model(tiny_llama(), path, seed=MODEL_SEED)
    options = engine_options(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=40,
                             kv_cache_dtype=kv_cache_dtype)
    plain, spec = LLM(str(path), **options), LLM(str(path), speculative_config=NGRAM, **options)
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                   [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(5)]):
        expected, got = plain.generate(_prompts(), params), spec.generate(_prompts(), params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_suffix_decoding_drafts_from_an_earlier_requests_output(llms):
    """Suffix decoding's global tree: a prompt without repeats asked again drafts the first answer's tokens from
    the tree of earlier outputs, so the second run accepts more drafts than the first, its tokens the same
    (greedy) as without speculation."""
    plain, _, suffix = llms
    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(11).permutation(256)[:20]]}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    accepted = []
    for _ in range(2):
        before = suffix.stats()["spec_decode_num_accepted_tokens"]
        assert suffix.generate([prompt], params)[0].outputs[0].token_ids == expected
        accepted.append(suffix.stats()["spec_decode_num_accepted_tokens"] - before)
    assert accepted[1] > accepted[0] and accepted[1] >= 8, accepted


# --- the fake runner: stop rules inside accepted runs, rollbacks, accounting ------------------------------
class LetterTokenizer:
    """Token t is the letter chr(97 + t): stop strings over the fake runner's tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t) for t in ids)


def _run(speculative: int, requests: list[tuple[list[int], SamplingParams]]):
    engine = make_engine(num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32, speculative=speculative,
                         async_scheduling=False)
    return _run_recording(engine, requests), engine


def _run_recording(engine, requests: list[tuple[list[int], SamplingParams]], record=None) -> dict:
    """Each request's ends (tokens, text in letters, finish and stop reasons, log-probabilities) run on
    ``engine``, calling record(scheduled, previous) at each step's launch; every block checked back."""
    engine.tokenizer = engine.output_processor.tokenizer = LetterTokenizer()
    if record is not None:
        launch = engine.runner.launch

        def recording(scheduled, bitmask=None, previous=None):
            record(scheduled, previous)
            return launch(scheduled, bitmask, previous)
        engine.runner.launch = recording
    for i, (prompt, p) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    done = run_checked(engine)
    check_all_free(engine)
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
                  for c in out.outputs] for rid, out in done.items()}


def test_stop_rules_inside_an_accepted_run_end_it_there():
    """max_tokens, EOS, stop token ids and stop strings (with and without the string in the output), met inside a
    run of accepted drafts, end the sequence at that token as without speculation: the same tokens, text,
    finish and stop reasons and log-probabilities; every block comes back."""
    prompts = [[1 + (i * 5 + j) % (VOCAB - 1) for j in range(6 + i)] for i in range(6)]
    free = [(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts)]
    plain, _ = _run(0, free)
    requests = []
    for i, (prompt, p) in enumerate(free):
        tokens, text = plain[f"r{i}"][0][0], plain[f"r{i}"][0][1]
        cut = 5 + 3 * i  # a stop a few tokens in
        rule = [dict(max_tokens=cut), dict(ignore_eos=False), dict(stop_token_ids=[tokens[cut]]),
                dict(stop=[text[cut:cut + 2]]), dict(stop=[text[cut:cut + 3]], include_stop_str_in_output=True),
                dict(max_tokens=cut, stop=[text[cut - 2:cut]], logprobs=2)][i]
        requests.append((prompt, dataclasses.replace(p, **rule)))
    expected, _ = _run(0, requests)
    got, engine = _run(3, requests)
    assert got == expected
    assert {rid: ends[0][2] for rid, ends in got.items()}["r3"] == "stop"
    spec = engine.stats()
    assert spec["spec_decode_num_accepted_tokens"] > 0 and spec["spec_decode_num_accepted_tokens_per_pos"][2] > 0


@settings(max_examples=30, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_speculation_keeps_the_accounting_and_the_outputs(scenario):
    """The block-accounting harness's scenarios (forks, beams, penalties, min_tokens, stop tokens, EOS, both
    preemption modes, prefix caching, aborts, LoRA) with 3 draft tokens a step: after every action the pool, the
    host slots and the queues check out (rejected drafts' blocks rolled back), every block is back at the end,
    and each request that ran to its end in both runs (not aborted) ends as without speculation."""
    setup, actions = scenario
    actions = [(a[0], a[1], dataclasses.replace(a[2], seed=i if a[2].seed is None else a[2].seed), *a[3:])
               if a[0] == "add" else a for i, a in enumerate(actions)]
    expected = play(make_engine(**setup, async_scheduling=False), actions)
    engine = make_engine(**setup, speculative=3)
    got = play(engine, actions)
    ends = {rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in out.outputs]
            for rid, out in got.items()}
    for rid in set(expected) & set(got):
        reasons = {c.finish_reason for c in expected[rid].outputs + got[rid].outputs}
        if "abort" not in reasons:
            assert ends[rid] == [(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob)
                                 for c in expected[rid].outputs], rid
    event(f"accepted drafts: {engine.stats()['spec_decode_num_accepted_tokens'] > 0}")


def test_disable_by_batch_size_drafts_only_below_that_many_running_sequences():
    """vLLM's disable_by_batch_size (3): over the fake runner, no step of 3 or more running sequences carries a
    draft, steps with fewer do once requests finish, and the outputs are a run's without speculation."""
    requests = [([1 + (i * 5 + j) % (VOCAB - 1) for j in range(6 + i)],
                 SamplingParams(temperature=0.0, max_tokens=8 + 10 * i, ignore_eos=True, seed=i)) for i in range(4)]
    expected, _ = _run(0, requests)
    engine = make_engine(num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32, speculative=3,
                         disable_by_batch_size=3)
    steps = []  # (running sequences, whether a row has drafts) per step
    got = _run_recording(engine, requests, lambda scheduled, _: steps.append(
        (engine.scheduler.num_running_seqs(), any(s.spec_token_ids for s in scheduled))))
    assert got == expected
    assert not any(drafts for running, drafts in steps if running >= 3), steps
    assert any(drafts for running, drafts in steps if running < 3), steps


def test_metrics_carry_the_acceptance_counters():
    """/metrics: vLLM's spec_decode_* counters, per draft position too, as LLM.stats() counts them."""
    from prometheus_client import generate_latest

    from serving.metrics import Metrics

    _, engine = _run(3, [([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])
    s = engine.stats()
    text = generate_latest(Metrics(engine.stats, lambda: "m").registry).decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'jaxpage:spec_decode_{name}_total{{model_name="m"}} {float(s["spec_decode_" + name])}' in text
    for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
        assert (f'jaxpage:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} '
                f'{float(n)}') in text
    assert s["spec_decode_num_drafts"] > 0 and "spec_decode" not in generate_latest(
        Metrics(make_engine(num_kv_blocks=20).stats, lambda: "m").registry).decode()


# --- async scheduling with speculation ------------------------------------------------------------------
def test_async_scheduling_runs_plain_steps_ahead_and_drafts_one_step_late():
    """With speculation, async scheduling stays on: a step without drafts is left in flight and the next one
    scheduled meanwhile, its drafts proposed one step late (the proposal after the tokens before the one in
    flight, its first token the guess of that one); a step with drafts is read before the next is built. Over
    the fake runner (drafts right for a while, then wrong): both kinds of steps launched ahead happen, the
    tokens, finish reasons and log-probabilities equal a synchronous run without speculation's, and every block
    comes back."""
    requests = [([1 + (i * 7 + j) % (VOCAB - 1) for j in range(5 + i)],
                 SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=30 + i, ignore_eos=i != 3, seed=i))
                for i in range(5)]
    expected, _ = _run(0, requests)
    engine = make_engine(num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=32, speculative=3)
    assert engine.async_scheduling
    launched = []  # every step's launch
    drafts = engine.scheduler.drafts.proposer.propose  # no draft in every third step: plain steps happen too
    engine.scheduler.drafts.proposer.propose = lambda seq, k: drafts(seq, k) if len(launched) % 3 else []
    ahead = []  # for each step launched while the one before ran: whether it carries drafts

    def record(scheduled, previous):
        launched.append(previous)
        if previous is not None:
            ahead.append(any(s.spec_token_ids for s in scheduled))
    assert _run_recording(engine, requests, record) == expected
    assert True in ahead and False in ahead, ahead
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_data_parallel_stats_sum_the_acceptance_per_position():
    """The data-parallel front end's stats add each replica's accepted tokens position by position (and
    concatenate the requests' latencies)."""
    from jaxpage.engine.data_parallel import merge_stats

    replicas = [_run(3, [([1, 2, 3, 4, 5][:n], SamplingParams(temperature=0.0, max_tokens=20 + n,
                                                               ignore_eos=True))])[1].stats() for n in (3, 5)]
    merged = merge_stats(replicas)
    key = "spec_decode_num_accepted_tokens_per_pos"
    assert merged[key] == [a + b for a, b in zip(replicas[0][key], replicas[1][key])] and len(merged[key]) == 3
    assert merged["spec_decode_num_drafts"] == sum(r["spec_decode_num_drafts"] for r in replicas)
    assert len(merged["requests"]) == 2
