"""OutputProcessor (vLLM's): each request's detokenizing, stop strings and RequestOutputs, full or delta."""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable

from jaxpage.core.beam_search import final_beams
from jaxpage.core.scheduler_output import TokensTaken
from jaxpage.core.stop import check_stop, reached_min_tokens
from jaxpage.engine.detokenizer import IncrementalDetokenizer
from jaxpage.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from jaxpage.sequence import FinishReason, Sequence, SequenceGroup

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestState:
    group: SequenceGroup
    prompt: str | None
    metrics: RequestMetrics
    prompt_token_ids: list[int]  # every output's prompt_token_ids (one list, made once, as in vLLM)
    detokenizers: dict[int, IncrementalDetokenizer] = dataclasses.field(default_factory=dict)  # by seq_id
    sent: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # delta mode: [tokens, chars] sent
    prompt_logprobs_sent: bool = False  # delta mode: the prompt logprobs go in the first output only


class OutputProcessor:
    """Turns the sequences' new tokens into text and outputs. It ends nothing itself: a stop string, a request
    whose every sequence is done and a request that failed are reported to the engine through ``end(group, seq,
    reason)`` (seq None: the whole request), which ends them in its scheduler at once."""

    def __init__(self, tokenizer, end: Callable[[SequenceGroup, Sequence | None, FinishReason], None]):
        self.tokenizer = tokenizer
        self.end = end
        self.requests: dict[str, RequestState] = {}
        self.finished_metrics: collections.deque[RequestMetrics] = collections.deque(maxlen=1000)

    def add_request(self, group: SequenceGroup, prompt: str | None, prompt_token_ids: list[int],
                    metrics: RequestMetrics) -> None:
        self.requests[group.request_id] = RequestState(group, prompt, metrics, prompt_token_ids)

    def process_outputs(self, sampled: list[TokensTaken], failed: dict[str, Exception],
                        now: float) -> list[RequestOutput]:
        """The outputs of the requests whose sequences got a token (the rows ``sampled``), in the order of their
        first rows; then an error output for each request in ``failed``."""
        outputs: list = []
        several: dict[str, int] = {}  # requests of several rows: their place in outputs, made once all are in
        states: dict[str, RequestState] = {}  # of requests failed here (they may be forgotten already)
        requests = self.requests
        for row, new_logprobs in sampled:
            seq, group = row.seq, row.group
            request_id, p = group.request_id, group.params
            request = None
            try:
                request = requests[request_id]
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                if not p.use_beam_search:  # beams decode their whole text once output
                    self._detokenize(request, seq, new_logprobs)
                if group.width == 1 and not p.use_beam_search:  # its only row: its output is made now
                    output = self._request_output(request, now)
                    if output is not None:
                        outputs.append(output)
                elif request_id not in several:
                    several[request_id] = len(outputs)
                    outputs.append(request)
            except Exception as e:  # noqa: BLE001 - a failure in one request's host work ends that request alone
                failed.setdefault(request_id, e)
                states.setdefault(request_id, request)
        for request_id, i in several.items():
            if request_id not in failed:
                request = outputs[i]
                try:
                    outputs[i] = self._request_output(request, now)
                except Exception as e:  # noqa: BLE001
                    failed.setdefault(request_id, e)
                    states.setdefault(request_id, request)
        if failed or several:
            outputs = [o for o in outputs if isinstance(o, (RequestOutput, PoolingRequestOutput))
                       and o.request_id not in failed]
        return outputs + [self.error(request_id, e, states.get(request_id)) for request_id, e in failed.items()]

    def _detokenize(self, request: RequestState, seq: Sequence, new_logprobs: tuple[float, ...] = ()) -> None:
        """Adds the sequence's new tokens to its text (one a step; several with speculative decoding, whose
        log-probabilities are ``new_logprobs``), token by token; a stop string ends the sequence at the token
        that completes it (check_stop), and the tokens after it in the same step are taken back out."""
        p = request.group.params
        detok = request.detokenizers.get(seq.seq_id)
        if detok is None:
            detok = request.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], p.skip_special_tokens, p.stop)
        new = seq.token_ids[seq.num_prompt_tokens + detok.num_tokens:]
        for i, token in enumerate(new):
            detok.add(token)
            last = i == len(new) - 1  # only the newest token can be a stop token (the scheduler ends runs there)
            if p.stop and (not last or seq.finish_reason != FinishReason.STOP) and reached_min_tokens(seq, p):
                stop = detok.find_stop(p.stop, p.include_stop_str_in_output)
                if stop is not None:
                    _drop_last(seq, len(new) - 1 - i, new_logprobs)
                    reason = check_stop(seq, p, stop_string=stop)
                    if seq.finish_reason is None:
                        self.end(request.group, seq, reason)
                    else:  # it reached its length with this token: the stop string comes first, as in vLLM
                        seq.finish_reason = reason
                    return

    def _request_output(self, request: RequestState, now: float) -> RequestOutput | None:
        """The request's output after a step (None while a final_only request runs); a request whose sequences
        are all done is finished and forgotten."""
        group = request.group
        done = not group.live_seqs
        if done:
            request.metrics.finished_time = now
            request.metrics.num_output_tokens = max(s.num_output_tokens for s in group.seqs + group.finished_seqs)
            self.finished_metrics.append(request.metrics)
            self.end(group, None, FinishReason.STOP)
            del self.requests[group.request_id]
        if not done and group.params.output_kind == "final_only":
            return None
        return self.output(request, done)

    def output(self, request: RequestState, finished: bool) -> RequestOutput | PoolingRequestOutput:
        group, p = request.group, request.group.params
        if group.pooling is not None and finished:
            if group.pooling.num_pooled_tokens < len(request.prompt_token_ids):  # aborted before the prompt's end
                return PoolingRequestOutput(group.request_id, PoolingOutput(None), request.prompt_token_ids, True,
                                            request.prompt, error="the pooling request was aborted before its "
                                                                  "prompt was computed")
            data = group.pooling.result(len(request.prompt_token_ids))
            return PoolingRequestOutput(group.request_id, PoolingOutput(data), request.prompt_token_ids, True,
                                        request.prompt)
        if p.use_beam_search:
            seqs = (final_beams(group) or group.seqs[:p.n]) if finished else group.live_seqs  # or aborted
        elif finished and p.best_of > p.n:
            seqs = sorted(group.seqs, key=lambda s: -s.cumulative_logprob)[:p.n]
        else:
            seqs = group.seqs[:p.n] if finished else group.seqs
        completions = ([self._completion(request, seqs[0], 0, finished)] if len(seqs) == 1 else
                       [self._completion(request, seq, index, finished) for index, seq in enumerate(seqs)])
        return RequestOutput(group.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             request.metrics, prompt_logprobs=self._prompt_logprobs(request))

    def _prompt_logprobs(self, request: RequestState) -> list | None:
        """The request's prompt logprobs once complete (they are by its first token), if it asked for them."""
        entries = request.group.prompt_logprobs
        if entries is None or len(entries) < len(request.prompt_token_ids) or request.prompt_logprobs_sent:
            return None
        request.prompt_logprobs_sent = request.group.params.output_kind == "delta"
        return entries

    def _completion(self, request: RequestState, seq: Sequence, index: int, finished: bool) -> CompletionOutput:
        p, seq_id = request.group.params, seq.seq_id
        done = finished or seq.finish_reason is not None
        detok = request.detokenizers.get(seq_id)
        text = detok.output_text(done) if detok else ""
        if p.use_beam_search and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        tokens_from = 0
        if p.output_kind == "delta":  # what is new since the last output
            sent = request.sent.get(seq_id)
            if sent is None:
                sent = request.sent[seq_id] = [0, 0]
            tokens_from, text_from = sent
            token_ids = seq.token_ids[seq.num_prompt_tokens + tokens_from:]
            sent[0], sent[1] = tokens_from + len(token_ids), len(text)
            if text_from:
                text = text[text_from:]
        else:
            token_ids = seq.token_ids[seq.num_prompt_tokens:]
        logprobs = seq.output_logprobs[tokens_from:] if p.logprobs is not None else None
        reason = seq.finish_reason.value if done and seq.finish_reason is not None else None  # the public str
        return CompletionOutput(index, text, token_ids, seq.cumulative_logprob, logprobs, reason, seq.stop_reason)

    def abort(self, request_id: str) -> RequestState | None:
        """Forgets the request; the caller ends its sequences."""
        return self.requests.pop(request_id, None)

    def error(self, request_id: str, error: Exception, request: RequestState | None) -> RequestOutput:
        """Ends a request whose host-side work raised (a bug or an input validation missed): it alone fails."""
        log.error("request %s failed on the engine thread; it is ended, the others go on", request_id,
                  exc_info=error)
        request = self.requests.pop(request_id, None) or request  # it may have been forgotten as it finished
        message = f"the request failed on the engine: {type(error).__name__}: {error}"
        if request is None:
            return RequestOutput(request_id, None, [], [], True, None, error=message)
        group = request.group
        self.end(group, None, FinishReason.ERROR)
        completions = [CompletionOutput(i, "", [], finish_reason=FinishReason.ERROR.value)
                       for i in range(group.params.n)]
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, completions, True,
                             request.metrics, error=message)


def _drop_last(seq: Sequence, n: int, logprobs: tuple[float, ...]) -> None:
    """Takes the last n tokens of a speculative run back out of a sequence that a stop string ended before
    them (they are never output), with their log-probabilities."""
    if n:
        del seq.token_ids[-n:]
        seq.cumulative_logprob -= sum(logprobs[-n:])
        del seq.output_logprobs[-n:]  # (empty when the request asked for no logprobs)
