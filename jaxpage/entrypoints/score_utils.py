"""Scoring text pairs (vLLM's score_utils), for LLM.score and the server's /score and /rerank: the pairs of two
inputs (one against many, or many against as many), a cross-encoder's prompt of a pair (the tokenizer's pair
encoding), and an embedding model's score of a pair (the cosine of the two embeddings)."""
from __future__ import annotations

import numpy as np

from jaxpage.utils import FieldError


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """(text_1, text_2) pairs: one text_1 against every text_2, or the i-th of each."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise FieldError("text_1" if not first else "text_2", f"{'text_1' if not first else 'text_2'}: empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise FieldError("text_2", f"text_2: {len(second)} texts for {len(first)} text_1 texts (give one text_1, "
                                   "or as many as text_2)")
    return list(zip(first, second))


def pair_prompt(tokenizer, text_1: str, text_2: str) -> dict:
    """A cross-encoder's prompt of a pair: the tokenizer's pair encoding (its special tokens where it has them)."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a model with a tokenizer")
    return {"prompt_token_ids": tokenizer(text_1, text_pair=text_2)["input_ids"], "prompt": f"{text_1}{text_2}"}


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
