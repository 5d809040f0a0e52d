"""Block accounting of the engine core under random workloads, without a model (hypothesis).

The engine runs over a fake runner (tests/fake_engine.py) that keeps a *simulated* KV pool: every slot holds a
rolling hash of the token prefix whose K/V it stands for (what a real model's K/V at position p depends on: tokens
0..p). The runner carries out the queued copies and swaps exactly as the real one batches them, writes each
scheduled chunk, and then checks that every position a sequence attends to holds its own prefix's hash, so a
prefix-cache hit on the wrong block, a missing copy-on-write, a swap to the wrong slot or a block handed out while
still in use all show up as a wrong hash. Sampled tokens are pseudo-random but deterministic in the sequence's
tokens and seed.

After every action (add, step, abort, explicit preempt), in both preemption modes, with prefix caching on or off:
- ``BlockPool.check`` over the tables of all live sequences of running groups (reference counts equal table
  entries, free means unreferenced), free + used = total;
- waiting groups and finished sequences hold no block; swapped groups hold host slots only, and free host slots
  plus the distinct slots held by swapped groups make up the host pool exactly, each slot once;
- every unfinished request sits in exactly one queue, with the matching status.
When every request has finished or been aborted, every block and every host slot is free again.
The same scenarios' requests as pooling requests (runner "pooling", the fake runner pooling a fake hidden state
of each position's prefix) also give each request its whole prompt's vector, however it was chunked, preempted or
read from the prefix cache.

Deterministic tests at the end, over the same fake runner: preemption of forks over a shared prefix in both modes,
the max_num_seqs bound with a not-yet-forked group, and regression tests for three scheduler bugs found with this
harness: a fork whose first sibling stops at once lost its computed count (recomputed its prompt into shared blocks
and read a sibling's K/V), a recomputed n>1 group was readmitted only if its sequences fit unshared, and a group
that can never fit in the pool was kept waiting forever (now it ends with finish_reason 'abort'); and such an
abort still returns n completions: a beam search cut short after fewer than n hypotheses ended returned only
those, and a group aborted before its prompt forked returned one.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpage.core.kv_cache_manager import COPY, SWAP_OUT
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import SamplingParams
from tests.fake_engine import (BLOCK_SIZE, EOS, VOCAB, check_accounting, check_all_free, fake_pooled, make_engine,
                                play, record_prompt_rows_ahead, run_checked, scenarios)


# --- the property test ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_block_accounting_stays_exact(scenario):
    setup, actions = scenario
    engine = make_engine(**setup)
    play(engine, actions)
    kinds = [k for k, _, _ in engine.runner.moves]  # what this example exercised (--hypothesis-show-statistics)
    event(f"mode={setup['mode']} preempted={engine.scheduler.num_preemptions > 0} swapped={SWAP_OUT in kinds} "
          f"copy-on-write={COPY in kinds} prefix-hit={engine.kv.prefix_cache_hits > 0} "
          f"host-tier-hit={engine.kv.offload.host_hits > 0} disk-tier-hit={engine.kv.offload.disk_hits > 0}")


@settings(max_examples=40, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(tiers=True))
def test_block_accounting_stays_exact_with_the_prefix_cache_tiers(scenario):
    """The scenarios with the host tier (2-24 blocks) and the disk tier: the fake runner moves its simulated K/V
    through both (real files), so a block restored with the wrong K/V fails the reads of its first step; every
    host slot is free or holds one block, the directory's files are the index's, their bytes counted, after every
    action. Files corrupted or deleted behind the engine ("damage") are never served: their loads fail and the
    requests holding their blocks compute them."""
    setup, actions = scenario
    engine = make_engine(**setup)
    play(engine, actions)
    event(f"host-tier-hit={engine.kv.offload.host_hits > 0} disk-tier-hit={engine.kv.offload.disk_hits > 0} "
          f"stored={engine.kv.offload.stores > 0} disk-load-failed={engine.kv.offload.disk_failed > 0}")


@settings(max_examples=40, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(), st.sampled_from(["LAST", "MEAN", "CLS"]))
def test_block_accounting_stays_exact_for_a_pooling_model(scenario, pooling):
    """The scenarios' requests as pooling requests (runner "pooling", prefix caching only with LAST): the
    accounting holds after every action, and each finished request's vector is its whole prompt's, pooled, though
    it was computed in chunks, preempted (recomputed or swapped), or (LAST) read from the prefix cache."""
    setup, actions = scenario
    engine = make_engine(**setup, pooling=pooling)
    actions = [(a[0], a[1], PoolingParams(task="encode"), *a[3:]) if a[0] == "add" else a for a in actions]
    finished = play(engine, actions)
    prompts = {f"r{i}": (a[1], a[4] if len(a) > 4 and a[4] else 0) for i, a in enumerate(actions) if a[0] == "add"}
    for request_id, out in finished.items():
        prompt, lora = prompts[request_id]
        np.testing.assert_allclose(out.outputs.data, fake_pooled(prompt, pooling, lora), rtol=1e-6)
    event(f"pooling={pooling} preempted={engine.scheduler.num_preemptions > 0} "
          f"prefix-hit={engine.kv.prefix_cache_hits > 0} finished={len(finished)}")


def _ends(finished: dict) -> dict:
    """Each finished request's completions: tokens, finish reason, stop reason, cumulative log-probability."""
    return {rid: [(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in out.outputs]
            for rid, out in finished.items()}


def _check_ahead_and_synchronous(run) -> None:
    """run(async_scheduling) -> (the requests' ends, _count_ahead's record): async scheduling ends them as
    synchronous scheduling does, with most steps scheduled while the one before ran."""
    expected, _ = run(False)
    got, asked = run(True)
    assert got == expected
    assert sum(asked) > len(asked) // 2, f"only {sum(asked)} of {len(asked)} steps were scheduled ahead"


def _count_ahead(engine) -> list[bool]:
    """Records, for each time the engine asks, whether the next step was scheduled while one ran (a synchronous
    engine's scheduler has no look-ahead: it never asks)."""
    asked = []
    if not engine.async_scheduling:
        return asked
    schedule_ahead = engine.scheduler.schedule_ahead
    engine.scheduler.schedule_ahead = lambda: (out := schedule_ahead(), asked.append(out is not None))[0]
    return asked


@settings(max_examples=40, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_async_scheduling_gives_the_synchronous_outputs(scenario):
    """Async scheduling (the next step scheduled and built while one runs, its placeholder tokens filled from the
    step before, the host reading tokens a step late) ends every request as synchronous scheduling does: the same
    tokens, finish and stop reasons and log-probabilities, over the scenarios' whole feature set (n > 1 forks,
    best_of, beams, stop tokens, EOS, max_tokens, min_tokens with penalties, logprobs, both preemption modes,
    prefix caching, aborts), with the accounting checked after every action and every block back at the end."""
    setup, actions = scenario
    # every request seeded: the fake runner's draws (greedy's too) depend on the seed, drawn afresh when None
    actions = [(a[0], a[1], dataclasses.replace(a[2], seed=i if a[2].seed is None else a[2].seed), *a[3:])
               if a[0] == "add" else a for i, a in enumerate(actions)]
    expected = _ends(play(make_engine(**setup, async_scheduling=False), actions))
    engine = make_engine(**setup)
    asked = _count_ahead(engine)
    assert _ends(play(engine, actions)) == expected
    event(f"steps scheduled ahead: {'some' if any(asked) else 'none'}")


# --- deterministic cases ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_runs_ahead_and_drops_the_extra_token(mode):
    """Decodes of requests that stop at different steps (max_tokens, EOS, stop tokens) under a pool tight enough
    to preempt: most steps are scheduled while the one before runs, a sequence that stopped had its one extra
    token computed and dropped (never output), and tokens match synchronous scheduling; every block comes back."""
    def run(async_scheduling):
        engine = make_engine(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=32, mode=mode,
                             num_host_blocks=16 if mode == "swap" else 0, async_scheduling=async_scheduling)
        asked = _count_ahead(engine)
        for i in range(6):
            p = SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=6 + 5 * i,
                               stop_token_ids=[3] if i == 3 else [], ignore_eos=i < 2)
            engine.add_request(f"r{i}", {"prompt_token_ids": [1 + (i * 7 + j) % (VOCAB - 1) for j in range(9)]}, p)
        done = run_checked(engine)
        check_all_free(engine)
        return _ends(done), asked
    _check_ahead_and_synchronous(run)


def test_requests_over_a_cached_prefix_are_scheduled_ahead():
    """Requests whose prompts share full blocks found in the prefix cache (blocks with several holders, never
    written: a prompt's last token goes into a block of its own) still take the decode fast path while a step
    runs, with synchronous scheduling's tokens; a fork's first token, written into a shared block, is copied
    first. Every block comes back."""
    def run(async_scheduling):
        engine = make_engine(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64,
                             async_scheduling=async_scheduling)
        asked = _count_ahead(engine)
        prefix = [1 + j % (VOCAB - 1) for j in range(3 * BLOCK_SIZE)]
        for i in range(4):
            p = SamplingParams(temperature=0.0, seed=i, max_tokens=12 + 3 * i, ignore_eos=True, n=2 if i == 3 else 1)
            engine.add_request(f"r{i}", {"prompt_token_ids": prefix + [5 + i, 9 + i]}, p)
            engine.step()  # the first prompt is cached before the next one arrives
        done = run_checked(engine)
        assert engine.kv.prefix_cache_hits > 0
        check_all_free(engine)
        return _ends(done), asked
    _check_ahead_and_synchronous(run)


def test_steps_with_new_prompts_are_scheduled_ahead():
    """Plain requests arriving while others decode: the steps that admit them (their prompts chunked over several
    steps under a small token budget, some over a cached prefix), and their first decodes, are scheduled while
    the step before runs, not only the decode fast path; the tokens are synchronous scheduling's and every
    block comes back. A pool too small for every next token sends the step back to the synchronous pass."""
    def run(async_scheduling):
        engine = make_engine(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=24, prefix_caching=True,
                             async_scheduling=async_scheduling)
        prompt_rows = record_prompt_rows_ahead(engine)
        prefix = [1 + j % (VOCAB - 1) for j in range(2 * BLOCK_SIZE)]
        done: dict = {}
        for i in range(8):
            p = SamplingParams(temperature=1.0 if i % 3 else 0.0, seed=i, max_tokens=5 + 2 * i,
                               ignore_eos=i % 2 == 0)
            prompt = (prefix if i % 2 else []) + [1 + (i * 5 + j) % (VOCAB - 1) for j in range(9 + 3 * i)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
            for _ in range(3):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                check_accounting(engine)
        done.update(run_checked(engine))
        check_all_free(engine)
        return _ends(done), prompt_rows
    expected, _ = run(False)
    got, prompt_rows = run(True)
    assert got == expected
    assert sum(n > 0 for n in prompt_rows) >= 5, f"prompt chunks scheduled ahead in {prompt_rows}"


def test_a_prefix_the_step_in_flight_computes_is_found_by_a_prompt_admitted_ahead():
    """A request arriving while the step that computes the first chunk of another prompt over the same prefix is
    still running is admitted ahead and reads that chunk's blocks from the cache (cached at launch, as in vLLM),
    as it does when scheduled after that step synchronously; the tokens are the same either way."""
    def run(async_scheduling):
        engine = make_engine(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=2 * BLOCK_SIZE,
                             prefix_caching=True, async_scheduling=async_scheduling)
        asked = _count_ahead(engine)
        prefix = [1 + j % (VOCAB - 1) for j in range(3 * BLOCK_SIZE)]
        for i in range(2):
            p = SamplingParams(temperature=0.0, seed=i, max_tokens=6, ignore_eos=True)
            engine.add_request(f"r{i}", {"prompt_token_ids": prefix + [2 + i, 7 + i]}, p)
            engine.step()  # r0's first chunk (two blocks): held in flight (ahead) or done (synchronous)
        done = run_checked(engine)
        check_all_free(engine)
        return _ends(done), asked, engine.kv.prefix_cache_hits
    expected, _, hits = run(False)
    got, asked, hits_ahead = run(True)
    assert got == expected
    assert asked[0]  # r1 was admitted while r0's first chunk ran
    assert hits_ahead == hits >= 2 * BLOCK_SIZE


@pytest.mark.parametrize("mode, host", [("recompute", 0), ("swap", 32), ("swap", 2)])
def test_shared_prefix_and_forks_survive_preemption(mode, host):
    """Parallel samples and beams over a shared prompt, under a pool that forces preemption: every block and
    host slot comes back, and the simulated K/V each sequence reads is always its own."""
    rng = np.random.default_rng()
    engine = make_engine(num_kv_blocks=14, max_num_seqs=8, max_num_batched_tokens=16, mode=mode,
                         num_host_blocks=host)
    system = [int(t) for t in rng.integers(1, VOCAB, 20)]
    for i in range(6):
        prompt = system + [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(1, 6)))]
        p = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=12, ignore_eos=True),
             SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=8)][i % 3]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    done = run_checked(engine)
    assert len(done) == 6
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap" and host >= 32:
        assert any(k == SWAP_OUT for k, _, _ in engine.runner.moves), "swap mode never swapped"
    check_all_free(engine)


