"""The step's tail, one for both drivers of the layer loop (jaxpage.worker.step): from the final-normed hidden
states to the sampler's output. The LM head and the sampler at each row's token (``sample_rows``, or
``greedy_rows`` where every row is plain greedy: their shapes depend on the sequence bucket only) and the prompt
logprobs at the tokens that ask for them (``prompt_logprobs_of``: per token of the flat batch). Where the choice
between the two samplers is made is the driver's: on the host (the host layer loop compiles each apart, and a
plain greedy step sends no sampling settings) or on the device (``choose_sampler``, inside one program)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpage.config import EngineConfig
from jaxpage.models import TokenBatch, compute_logits, compute_raw_logits
from jaxpage.worker.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingBatch,
    plain_greedy,
    plain_greedy_on_device,
    prompt_logprobs,
    sample,
)

# prompt logprobs: tokens whose logits one pass of prompt_logprobs_of holds ([chunk, vocab] float32)
PROMPT_LOGPROB_CHUNK = 64


def sample_tokens(config: EngineConfig, params: dict, hidden: jax.Array, batch: TokenBatch,
                  sampling: SamplingBatch) -> SamplerOutput:
    """The whole tail in one function (the one-program driver's): ``choose_sampler`` at each sequence's last
    scheduled token of final-normed ``hidden`` [T, D], and ``prompt_logprobs_of`` where the batch has prompt
    targets."""
    out = choose_sampler(config, params, hidden[batch.logits_indices], sampling)
    if sampling.prompt_targets is None:  # a batch made without targets (the benchmarks' own)
        return out
    return dataclasses.replace(out, prompt=prompt_logprobs_of(config, params, hidden, sampling.prompt_targets))


def sample_rows(config: EngineConfig, params: dict, rows: jax.Array, sampling: SamplingBatch) -> SamplerOutput:
    """The sampler's per-row output from the rows' final-normed hidden states [S, D] (prompt targets unread)."""
    return sample(compute_logits(config.step_model, params, rows), sampling, config.sampler_returns_probs)


def has_greedy_path(config: EngineConfig) -> bool:
    """Whether the tail may take ``greedy_rows``: not where the step returns each row's distribution (a draft
    model's runner) or samples a vocabulary split over a tensor-parallel mesh."""
    return not config.sampler_returns_probs and config.parallel.tensor_parallel_size == 1


def choose_sampler(config: EngineConfig, params: dict, rows: jax.Array, sampling: SamplingBatch) -> SamplerOutput:
    """``greedy_rows`` or ``sample_rows``, chosen on the device by ``plain_greedy_on_device``: a conditional runs
    one of them."""
    if not has_greedy_path(config) or sampling.draft_ids is not None:
        return sample_rows(config, params, rows, sampling)
    sampling = dataclasses.replace(sampling, prompt_targets=None)
    return jax.lax.cond(plain_greedy_on_device(sampling), lambda: greedy_rows(config, params, rows),
                        lambda: sample_rows(config, params, rows, sampling))


def greedy_rows(config: EngineConfig, params: dict, rows: jax.Array) -> SamplerOutput:
    """``sample_rows``' output where every row is plain greedy (``sampler.is_plain_greedy``; one device)."""
    cfg = config.step_model
    return plain_greedy(compute_raw_logits(cfg, params, rows), cfg.final_logit_softcap)


def prompt_logprobs_of(config: EngineConfig, params: dict, hidden: jax.Array,
                       targets: jax.Array) -> PromptLogprobsOutput:
    """The prompt logprobs (sampler.prompt_logprobs) of the tokens with a target (targets [T], -1: none), from
    the logits at their positions (final-normed ``hidden`` [T, D]). The tokens go in chunks of up to
    PROMPT_LOGPROB_CHUNK, so no more than [chunk, vocab] logits exist at once, and a chunk without a target
    skips its LM head under a ``lax.cond``: a step where no row asks pays only the skipped branches."""
    num_tokens = hidden.shape[0]
    chunk = math.gcd(num_tokens, PROMPT_LOGPROB_CHUNK)

    def one_chunk(args):
        h, t = args
        return jax.lax.cond(jnp.any(t >= 0), lambda: prompt_logprobs(compute_logits(config.step_model, params, h), t),
                            lambda: PromptLogprobsOutput.zeros(chunk))
    out = jax.lax.map(one_chunk, (hidden.reshape(-1, chunk, hidden.shape[1]), targets.reshape(-1, chunk)))
    return jax.tree.map(lambda a: a.reshape(num_tokens, *a.shape[2:]), out)
