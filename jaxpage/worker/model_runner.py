"""ModelRunner: turns scheduled sequences into one padded flat batch and runs the precompiled step on it."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from tqdm.auto import tqdm

from jaxpage.config import EngineConfig, pick_bucket
from jaxpage.attention.kv_cache import NULL_BLOCK, allocate_kv_pool, copy_blocks, host_kv_pool, jit_on_pool, pool_format
from jaxpage.core.kv_cache_manager import COPY, SWAP_IN, SWAP_OUT, DeviceOps
from jaxpage.worker.layer_loop import LayerLoop
from jaxpage.models import (TokenBatch, abstract_params, compute_logits, forward_hidden, partition_specs,
                            unstack_layers)
from jaxpage.distributed.parallel import placement, put, spec_shardings
from jaxpage.models.placement import place_params, replicate_kv_heads
from jaxpage.worker.penalty_history import PenaltyHistory
from jaxpage.worker.sampler import MAX_BANNED, SamplerOutput, SamplingBatch, sample
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.sequence import Sequence
from jaxpage.structured.manager import bitmask_words

log = logging.getLogger(__name__)

# where one compiled layer runs once per layer from the host (jaxpage.worker.layer_loop) instead of in a lax.scan:
# XLA:CPU copies a scanned layer's weights out of the stack. One device only: a tensor-parallel layer call is a
# launch on every device of the mesh, and 30 of them made a step 4x the fused step's on 3 forced CPU devices
# (SmolLM2, 8 streams: 4.0 s against 1.0 s).
HOST_LAYER_LOOP_PLATFORMS = ("cpu",)


def step(config: EngineConfig, params: dict, pool: jax.Array, batch: TokenBatch,
         sampling: SamplingBatch) -> tuple[SamplerOutput, jax.Array]:
    """One engine iteration: write K/V, attend through the block tables, sample one token per sequence."""
    hidden, pool = forward_hidden(config.model, params, pool, batch, config.attention_backend)
    return sample_tokens(config, params, hidden, batch, sampling), pool


def sample_tokens(config: EngineConfig, params: dict, hidden: jax.Array, batch: TokenBatch,
                  sampling: SamplingBatch) -> SamplerOutput:
    """The step's tail: logits at each sequence's last scheduled token (final-normed ``hidden``), sampled."""
    return sample(compute_logits(config.model, params, hidden[batch.logits_indices]), sampling)


def jit_step(config: EngineConfig, where=None):
    """``step`` jitted with the pool donated and in its one format: the engine's step, and what the compile lane
    compiles ahead of time for other targets. where: a device, or the mesh of a tensor-parallel config (the
    weights split as ``weight_shardings`` says)."""
    arg_shardings = {0: weight_shardings(config, where)} if isinstance(where, Mesh) else None
    return jit_on_pool(functools.partial(step, config), 4, 1, "pair", where, arg_shardings, config.kv_dtype)


def compile_step(jitted, params, pool, batch, sampling):
    """A bucket's executable of ``jit_step`` or a jitted ``LayerLoop``, for these (abstract) inputs."""
    if isinstance(jitted, LayerLoop):
        return jitted.compile(params, pool, batch, sampling)
    return jitted.lower(params, pool, batch, sampling).compile()


def weight_shardings(config: EngineConfig, mesh: Mesh | None, device=None, unrolled: bool | None = None):
    """Where each weight goes: split over ``mesh`` by the parameters' names, or whole on ``device`` (default:
    the default device); a tree matching the stacked or (``unrolled``, default: not ``config.scan_layers``)
    unrolled weights."""
    specs, shapes = partition_specs(config.model), abstract_params(config.model, np.float32)
    if unrolled is None:
        unrolled = not config.scan_layers
    if unrolled:  # each layer's entry: the stacked one less its layer axis
        def per_layer(tree, drop_layer_axis):
            layer = jax.tree.map(drop_layer_axis, tree["layers"], is_leaf=lambda x: isinstance(x, PartitionSpec))
            return {**tree, "layers": {i: layer for i in range(config.model.num_layers)}}
        specs = per_layer(specs, lambda s: PartitionSpec(*s[1:]))
        shapes = per_layer(shapes, lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))
    if mesh is not None:
        return spec_shardings(specs, shapes, mesh)
    device = SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda _: device, shapes)


def replicated(config: EngineConfig):
    """The sharding of the step's inputs other than weights and pool: the engine's device, or every device of
    its tensor-parallel mesh."""
    where = placement(config)
    return NamedSharding(where, PartitionSpec()) if isinstance(where, Mesh) else SingleDeviceSharding(where)


