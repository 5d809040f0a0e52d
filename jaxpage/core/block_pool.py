"""BlockPool: the host-side allocator of KV blocks: reference counts, an LRU free queue and the prefix cache."""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterator

import numpy as np

from jaxpage.attention.kv_cache import NULL_BLOCK


def hash_block(parent: bytes | None, token_ids: list[int], lora_int_id: int = 0) -> bytes:
    """Prefix-cache key of a full block: chained from its parent's key, so equal keys mean equal prefixes; the
    first block's from the LoRA adapter the K/V were computed with (two adapters never share a block)."""
    h = hashlib.blake2b(parent or (b"lora%d" % lora_int_id if lora_int_id else b"root"), digest_size=16)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


def hash_blocks(token_ids: list[int], block_size: int, lora_int_id: int = 0) -> Iterator[bytes]:
    """The chain of hash_block keys of token_ids' full blocks, first to last, each computed when it is taken (a
    caller that stops at its first miss hashes no further). The engine's prefix lookup and the data-parallel
    router's both walk this one chain."""
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], lora_int_id)
        yield parent


class BlockPool:
    """Hands out block ids 1..num_blocks-1 (block 0 is the null block, never handed out).

    A block whose reference count drops to zero goes to the back of the free queue but, if it holds a full
    cached block, stays findable by its hash until it is handed out again: least recently freed go first.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks={num_blocks} must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # front = LRU. An OrderedDict, not a dict: taking a dict's first key scans past every key deleted from its
        # front since it was last resized, which made each allocation cost microseconds per thousand blocks
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.peak_used = 0
        self.num_shared = 0  # blocks with more than one holder
        # called with (block, hash) as a cached block leaves the device cache (the prefix cache's host tier)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self._free if b in self._hash_of)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            assert self.ref_counts[block] == 0, f"free block {block} still referenced"
            self.ref_counts[block] = 1
            blocks.append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another owner now holds these blocks (a fork, or a prefix-cache hit on a possibly free block)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
            self.num_shared += self.ref_counts[b] == 2
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each; pass a table tail first so a prefix outlives its extensions."""
        for b in blocks:
            assert b != NULL_BLOCK and self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            self.num_shared -= self.ref_counts[b] == 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Makes a full block findable by its hash (the first holder of a hash keeps it)."""
        if self.enable_prefix_caching and block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(hash, block) of every cached block, held or free."""
        return list(self._cached.items())

    def uncache(self, block: int) -> bytes | None:
        """Makes a block unfindable by its hash (its K/V turned out not to be the prefix's); returns the hash."""
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._cached[block_hash]
        return block_hash

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._cached[block_hash]
            if self.on_evict is not None:
                self.on_evict(block, block_hash)

    def check(self, tables: list[list[int]]) -> None:
        """Asserts the accounting: references equal table entries (null ones, dead blocks of a sliding window,
        hold nothing); free means unreferenced."""
        counts = [0] * self.num_blocks
        for table in tables:
            for b in table:
                counts[b] += 1
        counts[NULL_BLOCK] = 0
        assert counts == self.ref_counts, "reference counts differ from the tables"
        assert all((self.ref_counts[b] == 0) == (b in self._free) for b in range(1, self.num_blocks))
        assert all(self._cached[h] == b for b, h in self._hash_of.items())
        assert self.num_shared == sum(c > 1 for c in self.ref_counts)
