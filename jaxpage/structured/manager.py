"""Per-sequence grammar state and the per-step token bitmask of structured outputs (llguidance on the host).

Each constrained sequence has its own llguidance matcher, keyed by the Sequence object (weakly: a finished,
aborted or pruned sequence's matcher goes with it). Before each step a matcher is brought up to its sequence's
output tokens, so every path is followed the same way: a new sample of n > 1 or best_of, a beam fork (a new
Sequence), a sequence recomputed after preemption or swapped back in (same object, same tokens) all get a matcher
that has consumed exactly their output, rebuilt from the tokens when the sequence is new to it.
"""
from __future__ import annotations

import collections
import weakref

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np

from jaxpage.sequence import Sequence
from jaxpage.utils import cdiv

ALL_ALLOWED = -1  # an int32 bitmask word with every bit set
MAX_CACHED_GRAMMARS = 256


def bitmask_words(vocab_size: int) -> int:
    return cdiv(vocab_size, 32)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None):
        self.words = bitmask_words(vocab_size)
        # the engine's EOS ids: the grammar allows them (and only them) where it may end
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.executor = llguidance.LLExecutor()
        self._compiled: collections.OrderedDict[tuple, llguidance.LLMatcher] = collections.OrderedDict()
        self._states: weakref.WeakKeyDictionary[Sequence, list] = weakref.WeakKeyDictionary()  # [matcher, consumed]

    def _new_matcher(self, params) -> llguidance.LLMatcher:
        """A fresh matcher for a constraint: a copy of the cached one compiled for this tokenizer."""
        proto = self._compiled.get(params.key)
        if proto is None:
            proto = self._compiled[params.key] = llguidance.LLMatcher(self.tokenizer, params.grammar_text)
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(params.key)
        return proto.deep_copy()

    def matcher(self, seq: Sequence, params) -> llguidance.LLMatcher:
        """The sequence's matcher, having consumed exactly its output tokens."""
        state = self._states.get(seq)
        if state is None or state[1] > seq.num_output_tokens:
            state = self._states[seq] = [self._new_matcher(params), 0]
        matcher, consumed = state
        new = seq.token_ids[seq.num_prompt_tokens + consumed:]
        if new:
            matcher.consume_tokens(new)
            state[1] += len(new)
            if matcher.is_error():
                raise ValueError(f"structured output: token outside the grammar: {matcher.get_error()}")
        return matcher

    def bitmask(self, scheduled, failed: dict[str, Exception]) -> np.ndarray | None:
        """[sampled rows, words] int32 of allowed tokens for this step's sampled rows (all ones for unconstrained
        rows), or None when no sampling row is constrained. A request whose matcher fails is recorded in
        ``failed``. Speculative decoding: a constrained row's positions (its draft positions' rows after the
        scheduled ones, in order, then its own row, the position after every draft) each get the grammar's state
        after the drafts before it; past the first draft the grammar refuses, a position keeps all ones: the
        masked target cannot sample that draft, so it is rejected there and no later position is used."""
        rows, drafted = [], []
        draft_row = len(scheduled)
        for i, s in enumerate(scheduled):
            so = s.group.params.structured_outputs
            if so is not None and s.samples:
                try:
                    matcher = self.matcher(s.seq, so)
                    positions = [*range(draft_row, draft_row + len(s.spec_token_ids)), i]
                    (drafted.append((matcher, list(s.spec_token_ids), positions)) if s.spec_token_ids
                     else rows.append((matcher, i)))
                except Exception as e:  # noqa: BLE001 - one request's failure must not stop the engine
                    failed.setdefault(s.group.request_id, e)
            draft_row += len(s.spec_token_ids)
        if not rows and not drafted:
            return None
        mask = np.full((draft_row, self.words), ALL_ALLOWED, np.int32)
        if rows:
            llnp.fill_next_token_bitmask_par(self.executor, rows, mask)
        for matcher, drafts, positions in drafted:
            _fill_draft_positions(matcher, drafts, mask, positions)
        return mask


def _fill_draft_positions(matcher: llguidance.LLMatcher, drafts: list[int], mask: np.ndarray,
                          positions: list[int]) -> None:
    """``mask[positions[p]]``: the grammar's allowed tokens after drafts[:p], for each p up to the first draft
    the grammar refuses; the matcher is left where it was."""
    accepted = matcher.validate_tokens(drafts)
    for p in range(accepted + 1):
        if p:
            matcher.consume_token(drafts[p - 1])
        llnp.fill_next_token_bitmask(matcher, mask, positions[p])
    matcher.rollback(accepted)