@pytest.mark.parametrize("pooling, mode", [("MEAN", "recompute"), ("MEAN", "swap"), ("CLS", "recompute"),
                                           ("LAST", "recompute")])
def test_a_pooling_request_preempted_mid_prompt_gives_its_whole_prompts_vector(pooling, mode):
    """A pooling request computed 8 tokens a step and preempted after three chunks (recomputed from its first
    token, or swapped out and back): its vector is its whole prompt's, pooled once; every block comes back."""
    rng = np.random.default_rng()
    engine = make_engine(num_kv_blocks=12, max_num_batched_tokens=8, mode=mode, num_host_blocks=8,
                         long_prefill_token_threshold=8, pooling=pooling)
    prompt = [int(t) for t in rng.integers(1, VOCAB, 60)]
    engine.add_request("r", {"prompt_token_ids": prompt}, PoolingParams(task="encode"))
    for _ in range(3):
        assert engine.step() == []
    engine.scheduler.preempt(engine.scheduler.running[0])
    [out] = run_checked(engine).values()
    np.testing.assert_allclose(out.outputs.data, fake_pooled(prompt, pooling), rtol=1e-6)  # float32
    if mode == "swap":
        assert any(k == SWAP_OUT for k, _, _ in engine.runner.moves), "swap mode never swapped"
    check_all_free(engine)


