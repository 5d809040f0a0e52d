"""The partial-prefill options (core/prefill_limits.py: long_prefill_token_threshold, max_num_partial_prefills,
max_long_partial_prefills) over the fake runner of tests/fake_engine.py, which checks every step against the
options and the token budget (check_prefill_limits): decodes keep their token every step while prompts arrive,
a short prompt overtakes long ones waiting for the long slot, and every prompt still finishes. With wave_prefill
a step with fewer decodes than prompts to compute has no caps: a wave of arrivals starts at once."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpage.core.prefill_limits import PrefillLimits
from jaxpage.sampling_params import SamplingParams
from tests.fake_engine import VOCAB, check_all_free, make_engine, run_checked

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, VOCAB, n)]


@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("threshold, partial, long", [(0, 1, 1), (8, 1, 1), (8, 2, 1), (4, 3, 2)])
def test_decodes_get_a_token_every_step_while_prompts_arrive(threshold, partial, long, wave):
    """Four requests decode while six 40-token prompts arrive: every step gives each decoding request its
    token (each step's prefills are checked against the options, or with wave_prefill only against the budget
    while they outnumber the decodes), and every request finishes."""
    rng = np.random.default_rng(0)
    engine = make_engine(num_kv_blocks=60, max_num_seqs=10, max_num_batched_tokens=16,
                         long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
                         max_long_partial_prefills=long, wave_prefill=wave)
    for i in range(4):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt(rng, 3)},
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    counts = {f"d{i}": 0 for i in range(4)}
    while min(counts.values()) < 1:
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    for i in range(6):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt(rng, 40)}, GREEDY)
    for _ in range(12):
        outs = {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
        for request_id, before in counts.items():
            assert outs.get(request_id) == before + 1, f"{request_id} got no token in a prefill step"
            counts[request_id] += 1
    finished = run_checked(engine)
    assert all(len(finished[f"p{i}"].outputs[0].token_ids) == GREEDY.max_tokens for i in range(6))
    check_all_free(engine)


def test_short_prompt_overtakes_long_ones_waiting_for_the_long_slot():
    """max_long_partial_prefills=1 of 2: while one long prompt prefills, a second long one waits and the short
    prompt behind it is admitted first (vLLM's jump of the queue); the second long prompt still finishes."""
    rng = np.random.default_rng(1)
    engine = make_engine(num_kv_blocks=60, max_num_seqs=8, max_num_batched_tokens=16,
                         long_prefill_token_threshold=6, max_num_partial_prefills=2, max_long_partial_prefills=1,
                         wave_prefill=False)
    for request_id, n in (("long0", 40), ("long1", 40), ("short", 5)):
        engine.add_request(request_id, {"prompt_token_ids": prompt(rng, n)}, GREEDY)
    first_token: dict[str, int] = {}
    for step in range(60):
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, step)
        if len(first_token) == 3:
            break
    assert first_token["short"] < first_token["long0"] < first_token["long1"], first_token
    run_checked(engine)
    check_all_free(engine)


def test_one_prefill_a_step_admits_every_queued_prompt_in_turn():
    """max_num_partial_prefills=1 with nothing decoding: one prompt starts per step, in arrival order, and
    none starves."""
    rng = np.random.default_rng(2)
    engine = make_engine(num_kv_blocks=60, max_num_seqs=8, max_num_batched_tokens=64, max_num_partial_prefills=1,
                         wave_prefill=False)
    for i in range(5):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt(rng, 6)}, GREEDY)
    first_token: dict[str, int] = {}
    for step in range(10):
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, step)
    start = first_token["r0"]  # 1 where the engine schedules prompt steps ahead: its outputs come a step late
    assert start <= 1 and first_token == {f"r{i}": start + i for i in range(5)}
    run_checked(engine)
    check_all_free(engine)


def first_token_steps(engine, request_ids, max_steps: int = 40) -> dict[str, int]:
    """The step at which each request's first token came out."""
    first: dict[str, int] = {}
    for step in range(max_steps):
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
        if set(request_ids) <= set(first):
            break
    return {r: first[r] for r in request_ids}


@pytest.mark.parametrize("decoding, wave", [(1, True), (7, True), (1, False)])
def test_a_wave_of_prompts_outnumbering_the_decodes_starts_at_once(decoding, wave):
    """Six 5-token prompts arrive beside `decoding` running requests (threshold 4, two partial prefills). With
    wave_prefill and one decode, they outnumber it: the caps are lifted and all six prompts compute in one step
    (their first tokens come out together). Beside seven decodes, or without wave_prefill, the caps hold: at most
    two prompts a step, each 4 tokens at most, so the first tokens come out over at least three steps. The
    decodes get a token every step either way."""
    rng = np.random.default_rng(3)
    engine = make_engine(num_kv_blocks=80, max_num_seqs=16, max_num_batched_tokens=64,
                         long_prefill_token_threshold=4, max_num_partial_prefills=2, max_long_partial_prefills=1,
                         wave_prefill=wave)
    for i in range(decoding):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt(rng, 2)},
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    first_token_steps(engine, [f"d{i}" for i in range(decoding)])
    for i in range(6):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt(rng, 5)}, GREEDY)
    steps = set(first_token_steps(engine, [f"p{i}" for i in range(6)]).values())
    if wave and decoding < 6:
        assert len(steps) == 1, steps
    else:
        assert len(steps) >= 3, steps
    assert all(len(o.outputs[0].token_ids) == 40 for r, o in run_checked(engine).items() if r.startswith("d"))
    check_all_free(engine)


