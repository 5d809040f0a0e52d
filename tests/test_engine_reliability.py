"""Issue 17 at the engine core, over the model-less stand-in engine (fast) and a tiny random model:

- a request whose host-side work raises (a beam score with a length_penalty past validation) ends alone with an
  error, the other request in the batch finishes, every block comes back;
- float edge values (inf, NaN, 1e39, denormals, extreme length penalties) are refused naming the field;
- fairness: one request may hold at most max_seqs_per_request sequences, and multi-sequence requests together at
  most that many slots, so a short request arriving while one or two monopolising n-sample requests are queued
  or running finishes within its own max_tokens steps (+1 for its prefill); without the cap it waits for the
  whole monopoliser (shown too, so the bound means something);
- a request that can never fit in the pool is refused at admission saying what it needs and what the pool has;
- min_tokens bans EOS and every stop token id, however many stop ids there are (up to 64);
- a hypothesis fuzz over SamplingParams and prompts against a real (tiny, random) model: nothing escapes but
  ValueError, and the engine still serves a plain request afterwards with every block back.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpage import SamplingParams
from jaxpage.engine.llm_engine import DoesNotFitError
from jaxpage.sampling_params import MAX_STOP_TOKEN_IDS
from tests.fake_engine import STAND_IN_TOKEN as TOKEN
from tests.fake_engine import stand_in_engine as make_engine


def run(engine, max_steps: int = 2000) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    pytest.fail(f"unfinished after {max_steps} steps")


def all_blocks_free(engine) -> bool:
    stats = engine.stats()
    return stats["num_free_blocks"] == stats["num_blocks"] and not engine.requests


def test_a_request_that_fails_on_the_engine_thread_ends_alone():
    """Without the containment the ZeroDivisionError of the beam score escaped step() and killed the engine."""
    engine = make_engine()
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=10, ignore_eos=True)
    beams.length_penalty = -400.0  # as if validation had missed it: 10 ** -400 == 0.0 in the beam score
    engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, beams)
    engine.add_request("good", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=20, ignore_eos=True))
    out = run(engine)
    assert out["bad"].error is not None and "ZeroDivisionError" in out["bad"].error
    assert [c.finish_reason for c in out["bad"].outputs] == ["error", "error"]
    assert out["good"].error is None and out["good"].outputs[0].token_ids == [TOKEN] * 20
    assert all_blocks_free(engine)
    engine.add_request("after", {"prompt_token_ids": [9]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert run(engine)["after"].outputs[0].token_ids == [TOKEN] * 3


@pytest.mark.parametrize("field, value", [
    ("length_penalty", -400.0), ("length_penalty", 1000.0), ("length_penalty", -math.inf),
    ("length_penalty", math.nan), ("top_p", 1e-45), ("repetition_penalty", 1e-40), ("temperature", math.inf),
    ("temperature", 1e39), ("temperature", math.nan), ("temperature", 1e-5), ("min_p", math.nan),
    ("presence_penalty", math.inf), ("frequency_penalty", -math.inf), ("top_p", math.nan),
])
def test_float_edge_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_the_issue_beam_request_is_refused_before_it_reaches_the_engine():
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(n=2, use_beam_search=True, length_penalty=-400)
    assert SamplingParams(n=2, use_beam_search=True, length_penalty=-10).length_penalty == -10


def test_a_request_wider_than_the_cap_is_refused_naming_the_field_the_client_set():
    engine = make_engine(max_num_seqs=8, max_seqs_per_request=4)
    with pytest.raises(ValueError, match=r"SamplingParams\.n=5 exceeds max_seqs_per_request=4"):
        engine.add_request("a", {"prompt_token_ids": [1]}, SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"SamplingParams\.best_of=6 exceeds"):
        engine.add_request("b", {"prompt_token_ids": [1]}, SamplingParams(n=1, best_of=6, temperature=1.0))
    with pytest.raises(ValueError, match=r"SamplingParams\.n=9 exceeds max_num_seqs=8"):
        make_engine(max_num_seqs=8).add_request("c", {"prompt_token_ids": [1]}, SamplingParams(n=9))


def _short_request_steps(max_seqs_per_request: int | None, monopoliser_n: int, monopolisers: int = 1) -> int:
    """Steps from a short request's arrival to its last token, while monopolisers run (or wait)."""
    engine = make_engine(max_num_seqs=8, max_seqs_per_request=max_seqs_per_request)
    for i in range(monopolisers):
        engine.add_request(f"monopoliser{i}", {"prompt_token_ids": list(range(1 + i, 40))}, SamplingParams(
            n=monopoliser_n, temperature=1.0, seed=0, max_tokens=300, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.add_request("short", {"prompt_token_ids": list(range(50, 70))},
                       SamplingParams(max_tokens=8, ignore_eos=True))
    for steps in range(1, 1000):
        if any(o.request_id == "short" and o.finished for o in engine.step()):
            return steps
    pytest.fail("the short request never finished")


def test_a_monopolising_request_cannot_starve_a_short_one():
    """Bound: a short request finishes within max_tokens + 1 steps of its arrival (its prefill fits the budget)."""
    assert _short_request_steps(max_seqs_per_request=4, monopoliser_n=4) <= 8 + 1
    # two wide requests of 4 would hold all 8 slots between them: wide groups together hold at most 4, so the
    # second waits in its place and the short request behind it is admitted
    assert _short_request_steps(max_seqs_per_request=4, monopoliser_n=4, monopolisers=2) <= 8 + 1
    # the same monopoliser holding every slot (no cap): the short request waits for all of its 300 tokens
    assert _short_request_steps(max_seqs_per_request=None, monopoliser_n=8) > 290


def test_a_request_that_can_never_fit_is_refused_at_admission():
    """The issue's case: a 1,900-token prompt with n=8 on a 129-block pool used to end 'OK' with empty aborts.
    Needs: 118 full prompt blocks shared + 8 x (120 - 118) blocks for each sample's own tail = 134 > 129."""
    engine = make_engine(num_kv_blocks=130, max_num_seqs=8, max_model_len=2048)
    prompt = {"prompt_token_ids": [1 + i % 200 for i in range(1900)]}
    with pytest.raises(DoesNotFitError, match="needs up to 134 KV blocks .* the pool has 129"):
        engine.add_request("wide", prompt, SamplingParams(n=8, temperature=1.0, max_tokens=16))
    assert not engine.requests and all_blocks_free(engine)
    engine.add_request("one", prompt, SamplingParams(n=1, max_tokens=16, ignore_eos=True))
    assert run(engine)["one"].outputs[0].token_ids == [TOKEN] * 16
    assert all_blocks_free(engine)


def test_min_tokens_bans_eos_and_every_stop_id_however_many():
    """A fixed ban list of 16 used to drop EOS once 16 stop ids filled it (EOS went last)."""
    import jax.numpy as jnp

    from jaxpage.core.scheduler_output import ScheduledSeq
    from jaxpage.sequence import Sequence, SequenceGroup
    from jaxpage.worker.input_batch import build_batch
    from jaxpage.worker.sampler import sample

    engine = make_engine()
    stops = list(range(100, 100 + MAX_STOP_TOKEN_IDS))
    params = SamplingParams(min_tokens=5, max_tokens=10, stop_token_ids=stops, temperature=0)
    seq = Sequence(0, [1, 2, 3], 3, 13)
    batch, sampling = build_batch(engine.config, [ScheduledSeq(seq, 3, SequenceGroup("r", [seq], params, 0), True,
                                                               block_ids=[1])],
                                  eos_token_ids=(0,))
    assert {0, *stops} <= set(np.asarray(sampling.banned[0]).tolist())
    vocab = engine.config.model.vocab_size
    logits = np.zeros((sampling.banned.shape[0], vocab), np.float32)
    logits[:, [0, *stops]] = 10.0  # EOS and every stop id are the likeliest: all banned, token 1 is next best
    logits[:, 1] = 5.0
    assert int(sample(jnp.asarray(logits), sampling).tokens[0]) == 1
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))


# --- fuzz: the offline engine over a tiny random model ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from tests.factories import tiny_llm

    return tiny_llm(tmp_path_factory, num_kv_blocks=40)


FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, 1.0, -1.0, 1e-45, 1e-40, 1e39, -400.0, 1000.0, 0.01, 2.0, 100.0]))
INTS = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-2, 70))


@st.composite
def requests(draw):
    kw = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty"):
        if draw(st.booleans()):
            kw[name] = draw(FLOATS)
    for name in ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs"):
        if draw(st.booleans()):
            kw[name] = draw(INTS)
    kw["max_tokens"] = kw.get("max_tokens", 4) if not isinstance(kw.get("max_tokens"), int) or \
        kw.get("max_tokens", 4) > 8 else kw["max_tokens"]  # keep runs short: at most 8 tokens
    kw["stop_token_ids"] = draw(st.lists(st.integers(-5, 300), max_size=70))
    kw["stop"] = draw(st.lists(st.text(max_size=3), max_size=3))
    kw["use_beam_search"] = draw(st.booleans())
    kw["ignore_eos"] = draw(st.booleans())
    prompt = draw(st.one_of(st.lists(st.integers(-3, 300), max_size=140).map(lambda ids: {"prompt_token_ids": ids}),
                            st.just({"prompt_token_ids": [1, 2, 3]})))
    return kw, prompt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_fuzz_no_exception_but_value_error_and_the_engine_serves_on(tiny_llm, request_):
    engine = tiny_llm.engine
    kw, prompt = request_
    try:
        params = SamplingParams(**kw)
        engine.add_request("fuzz", prompt, params)
    except ValueError:
        pass
    else:
        out = run(engine, max_steps=200)["fuzz"]
        assert out.error is None, out.error
        assert len(out.outputs) == params.n
        assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
    assert all_blocks_free(engine)
    engine.add_request("plain", {"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))
    assert len(run(engine)["plain"].outputs[0].token_ids) == 2


def test_a_step_samples_only_its_rows_and_the_same_tokens(tiny_llm):
    """On the host layer loop a step's sampled rows pad to their own bucket (InputBatch.sampled_rows_apart): a
    lone 20-token prompt in the 24-token bucket samples 1 row, not the bucket's 8 sequences. Its seeded samples,
    logprobs and prompt logprobs are those of the same engine sampling all 8 rows (the rows tied to the bucket,
    as the fused step samples), and every block comes back."""
    from jaxpage.core.scheduler_output import ScheduledSeq
    from jaxpage.sequence import Sequence, SequenceGroup
    from jaxpage.worker.input_batch import InputBatch, build_batch

    engine = tiny_llm.engine
    config, state = engine.config, engine.runner.input_batch
    assert state.sampled_rows_apart  # a CPU engine runs the host layer loop
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=3, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": list(range(3 + i, 23 + i))} for i in range(2)]
    seq = Sequence(0, prompts[0]["prompt_token_ids"], 20, 26)
    batch, sampling = build_batch(config, [ScheduledSeq(seq, 20, SequenceGroup("r", [seq], params, 0), True,
                                                        block_ids=[1, 2])],
                                  state=InputBatch(config, sampled_rows_apart=True))
    assert (batch.block_tables.shape[0], sampling.temperature.shape[0]) == (8, 1)

    def generate():
        return [tiny_llm.generate(p, params)[0] for p in prompts]  # one at a time: steps of one row
    apart = generate()
    state.sampled_rows_apart = False
    try:
        tied = generate()
    finally:
        state.sampled_rows_apart = True
    for a, t in zip(apart, tied):
        assert a.outputs[0].token_ids == t.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                             t.outputs[0].logprobs + t.prompt_logprobs[1:], strict=True):
            assert got.keys() == want.keys()
            np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-5, atol=1e-6)
    assert all_blocks_free(engine)
