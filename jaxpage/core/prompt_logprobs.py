"""Prompt logprobs on the host (vLLM's ``prompt_logprobs``): which tokens of a step's flat batch need the next
prompt token's log-probability, and the request's entries taken from the step's output.

A request that asks keeps them on its group (``SequenceGroup.prompt_logprobs``): ``[None]`` for the first prompt
token, then one entry per prompt position, in order. A chunk of the prompt covers its own positions, its last
one included, whose next token is the first of the next chunk: the host knows the whole prompt, so each token's
target comes down with the batch (``prompt_targets``). Positions whose entry exists already (recomputed after a
preemption) are not computed again. Such a request reads nothing from the prefix cache until its entries are
complete (``Scheduler``), so no position is skipped.
"""
from __future__ import annotations

import functools

import numpy as np

from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.sequence import SequenceGroup

NO_TARGET = -1


def lacks_prompt_logprobs(group: SequenceGroup) -> bool:
    """Whether the request asks for prompt logprobs and still lacks some (it then reads no prefix cache)."""
    entries = group.prompt_logprobs
    return entries is not None and len(entries) < group.seqs[0].num_prompt_tokens


def positions(s: ScheduledSeq) -> range:
    """The positions of row s's chunk whose next prompt token's entry its request still lacks (empty for a
    request that asks for none, and for a fork, which computes no token)."""
    entries = s.group.prompt_logprobs
    if entries is None or s.logits_of is not None:
        return range(0)
    first = s.seq.num_computed_tokens
    return range(max(first, len(entries) - 1), min(first + s.num_new_tokens, s.seq.num_prompt_tokens - 1))


def prompt_targets(scheduled: list[ScheduledSeq], num_tokens: int) -> np.ndarray:
    """[num_tokens] int32: for each token of the step's flat batch (the rows' chunks one after the other), the
    prompt token after it where its request needs that position's entry (``positions``), else NO_TARGET."""
    targets, at = no_targets(num_tokens), 0
    for s in scheduled:
        span = positions(s)
        if span:
            if not targets.flags.writeable:
                targets = targets.copy()
            start = at + span.start - s.seq.num_computed_tokens
            targets[start:start + len(span)] = s.seq.token_ids[span.start + 1:span.stop + 1]
        at += s.num_new_tokens
    return targets


@functools.lru_cache(maxsize=64)
def no_targets(num_tokens: int) -> np.ndarray:
    """The targets of a step where no token needs one (read-only, made once per bucket)."""
    targets = np.full(num_tokens, NO_TARGET, np.int32)
    targets.flags.writeable = False
    return targets


def take_prompt_logprobs(s: ScheduledSeq, out, at: int) -> None:
    """Appends the entries of row s's positions (``positions``; before the row's tokens are counted as
    computed) to its request's, from the step's per-token prompt output ``out`` (numpy; the sampler's
    PromptLogprobsOutput), the row's chunk starting at token ``at`` of the flat batch: the top
    ``prompt_logprobs`` token ids and the prompt token's own log-probability."""
    span = positions(s)
    if not span:
        return
    entries, k = s.group.prompt_logprobs, s.group.params.prompt_logprobs
    assert len(entries) == span.start + 1, (len(entries), span)  # in order, none skipped
    lo = at + span.start - s.seq.num_computed_tokens
    top_ids = out.top_ids[lo:lo + len(span), :k].tolist()
    top_logprobs = out.top_logprobs[lo:lo + len(span), :k].tolist()
    own = out.logprobs[lo:lo + len(span)].tolist()
    for token, ids, values, logprob in zip(s.seq.token_ids[span.start + 1:span.stop + 1], top_ids, top_logprobs,
                                           own):
        entry = dict(zip(ids, values))
        entry[token] = logprob
        entries.append(entry)