def test_a_pooling_request_over_a_cached_prefix_gives_its_whole_prompts_vector():
    """LAST pooling keeps prefix caching: a prompt over a prefix embedded before computes only its own tokens."""
    rng = np.random.default_rng()
    engine = make_engine(num_kv_blocks=12, pooling="LAST")
    head = [int(t) for t in rng.integers(1, VOCAB, 40)]
    for i, prompt in enumerate([head, head + [5, 6, 7]]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PoolingParams(task="encode"))
        [out] = run_checked(engine).values()
        np.testing.assert_allclose(out.outputs.data, fake_pooled(prompt, "LAST"))
    assert engine.kv.prefix_cache_hits >= 32  # its two full blocks
    check_all_free(engine)


def test_a_pooling_request_the_scheduler_ends_gives_an_error_not_a_vector():
    """A pooling request that can never fit is ended ('abort') by the scheduler before its prompt is computed: its
    output has an error and no vector; the engine goes on embedding, and every block comes back."""
    engine = make_engine(num_kv_blocks=12, pooling="MEAN")
    engine.add_request("cut", {"prompt_token_ids": [t % (VOCAB - 1) + 1 for t in range(29)]}, PoolingParams(task="encode"))
    engine.scheduler._fail_head()  # what schedule() does when nothing runs and the head cannot start
    (out,) = engine.step()
    assert out.finished and out.outputs.data is None and "aborted" in out.error
    engine.add_request("next", {"prompt_token_ids": [3, 4, 5]}, PoolingParams(task="encode"))
    [out] = run_checked(engine).values()
    np.testing.assert_allclose(out.outputs.data, fake_pooled([3, 4, 5], "MEAN"), rtol=1e-6)
    check_all_free(engine)


