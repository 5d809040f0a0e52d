"""Speculative decoding's part of scheduling: which rows of a step carry draft tokens, and how many. The
scheduler calls ``with_drafts`` on each step it makes; the proposer (jaxpage/spec_decode/) gives the tokens, and
the scheduler verifies them when the step's output comes back (Scheduler.update_from_output)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxpage.config import EngineConfig
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.core.stop import reached_min_tokens
from jaxpage.sequence import Sequence
from jaxpage.spec_decode.proposer import Proposer


class DraftScheduling:
    """proposer: None for the draft_model method, whose rows get draft positions reserved
    (ScheduledSeq.num_pending_drafts) that the engine's draft runner fills in before the step."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, proposer: Proposer | None):
        self.config = config
        self.kv = kv
        self.proposer = proposer

    def with_drafts(self, scheduled: list[ScheduledSeq], num_running: Callable[[], int]) -> list[ScheduledSeq]:
        """Each decode row that may speculate (``speculates``) gets the proposer's draft
        tokens, as many as what is left of the step's token budget, of its rows (a draft token's position is a
        sampled row: at most max_sampled_rows a step) and of the free blocks allow; the row then computes its
        last token and the drafts (a copy of the row: ``scheduled`` stays as it was, for the decode fast path).
        ``scheduled`` itself when no row got a draft, or when the running sequences number
        disable_by_batch_size or more (``num_running()``, asked only then). No draft runs past the sequence's
        max_len, and none preempts anything."""
        spec = self.config.speculative_config
        if spec.disable_by_batch_size and num_running() >= spec.disable_by_batch_size:
            return scheduled
        budget = self.config.scheduler.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        rows = self.config.max_sampled_rows - len(scheduled)
        parents = {id(s.logits_of) for s in scheduled if s.logits_of is not None}  # forks sample their last token
        out = scheduled
        for i, s in enumerate(scheduled):
            if min(budget, rows) <= 0:
                break
            seq = s.seq
            k = min(spec.num_speculative_tokens, budget, rows, seq.max_len - seq.num_tokens - 1)
            if k <= 0 or not self.speculates(s) or id(seq) in parents:
                continue
            draft = self.draft(seq, k) if self.proposer is not None else ()
            n = len(draft) if self.proposer is not None else k
            if n and self.kv.allocate_slots(seq, 1 + n):
                out = list(scheduled) if out is scheduled else out
                out[i] = dataclasses.replace(s, num_new_tokens=1 + n, spec_token_ids=tuple(draft),
                                             num_pending_drafts=n - len(draft))
                budget -= n
                rows -= n
        return out

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens after ``seq``. When its last token is still on the device (a placeholder: this
        step is scheduled while the one before runs), one step late: the proposal after the tokens before it,
        its first token taken as the guess of the one in flight and the rest as the drafts (verified against
        the real token all the same: a wrong guess only costs acceptance)."""
        if not seq.num_placeholders:
            return self.proposer.propose(seq, k)[:k]
        return self.proposer.propose(seq, k + 1)[1:k + 1]  # the proposer reads the tokens the host knows

    @staticmethod
    def speculates(s: ScheduledSeq) -> bool:
        """Whether a row may carry draft tokens: a decode row (its sequence's last token, sampled) of a request
        without beams, past min_tokens (the banned stop tokens end there). Penalties speculate: a draft
        position's count the drafts before it (SamplingBatch.history_extra); so do structured outputs: each draft
        position is masked by the grammar's state after the drafts before it (structured/manager.py)."""
        p = s.group.params
        return (s.num_new_tokens == 1 and s.samples and s.logits_of is None and not p.use_beam_search
                and reached_min_tokens(s.seq, p))
