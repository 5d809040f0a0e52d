"""ModelRunner: turns scheduled sequences into one padded flat batch and runs the precompiled step on it."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxpage.config import EngineConfig, pick_bucket
from jaxpage.kv_cache import NULL_BLOCK, allocate_kv_pool
from jaxpage.model import TokenBatch, compute_logits, forward_hidden
from jaxpage.sampler import SamplingBatch, sample
from jaxpage.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


def step(config: EngineConfig, params: dict, pool: jax.Array, batch: TokenBatch, sampling: SamplingBatch):
    """One engine iteration: write K/V, attend through the block tables, sample one token per sequence."""
    hidden, pool = forward_hidden(config.model, params, pool, batch)
    logits = compute_logits(config.model, params, hidden[batch.logits_indices])
    tokens, logprobs = sample(logits, sampling)
    return tokens, logprobs, pool


class ModelRunner:
    def __init__(self, config: EngineConfig, params: dict):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
        self.kv_pool = allocate_kv_pool(config.model, config.num_kv_blocks, config.block_size, dtype)
        self._step = jax.jit(functools.partial(step, config), donate_argnums=(1,))
        self._executables: dict[int, object] = {}  # token bucket -> compiled step

    def warm_up(self, progress: bool = True) -> None:
        """Compiles every token bucket ahead of time; serving never compiles."""
        for num_tokens in tqdm(self.config.token_buckets(), desc="compiling buckets", disable=not progress,
                               leave=False):
            if num_tokens not in self._executables:
                batch, sampling = _abstract_inputs(num_tokens, self.config.num_seqs_for(num_tokens),
                                                   self.config.max_blocks_per_seq)
                self._executables[num_tokens] = self._step.lower(self.params, self.kv_pool, batch,
                                                                 sampling).compile()

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns the sampled token and its logprob for each scheduled sequence, in order."""
        batch, sampling = build_batch(self.config, scheduled)
        compiled = self._executables.get(batch.token_ids.shape[0])
        if compiled is None:
            raise RuntimeError(f"no compiled step for {batch.token_ids.shape[0]} tokens; call warm_up() first")
        tokens, logprobs, self.kv_pool = compiled(self.params, self.kv_pool, batch, sampling)
        n = len(scheduled)
        return np.asarray(tokens)[:n], np.asarray(logprobs)[:n]


def _abstract_inputs(num_tokens: int, num_seqs: int, width: int):
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    batch = TokenBatch(i32(num_tokens), i32(num_tokens), i32(num_tokens), i32(num_tokens),
                       i32(num_seqs, width), i32(num_seqs))
    sampling = SamplingBatch(f32(num_seqs), i32(num_seqs), f32(num_seqs), f32(num_seqs),
                             jax.ShapeDtypeStruct((num_seqs,), jnp.uint32), i32(num_seqs))
    return batch, sampling


def build_batch(config: EngineConfig, scheduled: list[ScheduledSeq]) -> tuple[TokenBatch, SamplingBatch]:
    """The flat batch in numpy, padded to its buckets. Padding tokens write to the null block."""
    bs = config.block_size
    total = sum(s.num_new_tokens for s in scheduled)
    num_tokens = pick_bucket(config.token_buckets(), total)
    num_seqs = config.num_seqs_for(num_tokens)
    width = config.max_blocks_per_seq
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    token_seq = np.zeros(num_tokens, np.int32)
    tables = np.full((num_seqs, width), NULL_BLOCK, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    steps = np.zeros(num_seqs, np.int32)
    start = 0
    for row, s in enumerate(scheduled):
        seq, n = s.seq, s.num_new_tokens
        pos = np.arange(seq.num_computed_tokens, seq.num_computed_tokens + n, dtype=np.int32)
        table = np.asarray(seq.block_table, np.int32)
        token_ids[start:start + n] = seq.token_ids[pos[0]:pos[-1] + 1]
        positions[start:start + n] = pos
        slots[start:start + n] = table[pos // bs] * bs + pos % bs
        token_seq[start:start + n] = row
        tables[row, :len(table)] = table
        logits_indices[row] = start + n - 1
        p = seq.params
        temperature[row], top_k[row], top_p[row], min_p[row] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[row], steps[row] = seq.seed, seq.num_output_tokens
        start += n
    batch = TokenBatch(token_ids, positions, slots, token_seq, tables, logits_indices)
    return batch, SamplingBatch(temperature, top_k, top_p, min_p, seeds, steps)
