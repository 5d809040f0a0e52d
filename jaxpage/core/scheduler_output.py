"""What the scheduler hands the runner each step (vLLM's sched/output.py): the rows to compute and the block
moves to apply first."""
from __future__ import annotations

import dataclasses

from jaxpage.core.kv_cache_manager import DeviceOps
from jaxpage.sequence import Sequence, SequenceGroup

# Async scheduling: in a step's batch, the token a step still on the device samples for a sequence (counted in its
# num_placeholders until the host reads it); the device puts the sampled token in its place
PLACEHOLDER_TOKEN_ID = -1


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """One row of a step as the scheduler made it: plain data, never changed after (a row with other drafts is a
    new row, ``dataclasses.replace``). Not ``frozen``: a frozen dataclass took 1.2 us to make against 0.3, for
    every running sequence every step; the tests make its fields write-once instead (tests/conftest.py)."""

    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, starting at seq.num_computed_tokens
    group: SequenceGroup
    samples: bool  # this chunk reaches the sequence's last token, so the step's sample is its next token
    # its sequence's block table as the KV manager keeps it (KVCacheBlocks.block_ids: read, never written here)
    block_ids: list[int]
    logits_of: Sequence | None = None  # a fork sampling from its parent's last prompt token (no tokens of its own)
    # speculative decoding: the draft tokens this decode row verifies (num_new_tokens counts them: its last token,
    # then the drafts); each draft's position is sampled in a row of its own after the scheduled rows
    spec_token_ids: tuple[int, ...] = ()
    draft_probs: object = None  # a draft model's: [len(spec_token_ids), vocab] the distribution of each draft token
    # the draft_model method: draft positions reserved (num_new_tokens counts them) that the engine's draft runner
    # fills in before the step (a new row with those spec_token_ids and this 0)
    num_pending_drafts: int = 0


# A row whose sequence got tokens from a step (Scheduler.update_from_output), for the output processor: (the row,
# a speculative row's log-probabilities of the tokens appended, () for any other). A plain pair: one is made for
# every row every step.
TokensTaken = tuple[ScheduledSeq, tuple[float, ...]]


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    ops: DeviceOps


def num_sampled_rows(scheduled: list[ScheduledSeq]) -> int:
    """The rows a step samples: one per scheduled row, then one per draft token (speculative decoding)."""
    return len(scheduled) + sum(len(s.spec_token_ids) for s in scheduled)


def sampled_rows(scheduled: list[ScheduledSeq], rows: list[int]) -> list[int]:
    """The sampled rows of the scheduled rows ``rows`` (in order), as a step of those rows alone lays them out:
    the rows, then their draft positions' rows."""
    at, drafts = len(scheduled), {}
    for row, s in enumerate(scheduled):
        drafts[row] = range(at, at + len(s.spec_token_ids))
        at += len(s.spec_token_ids)
    return list(rows) + [d for row in rows for d in drafts[row]]