def test_recomputed_parallel_samples_are_readmitted():
    """A group of 4 samples over a 3-block prompt needs 3 shared + 4 own = 7 of the 11 blocks. Preempted
    (recompute) by an older request that grows, it must run again once that request is done, not wait forever
    for the 16 blocks its sequences would take unshared."""
    engine = make_engine(num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    engine.add_request("old", {"prompt_token_ids": [1 + i % 20 for i in range(20)]},
                       SamplingParams(temperature=0, max_tokens=43, ignore_eos=True))
    engine.step()
    while engine.scheduler.running[0].seqs[0].num_tokens < 30:
        engine.step()
    engine.add_request("forked", {"prompt_token_ids": [2 + i % 21 for i in range(24)]},
                       SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))
    for _ in range(6):
        engine.step()
        check_accounting(engine)
    assert engine.scheduler.num_preemptions > 0, "the scenario was meant to preempt the forked group"
    assert [g.request_id for g in engine.scheduler.waiting] == ["forked"] and engine.scheduler.waiting[0].forked
    done = run_checked(engine, max_steps=200)
    assert set(done) == {"old", "forked"}
    check_all_free(engine)


def test_sibling_samples_keep_their_kv_when_the_first_stops_at_once():
    """n=3 over a 4-token prompt: the first sample stops on its first token (a stop token). The two others share
    the prompt's partly filled block; each must copy it before writing its own token there (copy-on-write) and
    then decode one token per step. Found by the property test: both surviving samples were left with
    num_computed_tokens=0, recomputed the prompt into the shared block without copy-on-write, and one then
    attended to its sibling's K/V (the fake runner's "reads wrong K/V")."""
    rng = np.random.default_rng()
    # a prompt and seed whose three samples start with three different tokens (the fake sampler has only five
    # streams per prompt, seed % 5, so some prompts have none)
    for _ in range(100):
        prompt = [int(t) for t in rng.integers(1, VOCAB, 4)]
        seed = int(rng.integers(0, 5))
        probe = make_engine(num_kv_blocks=30, max_num_batched_tokens=64)
        probe.add_request("p", {"prompt_token_ids": prompt},
                          SamplingParams(n=3, seed=seed, max_tokens=6, ignore_eos=True))
        firsts = [c.token_ids[0] for c in probe.step()[0].outputs]
        if len(set(firsts)) == 3:
            break
    else:
        pytest.fail("no prompt and seed gave three different first samples")
    engine = make_engine(num_kv_blocks=30, max_num_batched_tokens=64)
    chunks: list[list[tuple[int, int, int]]] = []
    real_execute = engine.runner.execute
    engine.runner.execute = lambda sched: (chunks.append([(s.seq.seq_id, s.seq.num_computed_tokens,
                                                            s.num_new_tokens) for s in sched]),
                                           real_execute(sched))[1]
    engine.add_request("x", {"prompt_token_ids": prompt},
                       SamplingParams(n=3, seed=seed, max_tokens=6, ignore_eos=True, stop_token_ids=[firsts[0]]))
    out = run_checked(engine)["x"]  # the fake runner raises if a sample reads K/V that is not its own
    assert out.outputs[0].token_ids == [firsts[0]] and out.outputs[0].finish_reason == "stop"
    assert [c.token_ids[0] for c in out.outputs[1:]] == firsts[1:]
    after_fork = [row for step in chunks[1:] for row in step]
    assert all(n == 1 for _, _, n in after_fork), (
        f"a surviving sample recomputed its prompt: (seq, computed, new) per step {chunks}")
    check_all_free(engine)


