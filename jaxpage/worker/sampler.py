"""Token sampling on the device, one row per sequence."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.cpu_kernels import greedy_pick as greedy_kernel
from jaxpage.distributed.parallel import model_axis_size, over_vocab
from jaxpage.distributed.vocab_shard import VocabShard
from jaxpage.models.layers import soft_cap
from jaxpage.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

# EOS and stop token ids masked while a sequence is under min_tokens: room for MAX_STOP_TOKEN_IDS and 16 EOS ids
MAX_BANNED = MAX_STOP_TOKEN_IDS + 16


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling settings, padded to the sequence bucket [S].

    temperature 0 means greedy; top_k 0 and top_p 1 mean off. The key of a request's n-th token is
    fold_in(key(seed), n), whatever else is in the batch. history [slots, max_model_len] holds token ids (prompt
    then output, -1 after) of the sequences with penalties, on the device between steps (PenaltyHistory); row i's
    are history[history_rows[i]] (slot 0: none), read only when a row has a penalty; banned [S, MAX_BANNED] (-1 padded)
    lists token ids that may not be sampled. want_top [] says whether any row needs the top log-probabilities.
    allowed [S, ceil(vocab / 32)] int32 is each row's bitmask of tokens it may sample (bit j of word i: token
    32 i + j), all ones for rows without structured outputs. logit_bias_ids [S, MAX_LOGIT_BIAS] (-1 padded) and
    logit_bias [S, MAX_LOGIT_BIAS] are each row's OpenAI logit_bias, added to the logits before the penalties.
    prompt_targets [T] (one per token of the flat batch, not per row): the next prompt token of each token whose
    request asks for prompt logprobs at its position, -1 elsewhere (core/prompt_logprobs.py); None in batches
    made without them, whose step computes none. draft_ids [S] (-1: none) and draft_probs [S, V]: speculative
    decoding with a draft model, the draft token a row verifies and the draft's distribution it was drawn from
    (``rejection_sample``); None in every other engine's batches. history_extra [S, num_speculative_tokens] (-1
    padded): with speculative decoding, the draft tokens before each row's position, which the penalties count
    as output tokens after the row's history; None in engines without speculation.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    steps: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    history: jax.Array
    history_rows: jax.Array
    num_prompt_tokens: jax.Array
    banned: jax.Array
    want_top: jax.Array
    allowed: jax.Array
    logit_bias_ids: jax.Array
    logit_bias: jax.Array
    prompt_targets: jax.Array | None = None
    draft_ids: jax.Array | None = None
    draft_probs: jax.Array | None = None
    history_extra: jax.Array | None = None


jax.tree_util.register_dataclass(
    SamplingBatch, data_fields=[f.name for f in dataclasses.fields(SamplingBatch)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class PromptLogprobsOutput:
    """Per token of the step's flat batch [T]: the log-probability of its prompt target (SamplingBatch.
    prompt_targets) and the top MAX_LOGPROBS at its position; zeros where no token of its chunk of the
    batch has a target (``prompt_logprobs`` was not computed there)."""

    logprobs: jax.Array  # [T] float32
    top_ids: jax.Array  # [T, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32

    @classmethod
    def zeros(cls, num_tokens: int) -> PromptLogprobsOutput:
        return cls(jnp.zeros(num_tokens, jnp.float32), jnp.zeros((num_tokens, MAX_LOGPROBS), jnp.int32),
                   jnp.zeros((num_tokens, MAX_LOGPROBS), jnp.float32))


jax.tree_util.register_dataclass(
    PromptLogprobsOutput, data_fields=[f.name for f in dataclasses.fields(PromptLogprobsOutput)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] log-probability of each sampled token under the model's distribution
    top_ids: jax.Array  # [S, MAX_LOGPROBS] (zeros unless want_top)
    top_logprobs: jax.Array
    prompt: PromptLogprobsOutput | None = None  # per token, not per row; None from a batch without targets
    probs: jax.Array | None = None  # [S, V] the distribution each row was drawn from (a draft model's; else None)
    pooled: jax.Array | None = None  # [S, D] a pooling model's pooled hidden states (jaxpage.worker.pooler)
    # [T, A * D] per token, not per row: an EAGLE-3 head's target's auxiliary hidden states (EngineConfig's
    # aux_hidden_layers); None elsewhere
    hidden_states: jax.Array | None = None

    def rows(self, index) -> SamplerOutput:
        """The rows ``index`` (a slice or row numbers) of the per-row outputs; the per-token prompt part whole."""
        return SamplerOutput(self.tokens[index], self.logprobs[index], self.top_ids[index], self.top_logprobs[index],
                             self.prompt, None if self.probs is None else self.probs[index],
                             None if self.pooled is None else self.pooled[index], self.hidden_states)


jax.tree_util.register_dataclass(
    SamplerOutput, data_fields=[f.name for f in dataclasses.fields(SamplerOutput)], meta_fields=[])


def sample(logits: jax.Array, sp: SamplingBatch, with_probs: bool = False) -> SamplerOutput:
    """One token per row of logits [S, V]. Traced under a tensor-parallel mesh (``parallel.with_mesh``) whose
    size divides V, each device samples from its own slice of the vocabulary (the logits as the LM head leaves
    them: split by vocabulary), so no device gathers the full logits. with_probs: also each row's distribution
    (a draft model's q; one device only)."""
    tp, vocab = model_axis_size(), logits.shape[1]
    if tp == 1 or vocab % tp:
        return sample_shard(logits, sp, VocabShard(vocab, vocab), lambda: exponential_noise(sp, vocab), with_probs)
    noise = jax.lax.cond(jnp.any(sp.temperature > 0), lambda: exponential_noise(sp, vocab),
                         lambda: jnp.ones(logits.shape, jnp.float32))
    return over_vocab(sample_shard, logits, noise, sp, split_fields=("draft_probs",))


def sample_shard(logits: jax.Array, sp: SamplingBatch, vocab: VocabShard, noise,
                 with_probs: bool = False) -> SamplerOutput:
    """``sample`` on the slice ``vocab`` of the vocabulary: logits [S, vocab.size]; noise() gives the slice's
    exponential noise (``exponential_noise``), asked for only when a row samples at random."""
    logprobs = vocab.log_softmax(logits)
    logits = jax.lax.cond(jnp.any(sp.logit_bias_ids >= 0), lambda: _apply_logit_bias(logits, sp, vocab),
                          lambda: logits)
    has_penalty = (sp.presence_penalty != 0) | (sp.frequency_penalty != 0) | (sp.repetition_penalty != 1)
    logits = jax.lax.cond(jnp.any(has_penalty), lambda: _apply_penalties(logits, sp, vocab), lambda: logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, vocab.local(sp.banned)].set(-jnp.inf, mode="drop")
    allowed = vocab.bits(sp.allowed)
    logits = jnp.where(allowed, logits, -jnp.inf)
    greedy = vocab.argmax(logits)
    probs = None
    if with_probs:  # greedy rows' distributions stay zeros (a greedy draft is verified by argmax)
        tokens, probs = jax.lax.cond(jnp.any(sp.temperature > 0),
                                     lambda: _sample_random(logits, sp, greedy, vocab, noise, True),
                                     lambda: (greedy, jnp.zeros(logits.shape, jnp.float32)))
    else:
        tokens = jax.lax.cond(jnp.any(sp.temperature > 0), lambda: _sample_random(logits, sp, greedy, vocab, noise),
                              lambda: greedy)
    top_logprobs, top_ids = jax.lax.cond(
        sp.want_top, lambda: vocab.top_k(jnp.where(allowed, logprobs, -jnp.inf), MAX_LOGPROBS),
        lambda: (jnp.zeros((logits.shape[0], MAX_LOGPROBS), logprobs.dtype),
                 jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.int32)))
    return SamplerOutput(tokens, vocab.take(logprobs, tokens), top_ids.astype(jnp.int32), top_logprobs,
                         probs=probs)


