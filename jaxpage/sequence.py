"""Sequence (one stream of tokens and its block table) and SequenceGroup (the sequences of one request)."""
from __future__ import annotations

import dataclasses
import enum

from jaxpage.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a sequence ended (vLLM's names); the value is the finish_reason a user sees."""

    STOP = "stop"  # a stop token, EOS or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted, or the request can never fit in the KV pool
    ERROR = "error"  # its request failed on the engine
    PRUNED = "pruned"  # a beam the search dropped (never output)


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int  # prompt + output tokens may not exceed this (max_model_len and max_tokens)
    seed: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    pending_top: tuple | None = None  # beam search: this step's top (ids, logprobs), until all beams have theirs
    lora_int_id: int = 0  # the LoRA adapter its K/V are computed with (0: the base model); keys its cached blocks
    # async scheduling (vLLM's num_output_placeholders): tokens a launched step samples for it that the host has
    # not read yet; they count as its tokens (num_tokens) but are not in token_ids (core/async_scheduler.py)
    num_placeholders: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self, seq_id: int, seed: int) -> "Sequence":
        """A copy sharing this sequence's history; its blocks are the KV manager's (KVCacheManager.fork)."""
        return dataclasses.replace(self, seq_id=seq_id, seed=seed, token_ids=list(self.token_ids),
                                   output_logprobs=list(self.output_logprobs))


@dataclasses.dataclass(eq=False)
class SequenceGroup:
    """A request: one sequence until its prompt is computed, then ``width`` samples or beams sharing its blocks."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival: int
    priority: int = 0  # lower is served first, as in vLLM
    status: SequenceStatus = SequenceStatus.WAITING
    forked: bool = False  # whether the prompt's sequence has been forked into its samples or beams
    finished_seqs: list[Sequence] = dataclasses.field(default_factory=list)  # finished beam hypotheses
    lora_request: object | None = None  # its jaxpage.lora.request.LoRARequest; None: the base model
    # the adapter's host copy (jaxpage.lora.models.LoRAModel), read when the request was added: the request holds
    # it until it ends, so neither the host LRU's eviction nor the adapter's files going away can stop it
    lora_model: object | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0
    # with params.prompt_logprobs: [None] and an entry per prompt position computed so far, in order (each the
    # next prompt token's; core/prompt_logprobs.py); complete (one per prompt token) once the prompt is
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a pooling request's vector as its chunks are computed (jaxpage.core.pooling.PoolingState); None: it generates
    pooling: object | None = None

    @property
    def width(self) -> int:
        return self.params.best_of

    @property
    def live_seqs(self) -> list[Sequence]:
        if len(self.seqs) == 1:  # the common case, on the per-step path
            return [] if self.seqs[0].finish_reason is not None else self.seqs
        return [s for s in self.seqs if not s.is_finished]

    @property
    def prompt_done(self) -> bool:
        return self.seqs[0].num_computed_tokens >= self.seqs[0].num_prompt_tokens

    @property
    def max_seqs(self) -> int:
        """Sequences this group can hold at once (counted against max_num_seqs at admission)."""
        return self.width
