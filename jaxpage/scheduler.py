"""Scheduler: iteration-level (continuous) batching under a token budget, with chunked prefill and preemption."""
from __future__ import annotations

import collections
import dataclasses

from jaxpage.block_pool import BlockPool
from jaxpage.config import EngineConfig
from jaxpage.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so the step's sample is its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_pool: BlockPool):
        self.config = config
        self.block_pool = block_pool
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Running sequences first (a decode token, or the next prompt chunk), then waiting prompts."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve_or_preempt(seq, num_new):
                break  # seq itself was preempted: it was the last running one
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._blocks_needed(seq, num_new) > self.block_pool.num_free:
                break
            self.waiting.popleft()
            self._reserve(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new) // self.config.block_size)
        return max(0, total - len(seq.block_table))

    def _reserve(self, seq: Sequence, num_new: int) -> None:
        seq.block_table.extend(self.block_pool.allocate(self._blocks_needed(seq, num_new)))

    def _reserve_or_preempt(self, seq: Sequence, num_new: int) -> bool:
        while self._blocks_needed(seq, num_new) > self.block_pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self._reserve(seq, num_new)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's blocks and requeue it at the front."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.block_pool.free(seq.block_table)
        seq.block_table = []
