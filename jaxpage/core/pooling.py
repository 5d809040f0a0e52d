"""A pooling request's vector, gathered on the host over its prompt's chunks from each step's pooled rows
(jaxpage.worker.pooler): LAST keeps the final chunk's, MEAN sums the chunks' sums and divides by the prompt's
length, CLS keeps the first chunk's. A chunk that starts the prompt again (after a recompute preemption) starts the
vector again. The finished vector is cut to PoolingParams.dimensions and normalized as asked; a classification
model's (a *ForSequenceClassification head: ``classifier`` [num_labels, hidden]) is its head's logits, as
probabilities for task "classify" (softmax; a sigmoid for one label, as a cross-encoder's score)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxpage.config import PoolerConfig
from jaxpage.pooling_params import PoolingParams


@dataclasses.dataclass
class PoolingState:
    config: PoolerConfig
    params: PoolingParams
    classifier: np.ndarray | None = None
    acc: np.ndarray | None = None
    num_pooled_tokens: int = 0  # the prompt positions the chunks so far covered

    def add(self, start: int, num_tokens: int, pooled: np.ndarray) -> None:
        """One chunk's pooled row, the chunk of ``num_tokens`` starting at prompt position ``start``."""
        kind = self.config.pooling_type
        self.num_pooled_tokens = start + num_tokens
        if start == 0 or self.acc is None:
            self.acc = np.array(pooled, np.float32)
        elif kind == "MEAN":
            self.acc += pooled
        elif kind == "LAST":
            self.acc = np.array(pooled, np.float32)

    def result(self, num_prompt_tokens: int) -> np.ndarray:
        """The request's vector (float32), once its prompt is computed."""
        vector = self.acc / num_prompt_tokens if self.config.pooling_type == "MEAN" else self.acc.copy()
        if self.classifier is not None:
            return classify(self.classifier @ vector, self.params.task)
        if self.params.dimensions is not None:
            vector = vector[:self.params.dimensions]
        normalize = self.config.normalize if self.params.normalize is None else self.params.normalize
        if self.params.task == "embed" and normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # as torch's F.normalize
        return vector.astype(np.float32)


def classify(logits: np.ndarray, task: str) -> np.ndarray:
    """A classifier's output for task "encode" (its logits), "classify" (softmax) or "score" (one label's
    sigmoid)."""
    logits = logits.astype(np.float64)
    if task == "encode":
        return logits.astype(np.float32)
    if len(logits) == 1:
        return (1 / (1 + np.exp(-logits))).astype(np.float32)
    e = np.exp(logits - logits.max())
    return (e / e.sum()).astype(np.float32)
