"""The stop rule: decided in order, after min_tokens, with the stop reason."""
from __future__ import annotations


def test_check_stop_decides_in_order_after_min_tokens_and_sets_the_stop_reason():
    from jaxpage.core.stop import check_stop
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.sequence import FinishReason, Sequence

    def seq(*output: int, max_len: int = 10) -> Sequence:
        return Sequence(0, [1, 2, *output], num_prompt_tokens=2, max_len=max_len)

    eos = frozenset({9})
    p = SamplingParams(stop_token_ids=[5], min_tokens=2)
    assert check_stop(seq(5), p, eos) is None and check_stop(seq(9), p, eos) is None  # under min_tokens
    assert check_stop(seq(5, max_len=3), p, eos) is FinishReason.LENGTH  # the length ends it all the same
    s = seq(3, 5)
    assert check_stop(s, p, eos) is FinishReason.STOP and s.stop_reason == 5
    s = seq(3, 9)
    assert check_stop(s, p, eos) is FinishReason.STOP and s.stop_reason is None  # EOS has no stop reason
    assert check_stop(seq(3, 9), SamplingParams(ignore_eos=True), eos) is None
    s = seq(3, 4, max_len=4)  # a stop string found on its last token comes before its length
    assert check_stop(s, p, eos, stop_string="ab") is FinishReason.STOP and s.stop_reason == "ab"
    beam = SamplingParams(use_beam_search=True, best_of=2, stop_token_ids=[5])
    assert check_stop(seq(5), beam, eos) is None  # beams end at EOS alone (a hypothesis), not at stop tokens
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error", "pruned"]  # what users see
