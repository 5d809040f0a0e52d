"""Async scheduling on the real model: step N+1 scheduled and built while step N runs, its placeholder token ids
filled on the device from step N's samples, the host reading tokens a step late, gives the synchronous engine's
outputs exactly. (The scheduler side, over every feature and preemption, is tests/test_block_accounting.py.)"""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from jaxpage import SamplingParams
from jaxpage.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.structured_outputs import StructuredOutputsParams
from jaxpage.worker.step import substitute_placeholders
from tests.fake_engine import record_prompt_rows_ahead


def test_the_flag_is_vllms_and_on_by_default():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False


def test_steps_with_prompts_are_scheduled_ahead_except_on_a_cpu(smollm2):
    """Where the device is the host's own cores, the host's pass would compete with the step: only the decode
    fast path is scheduled ahead there (RESULTS.md, "Async scheduling of the steps that admit prompts")."""
    import jax
    assert smollm2.engine.config.scheduler.async_prompt_steps is (jax.default_backend() != "cpu")


def test_placeholders_take_the_previous_steps_tokens():
    """Against the plain rule: a placeholder at token i becomes sampled[rows[i]]; other ids stay."""
    rng = np.random.default_rng()
    ids = rng.integers(0, 1000, 16).astype(np.int32)
    at = rng.random(16) < 0.5
    ids[at] = PLACEHOLDER_TOKEN_ID
    sampled = rng.integers(0, 1000, 8).astype(np.int32)
    rows = rng.integers(0, 8, 16).astype(np.int32)
    expected = np.where(at, sampled[rows], ids)
    np.testing.assert_array_equal(np.asarray(substitute_placeholders(ids, sampled, rows)), expected)


def _requests(tokenizer) -> list[tuple[dict, SamplingParams]]:
    """The features async scheduling must keep exact, mixed in one batch, finishing at different steps."""
    def ids(text):
        return {"prompt_token_ids": tokenizer(text)["input_ids"]}
    return [
        (ids("The capital of France is"), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        (ids("def fibonacci(n):"), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),  # ends early
        (ids("Once upon a time"), SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=16, logprobs=2)),
        (ids("The three primary colors are"), SamplingParams(temperature=0, max_tokens=30, stop=[","])),
        (ids("Counting: 1, 2, 3,"), SamplingParams(temperature=0.8, seed=3, max_tokens=12,
                                                   stop_token_ids=[tokenizer(" 7")["input_ids"][-1]])),
        (ids("Les avantages du vélo"), SamplingParams(temperature=0.7, seed=11, max_tokens=10,
                                                     presence_penalty=0.6, min_tokens=4)),  # synchronous steps
        (ids("The answer is"), SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
            StructuredOutputsParams(regex=r" (yes|no)\.")))),  # synchronous steps
    ]


def _ends(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("features", ["plain", "all"])
def test_async_scheduling_gives_the_synchronous_outputs(smollm2, features):
    """The same tokens, text, finish and stop reasons and log-probabilities as synchronous scheduling (plain:
    greedy, seeded samples, n > 1, logprobs, stop strings and tokens, a request ending while others go on; all:
    with penalties and structured outputs, whose steps fall back to synchronous), every block back; most decode
    steps of the plain batch are scheduled while the one before runs."""
    engine = smollm2.engine
    requests = _requests(smollm2.get_tokenizer())
    requests = requests if features == "all" else requests[:5]
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    asked, schedule_ahead = [], engine.scheduler.schedule_ahead
    engine.scheduler.schedule_ahead = lambda: (out := schedule_ahead(), asked.append(out is not None))[0]
    try:
        engine.async_scheduling = False
        expected = _ends(smollm2.generate(prompts, params))
        engine.async_scheduling = True
        got = _ends(smollm2.generate(prompts, params))
    finally:
        engine.async_scheduling = engine.config.scheduler.async_scheduling
        del engine.scheduler.schedule_ahead
    assert got == expected
    assert engine.block_pool.num_free == engine.config.cache.num_kv_blocks - 1
    if features == "plain":
        assert sum(asked) > len(asked) // 2, f"only {sum(asked)} of {len(asked)} steps were scheduled ahead"


def test_a_request_ending_leaves_the_step_after_it_in_flight(smollm2):
    """On the decode fast path, a request ending when the step in flight is read does not make the step already
    launched after it synchronous: every engine step returns one step's tokens (never two for a request), the
    outputs are the synchronous engine's, every block back."""
    engine, tokenizer = smollm2.engine, smollm2.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer(text)["input_ids"]}
               for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]

    def run() -> tuple[dict, list[list[str]]]:
        for i, (prompt, max_tokens) in enumerate(zip(prompts, (4, 7, 11))):  # ending at different steps
            engine.add_request(f"e{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        done, calls = {}, []
        while engine.has_unfinished_requests():
            outs = engine.step()
            calls.append([o.request_id for o in outs])
            done.update({o.request_id: _ends([o]) for o in outs if o.finished})
        return done, calls

    try:
        engine.async_scheduling = False
        expected, _ = run()
        engine.async_scheduling = True
        got, calls = run()
    finally:
        engine.async_scheduling = engine.config.scheduler.async_scheduling
    assert got == expected and len(got) == len(prompts)
    assert all(len(ids) == len(set(ids)) for ids in calls), f"a step returned two tokens of a request: {calls}"
    assert engine.block_pool.num_free == engine.config.cache.num_kv_blocks - 1


def test_steps_admitting_prompts_beside_decodes_are_scheduled_ahead(smollm2):
    """Requests arriving while others decode (the served case): the step that adds a prompt beside the running
    decodes, and its first decode, are scheduled and launched while the step before runs, its placeholders
    filled on the device from that step's samples (a prompt's first token included); the outputs are the
    synchronous engine's, every block back."""
    engine, tokenizer = smollm2.engine, smollm2.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
             "Counting: 1, 2, 3,"]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=10, stop=[","], logprobs=1)]

    def run() -> tuple[dict, list[int]]:
        prompt_rows = record_prompt_rows_ahead(engine)
        done = {}
        try:
            for i, text in enumerate(texts):
                engine.add_request(f"r{i}", {"prompt_token_ids": tokenizer(text)["input_ids"]}, params[i % 3])
                for _ in range(2):
                    done.update({o.request_id: o for o in engine.step() if o.finished})
            while engine.has_unfinished_requests():
                done.update({o.request_id: o for o in engine.step() if o.finished})
        finally:
            vars(engine.scheduler).pop("schedule_ahead", None)  # the recording, where there was one
        return {k: _ends([v]) for k, v in done.items()}, prompt_rows

    try:
        engine.async_scheduling = False
        expected, _ = run()
        engine.async_scheduling = engine.scheduler.prompt_steps_ahead = True  # off by default on a CPU
        got, prompt_rows = run()
    finally:
        engine.async_scheduling = engine.config.scheduler.async_scheduling
        engine.scheduler.prompt_steps_ahead = engine.config.scheduler.async_prompt_steps
    assert got == expected and len(got) == len(texts)
    assert sum(n > 0 for n in prompt_rows) >= 3, f"prompts scheduled ahead: {prompt_rows}"
    assert engine.block_pool.num_free == engine.config.cache.num_kv_blocks - 1
