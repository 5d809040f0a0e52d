"""The ``draft_model`` method's scheduler side (vLLM's DraftModelProposer): the scheduler reserves a speculating
row's k draft positions (their blocks, budget and sampled rows) with pending tokens, and the engine's draft
runner (jaxpage/worker/draft_runner.py) puts the draft model's tokens in their place before the target's step."""
from __future__ import annotations

from jaxpage.sequence import Sequence

DRAFT_PENDING = -2  # a draft position the draft model has not filled in yet


class DraftModelProposer:
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        return [DRAFT_PENDING] * num_tokens
