"""The scheduler's side of the prefix cache's disk tier (vLLM's connector roles: the worker's side is
worker/kv_disk_store.py, which holds the files): which block hashes are on disk, least recently used first out,
within the tier's capacity in blocks. Bookkeeping in memory only, so a prefix lookup reads no file: the KV manager
queues the writes, reads and deletes it decides as block moves (core/kv_offload.py), and a read the store finds bad
comes back as a failed load (``discard``)."""
from __future__ import annotations

import collections


class DiskKVIndex:
    """capacity: the blocks the directory may hold (kv_offloading_disk_bytes over a file's size); stored: the
    hashes found on disk at start, least recently written first (those past the capacity are ``evicted``)."""

    def __init__(self, capacity: int, stored: list[bytes] = ()):
        if capacity < 1:
            raise ValueError(f"the disk tier's capacity is {capacity} blocks: it must hold at least one")
        self.capacity = capacity
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # front = least recently used
        self.evicted: list[bytes] = []  # taken by the KV manager, which queues their deletion
        for block_hash in stored:
            self.evicted += self.add(block_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self):
        return iter(self._lru)

    def touch(self, block_hash: bytes) -> None:
        """A block read: now the most recently used."""
        self._lru.move_to_end(block_hash)

    def add(self, block_hash: bytes) -> list[bytes]:
        """A block written; returns the least recently used blocks it pushes out (their files are deleted)."""
        self._lru[block_hash] = None
        self._lru.move_to_end(block_hash)
        out = []
        while len(self._lru) > self.capacity:
            out.append(self._lru.popitem(last=False)[0])
        return out

    def discard(self, block_hash: bytes) -> None:
        """A block whose file could not be read (missing, truncated, corrupt or foreign: the store deleted it)."""
        self._lru.pop(block_hash, None)