def is_plain_greedy(sp: SamplingBatch) -> bool:
    """Whether every row of a host batch asks for the argmax and its log-probability only (no randomness,
    penalty, bias, ban, grammar, top logprobs or draft): then ``plain_greedy`` gives ``sample``'s output."""
    return sp.draft_ids is None and bool(_all_plain_greedy(sp, np))


def plain_greedy_on_device(sp: SamplingBatch) -> jax.Array:
    """``is_plain_greedy`` of a traced batch, a bool scalar on the device (the fused step's choice)."""
    return jnp.logical_and(sp.draft_ids is None, _all_plain_greedy(sp, jnp))


def _all_plain_greedy(sp: SamplingBatch, xp):
    """The one rule of ``is_plain_greedy``, in numpy (``xp=np``: the first failed check ends it, so a sampled
    batch pays no pass over its bitmask) or traced (``xp=jnp``)."""
    checks = (lambda: ~xp.asarray(sp.want_top), lambda: xp.all(xp.asarray(sp.temperature) <= 0),
              lambda: xp.all(xp.asarray(sp.repetition_penalty) == 1),
              lambda: ~xp.any(xp.asarray(sp.presence_penalty) != 0),
              lambda: ~xp.any(xp.asarray(sp.frequency_penalty) != 0),
              lambda: xp.all(xp.asarray(sp.logit_bias_ids) < 0), lambda: xp.all(xp.asarray(sp.banned) < 0),
              lambda: xp.all(xp.asarray(sp.allowed) == -1))
    if xp is np:
        return all(bool(check()) for check in checks)
    return functools.reduce(xp.logical_and, (check() for check in checks))


