"""Block accounting of the engine core under random workloads, without a model (hypothesis).

The engine runs over a fake runner that keeps a *simulated* KV pool: every slot holds a rolling hash of the token
prefix whose K/V it stands for (what a real model's K/V at position p depends on: tokens 0..p). The runner carries
out the queued copies and swaps exactly as the real one batches them, writes each scheduled chunk, and then checks
that every position a sequence attends to holds its own prefix's hash, so a prefix-cache hit on the wrong block, a
missing copy-on-write, a swap to the wrong slot or a block handed out while still in use all show up as a wrong
hash. Sampled tokens are pseudo-random but deterministic in the sequence's tokens and seed.

After every action (add, step, abort, explicit preempt), in both preemption modes, with prefix caching on or off:
- ``BlockPool.check`` over the tables of all live sequences of running groups (reference counts equal table
  entries, free means unreferenced), free + used = total;
- waiting groups and finished sequences hold no block; swapped groups hold host slots only, and free host slots
  plus the distinct slots held by swapped groups make up the host pool exactly, each slot once;
- every unfinished request sits in exactly one queue, with the matching status.
When every request has finished or been aborted, every block and every host slot is free again.

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
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxpage.engine.config_builder import build_engine_config
from jaxpage.models import config_from_hf
from jaxpage.core.kv_cache_manager import COPY, NULL_HOST, SWAP_IN, SWAP_OUT
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.worker.sampler import SamplerOutput
from jaxpage.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpage.sequence import SequenceStatus

VOCAB = 24  # small, so EOS (token 0) is sampled now and then and prefixes repeat
EOS = 0
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
_MOD = (1 << 61) - 1
# The fork bug pinned by test_sibling_samples_keep_their_kv_when_the_first_stops_at_once: while it stands, the
# property test keeps the first sample of a fresh fork from drawing EOS as its first token (else it fails now
# and then on that one known bug). Set to False once LLMEngine.step no longer reads the parent's count.
AVOID_KNOWN_FORK_BUG = False


def prefix_hashes(token_ids: list[int]) -> list[int]:
    """hash(tokens[:p + 1]) for every position p: what the K/V at p depends on. Never 0 (0 = never written)."""
    out, h = [], 7
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h or 1)
    return out


class FakeRunner:
    """The runner interface over a simulated KV pool (see the module docstring)."""

    def __init__(self, config, num_host_blocks: int):
        self.config = config
        self.pool = np.zeros((config.num_kv_blocks, config.block_size), np.int64)
        self.host = np.zeros((max(num_host_blocks, 1), config.block_size), np.int64)
        self.num_host_blocks = num_host_blocks
        self.block_pool = None  # set by make_engine, to check that written blocks are held
        self.window = config.model.sliding_window if config.model.every_layer_windowed else 0
        self.moves: list[tuple[str, int, int]] = []
        self.max_rows = 0

    def warm_up(self, progress: bool = False) -> None:
        pass

    def apply(self, ops) -> None:
        nb = self.config.num_kv_blocks
        for kind, src, dst in ops.batches():  # one batched gather/scatter per run of one kind, as the real runner
            self.moves.extend((kind, s, d) for s, d in zip(src, dst))
            if kind == COPY:
                assert all(0 < b < nb for b in src + dst), f"copy with a bad block: {src} -> {dst}"
                self.pool[dst] = self.pool[src].copy()
            elif kind == SWAP_OUT:
                assert all(0 < b < nb for b in src) and all(0 <= s < self.num_host_blocks for s in dst), (src, dst)
                self.host[dst] = self.pool[src].copy()
            elif kind == SWAP_IN:
                assert all(0 <= s < self.num_host_blocks for s in src) and all(0 < b < nb for b in dst), (src, dst)
                self.pool[dst] = self.host[src].copy()
            else:
                raise AssertionError(f"unknown move {kind}")

    def execute(self, scheduled) -> SamplerOutput:
        cfg, bs = self.config, self.config.block_size
        n = len(scheduled)
        self.max_rows = max(self.max_rows, n)
        assert n <= cfg.max_num_seqs, f"{n} sequences in one step, max_num_seqs={cfg.max_num_seqs}"
        assert n > 0
        assert len({id(s.seq) for s in scheduled}) == n, "a sequence scheduled twice in one step"
        total = sum(s.num_new_tokens for s in scheduled)
        assert total <= cfg.max_num_batched_tokens, f"{total} tokens > budget {cfg.max_num_batched_tokens}"
        hashes = {}
        for s in scheduled:  # writes first (the real step writes a layer's K/V before attending)
            seq = s.seq
            assert s.group.status == SequenceStatus.RUNNING and not seq.is_finished
            if s.logits_of is not None:
                assert s.num_new_tokens == 0 and s.logits_of.seq_id != seq.seq_id
                continue
            first, count = seq.num_computed_tokens, s.num_new_tokens
            assert 0 < count <= seq.num_tokens - first, (first, count, seq.num_tokens)
            assert s.samples == (first + count == seq.num_tokens)
            assert len(seq.block_table) * bs >= first + count, "block table too short for the chunk"
            h = hashes[seq.seq_id] = prefix_hashes(seq.token_ids)
            for p in range(first, first + count):
                block = seq.block_table[p // bs]
                assert 0 < block < cfg.num_kv_blocks and self.block_pool.ref_counts[block] >= 1, block
                self.pool[block, p % bs] = h[p]
        for s in scheduled:  # then every sequence reads its whole context (with a window: what its chunk sees)
            if s.logits_of is not None:
                continue
            seq, end = s.seq, s.seq.num_computed_tokens + s.num_new_tokens
            h = hashes[seq.seq_id]
            seen = range(max(0, seq.num_computed_tokens - self.window + 1) if self.window else 0, end)
            got = {p: int(self.pool[seq.block_table[p // bs], p % bs]) for p in seen}
            bad = [p for p in seen if got[p] != h[p]]
            assert not bad, (f"seq {seq.seq_id} reads wrong K/V at positions {bad[:10]} (blocks "
                             f"{[seq.block_table[p // bs] for p in bad[:10]]}, table {seq.block_table})")
        tokens = np.zeros(n, np.int64)
        logprobs = np.zeros(n, np.float64)
        top_ids = np.zeros((n, MAX_LOGPROBS), np.int64)
        top_lps = np.zeros((n, MAX_LOGPROBS), np.float64)
        fork_parents = {id(s.logits_of) for s in scheduled if s.logits_of is not None}
        for row, s in enumerate(scheduled):
            src = s.logits_of or s.seq
            rng = np.random.default_rng([prefix_hashes(src.token_ids)[-1], s.seq.seed % 5])
            ids = rng.permutation(VOCAB)[:MAX_LOGPROBS]
            lps = np.sort(rng.uniform(-9.0, -0.05, MAX_LOGPROBS))[::-1]
            pick = 0 if s.group.params.temperature == 0 else int(rng.integers(0, 3))
            if AVOID_KNOWN_FORK_BUG and id(s.seq) in fork_parents and ids[pick] == EOS:
                pick += 1
            top_ids[row], top_lps[row] = ids, lps
            tokens[row], logprobs[row] = ids[pick], lps[pick]
        return SamplerOutput(tokens, logprobs, top_ids, top_lps)


def make_engine(*, num_kv_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                mode: str = "recompute", num_host_blocks: int = 0, prefix_caching: bool = True,
                max_model_len: int = MAX_MODEL_LEN, window: int = 0) -> LLMEngine:
    model = config_from_hf(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=max_model_len))
    if window:  # every layer slides (Mistral)
        model = dataclasses.replace(model, sliding_window=window, layer_types=("sliding_attention",))
    config = build_engine_config(model, dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=None,
                                 num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 gpu_memory_utilization=0.9, enable_prefix_caching=prefix_caching,
                                 preemption_mode=mode)
    config = dataclasses.replace(config, num_host_blocks=num_host_blocks)  # a swap space in blocks, not bytes
    runner = FakeRunner(config, num_host_blocks)
    engine = LLMEngine(config, runner, eos_token_ids=(EOS,))
    runner.block_pool = engine.block_pool
    engine.refuse_unfittable = False  # these tests drive the scheduler's own safety net for groups that never fit
    return engine


def check_accounting(engine: LLMEngine) -> None:
    sched, pool, kv = engine.scheduler, engine.block_pool, engine.kv
    groups = sched.running + sched.waiting + sched.swapped
    assert len({id(g) for g in groups}) == len(groups), "a group in two queues"
    assert {g.request_id for g in groups} == set(engine.requests), "queues and unfinished requests differ"
    for status, queue in ((SequenceStatus.RUNNING, sched.running), (SequenceStatus.WAITING, sched.waiting),
                          (SequenceStatus.SWAPPED, sched.swapped)):
        for g in queue:
            assert g.status == status, f"{g.request_id} is {g.status} in the {status.value} queue"
            for s in g.seqs + g.finished_seqs:
                if s.is_finished:
                    assert s.block_table == [], f"finished seq {s.seq_id} of {g.request_id} still holds blocks"
            if status == SequenceStatus.WAITING:
                assert all(s.block_table == [] for s in g.live_seqs), f"waiting {g.request_id} holds blocks"
    tables = [s.block_table for g in sched.running for s in g.live_seqs]
    pool.check(tables)
    assert pool.num_free + pool.num_used == pool.num_blocks - 1
    assert 0 <= pool.num_cached_free <= pool.num_free
    held = {b for g in sched.swapped for s in g.live_seqs for b in s.block_table} - {NULL_HOST}
    free_slots = list(kv.host_free)
    assert len(set(free_slots)) == len(free_slots), f"a host slot free twice: {sorted(free_slots)}"
    assert not held & set(free_slots), f"host slots both free and held: {sorted(held & set(free_slots))}"
    assert all(0 <= b < kv.num_host_blocks for b in held | set(free_slots))
    assert len(free_slots) + len(held) == kv.num_host_blocks, (
        f"{len(free_slots)} free + {len(held)} held host slots != {kv.num_host_blocks}")


def check_all_free(engine: LLMEngine) -> None:
    check_accounting(engine)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_pool.num_free == engine.config.num_kv_blocks - 1, "blocks still in use at the end"
    assert sorted(engine.kv.host_free) == list(range(engine.kv.num_host_blocks)), "host slots still held"
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


# --- the property test ------------------------------------------------------------------------------

def _params(draw, max_num_seqs: int) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "sample", "best_of", "beam"]))
    max_tokens = draw(st.integers(1, 24))
    ignore_eos = draw(st.booleans())
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if kind == "sample":
        n = draw(st.integers(1, min(4, max_num_seqs)))
        return SamplingParams(n=n, temperature=1.0, seed=draw(st.integers(0, 2**32 - 1)), max_tokens=max_tokens,
                              ignore_eos=ignore_eos)
    if kind == "best_of":
        best_of = draw(st.integers(2, min(4, max_num_seqs)))
        return SamplingParams(n=draw(st.integers(1, best_of)), best_of=best_of, temperature=0.8,
                              max_tokens=max_tokens, ignore_eos=ignore_eos)
    width = draw(st.integers(1, min(4, max_num_seqs)))
    return SamplingParams(n=draw(st.integers(1, width)), best_of=width, use_beam_search=True, temperature=0.0,
                          max_tokens=max_tokens, ignore_eos=ignore_eos,
                          length_penalty=draw(st.sampled_from([0.0, 1.0, 2.0])))


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from(["recompute", "swap"]))
    max_num_seqs = draw(st.sampled_from([4, 8]))
    setup = dict(
        mode=mode,
        num_host_blocks=draw(st.integers(0, 16)) if mode == "swap" else 0,  # small: swap sometimes falls back
        num_kv_blocks=draw(st.integers(MAX_MODEL_LEN // BLOCK_SIZE + 1, 40)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 32, 64])),
        prefix_caching=draw(st.booleans()),
    )
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=BLOCK_SIZE, max_size=40),
                             min_size=1, max_size=3))
    actions = []
    for _ in range(draw(st.integers(3, 30))):
        what = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "preempt"]))
        if what == "add":
            base = draw(st.sampled_from([[]] + prefixes))
            suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
            prompt = (base + suffix)[:MAX_MODEL_LEN - 1]
            actions.append(("add", prompt, _params(draw, max_num_seqs), draw(st.sampled_from([-1, 0, 0, 1]))))
        elif what == "step":
            actions.append(("step", draw(st.integers(1, 6))))
        else:
            actions.append((what, draw(st.integers(0, 1000))))
    return setup, actions


def _step(engine: LLMEngine, finished: set[str], params: dict) -> None:
    for out in engine.step():
        assert out.request_id not in finished, f"output for {out.request_id} after it finished"
        p = params[out.request_id]
        if out.finished:
            finished.add(out.request_id)
            assert len(out.outputs) == p.n
            for c in out.outputs:
                # "abort": a group that can never fit in the pool (e.g. samples recomputed without prefix caching)
                assert len(c.token_ids) <= p.max_tokens and c.finish_reason in ("stop", "length", "abort")
        check_accounting(engine)


@settings(max_examples=60, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_block_accounting_stays_exact(scenario):
    setup, actions = scenario
    engine = make_engine(**setup)
    finished: set[str] = set()
    params: dict[str, SamplingParams] = {}
    check_accounting(engine)
    for i, action in enumerate(actions):
        kind = action[0]
        if kind == "add":
            _, prompt, p, priority = action
            params[f"r{i}"] = p
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p, priority=priority)
        elif kind == "step":
            for _ in range(action[1]):
                _step(engine, finished, params)
        elif kind == "abort":
            ids = sorted(engine.requests)
            if ids:
                engine.abort_request(ids[action[1] % len(ids)])
        elif kind == "preempt":
            running = engine.scheduler.running
            if running:
                engine.scheduler.preempt(running[action[1] % len(running)])
        check_accounting(engine)
    for _ in range(300):  # drain; whatever is left after that (a group that cannot fit) is aborted
        if not engine.has_unfinished_requests():
            break
        _step(engine, finished, params)
    for request_id in sorted(engine.requests):
        engine.abort_request(request_id)
        check_accounting(engine)
    engine.step()  # applies any moves still queued; schedules nothing
    check_all_free(engine)
    kinds = [k for k, _, _ in engine.runner.moves]  # what this example exercised (--hypothesis-show-statistics)
    event(f"mode={setup['mode']} preempted={engine.scheduler.num_preemptions > 0} swapped={SWAP_OUT in kinds} "
          f"copy-on-write={COPY in kinds} prefix-hit={engine.kv.prefix_cache_hits > 0}")


# --- deterministic cases ------------------------------------------------------------------------------

def _run(engine: LLMEngine, max_steps: int = 500) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            check_accounting(engine)
            if out.finished:
                finished[out.request_id] = out
    s = engine.stats()
    pytest.fail(f"no progress after {max_steps} steps: running={s['num_running']} waiting={s['num_waiting']} "
                f"swapped={s['num_swapped']} free blocks={s['num_free_blocks']}/{s['num_blocks']} "
                f"preemptions={s['num_preemptions']}")


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
    done = _run(engine)
    assert len(done) == 6
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap" and host >= 32:
        assert any(k == SWAP_OUT for k, _, _ in engine.runner.moves), "swap mode never swapped"
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
    done = _run(engine, max_steps=200)
    assert set(done) == {"old", "forked"}
    check_all_free(engine)


def test_sibling_samples_keep_their_kv_when_the_first_stops_at_once():
    """n=3 over a 4-token prompt: the first sample stops on its first token (a stop token). The two others share
    the prompt's partly filled block; each must copy it before writing its own token there (copy-on-write) and
    then decode one token per step. Found by the property test: both surviving samples were left with
    num_computed_tokens=0, recomputed the prompt into the shared block without copy-on-write, and one then
    attended to its sibling's K/V (the fake runner's "reads wrong K/V")."""
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(1, VOCAB, 4)]
    for seed in range(200):  # a seed whose three samples start with three different tokens
        probe = make_engine(num_kv_blocks=30, max_num_batched_tokens=64)
        probe.add_request("p", {"prompt_token_ids": prompt},
                          SamplingParams(n=3, seed=seed, max_tokens=6, ignore_eos=True))
        firsts = [c.token_ids[0] for c in probe.step()[0].outputs]
        if len(set(firsts)) == 3:
            break
    else:
        pytest.fail(f"no seed gave three different first samples for prompt {prompt}")
    engine = make_engine(num_kv_blocks=30, max_num_batched_tokens=64)
    chunks: list[list[tuple[int, int, int]]] = []
    real_execute = engine.runner.execute
    engine.runner.execute = lambda sched: (chunks.append([(s.seq.seq_id, s.seq.num_computed_tokens,
                                                            s.num_new_tokens) for s in sched]),
                                           real_execute(sched))[1]
    engine.add_request("x", {"prompt_token_ids": prompt},
                       SamplingParams(n=3, seed=seed, max_tokens=6, ignore_eos=True, stop_token_ids=[firsts[0]]))
    out = _run(engine)["x"]  # the fake runner raises if a sample reads K/V that is not its own
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
    _run(engine)
    assert engine.runner.max_rows == 4, f"the widest step ran {engine.runner.max_rows} sequences, expected 4"
    check_all_free(engine)


def test_fake_runner_detects_a_wrong_block():
    """The K/V check is live: corrupting one written slot of a running sequence is caught on its next step."""
    engine = make_engine(num_kv_blocks=20)
    engine.add_request("a", {"prompt_token_ids": list(range(1, 20))},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.running[0].seqs[0]
    engine.runner.pool[seq.block_table[1], 3] += 1
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
    out = _run(engine)["beams"]
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