def test_a_backlog_deeper_than_the_free_rows_keeps_the_caps():
    """Three requests decode in four rows while ten 9-token prompts queue: only one prompt can run at a time,
    so it does not outnumber the decodes and every chunk beside them keeps to the threshold (4), with
    prefill_into_padding off (below)."""
    rng = np.random.default_rng(4)
    engine = make_engine(num_kv_blocks=80, max_num_seqs=4, max_num_batched_tokens=64,
                         long_prefill_token_threshold=4, max_num_partial_prefills=2, max_long_partial_prefills=1,
                         prefill_into_padding=False)
    for i in range(3):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt(rng, 2)},
                           SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    first_token_steps(engine, [f"d{i}" for i in range(3)])
    for i in range(10):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt(rng, 9)},
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        return out
    engine.scheduler.schedule = recorded
    finished = run_checked(engine)
    assert len(finished) == 13 and chunks and max(chunks) == 4, chunks
    check_all_free(engine)


@pytest.mark.parametrize("into_padding", [True, False])
def test_a_capped_chunk_fills_its_steps_padding(into_padding):
    """Seven requests decode while an 18-token prompt arrives (threshold 8; token buckets 1, 8, 16, 24, 32):
    7 decodes and an 8-token chunk make 15 tokens, padded to 16, so with prefill_into_padding each chunk takes
    9 and the prompt computes in two steps, against three (8, 8, 2) without. Every decode gets its token each
    step, and every block comes back."""
    rng = np.random.default_rng(5)
    engine = make_engine(num_kv_blocks=80, max_num_seqs=8, max_num_batched_tokens=32,
                         long_prefill_token_threshold=8, prefill_into_padding=into_padding)
    assert engine.config.token_buckets() == [1, 8, 16, 24, 32]
    for i in range(7):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt(rng, 2)},
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    first_token_steps(engine, [f"d{i}" for i in range(7)])
    engine.add_request("p", {"prompt_token_ids": prompt(rng, 18)}, GREEDY)
    chunks: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend(s.num_new_tokens for s in out.scheduled if s.seq.seq_id == prompt_seq.seq_id
                      and s.num_new_tokens > 1)
        return out
    prompt_seq = engine.scheduler.waiting[-1].seqs[0]
    engine.scheduler.schedule = recorded
    first_token_steps(engine, ["p"])
    assert chunks == ([9, 9] if into_padding else [8, 8, 2]), chunks
    assert all(len(o.outputs[0].token_ids) == 30 for r, o in run_checked(engine).items() if r.startswith("d"))
    check_all_free(engine)


def test_for_step_lifts_the_caps_only_when_prompts_outnumber_decodes():
    config = make_engine(num_kv_blocks=20, long_prefill_token_threshold=8, max_num_partial_prefills=2).config
    capped = PrefillLimits.for_step(config, decodes=3, prefills=3)
    assert (capped.threshold, capped.max_prefills, capped.max_long) == (8, 2, 1)
    lifted = PrefillLimits.for_step(config, decodes=2, prefills=3)
    assert (lifted.threshold, lifted.max_prefills, lifted.decodes_left) == (0, config.scheduler.max_num_seqs, 2)
    no_wave = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, wave_prefill=False))
    off = PrefillLimits.for_step(no_wave, decodes=0, prefills=5)
    assert (off.threshold, off.max_prefills) == (8, 2)


def test_tokens_for_keeps_the_decodes_still_to_come():
    """A prefill earlier in the running queue than three decodes leaves them their tokens; past the threshold a
    chunk is capped, and a prompt is long only with more than the threshold left."""
    limits = PrefillLimits(threshold=0, max_prefills=2, max_long=1, decodes_left=3)
    assert limits.tokens_for(100, budget=16) == 13
    assert [limits.tokens_for(1, budget) for budget in (3, 2, 1)] == [1, 1, 1]
    capped = PrefillLimits(threshold=8, max_prefills=2, max_long=1)
    assert capped.tokens_for(8, budget=16) == 8 and not capped.long  # exactly the threshold: not long
    assert capped.tokens_for(30, budget=16) == 8 and capped.long == 1
    assert not capped.can_start(5)  # two prefills already
    assert PrefillLimits(threshold=8, max_prefills=2, max_long=1, long=1).can_start(5)
    assert not PrefillLimits(threshold=8, max_prefills=2, max_long=1, long=1).can_start(9)


@pytest.mark.parametrize("options, field", [
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max_long_partial_prefills"),
    ({"max_long_partial_prefills": 0}, "max_long_partial_prefills"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
])
def test_bad_partial_prefill_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        make_engine(num_kv_blocks=20, **options)


def test_several_partial_prefills_default_the_threshold_to_4_percent_of_max_model_len():
    """vLLM's SchedulerConfig rule: max_num_partial_prefills > 1 without a threshold sets it to 4 % of
    max_model_len."""
    engine = make_engine(num_kv_blocks=20, max_model_len=64, long_prefill_token_threshold=0,
                         max_num_partial_prefills=2)
    assert engine.config.scheduler.long_prefill_token_threshold == int(64 * 0.04) == 2
