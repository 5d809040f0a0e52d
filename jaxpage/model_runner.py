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
    hidden, pool = forward_hidden(config.model, params, pool, batch, config.attention_backend)
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


@functools.lru_cache(maxsize=64)
def _plain_rows(num_seqs: int, max_model_len: int) -> tuple[np.ndarray, ...]:
    """Penalty and ban inputs of rows without penalties or bans (the common case), made once per shape."""
    arrays = (np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.float32), np.ones(num_seqs, np.float32),
              np.full((num_seqs, max_model_len), -1, np.int32), np.zeros(num_seqs, np.int32),
              np.full((num_seqs, MAX_BANNED), -1, np.int32))
    for a in arrays:
        a.flags.writeable = False
    return arrays


def build_batch(config: EngineConfig, scheduled: list[ScheduledSeq],
                eos_token_ids: tuple[int, ...] = ()) -> tuple[TokenBatch, SamplingBatch]:
    """The flat batch in numpy, padded to its buckets. Padding tokens write to the null block.

    Built in Python lists and converted once per field: this runs every step for every sequence.
    """
    bs = config.block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    table_entries: list[int] = []
    table_rows: list[int] = []
    table_cols: list[int] = []
    logits_indices: list[int] = []
    rows = {name: [] for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")}
    special_rows = []  # rows with penalties or banned tokens: rare, filled one by one below
    want_top = False
    last_index: dict[int, int] = {}
    for row, s in enumerate(scheduled):
        seq, n, p = s.seq, s.num_new_tokens, s.group.params
        if n:
            first, table = seq.num_computed_tokens, seq.block_table
            if n == 1:
                token_ids.append(seq.token_ids[first])
                positions.append(first)
                slots.append(table[first // bs] * bs + first % bs)
                token_seq.append(row)
            else:
                token_ids.extend(seq.token_ids[first:first + n])
                positions.extend(range(first, first + n))
                slots.extend(table[pos // bs] * bs + pos % bs for pos in range(first, first + n))
                token_seq.extend([row] * n)
            table_entries.extend(table)
            table_rows.extend([row] * len(table))
            table_cols.extend(range(len(table)))
            last_index[seq.seq_id] = len(token_ids) - 1
        logits_indices.append(last_index[(s.logits_of or seq).seq_id])
        rows["temperature"].append(p.temperature)
        rows["top_k"].append(p.top_k)
        rows["top_p"].append(p.top_p)
        rows["min_p"].append(p.min_p)
        rows["seeds"].append(seq.seed)
        rows["steps"].append(seq.num_output_tokens)
        want_top |= p.logprobs is not None or p.use_beam_search
        if p.has_penalties or seq.num_output_tokens < p.min_tokens:
            special_rows.append((row, seq, p))
    num_tokens = pick_bucket(config.token_buckets(), max(len(token_ids), len(scheduled), 1))  # forks add rows
    num_seqs = config.num_seqs_for(num_tokens)

    def padded(values, size, dtype, fill=0):
        out = np.full(size, fill, dtype)
        out[:len(values)] = values
        return out

    tables = np.zeros((num_seqs, config.max_blocks_per_seq), np.int32)
    tables[table_rows, table_cols] = table_entries
    batch = TokenBatch(padded(token_ids, num_tokens, np.int32), padded(positions, num_tokens, np.int32),
                       padded(slots, num_tokens, np.int32), padded(token_seq, num_tokens, np.int32), tables,
                       padded(logits_indices, num_seqs, np.int32))
    presence, frequency, repetition, history, num_prompt, banned = _plain_rows(num_seqs, config.max_model_len)
    if special_rows:  # copies: the plain arrays are shared between steps and must stay as they are
        presence, frequency, repetition, history, num_prompt, banned = (
            a.copy() for a in (presence, frequency, repetition, history, num_prompt, banned))
    for row, seq, p in special_rows:
        if p.has_penalties:
            presence[row], frequency[row], repetition[row] = (p.presence_penalty, p.frequency_penalty,
                                                              p.repetition_penalty)
            history[row, :seq.num_tokens] = seq.token_ids
            num_prompt[row] = seq.num_prompt_tokens
        if seq.num_output_tokens < p.min_tokens:
            ban = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            banned[row, :len(ban)] = ban[:MAX_BANNED]
    sampling = SamplingBatch(
        padded(rows["temperature"], num_seqs, np.float32), padded(rows["top_k"], num_seqs, np.int32),
        padded(rows["top_p"], num_seqs, np.float32, 1.0), padded(rows["min_p"], num_seqs, np.float32),
        padded(rows["seeds"], num_seqs, np.uint32), padded(rows["steps"], num_seqs, np.int32),
        presence, frequency, repetition, history, num_prompt, banned, np.bool_(want_top))
    return batch, sampling
