"""The sliding-window KV memory manager: where every layer has a window W (Mistral), blocks no future token can
see go back to the pool while the sequence runs, and NULL_BLOCK takes their place in its block table.

Over test_block_accounting's fake runner (a simulated pool of prefix hashes, checked at every read) with a
window: every position a chunk's queries can see holds its own prefix's K/V, so freeing a block still visible, a
prefix-cache hit handing out a dead or evicted position, a fork or swap losing a block all fail there. On top:
- at every step, each scheduled sequence's table is null exactly on its dead prefix and holds at most
  ``ceil((W - 1 + chunk) / block_size) + 1`` blocks (``ceil(W / block_size) + 1`` for a decode);
- a sequence 8x the window long never holds more than that, and every block comes back at the end;
- a tight pool runs more sequences at once with the window than without it;
- a prefix match needs only the blocks the next step sees to be cached;
- the KV-waste stats count the visible tokens only.
End to end: a random Mistral with a window generates transformers' greedy tokens in a pool too small for its
sequences without the window.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpage.attention.kv_cache import NULL_BLOCK
from jaxpage.core.block_pool import BlockPool
from jaxpage.core.kv_cache_manager import SWAP_OUT, KVCacheManager
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import Sequence
from tests.fake_engine import BLOCK_SIZE, VOCAB, check_all_free, make_engine, play, run_checked, scenarios


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dead_prefix(position: int, window: int) -> int:
    """Blocks whose every position p' satisfies p' <= position - window (straight from the definition)."""
    return sum(1 for b in range(position // BLOCK_SIZE + 1) if (b + 1) * BLOCK_SIZE - 1 <= position - window)


def watch_windows(engine, window: int) -> list[int]:
    """Wraps the runner: at every step, checks each scheduled table against the window; returns the blocks
    held by the most-holding sequence of each step."""
    execute, held = engine.runner.execute, []

    def checked(scheduled):
        most = 0
        for s in scheduled:
            if s.logits_of is not None:
                continue
            p = s.seq.num_computed_tokens
            dead = dead_prefix(p, window)
            table = list(s.block_ids)
            assert table[:dead] == [NULL_BLOCK] * dead, f"a dead block still held at p={p}: {table}"
            assert NULL_BLOCK not in table[dead:], f"a visible block freed at p={p}: {table}"
            live = len(table) - dead
            assert live <= cdiv(window - 1 + s.num_new_tokens, BLOCK_SIZE) + 1, (p, s.num_new_tokens, table)
            most = max(most, live)
        held.append(most)
        return execute(scheduled)

    engine.runner.execute = checked
    return held


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios(), st.sampled_from([3, 8, 13, 20]))
def test_windowed_accounting_stays_exact(scenario, window):
    """Random workloads (prefix sharing, n > 1, beams, aborts, preemption by recompute and swap)."""
    setup, actions = scenario
    engine = make_engine(**setup, window=window)
    watch_windows(engine, window)
    play(engine, actions)


@pytest.mark.parametrize("window", [5, 8, 13])
def test_a_long_sequence_holds_only_its_window(window):
    """A decode 8x the window long: at most ceil(W / block_size) + 1 blocks at every decode step; all back at
    the end. Without the window it holds its whole length."""
    length = 8 * window
    engine = make_engine(num_kv_blocks=40, max_num_batched_tokens=8, max_model_len=length + 8, window=window)
    held = watch_windows(engine, window)
    prompt = [int(t) for t in np.random.default_rng().integers(1, VOCAB, 8)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=length,
                                                                            ignore_eos=True))
    out = run_checked(engine)["long"]
    assert len(out.outputs[0].token_ids) == length
    assert max(held[1:]) <= cdiv(window, BLOCK_SIZE) + 1, held  # step 0 is the prompt
    assert engine.block_pool.peak_used <= cdiv(window - 1 + 8, BLOCK_SIZE) + 1
    check_all_free(engine)


@pytest.mark.parametrize("mode, host", [("recompute", 0), ("swap", 16)])
def test_a_tight_pool_runs_more_sequences_with_the_window(mode, host):
    """Four sequences 100 tokens long in 14 usable blocks: all four run at once with W = 13 (3 blocks each),
    none is preempted; without the window the pool forces preemptions."""
    def run(window):
        engine = make_engine(num_kv_blocks=15, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=112,
                             mode=mode, num_host_blocks=host, window=window)
        most = []
        execute = engine.runner.execute
        engine.runner.execute = lambda scheduled: (most.append(len(scheduled)), execute(scheduled))[1]
        rng = np.random.default_rng()
        for i in range(4):
            prompt = [int(t) for t in rng.integers(1, VOCAB, 4)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
        outs = run_checked(engine, max_steps=2000)
        assert all(len(o.outputs[0].token_ids) == 96 for o in outs.values())
        check_all_free(engine)
        return engine.scheduler.num_preemptions, max(most)

    assert run(13) == (0, 4)
    assert run(0)[0] > 0


def test_forks_and_swaps_keep_dead_entries_dead():
    """Parallel samples and beams over a prompt longer than the window, swapped out and in: null entries
    are not swapped (no host slot, no device block), shared live blocks are swapped once."""
    rng = np.random.default_rng()
    engine = make_engine(num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=16, mode="swap",
                         num_host_blocks=24, window=11)
    watch_windows(engine, 11)
    for i in range(4):
        prompt = [int(t) for t in rng.integers(1, VOCAB, 30 + i)]
        p = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=20, ignore_eos=True),
             SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=12)][i % 2]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    run_checked(engine)
    check_all_free(engine)
    assert SWAP_OUT in [k for k, _, _ in engine.runner.moves], "the pool was meant to force swapping"


def test_prefix_match_needs_only_the_visible_blocks():
    """A cached prompt whose early blocks were evicted still matches where the next step cannot see them."""
    pool = BlockPool(7)  # the prompt's 6 blocks and the null block: nothing else to hand out first
    kv = KVCacheManager(pool, BLOCK_SIZE, 0, window=13)
    tokens = [int(t) for t in np.random.default_rng().integers(1, VOCAB, 6 * BLOCK_SIZE)]
    first = Sequence(0, list(tokens), len(tokens), 100)
    kv.match_prefix(first)
    kv.reserve(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(first)
    blocks = list(kv.block_ids(first))
    kv.free_dead_blocks(first)  # blocks 0-3: positions <= 48 - 13
    assert kv.block_ids(first) == [NULL_BLOCK] * 4 + blocks[4:]
    taken = pool.allocate(2)  # the least recently freed: blocks 3 and 2 of the prompt, evicted
    assert sorted(taken) == sorted(blocks[2:4])
    second = Sequence(1, tokens + [1], len(tokens) + 1, 100)
    kv.match_prefix(second)
    assert second.num_computed_tokens == len(tokens)
    assert kv.block_ids(second) == [NULL_BLOCK] * 4 + blocks[4:]
    assert len(kv.blocks(second).block_hashes) == 6  # the whole chain, from the tokens
    pool.check([kv.block_ids(first), kv.block_ids(second), taken])
    without_window = KVCacheManager(pool, BLOCK_SIZE, 0)
    third = Sequence(2, tokens + [1], len(tokens) + 1, 100)
    without_window.match_prefix(third)
    assert without_window.block_ids(third) == blocks[:2], "full attention needs every block: the match stops at the eviction"


def test_stats_count_visible_tokens():
    """kv_tokens_stored counts the positions a query can still see, in [p - W + 1, p)."""
    window = 13
    engine = make_engine(num_kv_blocks=20, max_num_batched_tokens=8, max_model_len=80, window=window)
    engine.add_request("a", {"prompt_token_ids": [1] * 8}, SamplingParams(temperature=0, max_tokens=50,
                                                                          ignore_eos=True))
    for _ in range(40):
        engine.step()
        seq = engine.scheduler.running[0].seqs[0]
        p = seq.num_computed_tokens
        stats = engine.stats()
        assert stats["kv_tokens_stored"] == len(range(max(0, p - window + 1), p))
        assert stats["kv_slots_allocated"] == engine.block_pool.num_used * BLOCK_SIZE


def test_mistral_with_a_window_matches_transformers(tmp_path):
    """A random Mistral with sliding_window=W: prompts longer than the window and one shorter whose generation
    crosses it, greedy tokens as transformers'; and a pool too small for the four at full length runs them all
    at once, without a preemption."""
    from transformers import MistralConfig

    from jaxpage import LLM
    from tests.reference import assert_greedy_matches, hf_greedy, save_random_model

    window, block_size, new_tokens = 20, 16, 24
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           sliding_window=window, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    model = save_random_model(config, tmp_path / "mistral", seed=0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 256, n)] for n in (45, 12, 52, 33)]
    blocks_per_seq = cdiv(window - 1 + block_size, block_size) + 1  # chunks of up to 16 tokens
    usable = 4 * blocks_per_seq
    assert sum(cdiv(len(p) + new_tokens, block_size) for p in prompts) > usable, "a pool the window must save"
    llm = LLM(model=str(tmp_path / "mistral"), block_size=block_size, num_kv_blocks=usable + 1,
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, dtype="float32", progress=False)
    assert llm.engine.kv.window == window
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(model, prompt, new_tokens)
        assert_greedy_matches(out.outputs[0].token_ids, ref, ref_logits, context=f"prompt of {len(prompt)}")
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.block_pool.peak_used <= usable
