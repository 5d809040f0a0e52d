"""Beam search over the paged engine: beams are sequences of one group sharing blocks by reference count.

Each step every live beam offers its 2W best next tokens (W = beam width) scored by cumulative log-probability;
the best candidates are taken in order: an EOS among the first W ranks ends a hypothesis, other tokens extend a
beam, until W beams live. A beam chosen k times is forked k-1 times (copy-on-write takes care of the partly
filled last block); unchosen beams free their blocks. The search stops once W hypotheses have ended (early
stopping) or the beams reach their maximum length; the n best by cum_logprob / len**length_penalty are returned.
"""
from __future__ import annotations

from typing import Callable

from jaxpage.core.stop import check_stop, is_eos
from jaxpage.sequence import FinishReason, Sequence, SequenceGroup


def beam_search_step(group: SequenceGroup, eos_token_ids, scheduler, next_seq_id: Callable[[], int]) -> None:
    p, width = group.params, group.params.beam_width
    live = group.live_seqs
    candidates = []
    for b, seq in enumerate(live):
        ids, logprobs = seq.pending_top
        seq.pending_top = None
        for token, lp in zip(ids[:2 * width].tolist(), logprobs[:2 * width].tolist()):
            if lp != float("-inf"):  # a token structured outputs forbid
                candidates.append((seq.cumulative_logprob + lp, b, token, lp))
    candidates.sort(key=lambda c: -c[0])
    chosen = []
    for rank, (score, b, token, lp) in enumerate(candidates):
        if is_eos(token, p, eos_token_ids):
            if rank < width:
                group.finished_seqs.append(_hypothesis(live[b], token, lp, next_seq_id()))
            continue
        chosen.append((b, token, lp))
        if len(chosen) == width:
            break
    beams, used = [], set()
    for b, token, lp in chosen:  # fork before any beam is extended, so forks copy the old history
        if b in used:
            beam = scheduler.fork_seq(live[b], live[b].seed)
        else:
            beam = live[b]
            used.add(b)
        beams.append((beam, token, lp))
    for b, seq in enumerate(live):
        if b not in used:
            scheduler.finish_seq(group, seq, FinishReason.PRUNED)
    for beam, token, lp in beams:
        beam.token_ids.append(token)
        beam.cumulative_logprob += lp
    group.seqs = [beam for beam, _, _ in beams]
    group.forked = True
    _maybe_stop(group, eos_token_ids, scheduler)


def _hypothesis(parent: Sequence, token: int, logprob: float, seq_id: int) -> Sequence:
    hyp = parent.fork(seq_id, parent.seed)  # finished at once: it never holds blocks
    hyp.token_ids.append(token)
    hyp.cumulative_logprob += logprob
    hyp.finish_reason = FinishReason.STOP
    return hyp


def _maybe_stop(group: SequenceGroup, eos_token_ids, scheduler) -> None:
    p = group.params
    if len(group.finished_seqs) >= p.beam_width:
        for seq in group.live_seqs:
            scheduler.finish_seq(group, seq, FinishReason.PRUNED)
        return
    for seq in group.live_seqs:
        reason = check_stop(seq, p, eos_token_ids)  # its length: a beam's last token is never an ending EOS
        if reason is not None:
            scheduler.finish_seq(group, seq, reason)
            group.finished_seqs.append(seq)


def beam_score(seq: Sequence, length_penalty: float) -> float:
    return seq.cumulative_logprob / (seq.num_output_tokens ** length_penalty)


def final_beams(group: SequenceGroup) -> list[Sequence]:
    """The n best ended hypotheses. A search cut short (aborted: the group can never fit in the pool) may have
    ended fewer than n: its best unfinished beams make up the rest, so the request still gets n completions."""
    p = group.params
    best = sorted(group.finished_seqs, key=lambda s: -beam_score(s, p.length_penalty))[:p.n]
    if len(best) < p.n:
        ended = {id(s) for s in group.finished_seqs}
        rest = [s for s in group.seqs if id(s) not in ended]  # the beams of one step: all of the same length,
        best += sorted(rest, key=lambda s: -s.cumulative_logprob)[:p.n - len(best)]  # so ranked by cum_logprob
    return best