def _gather_blocks(pool, blocks: jax.Array):
    return jax.tree.map(lambda a: a[:, blocks], pool)  # an int8 pool's scales move with their blocks


def _scatter_blocks(pool, blocks: jax.Array, data):
    return jax.tree.map(lambda a, d: a.at[:, blocks].set(d), pool, data)


def _store_blocks(host: np.ndarray, gathered: jax.Array, blocks: np.ndarray) -> None:
    """A swap-out into host memory: the first len(blocks) gathered blocks (the rest is padding), shard by shard:
    a process stores the KV heads of its own devices (all of them, unless several processes share the mesh)."""
    for shard in gathered.addressable_shards:
        host[(slice(None), blocks, *shard.index[2:])] = np.asarray(shard.data)[:, :len(blocks)]


def _load_blocks(host: np.ndarray, sharding, blocks: np.ndarray) -> jax.Array:
    """A swap-in's data: host blocks as a device array sharded as the pool is, each device's part from its own
    process's host memory."""
    data = host[:, blocks]
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


@dataclasses.dataclass(frozen=True)
class BlockMoves:
    """Whole-block moves on the pool, jitted with the pool in its format: copy-on-write copies, swap-out gathers
    and swap-in scatters."""

    copy: object
    gather: object
    scatter: object
    blocks_sharding: object  # of gathered blocks (as the pool's; a ScaledPool of two for an int8 pool)

    @classmethod
    def jit(cls, where=None, dtype=None) -> "BlockMoves":
        """On a device or a mesh; swapped blocks travel split as the pool is (each device's KV heads). dtype:
        the pool's stored dtype (an int8 pool is values and scales)."""
        sharding = jax.tree.map(lambda f: f.sharding, pool_format(where, dtype),
                                is_leaf=lambda x: hasattr(x, "sharding"))
        on_pool = functools.partial(jit_on_pool, where=where, dtype=dtype)
        return cls(on_pool(copy_blocks, 3, 0, "pool"), on_pool(_gather_blocks, 2, 0, "blocks"),
                   on_pool(_scatter_blocks, 3, 0, "pool", arg_shardings={2: sharding}), sharding)