def test_batch_never_exceeds_max_num_seqs():
    """max_num_seqs=4: a request for n=4 samples whose prompt is still prefilling must keep the others waiting;
    the step batch (what the runner pads to at most max_num_seqs rows) never holds more than 4 sequences."""
    engine = make_engine(num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add_request("wide", {"prompt_token_ids": list(range(1, 21))},
                       SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    for i in range(3):
        engine.add_request(f"s{i}", {"prompt_token_ids": [3, 4, 5 + i]},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    run_checked(engine)
    assert engine.runner.max_rows == 4, f"the widest step ran {engine.runner.max_rows} sequences, expected 4"
    check_all_free(engine)


def test_fake_runner_detects_a_wrong_block():
    """The K/V check is live: corrupting one written slot of a running sequence is caught on its next step."""
    engine = make_engine(num_kv_blocks=20)
    engine.add_request("a", {"prompt_token_ids": list(range(1, 20))},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0].seqs[0]
    engine.runner.pool[engine.kv.block_ids(seq)[1], 3] += 1
    with pytest.raises(AssertionError, match="reads wrong K/V"):
        engine.step()


@pytest.mark.parametrize("mode, host", [("recompute", 0), ("swap", 64)])
def test_group_larger_than_the_pool_is_refused_not_left_waiting(mode, host):
    """n=4 samples of up to 58 tokens (8 blocks each, 1 shared) in a pool of 8 blocks: the request can never run
    to the end. It may be refused (ValueError at add_request or step) or ended, but the engine must not keep it
    unfinished forever while doing nothing."""
    engine = make_engine(num_kv_blocks=9, max_num_seqs=8, max_num_batched_tokens=64, mode=mode,
                         num_host_blocks=host)
    try:
        engine.add_request("wide", {"prompt_token_ids": list(range(1, 9))},
                           SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True))
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            engine.step()
    except (ValueError, RuntimeError) as refused:
        assert "wide" in str(refused) or "block" in str(refused), f"refused without saying why: {refused}"
        engine.abort_request("wide")
    s = engine.stats()
    assert not engine.has_unfinished_requests(), (
        f"the request is still unfinished after 500 steps with nothing running: waiting={s['num_waiting']} "
        f"swapped={s['num_swapped']} free blocks={s['num_free_blocks']}/{s['num_blocks']}")
    check_all_free(engine)


def test_beam_search_cut_short_still_returns_n_completions():
    """n=3 beams over a 12-token prompt in a pool of 8 blocks (recompute, no prefix caching, budget 8,
    max_num_seqs 4): two hypotheses end on EOS, then the three live beams grow to 3 blocks each (9 > 8), are
    preempted and can never fit again, so the request ends with 'abort'. Found by the property test: the output
    held only the two ended hypotheses (n=3 asked); the best aborted beam must make up the third."""
    engine = make_engine(num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=8, mode="recompute",
                         prefix_caching=False)
    engine.add_request("beams", {"prompt_token_ids": [17, 22, 3, 8, 13, 18, 23, 4, 9, 14, 19, 0]},
                       SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=16, seed=3))
    out = run_checked(engine)["beams"]
    assert engine.scheduler.num_preemptions > 0, "the scenario was meant to preempt the beams"
    assert [c.finish_reason for c in out.outputs] == ["stop", "stop", "abort"], (
        [(c.token_ids, c.finish_reason) for c in out.outputs])
    assert all(c.token_ids[-1] == EOS for c in out.outputs[:2]) and len(out.outputs[2].token_ids) > 7
    check_all_free(engine)


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4),
                                    SamplingParams(n=2, best_of=3, temperature=1.0, seed=1, max_tokens=4),
                                    SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=4)])
