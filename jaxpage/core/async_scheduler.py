"""Async scheduling's scheduler (vLLM's AsyncScheduler): the step after a launched one, scheduled while it runs.

After a step is launched its rows' sequences count a placeholder for the token it samples (``add_placeholders``);
``schedule_ahead`` then schedules the next step from that view (the decode fast path, or the full pass where
nothing in it depends on the tokens still on the device), and ``remove_placeholders`` undoes the view before the
step's real output is taken. The synchronous scheduling is the base class's, unchanged.
"""
from __future__ import annotations

import itertools

from jaxpage.core.scheduler import Scheduler
from jaxpage.core.scheduler_output import ScheduledSeq, SchedulerOutput
from jaxpage.sequence import SequenceGroup


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_steps_ahead = self.config.scheduler.async_prompt_steps  # any plain step ahead, not only decodes

    def runs_ahead(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether the step after ``scheduled`` (just launched) may be scheduled before its tokens are known:
        the decode fast path's step (see _decode_rows; with speculation too, but not a step that verifies
        drafts: the step after it starts where its accepted tokens end) where no row needs its token on the
        host before the next step is built (penalties upload the history; structured outputs advance their
        matcher); or, with prompt_steps_ahead and no speculation, any step of plain requests (runs_plain: new
        prompts, chunks)."""
        if self._decode is scheduled:
            return not any(s.group.params.has_penalties or s.group.params.structured_outputs is not None
                           for s in scheduled)
        return self.prompt_steps_ahead and self.drafts is None and all(runs_plain(s.group) for s in scheduled)

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The next step while the last one runs (its rows hold placeholders, see add_placeholders): the decode
        fast path (with speculation, its drafts proposed one step late: see DraftScheduling.draft), else, with
        prompt_steps_ahead, the full pass where nothing in it depends on the tokens still on the device
        (_full_pass_ahead_is_safe: new plain requests admitted beside the running ones, a prompt's next chunk,
        its first decode). None (nothing changed) otherwise; the engine then waits for the last step's tokens
        and schedules in full."""
        if self._decode is not None:
            again = self._decode_again(self._decode)
            if again is not None:
                return again
        return self.schedule() if self.prompt_steps_ahead and self._full_pass_ahead_is_safe() else None

    def _full_pass_ahead_is_safe(self) -> bool:
        """Whether the full pass may run before the last step's tokens are known: no swapped or failed group, no
        speculation, every group running or waiting plain (runs_plain), and every running sequence's next
        tokens fit in the free blocks with no preemption (which would recompute a placeholder) and no copy on
        write."""
        if not self.running or self.swapped or self._failed or self.drafts is not None:
            return False
        if not all(runs_plain(g) for g in itertools.chain(self.running, self.waiting)):
            return False
        needed = 0
        for group in self.running:
            for seq in group.live_seqs:
                if seq not in self.kv.seq_blocks or self.kv.writes_shared_block(seq):
                    return False  # recomputing after a preemption, or a copy on write
                needed += self.kv.blocks_needed(seq, seq.num_tokens - seq.num_computed_tokens)
        return needed <= self.kv.num_free_blocks()

    def add_placeholders(self, rows: list[ScheduledSeq]) -> None:
        """After a step is launched: each row's sequence as the step leaves it, the token a sampling row
        sampled counted as a placeholder (Sequence.num_placeholders), so that the next step can be scheduled and
        built meanwhile. The blocks the step fills are cached now, as in vLLM: a prompt admitted ahead finds a prefix
        being computed (its tokens are known; the device writes them before any later step reads them)."""
        seq_blocks, bs = self.kv.seq_blocks, self.config.cache.block_size
        for s in rows:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if s.samples:
                seq.num_placeholders += 1
            blocks = seq_blocks.get(seq)
            if blocks is not None and len(blocks.block_hashes) < seq.num_computed_tokens // bs:
                self.kv.cache_full_blocks(seq)

    def remove_placeholders(self, rows: list[ScheduledSeq]) -> None:
        """Undoes add_placeholders before the step's real output goes through update_from_output."""
        for s in rows:
            seq = s.seq
            if s.samples:
                seq.num_placeholders -= 1
            seq.num_computed_tokens -= s.num_new_tokens


def runs_plain(group: SequenceGroup) -> bool:
    """Whether a request's steps may be scheduled before the step before's tokens are known, whatever the step
    (AsyncScheduler.runs_ahead): one sequence (no beams, no parallel samples forking), no penalties (their history
    is uploaded from the host), no structured output (its matcher advances on the host); prompt logprobs stay
    on the synchronous path too (not exercised ahead)."""
    p = group.params
    return (group.width == 1 and not p.use_beam_search and not p.has_penalties and p.structured_outputs is None
            and p.prompt_logprobs is None)
