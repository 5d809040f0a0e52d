"""When a sequence stops, and why (vLLM's check_stop, in its core/sched/utils.py)."""
from __future__ import annotations

from collections.abc import Collection

from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import FinishReason, Sequence


def reached_min_tokens(seq: Sequence, params: SamplingParams) -> bool:
    """Whether the sequence may stop: before min_tokens output tokens only its length ends it (and the sampler
    bans its stop tokens)."""
    return not params.min_tokens or seq.num_output_tokens >= params.min_tokens


def is_eos(token: int, params: SamplingParams, eos_token_ids: Collection[int]) -> bool:
    return token in eos_token_ids and not params.ignore_eos


def check_stop(seq: Sequence, params: SamplingParams, eos_token_ids: Collection[int] = (),
               stop_string: str | None = None) -> FinishReason | None:
    """Whether ``seq`` ends with its last token, and why (None: it goes on); sets its stop_reason.

    Once it reached min_tokens: a stop string the output processor found in its text, then a stop token, then
    EOS (unless ignore_eos) end it as STOP. Otherwise it ends as LENGTH at its max_len. Beams end at EOS alone:
    beam search makes their hypotheses, and checks neither stop tokens nor stop strings."""
    if reached_min_tokens(seq, params):
        if stop_string is not None:
            seq.stop_reason = stop_string
            return FinishReason.STOP
        token = seq.token_ids[-1]
        if token in params.stop_token_ids and not params.use_beam_search:
            seq.stop_reason = token
            return FinishReason.STOP
        if is_eos(token, params, eos_token_ids):
            return FinishReason.STOP
    return FinishReason.LENGTH if seq.num_tokens >= seq.max_len else None