def plain_greedy(raw_logits: jax.Array, cap: float | None = None) -> SamplerOutput:
    """``sample``'s output for rows that ``is_plain_greedy`` (one device), from the LM head's output before its
    float32 cast and soft cap (``compute_raw_logits``; ``cap``: the model's final_logit_softcap). On the CPU one
    kernel (jaxpage/cpu_kernels/greedy_pick.cc) reads each row once where XLA:CPU makes four passes over [S, V] float32
    temporaries; elsewhere ``greedy_pick_xla``."""
    rows = raw_logits.shape[0]
    no_top = (jnp.zeros((rows, MAX_LOGPROBS), jnp.int32), jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))
    xla = functools.partial(greedy_pick_xla, cap=cap)
    return SamplerOutput(*greedy_kernel.GREEDY_PICK(xla, raw_logits, soft_cap=cap or 0.0), *no_top)


def greedy_pick_xla(raw_logits: jax.Array, cap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(tokens, logprobs) of ``plain_greedy`` in jnp, without the general path's [S, V] temporaries (the
    log-softmax, the masks): the log-probability is the log-softmax's at the token, (x - max) -
    log(sum(exp(x - max)))."""
    logits = soft_cap(raw_logits.astype(jnp.float32), cap)
    vocab = VocabShard(logits.shape[1], logits.shape[1])
    top = vocab.max(logits)
    tokens = vocab.argmax(logits)
    log_sum = jnp.log(vocab.sum(jnp.exp(logits - top)))
    return tokens, (vocab.take(logits, tokens) - top[:, 0]) - log_sum[:, 0]


def exponential_noise(sp: SamplingBatch, vocab: int) -> jax.Array:
    """[S, vocab] Exp(1) draws: row i's from fold_in(key(seed), step), whatever else is in the batch. Each
    element depends on its index only (JAX's partitionable threefry), so GSPMD computes a vocabulary-split copy
    shard by shard, each device its own slice."""
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sp.seeds, sp.steps)
    return jax.vmap(lambda k: jax.random.exponential(k, (vocab,)))(keys)


def _apply_logit_bias(logits: jax.Array, sp: SamplingBatch, vocab: VocabShard) -> jax.Array:
    """Each row's biases added to its logits (vLLM applies them before the penalties, as here)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, vocab.local(sp.logit_bias_ids)].add(sp.logit_bias, mode="drop")


def _apply_penalties(logits: jax.Array, sp: SamplingBatch, vocab: VocabShard) -> jax.Array:
    """vLLM's penalties: repetition over prompt and output tokens, presence and frequency over output tokens."""
    num_seqs, size = logits.shape
    history = sp.history[sp.history_rows]
    if sp.history_extra is not None:  # a draft position counts the drafts before it
        history = jnp.concatenate([history, sp.history_extra], axis=1)
    ids = vocab.local(history)
    is_output = (history >= 0) & (jnp.arange(history.shape[1])[None, :] >= sp.num_prompt_tokens[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], ids.shape)
    seen = jnp.zeros((num_seqs, size), bool).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((num_seqs, size), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32),
                                                                         mode="drop")
    rp = sp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - sp.frequency_penalty[:, None] * counts
    return logits - sp.presence_penalty[:, None] * (counts > 0)


