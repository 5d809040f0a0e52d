"""PoolingParams: vLLM's, what a pooling request (LLM.embed, /v1/embeddings) asks of the pooled vector."""
from __future__ import annotations

import dataclasses

TASKS = ("embed", "classify", "score", "encode")


@dataclasses.dataclass
class PoolingParams:
    """task: "embed" (the pooled vector, normalized as the model says), "classify" (a classification model's
    probabilities), "score" (a cross-encoder's sigmoid of its one logit) or "encode" (vLLM's: the pooler's output
    as is: the vector, or a classifier's logits). dimensions: keep the first this many (Matryoshka embeddings),
    normalized after; normalize: None takes the model's (its PoolerConfig)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r} must be one of {', '.join(TASKS)}")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions={self.dimensions!r} must be an integer >= 1")
