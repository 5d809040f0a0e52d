"""The runner's side of the prefix cache's host and disk tiers: the host arena (the device pool's format, an
int8 pool's scales included), the disk tier's files (worker/kv_disk_store.py), and the tier moves the KV manager
queues (core/kv_offload.py).

An OFFLOAD gathers the evicted blocks on the device in one batched call, queued in device order before any
later write into them (the step that reuses a block runs after the gather), and starts their copy to the host;
the host-side store into the arena (and any DISK_WRITE after it: a copy handed to the disk tier's writer thread)
is left pending and done once the step is launched, so it overlaps the step. A RESTORE first finishes what is
pending (it may read a slot just stored), then loads the slots into fresh blocks in one batched host-to-device
scatter; a DISK_RESTORE too, after reading the files (a block just written is read from the store's queued copy).
A file the store finds missing or bad leaves its block unrestored and is reported (``take_failed_loads``).
Under tensor parallelism the gathered blocks and the loads are sharded as the pool is
(``block_moves.store_blocks``/``load_blocks``)."""
from __future__ import annotations

import functools
import hashlib
import time

import jax
import numpy as np

from jaxpage.attention.block_moves import BlockMoves, padded_ids, store_blocks
from jaxpage.attention.kv_cache import host_kv_pool, kv_pool_shape, packs_kv
from jaxpage.config import EngineConfig
from jaxpage.core.kv_offload import DISK_DELETE, DISK_RESTORE, DISK_STORE, DISK_WRITE, OFFLOAD, RESTORE
from jaxpage.worker.kv_disk_store import DiskKVStore

TIER_MOVES = (OFFLOAD, RESTORE, DISK_WRITE, DISK_RESTORE, DISK_DELETE, DISK_STORE)


def kv_identity(config: EngineConfig, params, model_name: str = "") -> dict:
    """What a block's K/V depend on besides its tokens: the model (its config and a fingerprint of its weights:
    every leaf's path, shape, dtype and first values), the KV dtype, the block size and the layout."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda kv: str(kv[0])):
        head = np.asarray(leaf.reshape(-1)[:64] if hasattr(leaf, "reshape") else leaf)
        h.update(f"{jax.tree_util.keystr(path)}{np.shape(leaf)}{head.dtype}".encode() + head.tobytes())
    return {"model": model_name, "model_config": repr(config.model), "weights": h.hexdigest(),
            "kv_dtype": config.kv_dtype, "block_size": config.cache.block_size,
            "layout": repr(kv_pool_shape(config.model, 0, config.cache.block_size,
                                         packs_kv(config.model, config.attention_backend)))}


class KVTierMoves:
    """The host arena of ``config.cache.num_offload_blocks`` blocks and, with ``kv_offloading_dir``, the disk tier."""

    def __init__(self, config: EngineConfig, kv_dtype, block_moves: BlockMoves, move_size: int, identity: dict):
        self.arena = host_kv_pool(config.model, config.cache.num_offload_blocks, config.cache.block_size, kv_dtype,
                                  packs_kv(config.model, config.attention_backend))
        leaves = [(a.dtype, a.shape[:1] + a.shape[2:]) for a in jax.tree.leaves(self.arena)]
        directory = config.cache.kv_offloading_dir
        self.disk_store = DiskKVStore(directory, identity, leaves) if directory else None
        self.block_moves = block_moves
        self.move_size = move_size
        self._pending: list = []  # host-side work in queue order: stores into the arena, disk writes
        self._failed_loads: list[int] = []  # device blocks whose DISK_RESTORE found no good file
        self.store_seconds = self.restore_seconds = 0.0

    def apply(self, pool, kind: str, src: list, dst: list):
        """One run of consecutive moves of one kind, in calls of ``move_size`` blocks; returns the pool."""
        size = self.move_size
        for i in range(0, len(src), size):
            s, d = src[i:i + size], dst[i:i + size]
            if kind == OFFLOAD:
                self._pending.append(functools.partial(self._store, self._gather(pool, s), np.asarray(d)))
            elif kind == DISK_WRITE:
                self._pending.append(functools.partial(self._write, s, d))
            elif kind == RESTORE:
                self.finish()
                started = time.perf_counter()
                pool = self.block_moves.swap_in(pool, self.arena, padded_ids(s, size), padded_ids(d, size))
                self.restore_seconds += time.perf_counter() - started
            elif kind == DISK_RESTORE:
                self.finish()
                started = time.perf_counter()
                read = [self.disk_store.read(block_hash) for block_hash in s]
                self._failed_loads += [block for block, arrays in zip(d, read) if arrays is None]
                good = [(arrays, block) for arrays, block in zip(read, d) if arrays is not None]
                if good:
                    pool = self.block_moves.swap_in(pool, self._stacked([a for a, _ in good]), np.arange(size),
                                                    padded_ids([b for _, b in good], size))
                self.restore_seconds += time.perf_counter() - started
            elif kind == DISK_DELETE:
                self._pending.append(functools.partial(self._delete, s))
            elif kind == DISK_STORE:  # gathered as an OFFLOAD is, handed to the disk's writer after the launch
                self._pending.append(functools.partial(self._store_on_disk, self._gather(pool, s), d))
            else:
                raise ValueError(kind)
        return pool

    def _gather(self, pool, blocks: list[int]):
        """The blocks gathered on the device in one padded call, their copy to the host started."""
        gathered = self.block_moves.gather(pool, padded_ids(blocks, self.move_size))
        for leaf in jax.tree.leaves(gathered):
            leaf.copy_to_host_async()
        return gathered

    def finish(self) -> None:
        """Does the pending host-side work (after the step is launched, or before a restore reads the arena)."""
        pending, self._pending = self._pending, []
        for work in pending:
            work()

    def _store(self, gathered, slots: np.ndarray) -> None:
        started = time.perf_counter()
        jax.tree.map(functools.partial(store_blocks, blocks=slots), self.arena, gathered)
        self.store_seconds += time.perf_counter() - started

    def take_failed_loads(self) -> list[int]:
        """The device blocks whose DISK_RESTORE failed since the last call (vLLM's invalid_block_ids)."""
        failed, self._failed_loads = self._failed_loads, []
        return failed

    def _write(self, slots: list[int], hashes: list[bytes]) -> None:
        for slot, block_hash in zip(slots, hashes):
            self.disk_store.write(block_hash, [a[:, slot] for a in jax.tree.leaves(self.arena)])

    def _store_on_disk(self, gathered, hashes: list[bytes]) -> None:
        """Written through: dropped, not waited for, when the disk's writer is behind (its load then fails and
        its blocks are computed: Scheduler.recompute_failed_loads)."""
        leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(gathered)]
        for j, block_hash in enumerate(hashes):
            self.disk_store.write(block_hash, [leaf[:, j] for leaf in leaves], wait=False)

    def _delete(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            self.disk_store.delete(block_hash)

    def _stacked(self, blocks: list[list[np.ndarray]]):
        """Blocks read from disk as an arena-like pytree of ``move_size`` blocks (the rest zeros)."""
        out = []
        for k, a in enumerate(jax.tree.leaves(self.arena)):
            data = np.zeros((a.shape[0], self.move_size, *a.shape[2:]), a.dtype)
            for j, arrays in enumerate(blocks):
                data[:, j] = arrays[k]
            out.append(data)
        return jax.tree.unflatten(jax.tree.structure(self.arena), out)
