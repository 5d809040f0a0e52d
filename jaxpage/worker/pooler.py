"""The step's tail on a pooling model (runner "pooling", vLLM's pooler): each row's part of its pooled vector from
the final-normed hidden states of its scheduled tokens, on the device, where the host accumulates it over a
prompt's chunks (jaxpage.core.pooling): LAST the row's last token's (the prompt's last, in its final chunk), MEAN
the sum over the row's tokens, CLS its first token's (the prompt's first, in its first chunk). A pooling step
samples nothing: its tokens are zeros."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpage.config import EngineConfig
from jaxpage.models import TokenBatch
from jaxpage.sampling_params import MAX_LOGPROBS
from jaxpage.worker.sampler import SamplerOutput


def pooled_rows(config: EngineConfig, hidden: jax.Array, batch: TokenBatch) -> jax.Array:
    """[S, D] float32 of final-normed ``hidden`` [T, D]. A pooling batch's rows are prompt chunks laid out in
    order, so its last real token is at the greatest logits index: the tokens after it are padding."""
    h, rows = hidden.astype(jnp.float32), batch.logits_indices
    pooling = config.pooler_config.pooling_type
    if pooling == "LAST":
        return h[rows]
    index = jnp.arange(h.shape[0])
    real = index <= jnp.max(rows)
    if pooling == "MEAN":
        return jax.ops.segment_sum(jnp.where(real[:, None], h, 0.0), batch.token_seq, num_segments=rows.shape[0])
    first = jax.ops.segment_min(jnp.where(real, index, h.shape[0] - 1), batch.token_seq, num_segments=rows.shape[0])
    return h[jnp.clip(first, 0, h.shape[0] - 1)]


def pooler_output(config: EngineConfig, hidden: jax.Array, batch: TokenBatch) -> SamplerOutput:
    """The sampler's output shape with the pooled rows and no samples."""
    pooled = pooled_rows(config, hidden, batch)
    rows = pooled.shape[0]
    zeros = jnp.zeros(rows, jnp.int32)
    top = jnp.zeros((rows, MAX_LOGPROBS), jnp.int32)
    return SamplerOutput(zeros, zeros.astype(jnp.float32), top, top.astype(jnp.float32), pooled=pooled)
