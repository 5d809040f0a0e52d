"""How many prompt tokens one step may compute beside its decodes: vLLM's long_prefill_token_threshold,
max_num_partial_prefills and max_long_partial_prefills, counted over one step's scheduling pass."""
from __future__ import annotations

import dataclasses

from jaxpage.config import EngineConfig, pick_bucket


@dataclasses.dataclass
class PrefillLimits:
    """One step's prefill rows so far. A row is a prefill when its sequence has more than one token to compute
    (a prompt, its next chunk, or a preempted sequence recomputing its history); anything else is a decode.

    - a prefill takes at most ``threshold`` tokens a step (vLLM V1's long_prefill_token_threshold; 0: no cap),
      and a prompt with more tokens than that left to compute is *long* (vLLM V0's);
    - at most ``max_prefills`` prefill rows a step (max_num_partial_prefills), at most ``max_long`` of them long
      (max_long_partial_prefills): a short prompt behind a long one waiting for its slot is admitted first;
    - a prefill never takes the tokens of the decode rows still to come in the step (``decodes_left``), so every
      running decode gets its token whatever the prefills before it in the running queue;
    - with ``config.scheduler.wave_prefill``, a step whose decodes are fewer than the prompts that could compute in it
      (running ones with tokens left, and queued ones up to the free rows of max_num_seqs: a backlog deeper than
      that waits either way) has none of the three caps, only the step's token budget: a wave of arrivals then
      prefills in as few steps as the budget allows, and the few decodes beside it wait once, rather than every
      decode of the next steps waiting beside a chunk each step."""

    threshold: int
    max_prefills: int
    max_long: int
    decodes_left: int = 0
    prefills: int = 0
    long: int = 0

    @classmethod
    def for_step(cls, config: EngineConfig, decodes: int, prefills: int) -> PrefillLimits:
        """The limits of a step with ``decodes`` decode rows running and ``prefills`` prompts to compute."""
        if config.scheduler.wave_prefill and decodes < prefills:
            return cls(0, config.scheduler.max_num_seqs, config.scheduler.max_num_seqs, decodes_left=decodes)
        return cls(config.scheduler.long_prefill_token_threshold, config.scheduler.max_num_partial_prefills,
                   config.scheduler.max_long_partial_prefills, decodes_left=decodes)

    def is_long(self, num_left: int) -> bool:
        return 0 < self.threshold < num_left

    def can_start(self, num_left: int) -> bool:
        """Whether a prefill with num_left tokens to compute may have a row in this step."""
        if self.prefills >= self.max_prefills:
            return False
        return not (self.is_long(num_left) and self.long >= self.max_long)

    def tokens_for(self, num_left: int, budget: int) -> int:
        """The tokens a row with num_left tokens to compute gets out of the step's remaining budget (0: none this
        step), counted as one of the step's decodes or prefills."""
        if num_left <= 1:
            self.decodes_left = max(self.decodes_left - num_left, 0)
            return min(num_left, budget)
        if not self.can_start(num_left):
            return 0
        num_new = min(num_left, self.threshold or num_left, budget - self.decodes_left)
        if num_new <= 0:
            return 0
        self.prefills += 1
        self.long += self.is_long(num_left)
        return num_new


def decodes_and_prefills(groups) -> tuple[int, int]:
    """The decode rows (exactly one token to compute) and prefill rows (more) of the groups' live sequences."""
    left = [len(s.token_ids) + s.num_placeholders - s.num_computed_tokens  # num_tokens, inlined: every step
            for g in groups for s in g.live_seqs]
    return sum(n == 1 for n in left), sum(n > 1 for n in left)


def padding_room(config: EngineConfig, num_tokens: int) -> int:
    """The padding rows of the token bucket a step of ``num_tokens`` tokens is padded to: the step computes them
    either way, so a chunk cut short by long_prefill_token_threshold may take them
    (config.scheduler.prefill_into_padding)
    at the cost of the step it pads to already."""
    return pick_bucket(config.token_buckets(), max(num_tokens, 1)) - num_tokens
