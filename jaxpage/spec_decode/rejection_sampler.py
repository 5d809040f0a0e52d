"""Verification of a sequence's draft tokens against the target model's samples at the same positions (vLLM's
RejectionSampler). For deterministic drafts (n-gram and suffix proposals) the target's own draws decide; a draft
model's drafts, drawn from its q, are verified on the device (``jaxpage.worker.sampler.rejection_sample``: the
row's token is the draft d with probability min(1, p(d) / q(d)), else a draw from the residual max(0, p - q)),
after which the same rule below reads the step's tokens: a row whose token is its draft accepted it (a
residual draw is never d), the first that differs holds the recovered token.

A draft of k tokens is a chunk of k + 1 query tokens in one step: the sequence's last token and the drafts. The
step samples the target's token at each of those positions, as it samples any token (temperature, top-k/p,
min-p, the row's seed at that token's output index): ``sampled[j]`` follows the tokens and drafts[:j].

Rejection sampling with a one-hot proposal q (the draft d) accepts d with probability min(1, p(d) / q(d)) = p(d)
and on rejection draws from the residual max(0, p - q) renormalised: p without d. Drawing x ~ p and accepting
iff x == d is the same law: P(accept) = P(x = d) = p(d), and given x != d, x is distributed as p without d,
renormalised. So the target's own draw is the rejection sampler's: the first draft that differs from the
target's sample at its position is rejected and that sample stands in its place (the recovered token); when all
k agree, the sample after the last draft is the bonus token. Greedy rows (argmax) accept the longest prefix that
matches the target's argmax. A seeded row's draw at output index i uses the key a non-speculative run uses for
index i, so its tokens are those of a run without speculation."""
from __future__ import annotations


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """How many leading draft tokens the target's samples at their positions confirm (``sampled[j]``: the
    target's token after drafts[:j]; len(sampled) == len(draft) + 1)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n


def emitted_tokens(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified draft adds to its sequence: the accepted drafts, then the target's sample after
    them (the recovered token at the first rejection, else the bonus token)."""
    n = num_accepted(draft, sampled)
    return list(sampled[:n + 1])
