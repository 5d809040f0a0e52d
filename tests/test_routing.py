"""The data-parallel router on its own (jaxpage/engine/routing.py): the hash chain it computes is the engine's, a
prefix goes back to the replica it was sent to, the load thresholds, the index's bound, and bad options refused
by name. The router inside DataParallelEngine, on forced CPU devices: tests/test_data_parallel.py."""
from __future__ import annotations

import numpy as np
import pytest

from jaxpage.config import RoutingConfig
from jaxpage.core.block_pool import BlockPool, hash_blocks
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.routing import Branches, PrefixIndex, Router
from jaxpage.sequence import Sequence

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def router(policy="cache_aware", entries=1000, **thresholds) -> Router:
    return Router(RoutingConfig(policy, **thresholds), 2, BS, entries)


@pytest.mark.parametrize("lora_int_id", [0, 3])
def test_the_routers_chain_is_the_one_the_engine_caches_blocks_under(lora_int_id):
    prompt = tokens(0, 5 * BS + 7)
    kv = KVCacheManager(BlockPool(12), BS, 0)
    seq = Sequence(0, list(prompt), len(prompt), 200, lora_int_id=lora_int_id)
    kv.match_prefix(seq)
    kv.allocate_slots(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(seq)  # the engine's incremental path, block by block from the parent's hash
    hashes = kv.blocks(seq).block_hashes
    assert list(hash_blocks(prompt, BS, lora_int_id)) == hashes and len(hashes) == 5
    again = Sequence(1, prompt + [1], len(prompt) + 1, 200, lora_int_id=lora_int_id)
    kv.match_prefix(again)
    assert again.num_computed_tokens == 5 * BS  # the engine's lookup walks the same chain


def test_a_prefix_sent_again_goes_to_its_replica_and_load_decides_the_rest():
    r = router()
    a, b = tokens(1, 4 * BS), tokens(2, 4 * BS)
    assert r.choose([0, 0], a) == 0  # nothing matches: the least loaded, lowest rank
    assert r.choose([1, 0], b) == 1
    assert r.choose([0, 0], b + tokens(3, 20)) == 1  # 64 of 84 tokens match on replica 1
    assert r.choose([0, 0], a + tokens(4, BS)) == 0
    assert r.choose([0, 1], tokens(5, 3 * BS)) == 0  # no match: by load
    assert r.decisions == {"load": 0, "cache_hit": 2, "cache_miss": 3, "balance_fallback": 0}
    assert r.matched_tokens == 8 * BS
    plain = router("load")
    assert [plain.choose(load, a) for load in ([0, 0], [1, 0], [0, 0])] == [0, 1, 0]
    assert plain.decisions["load"] == 3


def test_a_match_below_cache_threshold_goes_by_load():
    r = router(cache_threshold=0.5)
    a, b = tokens(6, 2 * BS), tokens(8, 2 * BS)
    assert r.choose([0, 0], a) == 0
    assert r.choose([3, 0], a + tokens(7, 2 * BS + 1)) == 1  # 32 of 65 tokens: under half
    assert r.choose([0, 3], b) == 0
    assert r.choose([3, 0], b + tokens(9, 2 * BS - 1)) == 0  # 32 of 63: over half
    assert r.decisions["cache_miss"] == 3 and r.decisions["cache_hit"] == 1


FIRST_LOADS = ([0, 0], [1, 0], [1, 1], [2, 1])  # each first turn stays in flight


def conversations(system: list[int], count: int, turns: int) -> list[list[list[int]]]:
    """Each conversation's prompt turn by turn: the system prompt, then each turn a 40-token message and (from
    the second turn) the 12-token answer to the turn before, as benchmarks/multi_turn.py sends them."""
    out = []
    for c in range(count):
        prompt, prompts = list(system), []
        for turn in range(turns):
            prompt = prompt + (tokens(1000 * c + 2 * turn, 12) if turn else []) + tokens(1000 * c + 2 * turn + 1, 40)
            prompts.append(prompt)
        out.append(prompts)
    return out


def test_new_conversations_sharing_a_system_prompt_spread_by_load():
    """The 2-block system prompt is 44 % of a first turn, over cache_threshold: counted as a hit, it sent every
    new conversation to replica 0. Once two conversations went on differently after it, it is the shared head,
    and a first turn matches nothing beyond it."""
    firsts = [prompts[0] for prompts in conversations(tokens(99, 2 * BS), 4, 1)]
    r = router()
    assert [r.choose(load, p) for load, p in zip(FIRST_LOADS, firsts)] == [0, 1, 0, 1]
    assert r.decisions["cache_miss"] == 4 and r.decisions["cache_hit"] == 0


def test_a_conversations_later_turns_go_back_to_its_replica_past_a_shared_system_prompt():
    chats = conversations(tokens(99, 2 * BS), 4, 3)
    r = router()
    ranks = [r.choose(load, chat[0]) for load, chat in zip(FIRST_LOADS, chats)]
    assert ranks == [0, 1, 0, 1]
    for turn in (1, 2):
        for c in range(4):  # the conversation's replica the busier one (by less than the balance thresholds)
            load = [0, 0]
            load[ranks[c]] = 3
            assert r.choose(load, chats[c][turn]) == ranks[c], (c, turn)
    assert r.decisions == {"load": 0, "cache_hit": 8, "cache_miss": 4, "balance_fallback": 0}


def test_the_shared_head_ends_where_two_requests_went_on_differently():
    branches = Branches(100)
    system, x, y = tokens(20, 2 * BS), tokens(21, 3 * BS), tokens(22, 3 * BS)
    chain = lambda t: list(hash_blocks(t, BS))  # noqa: E731
    assert branches.shared_head(chain(system + x)) == 0  # one request: nothing shared yet
    assert branches.shared_head(chain(system + x + y)) == 0  # its next turn extends it
    assert branches.shared_head(chain(system + y)) == 2  # went on differently after the system prompt
    assert branches.shared_head(chain(system + x[:BS] + y)) == 3  # and after x's first block
    assert branches.shared_head(chain(system)) == 0  # no block of its own follows one of the shared ones


def test_the_prefixs_replica_gives_way_only_when_much_busier():
    a = tokens(9, 4 * BS)
    r = router()  # sglang-router's defaults: more than 64 requests more, and more than 1.5 times as many
    r.choose([0, 0], a)
    assert r.choose([64, 0], a) == 0  # 64 more: not more than balance_abs_threshold
    assert r.choose([100, 60], a) == 0  # 40 more
    assert r.choose([200, 135], a) == 0  # 65 more, but 1.48 times as many
    assert r.choose([66, 1], a) == 1  # 65 more and 66 times as many: the least loaded
    assert r.decisions == {"load": 0, "cache_hit": 3, "cache_miss": 1, "balance_fallback": 1}
    # both replicas were sent it now: the less loaded of the two
    assert r.choose([5, 9], a) == 0 and r.choose([9, 5], a) == 1


def test_each_replicas_index_keeps_its_most_recently_sent_blocks():
    index = PrefixIndex(4)
    first, second = list(hash_blocks(tokens(10, 3 * BS), BS)), list(hash_blocks(tokens(11, 3 * BS), BS))
    index.insert(first)
    assert index.match(first) == 3
    index.insert(second)  # 6 hashes into 4 places: the first prompt's oldest two blocks go
    assert len(index) == 4 and index.match(second) == 3 and index.match(first) == 0
    r = router(entries=2 * 4)
    r.choose([0, 0], tokens(12, 4 * BS))
    assert r.stats()["routing_index_blocks"] == [4, 0]


def test_an_adapters_prefix_matches_only_under_that_adapter():
    r = router()
    a = tokens(13, 4 * BS)
    assert r.choose([0, 0], a, lora_int_id=1) == 0
    assert r.choose([1, 0], a, lora_int_id=2) == 1  # the same tokens, another adapter: no match
    assert r.choose([1, 0], a, lora_int_id=1) == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"policy": "round_robin"}, "data_parallel_routing='round_robin' must be one of 'load', 'cache_aware'"),
    ({"cache_threshold": 1.5}, "cache_threshold=1.5 must be in"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold=-1 must be an integer >= 0"),
    ({"balance_rel_threshold": 0.5}, "balance_rel_threshold=0.5 must be >= 1"),
])
def test_bad_routing_options_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**changes)


def test_the_routing_flags_are_sglang_routers():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--data-parallel-routing", "load", "--cache-threshold", "0.5",
                            "--balance-abs-threshold", "8", "--balance-rel-threshold", "1.2"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.data_parallel_routing, args.cache_threshold, args.balance_abs_threshold,
            args.balance_rel_threshold) == ("load", 0.5, 8, 1.2)
    assert EngineArgs().data_parallel_routing == "cache_aware"
