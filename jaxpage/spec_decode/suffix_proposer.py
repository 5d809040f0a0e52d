"""Suffix decoding (vLLM's ``suffix`` method, Arctic Inference's algorithm through its PyPI package
``arctic-inference``): suffix trees over each running sequence's prompt and output and one over the outputs of
earlier requests (bounded: the oldest evicted first), the draft the most frequent continuation of the longest
match of the sequence's last tokens, as long as the match allows (max_spec_factor) and each token likely enough
(min_token_prob)."""
from __future__ import annotations

from jaxpage.config import SpeculativeConfig
from jaxpage.sequence import Sequence


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as e:
            raise ValueError("speculative_config.method='suffix' needs the package arctic-inference "
                             "(pip install 'jaxpage[suffix]' or pip install arctic-inference)") from e
        self.config = config
        self.cache = SuffixDecodingCache(config.suffix_decoding_max_tree_depth,
                                         config.suffix_decoding_max_cached_requests)
        self._active: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (its sequence, output tokens added)

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        self._stop_finished()
        output = seq.token_ids[seq.num_prompt_tokens:]
        if seq.seq_id not in self._active:
            self.cache.start_request(seq.seq_id, seq.token_ids[:seq.num_prompt_tokens])
            self._active[seq.seq_id] = (seq, 0)
        owner, added = self._active[seq.seq_id]
        if len(output) > added:  # its new tokens join its own tree and the global one
            self.cache.add_active_response(seq.seq_id, output[added:])
            self._active[seq.seq_id] = (owner, len(output))
        c = self.config
        draft = self.cache.speculate(seq.seq_id, seq.token_ids[-c.suffix_decoding_max_tree_depth:],
                                     max_spec_tokens=num_tokens, max_spec_factor=c.suffix_decoding_max_spec_factor,
                                     min_token_prob=c.suffix_decoding_min_token_prob)
        return list(draft.token_ids[:num_tokens])

    def _stop_finished(self) -> None:
        """Ends the per-sequence trees of the sequences that finished (their outputs stay in the global one)."""
        for seq_id in [i for i, (seq, _) in self._active.items() if seq.is_finished]:
            self.cache.stop_request(seq_id)
            del self._active[seq_id]