def test_group_ended_before_its_fork_returns_n_completions(params):
    """A group that can never fit is ended ('abort') by the scheduler; if that happens before its prompt was
    forked (e.g. swapped out mid-prefill holding the whole pool), the output still has n (empty) completions."""
    engine = make_engine(num_kv_blocks=9, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add_request("x", {"prompt_token_ids": list(range(1, 20))}, params)
    engine.scheduler._fail_head()  # what schedule() does when nothing runs and the head cannot start
    (out,) = engine.step()
    assert out.finished and len(out.outputs) == params.n
    assert all(c.token_ids == [] and c.finish_reason == "abort" for c in out.outputs)
    check_all_free(engine)


@pytest.mark.parametrize("concurrent", [64, 128])
def test_async_scheduling_gives_the_synchronous_outputs_at_64_and_128_requests(concurrent):
    """``concurrent`` requests at once over a pool too small for all of them (recompute preemptions), with
    speculative drafts (3 a step once fewer than 8 sequences run: disable_by_batch_size), n = 2 samples,
    penalties, seeded random samples, stop tokens and EOS in the mix: async scheduling ends every request with the
    synchronous engine's tokens, finish and stop reasons and log-probabilities, checking the block accounting
    after every step, and steps are scheduled while the one before runs; every block comes back. (Structured
    outputs need a tokenizer: tests/test_async_scheduling.py mixes them in on SmolLM2.)"""
    mixes = [dict(temperature=0.0), dict(temperature=1.0, seed=3, n=2), dict(temperature=0.0, presence_penalty=0.5),
             dict(temperature=0.8, seed=11, stop_token_ids=[5]), dict(temperature=0.0, repetition_penalty=1.2),
             dict(temperature=0.7, seed=2, frequency_penalty=0.3, n=2)]

    def run(async_scheduling):
        engine = make_engine(num_kv_blocks=concurrent * 3 // 4 + 20, max_num_seqs=concurrent,
                             max_num_batched_tokens=2 * concurrent, speculative=3, disable_by_batch_size=8,
                             async_scheduling=async_scheduling)
        asked = _count_ahead(engine)
        for i in range(concurrent):
            mix = mixes[i % len(mixes)]  # the rows that keep a step synchronous end early: later steps run ahead
            synchronous = "n" in mix or any(k.endswith("penalty") for k in mix)
            p = SamplingParams(max_tokens=3 + i % 3 if synchronous else 20 + i % 25, ignore_eos=i % 5 == 0,
                               **{"seed": i, **mix})  # seeded: the fake draws by seed, greedy rows too
            prompt = [1 + (i * 5 + j) % (VOCAB - 1) for j in range(3 + i % 7)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
        done = run_checked(engine, max_steps=2000)
        check_all_free(engine)
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.spec_stats.num_drafts > 0
        return _ends(done), asked
    expected, _ = run(False)
    got, asked = run(True)
    assert got == expected and len(got) == concurrent
    assert sum(asked) >= 2, f"{sum(asked)} steps scheduled while one ran"
