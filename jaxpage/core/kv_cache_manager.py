"""KVCacheManager: the block tables of sequences: prefix matching, growth, copy-on-write, forks and swapping.

It only does bookkeeping; the device work it implies (block copies, swaps) is queued in ``DeviceOps`` for the
model runner to carry out before the step that needs it.

Sliding window (``window`` W > 0, for models whose every layer has that window): a block whose last position is
at most ``p - W``, p being the first position of the next step (``num_computed_tokens``), is dead: no query can
see it again. Dead blocks go back to the pool (a shared one loses a reference) and NULL_BLOCK takes their place
in the table; they always form a prefix of it. A sequence's hashes still cover every block (they come from its
tokens), so blocks computed later are cached under the right chained hashes.

The prefix cache's tiers (``host_tier``, ``disk_index``: bookkeeping of which hashes are where, no file read):
a cached block leaving the device cache is copied to the host tier (an OFFLOAD move, queued before any move or
step that writes the block), the host tier's least recently used block to the disk tier (DISK_WRITE, and a
DISK_DELETE of each block the disk tier's capacity pushes out); a prefix block missing on the device but found in
a tier gets a fresh device block and a RESTORE (or DISK_RESTORE) move, queued before the sequence's first step. A
DISK_RESTORE whose file the worker finds bad comes back as a failed load (``forget_failed_loads``).
"""
from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable

from jaxpage.attention.kv_cache import NULL_BLOCK
from jaxpage.core.block_pool import BlockPool, hash_block, hash_blocks
from jaxpage.core.kv_disk_index import DiskKVIndex
from jaxpage.core.kv_offload import (
    DISK_DELETE,
    DISK_RESTORE,
    DISK_STORE,
    DISK_WRITE,
    OFFLOAD,
    RESTORE,
    HostKVTier,
    OffloadCounters,
)
from jaxpage.sequence import Sequence
from jaxpage.utils import cdiv

COPY, SWAP_OUT, SWAP_IN = "copy", "swap_out", "swap_in"
NULL_HOST = -1  # a dead block in a swapped sequence's table of host slots (host slot 0 is a real one)
IN_HOST, ON_DISK = "host", "disk"  # where match_prefix found a block that is not on the device


@dataclasses.dataclass
class DeviceOps:
    """Block moves to apply before the next step, in the order they were queued (a later op may read what an
    earlier one wrote): (COPY, src block, dst block), (SWAP_OUT, block, host slot), (SWAP_IN, host slot, block),
    and the prefix cache tiers' moves (core/kv_offload.py: OFFLOAD, RESTORE, DISK_WRITE, DISK_RESTORE)."""

    moves: list[tuple[str, object, object]] = dataclasses.field(default_factory=list)

    def batches(self) -> list[tuple[str, list, list]]:
        """Consecutive moves of one kind, as (kind, sources, destinations)."""
        out: list[tuple[str, list, list]] = []
        for kind, src, dst in self.moves:
            if not out or out[-1][0] != kind:
                out.append((kind, [], []))
            out[-1][1].append(src)
            out[-1][2].append(dst)
        return out


@dataclasses.dataclass(eq=False, slots=True)
class KVCacheBlocks:
    """A sequence's blocks (vLLM's KVCacheBlocks), written by the KV manager alone: its block table (device
    blocks; NULL_BLOCK where a sliding window let one go; host slots while swapped out, NULL_HOST for dead ones)
    and the prefix-cache hashes of its full blocks. Others read them (``KVCacheManager.blocks``); the lists are
    changed in place, so a step's row may hold its sequence's table (ScheduledSeq.block_ids)."""

    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)


