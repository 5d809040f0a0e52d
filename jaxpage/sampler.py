"""Token sampling on the device, one row per sequence."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling settings, padded to the sequence bucket [S].

    temperature 0 means greedy; top_k 0 means off; top_p 1 means off. seeds and steps form the per-request
    PRNG stream: the key of a request's n-th token is fold_in(key(seed), n), whatever else is in the batch.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    steps: jax.Array


jax.tree_util.register_dataclass(
    SamplingBatch, data_fields=[f.name for f in dataclasses.fields(SamplingBatch)], meta_fields=[])


def sample(logits: jax.Array, sp: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """Returns (token ids [S] int32, their log-probabilities [S] under the unmodified distribution)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(jnp.any(sp.temperature > 0), lambda: _sample_random(logits, sp, greedy),
                          lambda: greedy)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _sample_random(logits: jax.Array, sp: SamplingBatch, greedy: jax.Array) -> jax.Array:
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = _filter(logits / temp, sp)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(sp.seeds, sp.steps)
    noise = jax.vmap(lambda k: jax.random.exponential(k, (logits.shape[-1],)))(keys)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, without a cumulative sum.
    probs = jax.nn.softmax(scaled, axis=-1)
    sampled = jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)
    return jnp.where(sp.temperature > 0, sampled, greedy)


def _filter(logits: jax.Array, sp: SamplingBatch) -> jax.Array:
    """Masks tokens outside top-k, outside the top-p nucleus, and below min_p times the top probability."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly above each token
    in_nucleus = before < sp.top_p[:, None]
    nucleus_min = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    min_p_floor = sorted_logits[:, :1] + jnp.log(jnp.maximum(sp.min_p, 1e-30))[:, None]
    floor = jnp.maximum(jnp.maximum(kth, nucleus_min), jnp.where(sp.min_p[:, None] > 0, min_p_floor, -jnp.inf))
    return jnp.where(logits >= floor, logits, -jnp.inf)
