"""Scheduler: iteration-level (continuous) batching under a token budget, with chunked prefill and preemption."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.beam_search import beam_search_step
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.prefill_limits import PrefillLimits, decodes_and_prefills, padding_room
from jaxpage.core.prompt_logprobs import lacks_prompt_logprobs, take_prompt_logprobs
from jaxpage.core.scheduler_output import (
    ScheduledSeq,
    SchedulerOutput,
    TokensTaken,
)
from jaxpage.core.stop import check_stop
from jaxpage.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from jaxpage.spec_decode.metrics import SpecDecodingStats
from jaxpage.core.draft_scheduling import DraftScheduling
from jaxpage.spec_decode.proposer import make_proposer
from jaxpage.spec_decode.rejection_sampler import emitted_tokens

log = logging.getLogger(__name__)

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, eos_token_ids: frozenset[int] = frozenset(), *,
                 next_seq_id: Callable[[], int] | None = None):
        self.config = config
        self.kv = kv
        self.preemption_mode = config.scheduler.preemption_mode  # one of PREEMPTION_MODES (checked by the builder)
        self.eos_token_ids = eos_token_ids
        self.waiting: list[SequenceGroup] = []  # kept sorted by (priority, arrival)
        self.running: list[SequenceGroup] = []  # in admission order
        self.swapped: list[SequenceGroup] = []
        self.num_preemptions = 0
        self._failed: list[SequenceGroup] = []  # requests that can never fit, to be reported by the engine
        self.max_wide_seqs = config.scheduler.seqs_per_request  # slots that groups of several sequences may hold
        self._next_seq_id = next_seq_id or itertools.count().__next__  # fresh sequence ids (the engine's counter)
        # The last schedule, when it was a plain decode step of every running sequence (see _decode_again); None
        # once anything it depends on may have changed (a group preempted, finished, queued, or beams reordered)
        self._decode: list[ScheduledSeq] | None = None
        # speculative decoding: the proposer of draft tokens and the acceptance counters (None: off)
        spec = config.speculative_config
        self.drafts = DraftScheduling(config, kv, make_proposer(spec)) if spec is not None else None
        self.spec_stats = SpecDecodingStats(spec.num_speculative_tokens) if spec is not None else None

    def add(self, group: SequenceGroup) -> None:
        self._decode = None
        self.waiting.append(group)
        self.waiting.sort(key=lambda g: (g.priority, g.arrival))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(g.live_seqs) for g in self.running)

    def schedule(self) -> SchedulerOutput:
        if self._decode is not None:
            again = self._decode_again(self._decode)
            if again is not None:
                return again
        self._decode = None
        budget = self.config.scheduler.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        preemptions = self.num_preemptions
        decodes, prefills = decodes_and_prefills(self.running)
        free_rows = self.config.scheduler.max_num_seqs - self.num_running_seqs()
        limits = PrefillLimits.for_step(self.config, decodes, prefills + min(len(self.waiting), free_rows))
        windowed, seq_blocks = bool(self.kv.window), self.kv.seq_blocks
        for group in list(self.running):
            if group.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            live = group.live_seqs
            for seq in live:
                if seq.num_computed_tokens == 0 and seq not in seq_blocks:
                    if seq is not live[0] and live[0].num_computed_tokens < live[0].num_prompt_tokens:
                        continue  # a recomputing sibling waits until the first has cached the shared prompt
                    self._match_prefix(seq, group)  # a sequence recomputing after preemption
                if windowed:
                    self.kv.free_dead_blocks(seq)  # sliding window: blocks no query can see again
                computed, num_tokens = seq.num_computed_tokens, len(seq.token_ids) + seq.num_placeholders  # num_tokens
                num_new = limits.tokens_for(num_tokens - computed, budget)
                if num_new == 0:
                    continue  # waiting for its beam siblings, or out of budget or prefill slots
                # fast path, the common decode step: room in its blocks and no shared block to copy on write
                if not self.kv.has_room(seq, num_new):
                    if not self._make_room(seq, num_new, group):
                        preempted = True
                        break
                    preempted |= group.status != SequenceStatus.RUNNING
                scheduled.append(ScheduledSeq(seq, num_new, group, computed + num_new == num_tokens,
                                              seq_blocks[seq].block_ids))
                budget -= num_new
        if self.num_preemptions != preemptions:  # drop what was scheduled of groups preempted later on
            scheduled = [s for s in scheduled if s.group.status == SequenceStatus.RUNNING]
            budget = self.config.scheduler.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        if not preempted:
            self._swap_in_what_fits()
        if self.waiting and budget > 0 and not self.swapped:
            self._admit_waiting(scheduled, budget, limits)
        if self.num_preemptions == preemptions and not self.swapped:
            self._prefill_into_padding(scheduled)
        scheduled.extend(self._forks(scheduled))
        plain = scheduled
        if self.drafts is not None:
            scheduled = self.drafts.with_drafts(scheduled, self.num_running_seqs)
        if not scheduled and not self.running and (self.waiting or self.swapped):
            self._fail_head()
        elif not self.waiting and not self.swapped and not self._failed:
            self._decode = self._decode_rows(plain)  # its rows without drafts: the next step proposes afresh
        return SchedulerOutput(scheduled, self.kv.take_ops())

    def _prefill_into_padding(self, scheduled: list[ScheduledSeq]) -> None:
        """Chunks that long_prefill_token_threshold cut short take the rows the step pads to anyway (its token
        bucket's padding), in order, as far as the token budget and the pool's free blocks allow, in a step that
        preempted nothing with nothing swapped out: an 80-token prompt beside 7 decodes then computes whole in
        the step of 96 rows that its 64-token chunk pads to, where it took two steps. Not with speculative
        decoding, whose drafts come after and take the room."""
        cfg = self.config.scheduler
        if not (cfg.prefill_into_padding and cfg.long_prefill_token_threshold) or self.drafts is not None:
            return
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        room = min(padding_room(self.config, num_tokens), cfg.max_num_batched_tokens - num_tokens)
        for i, s in enumerate(scheduled):
            if room <= 0:
                break
            seq = s.seq
            left = seq.num_tokens - seq.num_computed_tokens - s.num_new_tokens
            if s.samples or left <= 0 or s.logits_of is not None:
                continue
            extra = min(left, room)
            if self.kv.allocate_slots(seq, s.num_new_tokens + extra):
                scheduled[i] = self._scheduled(seq, s.num_new_tokens + extra, s.group)
                room -= extra

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int, limits: PrefillLimits) -> None:
        """Admits waiting groups in order while the token budget, max_num_seqs, the step's prefill limits and the
        pool allow; a long prompt without a long-prefill slot waits in its place while shorter ones behind it go.

        Fairness: groups of several sequences (n, best_of, beams) together hold at most max_wide_seqs slots; a
        wide group beyond that waits in its place while the narrower requests behind it are admitted, so wide
        requests cannot take every slot between them. LoRA: a group whose adapter would make more distinct
        adapters run than the device has slots (max_loras) waits in its place too."""
        limits.decodes_left = 0  # the running decodes have had their turn (or were preempted)
        num_seqs = sum(g.max_seqs for g in self.running)  # as reserved at admission
        wide = sum(g.max_seqs for g in self.running if g.max_seqs > 1)
        loras = self._running_loras()
        i = 0
        while i < len(self.waiting) and budget > 0:
            group = self.waiting[i]
            if num_seqs + group.max_seqs > self.config.scheduler.max_num_seqs:
                break
            if group.max_seqs > 1 and wide + group.max_seqs > self.max_wide_seqs or not self._lora_fits(group, loras):
                i += 1
                continue
            seq = None if group.forked else group.seqs[0]
            if seq is None:  # resumed after recompute: every live sequence recomputes its own history
                if not self._admit_all(group):
                    break
            else:
                if not limits.can_start(seq.num_tokens - seq.num_computed_tokens):
                    if limits.prefills >= limits.max_prefills:
                        break
                    i += 1
                    continue
                if seq.num_computed_tokens == 0 and seq not in self.kv.seq_blocks:
                    self._match_prefix(seq, group)
                num_new = limits.tokens_for(seq.num_tokens - seq.num_computed_tokens, budget)
                if not num_new or not self.kv.allocate_slots(seq, num_new):
                    self.kv.free(seq)
                    break
                scheduled.append(self._scheduled(seq, num_new, group))
                budget -= num_new
            self.waiting.pop(i)
            group.status = SequenceStatus.RUNNING
            self.running.append(group)
            num_seqs += group.max_seqs
            wide += group.max_seqs if group.max_seqs > 1 else 0
            loras.add(group.lora_int_id)

    def _running_loras(self) -> set[int]:
        """The LoRA adapters of the running groups (0: the base model, which takes no slot)."""
        return {g.lora_int_id for g in self.running} - {0}

    def _lora_fits(self, group: SequenceGroup, loras: set[int]) -> bool:
        """Whether ``group`` may run beside groups of these adapters: its adapter is among them, or a device slot
        is left for it (the runner loads it there before the step)."""
        lora = group.lora_int_id
        return not lora or lora in loras or len(loras - {0}) < self.config.lora.max_loras

    def _match_prefix(self, seq: Sequence, group: SequenceGroup) -> None:
        """The prefix cache's blocks for a sequence starting (or recomputing), unless its request still lacks
        prompt logprobs: those need every prompt position computed, so, as in vLLM, it reads no cached block."""
        if not lacks_prompt_logprobs(group):
            self.kv.match_prefix(seq)

    def _decode_rows(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """``scheduled`` if it is one decode row (a token, sampled) of every live sequence of every running group
        in order, none of them a beam (beam steps reorder and replace sequences outside the scheduler): the next
        step can then reuse it. None otherwise."""
        i, n = 0, len(scheduled)
        for group in self.running:
            if group.params.use_beam_search or (group.width > 1 and not group.forked):
                return None
            for seq in group.live_seqs:
                if i == n:
                    return None
                s = scheduled[i]
                if s.seq is not seq or s.num_new_tokens != 1 or not s.samples or s.logits_of is not None:
                    return None
                i += 1
        return scheduled if i == n and n else None

    def _decode_again(self, rows: list[ScheduledSeq]) -> SchedulerOutput | None:
        """The decode fast path: when nothing has changed since the last step but a token sampled for each row
        (no request queued, finished or preempted since), that step's rows are this step's too, as the full
        scheduling pass would rebuild them, the blocks a row now needs allocated in the same order, then the
        drafts proposed (speculative decoding). None (and nothing changed) when anything differs, or when a row
        cannot get its block without a preemption."""
        if self.waiting or self.swapped or self._failed:
            return None  # admission or swap-in: the full pass
        if len(rows) > self.config.scheduler.max_num_batched_tokens:
            return None
        kv = self.kv
        grow, windowed = [], bool(kv.window)
        for s in rows:
            seq = s.seq
            if windowed:
                kv.free_dead_blocks(seq)
            if len(seq.token_ids) + seq.num_placeholders != seq.num_computed_tokens + 1:  # num_tokens, inlined
                return None  # not exactly one new token (an engine step did not run; or it finished)
            if kv.writes_shared_block(seq):
                return None  # copy-on-write (a fork's first token): the full pass
            if not kv.holds(seq, 1):
                grow.append(seq)
        if grow and sum(self.kv.blocks_needed(seq, 1) for seq in grow) > self.kv.num_free_blocks():
            return None  # the full pass preempts
        for seq in grow:
            self.kv.reserve(seq, 1)
        scheduled = self.drafts.with_drafts(rows, self.num_running_seqs) if self.drafts is not None else rows
        return SchedulerOutput(scheduled, self.kv.take_ops())

    def _fail_head(self) -> None:
        """Nothing runs and the first queued request still cannot start: it can never fit in the pool."""
        group = (self.swapped or self.waiting)[0]
        self.finish_group(group, FinishReason.ABORT)
        if not group.forked and group.width > 1:  # ended before its prompt forked: its n samples end empty too
            parent = group.seqs[0]  # no blocks left: the forks share nothing
            group.seqs += [parent.fork(self._next_seq_id(), seed=_child_seed(parent.seed, i))
                           for i in range(1, group.width)]
        self._failed.append(group)

    def take_failed(self) -> list[SequenceGroup]:
        failed, self._failed = self._failed, []
        return failed

    def _admit_all(self, group: SequenceGroup) -> bool:
        """Admits a resumed multi-sequence group without computing yet; its sequences run from the next step.
        The first recomputes the shared prompt; the others then find its full blocks in the prefix cache."""
        return self.kv.blocks_to_recompute(group.live_seqs) <= self.kv.num_free_blocks()

    def _scheduled(self, seq: Sequence, num_new: int, group: SequenceGroup) -> ScheduledSeq:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSeq(seq, num_new, group, samples, self.kv.block_ids(seq))

    def _forks(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Parallel samples: when a prompt's last chunk runs, its siblings fork it and sample the same logits."""
        forks = []
        for s in scheduled:
            group = s.group
            if not s.samples or group.forked or group.width == 1 or group.params.use_beam_search:
                continue
            group.forked = True
            for i in range(1, group.width):
                child = self.fork_seq(s.seq, _child_seed(s.seq.seed, i))
                group.seqs.append(child)
                forks.append(ScheduledSeq(child, 0, group, True, self.kv.block_ids(child), logits_of=s.seq))
        return forks

    def fork_seq(self, parent: Sequence, seed: int) -> Sequence:
        """A new sequence sharing ``parent``'s history and blocks (a parallel sample or a beam)."""
        child = parent.fork(self._next_seq_id(), seed)
        self.kv.fork(parent, child)
        return child

    def _make_room(self, seq: Sequence, num_new: int, group: SequenceGroup) -> bool:
        """Preempts the lowest-priority, most recently admitted groups until seq fits; False if it was preempted."""
        needed = self.kv.blocks_needed(seq, num_new)
        if not needed:
            return True  # the common decode step: room in its last, unshared block
        while needed > self.kv.num_free_blocks():
            victim = max(self.running, key=lambda g: (g.priority, g.arrival))
            self.preempt(victim)
            if victim is group:
                return False
        self.kv.reserve(seq, num_new)
        return True

    def preempt(self, group: SequenceGroup, recompute: bool = False) -> None:
        """Takes a running group off the device: swapped out (preemption_mode 'swap', where the host has room and
        not ``recompute``), else its blocks freed and the group back at the head of the queue, to compute afresh."""
        self._decode = None
        self.running.remove(group)
        self.num_preemptions += 1
        live = group.live_seqs
        if self.preemption_mode == "swap" and not recompute and self.kv.can_swap_out(live):
            self.kv.swap_out(live)
            group.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in live:
            self.kv.free(seq)
        group.status = SequenceStatus.WAITING
        self.waiting.insert(0, group)

    def recompute_failed_loads(self, blocks: list[int]) -> None:
        """Device blocks the disk tier failed to restore (the worker found their files missing or bad): forgotten
        as cached and on disk, and every running group holding one preempted to compute its prompt afresh (vLLM's
        kv_load_failure_policy 'recompute'). Only groups admitted in the step that queued the restores hold them."""
        self.kv.forget_failed_loads(blocks)
        bad = set(blocks)
        for group in [g for g in self.running if any(bad.intersection(self.kv.block_ids(s)) for s in g.live_seqs)]:
            self.preempt(group, recompute=True)

    def _swap_in_what_fits(self) -> None:
        while self.swapped:
            group = self.swapped[0]
            live = group.live_seqs
            needed = self.kv.blocks_to_swap_in(live) + len(live)  # and room for each to grow by a block
            if needed > self.kv.num_free_blocks() or not self._lora_fits(group, self._running_loras()):
                return
            self.swapped.pop(0)
            self.kv.swap_in(live)
            group.status = SequenceStatus.RUNNING
            self.running.append(group)

    def update_from_output(self, scheduled: list[ScheduledSeq], sampled,
                           failed: dict[str, Exception]) -> list[TokensTaken]:
        """Takes a step's output (vLLM's update_from_output): each row's sequence advances by the tokens the step
        computed and gets its sampled token, finishing on a stop token or at its length; beams advance once every
        beam of their group has its candidates. Returns the rows whose sequence got a token. A failure in one
        request's rows is recorded in ``failed`` and ends that request alone."""
        tokens, logprobs = np.asarray(sampled.tokens).tolist(), np.asarray(sampled.logprobs).tolist()
        finished, bs, seq_blocks = SequenceStatus.FINISHED, self.config.cache.block_size, self.kv.seq_blocks
        got, beams = [], []
        at = 0  # the row's first token in the step's flat batch
        spec_at = len(scheduled)  # the next draft position's row (speculative decoding)
        for row, s in enumerate(scheduled):
            first_token, at = at, at + s.num_new_tokens
            try:
                seq, group = s.seq, s.group
                if s.spec_token_ids:  # its drafts' rows follow the scheduled rows, in order
                    verify, spec_at = spec_at, spec_at + len(s.spec_token_ids)
                    if group.status is not finished:
                        appended = self._take_verified(s, list(range(verify, spec_at)) + [row], tokens, logprobs,
                                                       sampled)
                        got.append((s, appended))
                    continue
                if group.prompt_logprobs is not None:  # before its tokens are counted as computed
                    take_prompt_logprobs(s, sampled.prompt, first_token)
                if group.pooling is not None:
                    group.pooling.add(seq.num_computed_tokens, s.num_new_tokens, sampled.pooled[row])
                if s.logits_of is None:
                    seq.num_computed_tokens += s.num_new_tokens
                else:  # a fork holds exactly the prompt its parent's row computed (the parent may be gone already)
                    seq.num_computed_tokens = seq.num_tokens
                blocks = seq_blocks.get(seq)
                if blocks is not None and len(blocks.block_hashes) < seq.num_computed_tokens // bs:
                    self.kv.cache_full_blocks(seq)  # a block was filled
                if not s.samples or group.status is finished:
                    continue
                p = group.params
                if p.use_beam_search:
                    seq.pending_top = (sampled.top_ids[row], sampled.top_logprobs[row])
                    beams.append(group)
                else:  # the top log-probabilities are read only when the request asked for them
                    top = (sampled.top_ids[row], sampled.top_logprobs[row]) if p.logprobs is not None else None
                    self._append_token(group, seq, tokens[row], logprobs[row], top)
                got.append((s, ()))
            except Exception as e:  # noqa: BLE001 - a failure in one request's host work ends that request alone
                failed.setdefault(s.group.request_id, e)
        for group in dict.fromkeys(beams):
            if group.request_id not in failed:
                try:
                    self._advance_beams(group)
                except Exception as e:  # noqa: BLE001
                    failed.setdefault(group.request_id, e)
        return got

    def _take_verified(self, s: ScheduledSeq, rows: list[int], tokens: list[int], logprobs: list[float],
                       sampled) -> tuple[float, ...]:
        """A speculating row's output: the target's samples at its drafts' positions and after the last
        (``rows``) verified (spec_decode/rejection_sampler.py); the accepted drafts and the target's next token
        appended one by one, each checked by the one stop rule, a stop ending the run there. Then the K/V of the
        rejected drafts is rolled back: the computed tokens are the accepted ones, a block holding no accepted
        token goes back to the pool, and the prefix cache registers the blocks full of accepted tokens. Returns
        the log-probabilities of the tokens appended."""
        seq, group, draft = s.seq, s.group, list(s.spec_token_ids)
        new = emitted_tokens(draft, [tokens[r] for r in rows])
        self.spec_stats.observe(len(draft), len(new) - 1)
        want_top = group.params.logprobs is not None
        appended = []
        for token, r in zip(new, rows):
            top = (sampled.top_ids[r], sampled.top_logprobs[r]) if want_top else None
            appended.append(logprobs[r])
            self._append_token(group, seq, token, logprobs[r], top)
            if seq.is_finished:  # its blocks are freed
                break
        if not seq.is_finished:
            seq.num_computed_tokens = seq.num_tokens - 1  # the K/V of every token but the newest
            self.kv.trim(seq)
            self.kv.cache_full_blocks(seq)
        return tuple(appended)

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float, top) -> None:
        p = group.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            ids, lps = top
            entry = {int(i): float(v) for i, v in zip(ids[:p.logprobs], lps[:p.logprobs])}
            entry[token] = logprob
            seq.output_logprobs.append(entry)
        reason = check_stop(seq, p, self.eos_token_ids)
        if reason is not None:  # a stop string on this token still makes LENGTH a STOP (OutputProcessor)
            self.finish_seq(group, seq, reason)

    def _advance_beams(self, group: SequenceGroup) -> None:
        live = group.live_seqs
        if not live or any(s.pending_top is None for s in live):
            return  # some beam is still recomputing after a preemption
        beam_search_step(group, self.eos_token_ids, self, self._next_seq_id)

    def finish_seq(self, group: SequenceGroup, seq: Sequence, reason: FinishReason) -> None:
        self._decode = None
        seq.finish_reason = reason
        if group.status != SequenceStatus.SWAPPED:
            self.kv.free(seq)
        else:  # its host slots, but those its swapped siblings still hold
            self.kv.free_swapped([seq], (s for g in self.swapped for s in g.live_seqs if s is not seq))

    def finish_group(self, group: SequenceGroup, reason: FinishReason = FinishReason.ABORT) -> None:
        """Ends every live sequence of the group and forgets the group (finish or abort)."""
        self._decode = None
        for seq in group.live_seqs:
            self.finish_seq(group, seq, reason)
        for queue in (self.running, self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        group.status = SequenceStatus.FINISHED


def _child_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7_919) % (1 << 32)