NO_BLOCKS = KVCacheBlocks((), ())  # what a sequence holding no blocks reads (tuples: never written)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, num_host_blocks: int, window: int = 0,
                 host_tier: HostKVTier | None = None, disk_index: DiskKVIndex | None = None,
                 disk_stores_per_step: int = 8):
        self.pool = block_pool
        self.block_size = block_size
        self.window = window  # 0: every block stays visible
        self.host_free = collections.deque(range(num_host_blocks))
        self.num_host_blocks = num_host_blocks
        self.ops = DeviceOps()
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found on the device
        self.host_tier = host_tier
        self.disk_index = disk_index if host_tier is not None else None
        self.offload = OffloadCounters()
        self.seq_blocks: dict[Sequence, KVCacheBlocks] = {}  # the sequences holding blocks (running or swapped)
        # the disk tier's write-through: at most this many newly cached device blocks queued for disk a step
        self.disk_stores_per_step, self._disk_stores = disk_stores_per_step, 0
        if self.disk_index is not None:  # files found at start past the capacity
            self.ops.moves += [(DISK_DELETE, block_hash, None) for block_hash in self.disk_index.evicted]
            self.disk_index.evicted = []
        if host_tier is not None:
            block_pool.on_evict = self._offload

    def blocks(self, seq: Sequence) -> KVCacheBlocks:
        """The sequence's blocks (NO_BLOCKS if it holds none), to read."""
        return self.seq_blocks.get(seq, NO_BLOCKS)

    def block_ids(self, seq: Sequence) -> list[int]:
        return self.seq_blocks.get(seq, NO_BLOCKS).block_ids

    def _own(self, seq: Sequence) -> KVCacheBlocks:
        blocks = self.seq_blocks.get(seq)
        if blocks is None:
            blocks = self.seq_blocks[seq] = KVCacheBlocks()
        return blocks

    def take_ops(self) -> DeviceOps:
        ops, self.ops = self.ops, DeviceOps()
        self._disk_stores = 0
        return ops

    # --- what the scheduler asks of the pool ---------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def writes_shared_block(self, seq: Sequence) -> bool:
        """Whether the sequence's next token goes into a block someone else holds (it is copied first). A prefix
        cache's shared blocks are full, so only a fork's partly filled last block is ever written shared."""
        return self.pool.num_shared > 0 and self._shared_write_block(seq) is not None

    def has_room(self, seq: Sequence, num_new: int) -> bool:
        """Whether the sequence's blocks hold num_new more tokens with no block to allocate or copy (the common
        decode step)."""
        return self.holds(seq, num_new) and not self.writes_shared_block(seq)

    def holds(self, seq: Sequence, num_new: int) -> bool:
        """Whether the sequence's blocks have room for num_new more tokens (shared or not)."""
        table = self.seq_blocks.get(seq, NO_BLOCKS).block_ids
        return seq.num_computed_tokens + num_new <= len(table) * self.block_size

    def blocks_to_recompute(self, seqs: list[Sequence]) -> int:
        """Blocks to compute these sequences afresh: with prefix caching the full blocks of their common prefix
        once (the first computes them, the others find them cached), the rest each."""
        bs = self.block_size
        common = len(os.path.commonprefix([s.token_ids for s in seqs])) // bs if self.pool.enable_prefix_caching else 0
        return common + sum(cdiv(s.num_tokens, bs) - common for s in seqs)

    # --- admission and growth -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, tiers: bool = True) -> None:
        """Reuses cached blocks for the longest cached prefix; the last token is always left to compute. With a
        window, only the blocks the next step can see must be cached: the dead ones before them become null.
        Blocks found in the host or disk tier are restored into fresh blocks (tiers=False: the device's only,
        the retry when the pool has too few free blocks for them)."""
        assert seq not in self.seq_blocks and seq.num_computed_tokens == 0
        bs, tokens = self.block_size, seq.token_ids
        hashes, cached = [], []
        for block_hash in hash_blocks(tokens[:(seq.num_tokens - 1) // bs * bs], bs, seq.lora_int_id):
            hashes.append(block_hash)
            cached.append(self._find(hashes[-1], tiers))
            if cached[-1] is None and not self.window:
                break
        hit = self._longest_hit(cached)
        dead = self.dead_blocks(hit * bs)
        live = cached[dead:hit]
        on_device = [b for b in live if isinstance(b, int)]
        self.pool.share(on_device)
        if len(on_device) < len(live):
            enough = len(live) - len(on_device) <= self.pool.num_free
            if not enough:  # too few free blocks for the tiers' hits: the device's hits only
                self.pool.free(on_device[::-1])
                return self.match_prefix(seq, tiers=False)
            live = self._restore(live, hashes[dead:hit])
        self.seq_blocks[seq] = KVCacheBlocks([NULL_BLOCK] * dead + live, hashes[:hit])
        seq.num_computed_tokens = hit * bs
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens - (len(live) - len(on_device)) * bs  # the device's

    def _find(self, block_hash: bytes, tiers: bool) -> int | str | None:
        """The device block holding a prefix block, or IN_HOST / ON_DISK, or None."""
        block = self.pool.lookup(block_hash)
        if block is not None or not tiers or self.host_tier is None:
            return block
        if block_hash in self.host_tier:
            return IN_HOST
        return ON_DISK if self.disk_index is not None and block_hash in self.disk_index else None

    def _restore(self, live: list, hashes: list[bytes]) -> list[int]:
        """Fresh device blocks for the entries found in a tier, their restores queued (one batched copy per
        tier before the step; the caller made sure the pool has the blocks)."""
        fresh = [i for i, b in enumerate(live) if not isinstance(b, int)]
        source: dict[int, object] = {}
        for i in fresh:  # the host slots may not be reused by the evictions that allocate() makes
            if live[i] == IN_HOST:
                source[i] = self.host_tier.pin(hashes[i])
            else:
                source[i] = hashes[i]
                self.disk_index.touch(hashes[i])
        blocks = self.pool.allocate(len(fresh))
        self.host_tier.unpin_all()
        table = list(live)
        for i, block in zip(fresh, blocks):
            self.ops.moves.append((DISK_RESTORE if live[i] == ON_DISK else RESTORE, source[i], block))
            self.pool.cache(block, hashes[i])
            table[i] = block
        disk = sum(live[i] == ON_DISK for i in fresh)
        self.offload.disk_hits += disk
        self.offload.host_hits += len(fresh) - disk
        self.offload.hit_tokens += len(fresh) * self.block_size
        return table

    def forget_failed_loads(self, blocks: Iterable[int]) -> None:
        """Device blocks whose DISK_RESTORE the worker could not carry out (their file missing or bad): no longer
        cached (their K/V is not the prefix's) nor on disk, nor counted as hits. Their holders must compute them
        (Scheduler.recompute_failed_loads)."""
        for block in blocks:
            block_hash = self.pool.uncache(block)
            if block_hash is not None:
                self.disk_index.discard(block_hash)
            self.offload.disk_hits -= 1
            self.offload.disk_failed += 1
            self.offload.hit_tokens -= self.block_size

    def _offload(self, block: int, block_hash: bytes) -> None:
        """A cached block leaving the device cache: copied into the host tier (unless it is there already), the
        host tier's least recently used block written to the disk tier first if its slot is taken (and the disk
        tier's least recently used blocks deleted past its capacity)."""
        if self.host_tier.lookup(block_hash) is not None:
            return
        taken = self.host_tier.add(block_hash)
        if taken is None:  # every slot is pinned by a restore queued now
            self.offload.dropped += 1
            return
        slot, evicted = taken
        if evicted is not None and self.disk_index is not None and evicted[0] not in self.disk_index:
            self._queue_for_disk(DISK_WRITE, slot, evicted[0])
        self.ops.moves.append((OFFLOAD, block, slot))
        self.offload.stores += 1

    def _longest_hit(self, cached: list[int | None]) -> int:
        """The most leading blocks whose live part (all of them without a window) is cached."""
        for hit in range(len(cached), 0, -1):
            if None not in cached[self.dead_blocks(hit * self.block_size):hit]:
                return hit
        return 0

    def dead_blocks(self, position: int) -> int:
        """Leading blocks that no query at ``position`` or later can see."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def free_dead_blocks(self, seq: Sequence) -> None:
        """Frees the blocks the next step (from num_computed_tokens) cannot see; cheap when there are none."""
        dead = self.dead_blocks(seq.num_computed_tokens)
        if dead == 0:
            return
        table = self.block_ids(seq)
        if len(table) < dead or table[dead - 1] == NULL_BLOCK:
            return
        first = dead - 1
        while first and table[first - 1] != NULL_BLOCK:
            first -= 1
        self.pool.free(table[first:dead][::-1])
        table[first:dead] = [NULL_BLOCK] * (dead - first)

    def visible_tokens(self, seq: Sequence) -> tuple[int, int]:
        """The positions [lo, hi) of the sequence's stored K/V that a future query can still see."""
        hi = seq.num_computed_tokens
        return (max(0, hi - self.window + 1) if self.window else 0), hi

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """New blocks to write num_new more tokens: growth plus a copy of a shared block written into."""
        end = seq.num_computed_tokens + num_new
        growth = max(0, cdiv(end, self.block_size) - len(self.block_ids(seq)))
        return growth + self.writes_shared_block(seq)

    def allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        """Reserves the blocks to write num_new more tokens, if the pool has them (vLLM's allocate_slots); False,
        and nothing changed, if not."""
        if self.blocks_needed(seq, num_new) > self.pool.num_free:
            return False
        self.reserve(seq, num_new)
        return True

    def reserve(self, seq: Sequence, num_new: int) -> None:
        """Allocates the blocks to write num_new more tokens (the caller made room: see blocks_needed)."""
        shared = self._shared_write_block(seq)
        if shared is not None:  # copy-on-write: the first write into a block someone else holds
            index, src = shared
            (dst,) = self.pool.allocate(1)
            self.ops.moves.append((COPY, src, dst))
            self.pool.free([src])
            self.seq_blocks[seq].block_ids[index] = dst
        total = cdiv(seq.num_computed_tokens + num_new, self.block_size)
        table = self._own(seq).block_ids
        table.extend(self.pool.allocate(max(0, total - len(table))))

    def _shared_write_block(self, seq: Sequence) -> tuple[int, int] | None:
        index, table = seq.num_computed_tokens // self.block_size, self.block_ids(seq)
        if seq.num_computed_tokens % self.block_size == 0 or index >= len(table):
            return None  # writing starts a fresh block
        block = table[index]
        return (index, block) if self.pool.ref_counts[block] > 1 else None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the blocks this sequence has completely computed under their chained hashes."""
        bs, blocks = self.block_size, self.seq_blocks.get(seq, NO_BLOCKS)
        hashes, table = blocks.block_hashes, blocks.block_ids
        while len(hashes) < seq.num_computed_tokens // bs:
            i = len(hashes)
            block_hash = hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs],
                                    seq.lora_int_id)
            hashes.append(block_hash)
            if table[i] != NULL_BLOCK:
                self.pool.cache(table[i], block_hash)
                if self.disk_index is not None and self._disk_stores < self.disk_stores_per_step:
                    self._store_on_disk(table[i], block_hash)

    def _store_on_disk(self, block: int, block_hash: bytes) -> None:
        """A cached device block written through to the disk tier (a DISK_STORE, off the step's path), unless the
        disk holds its hash or another block is the cache's copy of it."""
        if block_hash in self.disk_index or self.pool.lookup(block_hash) != block:
            return
        self._queue_for_disk(DISK_STORE, block, block_hash)
        self._disk_stores += 1

    def _queue_for_disk(self, kind: str, source: int, block_hash: bytes) -> None:
        """A block's write to disk (DISK_WRITE from a host slot, DISK_STORE from a device block), indexed now, and
        the deletion of each block the disk tier's capacity pushes out for it."""
        self.ops.moves.append((kind, source, block_hash))
        self.ops.moves += [(DISK_DELETE, gone, None) for gone in self.disk_index.add(block_hash)]
        self.offload.disk_writes += 1

    def flush_to_disk(self) -> DeviceOps:
        """Before a graceful shutdown: every cached block, on the device or in the host tier, that the disk tier
        lacks, queued for disk (the most recently used last, so the capacity keeps those); the moves to apply."""
        if self.disk_index is not None:
            for block_hash, slot in self.host_tier.blocks():
                if block_hash not in self.disk_index:
                    self._queue_for_disk(DISK_WRITE, slot, block_hash)
            for block_hash, block in self.pool.cached_blocks():
                self._store_on_disk(block, block_hash)  # no per-step bound: the engine takes no more steps
        return self.take_ops()

    def trim(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: the blocks past the sequence's computed tokens (they held only
        rejected drafts' K/V) go back to the pool; the K/V left past num_computed_tokens in its last block is
        never read (keys are masked by position) and is overwritten by the next step."""
        keep, table = cdiv(seq.num_computed_tokens, self.block_size), self.block_ids(seq)
        if len(table) > keep:
            self.pool.free(_live(table[keep:])[::-1])
            del table[keep:]

    # --- sharing and release --------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (Sequence.fork of ``parent``) holds the parent's blocks too."""
        blocks = self.blocks(parent)
        self.seq_blocks[child] = KVCacheBlocks(list(blocks.block_ids), list(blocks.block_hashes))
        self.pool.share(_live(blocks.block_ids))

    def free(self, seq: Sequence) -> None:
        blocks = self.seq_blocks.pop(seq, None)
        if blocks is not None:
            self.pool.free(_live(blocks.block_ids)[::-1])
        seq.num_computed_tokens = 0

    # --- swapping -------------------------------------------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len({b for s in seqs for b in _live(self.block_ids(s))}) <= len(self.host_free)

    def swap_out(self, seqs: list[Sequence]) -> None:
        """Moves the sequences' blocks to host slots (shared blocks once) and frees them on the device; dead
        (null) entries stay dead, as NULL_HOST."""
        slot_of: dict[int, int] = {NULL_BLOCK: NULL_HOST}
        for seq in seqs:
            for b in self.block_ids(seq):
                if b not in slot_of:
                    slot_of[b] = self.host_free.popleft()
                    self.ops.moves.append((SWAP_OUT, b, slot_of[b]))
        for seq in seqs:
            table = self._own(seq).block_ids
            self.pool.free(_live(table)[::-1])
            table[:] = [slot_of[b] for b in table]

    def free_swapped(self, seqs: list[Sequence], still_swapped: Iterable[Sequence]) -> None:
        """Gives back the host slots of swapped-out sequences that end, but those the ``still_swapped`` ones (their
        siblings) hold too."""
        slots = {b for s in seqs for b in self.block_ids(s)} - {NULL_HOST}
        still_used = {b for s in still_swapped for b in self.block_ids(s)}
        self.host_free.extend(slots - still_used)
        for s in seqs:
            self.seq_blocks.pop(s, None)

    def blocks_to_swap_in(self, seqs: list[Sequence]) -> int:
        return len({b for s in seqs for b in self.block_ids(s) if b != NULL_HOST})

    def swap_in(self, seqs: list[Sequence]) -> None:
        slots = list(dict.fromkeys(b for s in seqs for b in self.block_ids(s) if b != NULL_HOST))
        blocks = self.pool.allocate(len(slots))
        block_of = dict(zip(slots, blocks))
        refs = collections.Counter(b for s in seqs for b in self.block_ids(s))
        for slot, block in block_of.items():
            self.pool.share([block] * (refs[slot] - 1))
            self.ops.moves.append((SWAP_IN, slot, block))
            self.host_free.append(slot)
        block_of[NULL_HOST] = NULL_BLOCK
        for seq in seqs:
            blocks = self.seq_blocks[seq]
            blocks.block_ids[:] = [block_of[s] for s in blocks.block_ids]
            blocks.block_hashes.clear()  # re-registered by cache_full_blocks after the next step


def _live(table: list[int]) -> list[int]:
    """The table's blocks without its dead (null) entries."""
    return [b for b in table if b != NULL_BLOCK]
