"""ModelRunner: turns scheduled sequences into one padded flat batch and runs the precompiled step on it."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxpage.config import EngineConfig, pick_bucket
from jaxpage.kv_cache import NULL_BLOCK, allocate_kv_pool, kv_pool_shape
from jaxpage.kv_cache_manager import COPY, SWAP_IN, SWAP_OUT, DeviceOps
from jaxpage.model import TokenBatch, compute_logits, forward_hidden
from jaxpage.sampler import MAX_BANNED, SamplerOutput, SamplingBatch, sample
from jaxpage.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


def step(config: EngineConfig, params: dict, pool: jax.Array, batch: TokenBatch,
         sampling: SamplingBatch) -> tuple[SamplerOutput, jax.Array]:
    """One engine iteration: write K/V, attend through the block tables, sample one token per sequence."""
    hidden, pool = forward_hidden(config.model, params, pool, batch)
    logits = compute_logits(config.model, params, hidden[batch.logits_indices])
    return sample(logits, sampling), pool


def _copy_blocks(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[:, dst].set(pool[:, src])


def _gather_blocks(pool: jax.Array, blocks: jax.Array) -> jax.Array:
    return pool[:, blocks]


def _scatter_blocks(pool: jax.Array, blocks: jax.Array, data: jax.Array) -> jax.Array:
    return pool.at[:, blocks].set(data)


class ModelRunner:
    def __init__(self, config: EngineConfig, params: dict, num_host_blocks: int = 0):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
        self.kv_pool = allocate_kv_pool(config.model, config.num_kv_blocks, config.block_size, dtype)
        shape = kv_pool_shape(config.model, num_host_blocks, config.block_size)
        self.host_pool = np.zeros(shape, dtype) if num_host_blocks else None
        self._step = jax.jit(functools.partial(step, config), donate_argnums=(1,))
        self._executables: dict[int, object] = {}  # token bucket -> compiled step
        self._moves = config.max_num_seqs  # blocks moved per call of the copy/swap functions (padded)
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,))
        self._gather = jax.jit(_gather_blocks)
        self._scatter = jax.jit(_scatter_blocks, donate_argnums=(0,))
        self.eos_token_ids: tuple[int, ...] = ()

    def warm_up(self, progress: bool = True) -> None:
        """Compiles every token bucket and the block-move functions ahead of time; serving never compiles."""
        buckets = self.config.token_buckets()
        with tqdm(total=len(buckets) + 1, desc="compiling", disable=not progress, leave=False) as bar:
            for num_tokens in buckets:
                if num_tokens not in self._executables:
                    batch, sampling = _abstract_inputs(self.config, num_tokens)
                    self._executables[num_tokens] = self._step.lower(self.params, self.kv_pool, batch,
                                                                     sampling).compile()
                bar.update()
            idle = np.zeros(self._moves, np.int32)  # null block onto itself: compiles, changes nothing
            self.kv_pool = self._copy(self.kv_pool, idle, idle)
            if self.host_pool is not None:
                self.kv_pool = self._scatter(self.kv_pool, idle, self._gather(self.kv_pool, idle))
            bar.update()

    def apply(self, ops: DeviceOps) -> None:
        """Carries out the queued block copies and swaps, in order, in padded fixed-size calls."""
        for kind, src, dst in ops.batches():
            for i in range(0, len(src), self._moves):
                s, d = self._padded(src[i:i + self._moves]), self._padded(dst[i:i + self._moves])
                n = len(src[i:i + self._moves])
                if kind == COPY:
                    self.kv_pool = self._copy(self.kv_pool, s, d)
                elif kind == SWAP_OUT:
                    self.host_pool[:, d[:n]] = np.asarray(self._gather(self.kv_pool, s))[:, :n]
                elif kind == SWAP_IN:
                    self.kv_pool = self._scatter(self.kv_pool, d, self.host_pool[:, s])
                else:
                    raise ValueError(kind)

    def _padded(self, ids: list[int]) -> np.ndarray:
        out = np.full(self._moves, NULL_BLOCK, np.int32)
        out[:len(ids)] = ids
        return out

    def execute(self, scheduled: list[ScheduledSeq]) -> SamplerOutput:
        """Runs one step; returns the sampler's output (numpy) for each scheduled sequence, in order."""
        batch, sampling = build_batch(self.config, scheduled, self.eos_token_ids)
        compiled = self._executables.get(batch.token_ids.shape[0])
        if compiled is None:
            raise RuntimeError(f"no compiled step for {batch.token_ids.shape[0]} tokens; call warm_up() first")
        out, self.kv_pool = compiled(self.params, self.kv_pool, batch, sampling)
        n = len(scheduled)
        return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def _abstract_inputs(config: EngineConfig, num_tokens: int):
    num_seqs = config.num_seqs_for(num_tokens)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    batch = TokenBatch(i32(num_tokens), i32(num_tokens), i32(num_tokens), i32(num_tokens),
                       i32(num_seqs, config.max_blocks_per_seq), i32(num_seqs))
    sampling = SamplingBatch(f32(num_seqs), i32(num_seqs), f32(num_seqs), f32(num_seqs),
                             jax.ShapeDtypeStruct((num_seqs,), jnp.uint32), i32(num_seqs),
                             f32(num_seqs), f32(num_seqs), f32(num_seqs), i32(num_seqs, config.max_model_len),
                             i32(num_seqs), i32(num_seqs, MAX_BANNED), jax.ShapeDtypeStruct((), jnp.bool_))
    return batch, sampling


