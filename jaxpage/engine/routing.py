"""The data-parallel front end's choice of replica (``RoutingConfig``): by load, or cache-aware as sglang-router's
``cache_aware`` policy.

Cache-aware: per replica a ``PrefixIndex`` of the block hashes of the prompts it was sent, the same chain the
engine's prefix cache keys blocks by (``block_pool.hash_blocks``: chained, LoRA-keyed), bounded in entries and
least recently sent first out, so it approximates what the replica's cache still holds without asking it (the
engine evicts on its own). A request goes to the replica with the longest matching prefix when the part of the
match beyond the prompt's shared head covers at least ``cache_threshold`` of the prompt beyond that head, and the
replica is not much busier than the least loaded; otherwise to the least loaded. sglang-router gives way to load
when the busiest and the idlest replicas differ by the thresholds, whichever the prefix's is; here only when the
prefix's replica is the busy one.

The shared head (``Branches``): the prompt's blocks up to the last one after which two requests the router was
sent went on differently (a system prompt, a few-shot header). Every replica is about as likely to hold it, and
counting it made the first replica sent a common system prompt "hit" every new conversation
(benchmarks/RESULTS.md, "Multi-turn conversations"); a conversation's later turns extend its earlier prompts
without branching, so their own blocks still count. sglang-router counts the whole match.
"""
from __future__ import annotations

import collections
import dataclasses

from jaxpage.config import RoutingConfig
from jaxpage.core.block_pool import hash_blocks

DECISIONS = ("load", "cache_hit", "cache_miss", "balance_fallback")


class PrefixIndex:
    """The block hashes one replica was sent, at most ``max_entries`` of them, least recently sent dropped first."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._hashes: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain the replica was sent."""
        for n, block_hash in enumerate(hashes):
            if block_hash not in self._hashes:
                return n
        return len(hashes)

    def insert(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_entries:
            self._hashes.popitem(last=False)


SHARED = object()  # Branches: two requests went on differently after this block


class Branches:
    """Per block hash the router was sent, the block that followed it, or SHARED once two requests went on
    differently after it; at most ``max_entries`` hashes, least recently sent dropped first."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._next: collections.OrderedDict[bytes, object] = collections.OrderedDict()

    def shared_head(self, hashes: list[bytes]) -> int:
        """Records the chain's links; returns its shared head: the blocks up to the last one after which two
        requests (this one included) went on differently, 0 if none."""
        head = 0
        for n, (block_hash, child) in enumerate(zip(hashes, hashes[1:]), 1):
            seen = self._next.get(block_hash, child)
            self._next[block_hash] = seen if seen == child else SHARED
            self._next.move_to_end(block_hash)
            if self._next[block_hash] is SHARED:
                head = n
        while len(self._next) > self.max_entries:
            self._next.popitem(last=False)
        return head


@dataclasses.dataclass
class Router:
    """Picks the replica of each request and counts its decisions by kind (``DECISIONS``): load (the load
    policy), cache_hit (the longest prefix's replica), cache_miss (no prefix long enough beyond the shared head:
    by load), balance_fallback (the prefix's replica was much busier: by load)."""

    config: RoutingConfig
    num_replicas: int
    block_size: int
    index_entries: int  # each replica's PrefixIndex bound: its pool's blocks
    decisions: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(DECISIONS, 0))
    matched_tokens: int = 0  # prompt tokens of cache-aware requests their chosen replica had been sent

    def __post_init__(self):
        self.indexes = [PrefixIndex(self.index_entries) for _ in range(self.num_replicas)]
        self.branches = Branches(self.num_replicas * self.index_entries)

    def choose(self, load: list[int], token_ids: list[int], lora_int_id: int = 0) -> int:
        """The rank for a request, given each replica's requests in flight; the chosen replica's index takes the
        prompt's blocks."""
        least = min(range(self.num_replicas), key=lambda r: (load[r], r))
        if self.config.policy == "load":
            return self._decided("load", least)
        hashes = list(hash_blocks(token_ids, self.block_size, lora_int_id))
        shared = self.branches.shared_head(hashes)
        matches = [index.match(hashes) for index in self.indexes]
        best = max(range(self.num_replicas), key=lambda r: (matches[r], -load[r], -r))
        own = (matches[best] - shared) * self.block_size  # the match's tokens beyond the shared head
        if own <= 0 or own < self.config.cache_threshold * (len(token_ids) - shared * self.block_size):
            rank = self._decided("cache_miss", least)
        elif self._much_busier(load[best], load[least]):
            rank = self._decided("balance_fallback", least)
        else:
            rank = self._decided("cache_hit", best)
        self.matched_tokens += matches[rank] * self.block_size
        self.indexes[rank].insert(hashes)
        return rank

    def _much_busier(self, busy: int, idle: int) -> bool:
        return (busy - idle > self.config.balance_abs_threshold
                and busy > self.config.balance_rel_threshold * idle)

    def _decided(self, decision: str, rank: int) -> int:
        self.decisions[decision] += 1
        return rank

    def stats(self) -> dict:
        return {"policy": self.config.policy, **{f"routed_{d}": n for d, n in self.decisions.items()},
                "routed_matched_tokens": self.matched_tokens,
                "routing_index_blocks": [len(index) for index in self.indexes]}