def _sample_random(logits: jax.Array, sp: SamplingBatch, greedy: jax.Array, vocab: VocabShard, noise,
                   with_probs: bool = False):
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = logits / temp
    truncates = (sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0)
    # the filter makes 32-pass bisections over every row's vocabulary: only when a row asks
    scaled = jax.lax.cond(jnp.any(truncates), lambda: _filter(scaled, sp, vocab), lambda: scaled)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, without a cumulative sum.
    # A draw of E = 0 (about once in 2**24 tokens) makes p / E NaN for a token of probability 0 (masked by top-k,
    # top-p or structured outputs), and argmax picks NaN: such tokens must score 0, whatever their E.
    probs = vocab.softmax(scaled)
    sampled = vocab.argmax(jnp.where(probs > 0, probs / noise(), 0.0))
    if sp.draft_ids is not None:
        sampled = rejection_sample(probs, sampled, sp, vocab)
    tokens = jnp.where(sp.temperature > 0, sampled, greedy)
    return (tokens, probs) if with_probs else tokens


def rejection_sample(probs: jax.Array, sampled: jax.Array, sp: SamplingBatch, vocab: VocabShard) -> jax.Array:
    """Speculative decoding's rejection sampling of draft tokens drawn from a draft model's q (vLLM's
    RejectionSampler): a row verifying draft d (sp.draft_ids >= 0) takes d with probability min(1, p(d) / q(d)),
    else a draw from the residual max(0, p - q) renormalised; other rows keep ``sampled`` (their draw from p).
    p: the target's ``probs`` after temperature and truncation, as q is the draft's (both the device's slice of
    the vocabulary under tensor parallelism). The uniform and the
    residual's exponential race use the row's key folded with 1 and 2, independent of the draft's own draw (the
    row's key at that output index, unfolded)."""
    d, q = sp.draft_ids, sp.draft_probs
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sp.seeds, sp.steps)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    # the residual race's noise over the whole vocabulary, this device's slice taken: the tokens of one device
    e = jax.vmap(lambda k: jax.random.exponential(jax.random.fold_in(k, 2), (vocab.total,)))(keys)
    e = jax.lax.dynamic_slice_in_dim(e, vocab.start, vocab.size, axis=1)
    token = jnp.maximum(d, 0)
    accept = u * vocab.take(q, token) < vocab.take(probs, token)  # u < p(d) / q(d); q(d) > 0: d was drawn from q
    residual = jnp.maximum(probs - q, 0.0)
    recovered = vocab.argmax(jnp.where(residual > 0, residual / e, 0.0))
    recovered = jnp.where(vocab.sum(residual)[:, 0] > 0, recovered, sampled)  # p == q: rejection cannot happen
    return jnp.where(d < 0, sampled, jnp.where(accept, d, recovered))


