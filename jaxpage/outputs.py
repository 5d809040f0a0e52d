"""What a request gives back, shaped as vLLM's RequestOutput."""
from __future__ import annotations

import dataclasses

# vLLM's PromptLogprobs, with the log-probability a float as in CompletionOutput.logprobs: one entry per prompt
# token, None for the first (nothing precedes it), else token id -> log-probability for the top N at that
# position and the prompt token itself
PromptLogprobs = list[dict[int, float] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None  # per generated token: top token id -> log-probability
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine ended this request on an internal failure
    # with SamplingParams.prompt_logprobs (in delta mode, in the request's first output only)
    prompt_logprobs: PromptLogprobs | None = None


@dataclasses.dataclass
class PoolingOutput:
    """vLLM's: the pooler's output for one prompt (a float32 vector)."""
    data: object  # numpy [D]


@dataclasses.dataclass
class PoolingRequestOutput:
    """vLLM's: what a pooling request gives back, once its prompt is computed."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    error: str | None = None  # as RequestOutput's (a failed pooling request's output is a RequestOutput)


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's: LLM.embed's output per prompt."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput([float(x) for x in out.outputs.data]), out.prompt_token_ids,
                   out.finished)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """vLLM's: LLM.classify's output per prompt."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput([float(x) for x in out.outputs.data]), out.prompt_token_ids,
                   out.finished)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """vLLM's: LLM.score's output per pair (prompt_token_ids: the pair's, or both texts' for an embedding model)."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
