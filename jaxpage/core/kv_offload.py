"""The prefix cache's host tier: which block hashes sit in which slot of the host arena, least recently used
first out. Bookkeeping only: the copies it implies are queued as block moves (kv_cache_manager.DeviceOps) and
carried out by the runner, which holds the arena (the device pool's format, int8 scales included)."""
from __future__ import annotations

import collections
import dataclasses

# Block moves of the tiers, beside kv_cache_manager's COPY/SWAP_OUT/SWAP_IN, in queue order:
OFFLOAD = "offload"  # (OFFLOAD, device block, host slot): a block evicted from the device, copied to the host
RESTORE = "restore"  # (RESTORE, host slot, device block): a host-tier hit restored into a fresh device block
DISK_WRITE = "disk_write"  # (DISK_WRITE, host slot, block hash): a block leaving the host tier, written to disk
DISK_RESTORE = "disk_restore"  # (DISK_RESTORE, block hash, device block): a disk-tier hit read into a fresh block
DISK_DELETE = "disk_delete"  # (DISK_DELETE, block hash, None): a block the disk tier's capacity pushed out
DISK_STORE = "disk_store"  # (DISK_STORE, device block, block hash): a cached device block written through to disk


@dataclasses.dataclass
class OffloadCounters:
    """What the tiers did, in blocks (LLM.stats() turns them into bytes with the block's size)."""

    host_hits: int = 0  # blocks a prefix lookup found in the host tier (restored, not recomputed)
    disk_hits: int = 0  # blocks found in the disk tier and restored (a file the store found bad is not counted)
    stores: int = 0  # blocks copied device -> host tier
    disk_writes: int = 0  # blocks queued for disk: leaving the host tier, or written through from the device
    disk_failed: int = 0  # disk-tier hits whose file the store found missing or bad: computed instead
    dropped: int = 0  # cached blocks leaving the device that no tier took (every host slot pinned by restores)
    hit_tokens: int = 0  # prompt tokens the tiers saved (vLLM's external_prefix_cache_hits)


class HostKVTier:
    """``num_blocks`` host slots holding full blocks by their chained prefix hash; an LRU."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # front = LRU
        self._free = list(range(num_blocks))[::-1]
        self._pinned: dict[bytes, int] = {}  # taken out of the LRU while their restore is queued

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding the block, now the most recently used; None if it is not here."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def add(self, block_hash: bytes) -> tuple[int, tuple[bytes, int] | None] | None:
        """A slot for a new block: a free one, else the least recently used one's, whose (hash, slot) is returned
        as evicted; None if every slot is pinned."""
        assert block_hash not in self._slot_of and block_hash not in self._pinned
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif self._slot_of:
            evicted = self._slot_of.popitem(last=False)
            slot = evicted[1]
        else:
            return None
        self._slot_of[block_hash] = slot
        return slot, evicted

    def blocks(self) -> list[tuple[bytes, int]]:
        """(hash, slot) of every block held, least recently used first."""
        return list(self._slot_of.items())

    def pin(self, block_hash: bytes) -> int:
        """Takes a block out of the LRU (no slot reuse) while its restore is queued; ``unpin`` puts it back."""
        slot = self._slot_of.pop(block_hash)
        self._pinned[block_hash] = slot
        return slot

    def unpin_all(self) -> None:
        for block_hash, slot in self._pinned.items():
            self._slot_of[block_hash] = slot  # most recently used
        self._pinned.clear()

    def check(self) -> None:
        """Asserts the accounting: every slot is free or holds one hash, none pinned between schedules."""
        slots = list(self._slot_of.values())
        assert not self._pinned, "host-tier blocks still pinned"
        assert len(set(slots)) == len(slots), "a host-tier slot holds two blocks"
        assert not set(slots) & set(self._free) and len(set(self._free)) == len(self._free)
        assert sorted(slots + self._free) == list(range(self.num_blocks)), "a host-tier slot lost"