class ModelRunner:
    def __init__(self, config: EngineConfig, params: dict):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        where = placement(config)  # the mesh of a tensor-parallel engine, else its one device
        self.mesh = where if isinstance(where, Mesh) else None
        device = self.mesh.devices.flat[0] if self.mesh is not None else where
        host_loop = config.scan_layers and device.platform in HOST_LAYER_LOOP_PLATFORMS and self.mesh is None
        unrolled = host_loop or not config.scan_layers
        if unrolled:
            params = unstack_layers(params)
        params = replicate_kv_heads(params, config.model.num_kv_heads)
        shardings = weight_shardings(config, self.mesh, where, unrolled=unrolled)
        self.params = place_params(params, shardings, dtype)
        kv_dtype = jnp.dtype(config.kv_dtype)
        self.kv_pool = allocate_kv_pool(config.model, config.num_kv_blocks, config.block_size, kv_dtype, where)
        self.host_pool = (host_kv_pool(config.model, config.num_host_blocks, config.block_size, kv_dtype)
                          if config.num_host_blocks else None)
        self._step = (LayerLoop.make(config, sample_tokens, shardings, where) if host_loop
                      else jit_step(config, where))
        self._executables: dict[int, object] = {}  # token bucket -> compiled step
        self._moves = config.max_num_seqs  # blocks moved per call of the copy/swap functions (padded)
        moves = BlockMoves.jit(where, kv_dtype)
        self._copy, self._gather, self._scatter = moves.copy, moves.gather, moves.scatter
        self._blocks_sharding = moves.blocks_sharding
        self.eos_token_ids: tuple[int, ...] = ()
        self.input_batch = InputBatch(config)  # build_batch's persistent block tables and sampling settings

    def warm_up(self, progress: bool = True) -> None:
        """Compiles (and runs once) every token bucket and the block-move functions ahead of time; serving never
        compiles."""
        buckets = self.config.token_buckets()
        with tqdm(total=len(buckets) + 1, desc="compiling", disable=not progress, leave=False) as bar:
            for num_tokens in buckets:
                if num_tokens not in self._executables:
                    batch, sampling = abstract_step_inputs(self.config, num_tokens)
                    compiled = compile_step(self._step, self.params, self.kv_pool, batch, sampling)
                    # The first run of an executable costs 0.3-0.7 s more on a CPU (one-time set-up in the
                    # runtime): take it here, on an all-padding batch (writes only the null block).
                    padding = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), (batch, sampling))
                    out, self.kv_pool = compiled(self.params, self.kv_pool, *padding)
                    jax.block_until_ready(out)
                    self._executables[num_tokens] = compiled
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
                self.move(kind, self._padded(src[i:i + self._moves]), self._padded(dst[i:i + self._moves]),
                          len(src[i:i + self._moves]))

    def move(self, kind: str, src: np.ndarray, dst: np.ndarray, n: int) -> None:
        """One padded call: the first ``n`` of ``src`` -> ``dst`` (block ids, ``self._moves`` of each)."""
        if kind == COPY:
            self.kv_pool = self._copy(self.kv_pool, src, dst)
        elif kind == SWAP_OUT:
            jax.tree.map(functools.partial(_store_blocks, blocks=dst[:n]), self.host_pool,
                         self._gather(self.kv_pool, src))
        elif kind == SWAP_IN:
            data = jax.tree.map(functools.partial(_load_blocks, blocks=src), self.host_pool, self._blocks_sharding)
            self.kv_pool = self._scatter(self.kv_pool, dst, data)
        else:
            raise ValueError(kind)

    def _padded(self, ids: list[int]) -> np.ndarray:
        out = np.full(self._moves, NULL_BLOCK, np.int32)
        out[:len(ids)] = ids
        return out

    def execute(self, scheduled: list[ScheduledSeq], bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Runs one step; returns the sampler's output (numpy) for each scheduled sequence, in order. bitmask
        [rows, ceil(vocab / 32)] int32: the tokens each row may sample (structured outputs); None: any."""
        batch, sampling = build_batch(self.config, scheduled, self.eos_token_ids, self.input_batch, bitmask)
        out = self.run(batch, sampling)
        n = len(scheduled)
        return jax.tree.map(lambda a: np.asarray(a)[:n], out)

    def run(self, batch: TokenBatch, sampling: SamplingBatch) -> SamplerOutput:
        """The compiled step of the batch's bucket on it (the pool updated in place)."""
        compiled = self._executables.get(batch.token_ids.shape[0])
        if compiled is None:
            raise RuntimeError(f"no compiled step for {batch.token_ids.shape[0]} tokens; call warm_up() first")
        out, self.kv_pool = compiled(self.params, self.kv_pool, batch, sampling)
        return out


def abstract_step_inputs(config: EngineConfig, num_tokens: int):
    """The shapes of one bucket's (batch, sampling) inputs, for compiling ahead of time."""
    num_seqs = config.num_seqs_for(num_tokens)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    batch = TokenBatch(i32(num_tokens), i32(num_tokens), i32(num_tokens), i32(num_tokens),
                       i32(num_seqs, config.max_blocks_per_seq), i32(num_seqs))
    sampling = SamplingBatch(f32(num_seqs), i32(num_seqs), f32(num_seqs), f32(num_seqs),
                             jax.ShapeDtypeStruct((num_seqs,), jnp.uint32), i32(num_seqs),
                             f32(num_seqs), f32(num_seqs), f32(num_seqs),
                             i32(config.max_num_seqs + 1, config.max_model_len), i32(num_seqs), i32(num_seqs),
                             i32(num_seqs, MAX_BANNED), jax.ShapeDtypeStruct((), jnp.bool_),
                             i32(num_seqs, bitmask_words(config.model.vocab_size)))
    return batch, sampling


@functools.lru_cache(maxsize=64)
def _plain_rows(num_seqs: int) -> tuple[np.ndarray, ...]:
    """Penalty and ban inputs of rows without penalties or bans (the common case), made once per shape."""
    arrays = (np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.float32), np.ones(num_seqs, np.float32),
              np.zeros(num_seqs, np.int32), np.zeros(num_seqs, np.int32), np.full((num_seqs, MAX_BANNED), -1, np.int32))
    for a in arrays:
        a.flags.writeable = False
    return arrays


@functools.lru_cache(maxsize=64)
def _all_allowed(num_seqs: int, vocab_size: int, sharding=None) -> jax.Array:
    """The bitmask of a batch without structured outputs, on the device(s) once per shape: such batches pay no
    transfer for it."""
    return put(np.full((num_seqs, bitmask_words(vocab_size)), -1, np.int32), sharding)  # no compile


def _bitmask_rows(bitmask: np.ndarray | None, num_seqs: int, config: EngineConfig):
    if bitmask is None:
        return _all_allowed(num_seqs, config.model.vocab_size, replicated(config))
    out = np.full((num_seqs, bitmask.shape[1]), -1, np.int32)
    out[:len(bitmask)] = bitmask
    return out


