"""Sequence: one stream of tokens being generated, with its block table."""
from __future__ import annotations

import dataclasses
import enum

from jaxpage.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # prompt + output tokens may not exceed this (max_model_len and max_tokens)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    seed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