def _filter(logits: jax.Array, sp: SamplingBatch, vocab: VocabShard) -> jax.Array:
    """Masks tokens outside top-k, outside the top-p nucleus, and below min_p times the top probability.

    The k-th largest logit and the nucleus' smallest are found by bisection over the order of float32 values
    (32 passes of a count or a masked sum over the vocabulary), not by sorting the vocabulary: XLA:CPU's sort took
    1.4-1.7 s for 32 rows of 49152 logits, the bisections 55 ms. Ties are kept together, as after a sort."""
    rows = logits.shape[0]
    keys = _order_keys(logits)
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab.total), vocab.total)[:, None]
    kth = jax.lax.cond(  # the largest key with at least k logits at or above it
        jnp.any(sp.top_k > 0), lambda: _bisect(lambda t: vocab.sum(keys >= t) >= k, rows),
        lambda: jnp.zeros((rows, 1), jnp.uint32))
    probs = vocab.softmax(logits)
    top_p = sp.top_p[:, None]
    # the largest key whose strictly greater logits hold at least top_p: the nucleus starts one key above it
    # (top_p 1 keeps every token, also those whose preceding mass rounds to 1)
    below = jax.lax.cond(
        jnp.any(top_p < 1),
        lambda: _bisect(lambda t: vocab.sum(jnp.where(keys > t, probs, 0.0)) >= top_p, rows),
        lambda: jnp.zeros((rows, 1), jnp.uint32))
    nucleus_min = jnp.where(top_p >= 1, jnp.uint32(0), below + 1)
    min_p_floor = vocab.max(logits) + jnp.log(jnp.maximum(sp.min_p, 1e-30))[:, None]
    keep = keys >= jnp.maximum(kth, nucleus_min)
    keep &= logits >= jnp.where(sp.min_p[:, None] > 0, min_p_floor, -jnp.inf)
    return jnp.where(keep, logits, -jnp.inf)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (sign bit set for positives, every bit flipped for negatives)."""
    x = jnp.where(x == 0, 0.0, x).astype(jnp.float32)  # -0.0 ties with 0.0
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _bisect(holds, rows: int) -> jax.Array:
    """The largest uint32 key t [rows, 1] for which holds(t) [rows, 1]: true up to a point in each row, then false;
    true at key 0 (below every float), false at the top key."""
    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    bounds = (jnp.zeros((rows, 1), jnp.uint32), jnp.full((rows, 1), 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, step, bounds)[0]  # 32 halvings span every uint32 key


def prompt_logprobs(logits: jax.Array, targets: jax.Array) -> PromptLogprobsOutput:
    """Prompt logprobs of logits [N, V] (the positions' float32 logits): each row's log-softmax, its top
    MAX_LOGPROBS and the log-probability of its target token (targets [N]; a negative one reads token 0). Under a
    tensor-parallel mesh, on each device's slice of the vocabulary, as ``sample``."""
    tp, vocab = model_axis_size(), logits.shape[1]
    if tp == 1 or vocab % tp:
        return prompt_logprobs_shard(logits, targets, VocabShard(vocab, vocab))
    # no noise is drawn: the logits stand in for it (over_vocab passes the noise as a callable, never called here)
    return over_vocab(lambda x, t, shard, _: prompt_logprobs_shard(x, t, shard), logits, logits, targets)


def prompt_logprobs_shard(logits: jax.Array, targets: jax.Array, vocab: VocabShard) -> PromptLogprobsOutput:
    """``prompt_logprobs`` on the slice ``vocab`` of the vocabulary (the top ones: lower ids first among ties)."""
    logprobs = vocab.log_softmax(logits)
    top_logprobs, top_ids = vocab.top_k(logprobs, MAX_LOGPROBS)
    return PromptLogprobsOutput(vocab.take(logprobs, jnp.maximum(targets, 0)), top_ids.astype(jnp.int32),
                                top_logprobs)