@functools.lru_cache(maxsize=64)
def _decode_rows(count: int, size: int) -> np.ndarray:
    """0, 1, ..., count - 1, then zeros up to size (int32, read-only): a decode step's token rows and logits."""
    rows = np.zeros(size, np.int32)
    rows[:count] = np.arange(count)
    rows.flags.writeable = False
    return rows


class InputBatch:
    """What build_batch keeps between steps, as vLLM's InputBatch: each sequence's block-table row and sampling
    settings in persistent numpy arrays, indexed by a row the sequence keeps while it runs.

    A row is (re)written only when its sequence's block table differs from the copy kept here (a new block,
    copy-on-write, swap, preemption) or the sequence is new to it; a step then gathers its rows in one go instead
    of rebuilding every table from Python lists. Entries are keyed by the Sequence object itself (not its id,
    which engines sharing a runner reuse), whose seed and sampling parameters are fixed for its life. Rows of
    sequences gone are taken back when the rows run out. Row 0 stays the padding row (null blocks, neutral
    sampling settings).
    """

    _FIELDS = {"tables": (np.int32, 0), "temperature": (np.float32, 0), "top_k": (np.int32, 0),
               "top_p": (np.float32, 1), "min_p": (np.float32, 0), "seeds": (np.uint32, 0), "want_top": (bool, 0),
               "special_below": (np.int64, 0),  # special_below: the row needs special inputs while steps < this
               "num_prompt": (np.int64, 0)}

    def __init__(self, config: EngineConfig):
        self.config = config
        self._entries: dict[Sequence, list] = {}  # sequence -> [copy of its block table, row]
        self._allocate(config.max_num_seqs * 2 + 1)
        self.penalty_history = PenaltyHistory(config.max_num_seqs, config.max_model_len, replicated(config))

    def _allocate(self, capacity: int) -> None:
        """Makes room for ``capacity`` rows, keeping the rows written so far."""
        old = len(self.tables) if hasattr(self, "tables") else 1
        for name, (dtype, fill) in self._FIELDS.items():
            shape = (capacity, self.config.max_blocks_per_seq) if name == "tables" else (capacity,)
            array = np.full(shape, fill, dtype)
            if hasattr(self, name):
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        self._free_rows = getattr(self, "_free_rows", []) + list(range(capacity - 1, old - 1, -1))

    def _write(self, seq, p, entry, scheduled: list[ScheduledSeq]) -> list:
        table = seq.block_table
        if entry is None:
            if not self._free_rows:  # drop the rows of sequences that are not in this step (finished, or idle)
                keep = {s.seq for s in scheduled}
                for gone in [q for q in self._entries if q not in keep]:
                    self._free_rows.append(self._entries.pop(gone)[1])
                if not self._free_rows:
                    self._allocate(2 * len(self.tables))
            row, old_len = self._free_rows.pop(), self.tables.shape[1]
        else:
            row, old_len = entry[1], len(entry[0])
        self.tables[row, :len(table)] = table
        if old_len > len(table):
            self.tables[row, len(table):old_len] = 0
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = (p.temperature, p.top_k,
                                                                                    p.top_p, p.min_p)
        self.seeds[row] = seq.seed
        self.num_prompt[row] = seq.num_prompt_tokens
        self.want_top[row] = p.logprobs is not None or p.use_beam_search
        self.special_below[row] = np.iinfo(np.int64).max if p.has_penalties else p.min_tokens
        entry = self._entries[seq] = [list(table), row]
        return entry