def build_batch(config: EngineConfig, scheduled: list[ScheduledSeq],
                eos_token_ids: tuple[int, ...] = ()) -> tuple[TokenBatch, SamplingBatch]:
    """The flat batch in numpy, padded to its buckets. Padding tokens write to the null block."""
    bs = config.block_size
    total = sum(s.num_new_tokens for s in scheduled)
    num_tokens = pick_bucket(config.token_buckets(), max(total, 1))
    num_seqs = config.num_seqs_for(num_tokens)
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)
    token_seq = np.zeros(num_tokens, np.int32)
    tables = np.zeros((num_seqs, config.max_blocks_per_seq), np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    f = lambda value: np.full(num_seqs, value, np.float32)  # noqa: E731
    temperature, top_p, min_p = f(0), f(1), f(0)
    presence, frequency, repetition = f(0), f(0), f(1)
    top_k, steps, num_prompt = (np.zeros(num_seqs, np.int32) for _ in range(3))
    seeds = np.zeros(num_seqs, np.uint32)
    history = np.full((num_seqs, config.max_model_len), -1, np.int32)
    banned = np.full((num_seqs, MAX_BANNED), -1, np.int32)
    want_top = False
    last_index: dict[int, int] = {}
    start = 0
    for row, s in enumerate(scheduled):
        seq, n, p = s.seq, s.num_new_tokens, s.group.params
        if n:
            first = seq.num_computed_tokens
            pos = np.arange(first, first + n, dtype=np.int32)
            table = np.asarray(seq.block_table, np.int32)
            token_ids[start:start + n] = seq.token_ids[first:first + n]
            positions[start:start + n] = pos
            slots[start:start + n] = table[pos // bs] * bs + pos % bs
            token_seq[start:start + n] = row
            tables[row, :len(table)] = table
            start += n
            last_index[seq.seq_id] = start - 1
        logits_indices[row] = last_index[(s.logits_of or seq).seq_id]
        temperature[row], top_k[row], top_p[row], min_p[row] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[row], steps[row] = seq.seed, seq.num_output_tokens
        want_top |= p.logprobs is not None or p.use_beam_search
        if p.has_penalties:
            presence[row], frequency[row], repetition[row] = (p.presence_penalty, p.frequency_penalty,
                                                              p.repetition_penalty)
            history[row, :seq.num_tokens] = seq.token_ids
            num_prompt[row] = seq.num_prompt_tokens
        if seq.num_output_tokens < p.min_tokens:
            ban = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            banned[row, :len(ban)] = ban[:MAX_BANNED]
    batch = TokenBatch(token_ids, positions, slots, token_seq, tables, logits_indices)
    sampling = SamplingBatch(temperature, top_k, top_p, min_p, seeds, steps, presence, frequency, repetition,
                             history, num_prompt, banned, np.bool_(want_top))
    return batch, sampling
