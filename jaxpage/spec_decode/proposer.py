"""The proposal interface: a proposer gives a running sequence's next few tokens before the step that verifies
them. One module per method (vLLM's names); ``make_proposer`` picks the method of the engine's config."""
from __future__ import annotations

from typing import Protocol

from jaxpage.config import DEVICE_DRAFT_METHODS, SpeculativeConfig
from jaxpage.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens to follow ``seq.token_ids`` (none: the sequence decodes one token)."""


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The proposer of ``config.method``; None without speculative decoding, or where a draft model or head proposes
    (its tokens come from a step of its own on the device, not from the scheduler's host pass)."""
    if config is None:
        return None
    if config.method == "ngram":
        from jaxpage.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method in DEVICE_DRAFT_METHODS:
        return None  # the engine's draft runner (draft_runner.py, eagle3_runner.py) fills the reserved positions
    if config.method == "suffix":
        from jaxpage.spec_decode.suffix_proposer import SuffixProposer

        return SuffixProposer(config)
    raise ValueError(f"speculative_config.method={config.method!r} has no proposer")