def build_batch(config: EngineConfig, scheduled: list[ScheduledSeq], eos_token_ids: tuple[int, ...] = (),
                state: InputBatch | None = None, bitmask: np.ndarray | None = None) -> tuple[TokenBatch, SamplingBatch]:
    """The flat batch in numpy, padded to its buckets. Padding tokens write to the null block.

    This runs every step for every sequence: the per-sequence block tables and sampling settings come from the
    persistent ``state`` (the runner's InputBatch; a fresh one if none is given), only the token ids and positions
    are gathered in Python, and everything else is computed on whole arrays.
    """
    state = state if state is not None else InputBatch(config)
    bs = config.block_size
    num_rows = len(scheduled)
    # One pass over the rows: each sequence's persistent row and, while every row is a decode row (one token,
    # sampled), its token and position
    entries, write = state._entries, state._write
    rows, token_ids, positions = [], [], []
    decode = True
    for s in scheduled:
        seq = s.seq
        entry = entries.get(seq)
        if entry is None or entry[0] != seq.block_table:
            entry = write(seq, s.group.params, entry, scheduled)
        rows.append(entry[1])
        if decode:
            if s.num_new_tokens == 1 and s.samples and s.logits_of is None:
                first = seq.num_computed_tokens
                positions.append(first)
                token_ids.append(seq.token_ids[first])
            else:
                decode = False
    forks: list[int] = []  # rows that compute no token (a fork sampling its parent's logits): no block table
    if decode:  # a token per row, its sequence's last (so steps are positions + 1 - prompt lengths, below)
        count = num_rows
    else:
        seqs = [s.seq for s in scheduled]
        firsts = [q.num_computed_tokens for q in seqs]
        token_ids, positions, token_seq, logits_indices = [], [], [], []
        last_index: dict[int, int] = {}
        for row, s in enumerate(scheduled):
            seq, n = s.seq, s.num_new_tokens
            if n:
                first = firsts[row]
                if n == 1:
                    token_ids.append(seq.token_ids[first])
                    positions.append(first)
                    token_seq.append(row)
                else:
                    token_ids.extend(seq.token_ids[first:first + n])
                    positions.extend(range(first, first + n))
                    token_seq.extend([row] * n)
                last_index[seq.seq_id] = len(token_ids) - 1
            else:
                forks.append(row)
            logits_indices.append(last_index[(s.logits_of or seq).seq_id])
        count = len(token_ids)
    num_tokens = pick_bucket(config.token_buckets(), max(count, num_rows, 1))  # forks add rows
    num_seqs = config.num_seqs_for(num_tokens)
    index = np.zeros(num_seqs, np.intp)  # padding rows read row 0
    index[:num_rows] = rows
    tables = state.tables[index]
    if forks:
        tables[forks] = 0
    ids, pos, slots = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    ids[:count], pos[:count] = token_ids, positions
    if decode:  # row i's token is token i: shared, read-only arrays
        tok_seq, logits = _decode_rows(count, num_tokens), _decode_rows(count, num_seqs)
        token_rows = tok_seq[:count]
    else:
        tok_seq, logits = np.zeros(num_tokens, np.int32), np.zeros(num_seqs, np.int32)
        tok_seq[:count], logits[:num_rows] = token_seq, logits_indices
        token_rows = tok_seq[:count]
    if count:  # each token's slot, through its row's block table
        at = pos[:count].astype(np.int64)
        slots[:count] = tables[token_rows, at // bs].astype(np.int64) * bs + at % bs
    batch = TokenBatch(ids, pos, slots, tok_seq, tables, logits)
    steps = np.zeros(num_seqs, np.int32)
    if decode and count:  # len(token_ids) - num_prompt_tokens, the token computed being the sequence's last
        steps[:num_rows] = at + 1 - state.num_prompt[index[:num_rows]]
    elif not decode:
        steps[:num_rows] = [len(q.token_ids) - q.num_prompt_tokens for q in seqs]
    presence, frequency, repetition, history_rows, num_prompt, banned = _plain_rows(num_seqs)
    special_rows = np.flatnonzero(steps[:num_rows] < state.special_below[index[:num_rows]]).tolist()
    if special_rows:  # rows with penalties or banned tokens: rare, filled one by one; copies, as the plain
        presence, frequency, repetition, history_rows, num_prompt, banned = (  # arrays are shared between steps
            a.copy() for a in (presence, frequency, repetition, history_rows, num_prompt, banned))
    penalized = []
    for row in special_rows:
        seq, p = scheduled[row].seq, scheduled[row].group.params
        if p.has_penalties:
            presence[row], frequency[row], repetition[row] = (p.presence_penalty, p.frequency_penalty,
                                                              p.repetition_penalty)
            num_prompt[row] = seq.num_prompt_tokens
            penalized.append(row)
        if seq.num_output_tokens < p.min_tokens:
            ban = ([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)  # EOS first
            banned[row, :len(ban)] = ban[:MAX_BANNED]
    if penalized:  # their tokens, on the device already but for those new since the last step
        history_rows[penalized] = state.penalty_history.slots([scheduled[row].seq for row in penalized],
                                                              {s.seq for s in scheduled})
    sampling = SamplingBatch(
        state.temperature[index], state.top_k[index], state.top_p[index], state.min_p[index], state.seeds[index],
        steps, presence, frequency, repetition, state.penalty_history.table, history_rows, num_prompt, banned,
        np.bool_(state.want_top[index].any()), _bitmask_rows(bitmask, num_seqs, config))
    return batch, sampling
