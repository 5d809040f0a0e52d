"""n-gram prompt lookup (vLLM's ``ngram`` method, NgramProposer): the tokens that followed an earlier occurrence
of the sequence's last n tokens, over its own prompt and output, on the host."""
from __future__ import annotations

import numpy as np

from jaxpage.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        return propose_ngram(seq.token_ids, self.min_n, self.max_n, num_tokens)


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The up to ``num_tokens`` tokens after the latest earlier occurrence of the longest suffix of ``token_ids``
    of max_n down to min_n tokens; [] when no such suffix occurred before (or num_tokens is 0). The latest
    occurrence rather than the first (vLLM's): the nearest context is the likelier to repeat."""
    if num_tokens <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram with a token after it
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []
