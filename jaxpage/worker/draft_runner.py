"""The draft model of speculative decoding's ``draft_model`` method: a ModelRunner of its own (the same class, built
from the draft's EngineConfig) whose KV pool has the target's blocks, indexed by the target's block tables, and
the k steps a target step that propose each speculating row's draft tokens.

The draft's K/V of a token sit in its pool at the slot the target's K/V of that token sit in its own: block moves
(copy-on-write, swaps) are applied to both pools, a block freed by the target holds nothing the draft reads, and
a rollback of the target's computed tokens rolls the draft's back too. The draft computes the tokens the target
computes each step (prompt chunks as scheduled); after a fully accepted draft it lags one token (the last draft,
whose K/V only the target computed), which its next step computes first. Drafts are drawn as the request
samples (temperature, top-k/p, min-p, its seed's key at that output index; greedy: the draft's argmax), and
each comes with the draft's distribution q it was drawn from, which the target's step verifies it against
(``sampler.rejection_sample``)."""
from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.kv_cache_manager import DeviceOps
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.sequence import Sequence, SequenceGroup
from jaxpage.worker.model_runner import ModelRunner


class DraftRunner:
    def __init__(self, config: EngineConfig, params: dict, eos_token_ids=()):
        self.config = config
        self.runner = ModelRunner(config, params, eos_token_ids)
        # tokens whose draft K/V are in the draft's pool, per sequence (valid below the target's computed tokens)
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._views: weakref.WeakKeyDictionary[Sequence, Sequence] = weakref.WeakKeyDictionary()

    def warm_up(self, progress: bool = True) -> None:
        self.runner.warm_up(progress)

    def apply(self, ops: DeviceOps) -> None:
        """The target's block moves, applied to the draft's pool too (no prefix tiers with a draft model)."""
        self.runner.apply(ops)

    def propose(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The rows with each speculating row's reserved draft positions (``num_pending_drafts``) filled in
        (``spec_token_ids`` and ``draft_probs``: new rows, the scheduler's unchanged): a first draft
        step computes every row's tokens the draft lacks up to what the target computes this step (a speculating
        row: up to its last token, whose next token is its first draft), then one step per further draft."""
        first, spec = [], []
        for s in scheduled:
            if not s.num_new_tokens:
                continue  # a fork: its parent's row computes its tokens
            seq = s.seq
            start = min(self._computed.get(seq, seq.num_computed_tokens), seq.num_computed_tokens)
            end = seq.num_tokens if s.num_pending_drafts else seq.num_computed_tokens + s.num_new_tokens
            first.append((s, start, end, []))
            if s.num_pending_drafts:
                spec.append((len(first) - 1, s))
        if not first:
            return scheduled
        tokens, probs = self._step(first)
        drafts = {id(s): [tokens[row]] for row, s in spec}
        q = {id(s): [probs[row]] for row, s in spec}
        for j in range(1, max((s.num_pending_drafts for _, s in spec), default=0)):
            rows = [s for _, s in spec if s.num_pending_drafts > j]
            n = [s.seq.num_tokens + j - 1 for s in rows]  # the position of the draft this step computes
            tokens, probs = self._step([(s, at, at + 1, drafts[id(s)]) for s, at in zip(rows, n)])
            for row, s in enumerate(rows):
                drafts[id(s)].append(tokens[row])
                q[id(s)].append(probs[row])
        for s, _, end, _ in first:
            self._computed[s.seq] = end
        for _, s in spec:
            self._computed[s.seq] = s.seq.num_tokens + len(drafts[id(s)]) - 1
        return [dataclasses.replace(s, spec_token_ids=tuple(drafts[id(s)]), draft_probs=np.stack(q[id(s)]),
                                    num_pending_drafts=0)
                if id(s) in drafts else s for s in scheduled]

    def _step(self, rows: list[tuple[ScheduledSeq, int, int, list[int]]]) -> tuple[list[int], np.ndarray]:
        """One draft step: each (target row, start, end, extra) computes positions [start, end) of its sequence's
        tokens + extra (the sequence seen as if extended by its drafts so far) and samples after ``end`` with its
        request's parameters; returns each row's token and the distribution it was drawn from. The target's
        sequences are only read: the step runs on this runner's views of them (``_view``), in their blocks."""
        scheduled = []
        for s, start, end, extra in rows:
            view = self._view(s.seq, start, extra)
            group = SequenceGroup(s.group.request_id, [view], s.group.params, arrival=0)  # no prompt logprobs
            scheduled.append(ScheduledSeq(view, end - start, group, end == view.num_tokens, s.block_ids))
        out = self.runner.execute(scheduled)
        # a view's tokens changed other than by appending: its penalty history is synced afresh next time
        self.runner.input_batch.penalty_history.forget([s.seq for s, (*_, extra) in zip(scheduled, rows) if extra])
        return np.asarray(out.tokens).tolist(), np.asarray(out.probs)

    def _view(self, seq: Sequence, start: int, extra: list[int]) -> Sequence:
        """The draft's own Sequence for a target sequence (one per sequence, so that the draft runner's per-sequence
        rows last): its tokens followed by ``extra``, ``start`` of them computed."""
        view = self._views.get(seq)
        if view is None:
            view = self._views[seq] = Sequence(seq.seq_id, [], seq.num_prompt_tokens, seq.max_len, seed=seq.seed,
                                               lora_int_id=seq.lora_int_id)
        view.token_ids = seq.token_ids + extra if extra else seq.token_ids
        view.num_computed_tokens = start
        return view
