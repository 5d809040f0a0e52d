"""BlockPool: the host-side allocator of KV blocks, a free list with reference counts."""
from __future__ import annotations

import collections

from jaxpage.kv_cache import NULL_BLOCK


class BlockPool:
    """Hands out physical block ids 1..num_blocks-1 (block 0 is the null block, never handed out)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks={num_blocks} must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = collections.deque(range(1, num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for b in blocks:
            assert self.ref_counts[b] == 0, f"free block {b} still referenced"
            self.ref_counts[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def fork(self, blocks: list[int]) -> None:
        """Another owner now shares these blocks."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"fork of free block {b}"
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b != NULL_BLOCK and self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
