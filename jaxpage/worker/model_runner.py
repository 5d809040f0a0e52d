"""ModelRunner: the weights and the KV pool on the engine's device(s), the step compiled for every token bucket
ahead of time, the scheduler's block moves applied to the pool, and each step run on the flat batch that
build_batch makes of the scheduled sequences."""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpage.attention.block_moves import BlockMoves, padded_chunks
from jaxpage.attention.kv_cache import allocate_kv_pool, host_kv_pool, packs_kv
from jaxpage.config import EngineConfig
from jaxpage.core.kv_cache_manager import COPY, SWAP_IN, SWAP_OUT, DeviceOps
from jaxpage.core.scheduler_output import ScheduledSeq, num_sampled_rows
from jaxpage.distributed.parallel import placement
from jaxpage.lora.models import LoRAModel
from jaxpage.lora.worker_manager import (
    SlotWriter,
    WorkerLoRAManager,
    lora_mapping,
    with_empty_slots,
)
from jaxpage.models import TokenBatch, unstack_layers
from jaxpage.models.placement import place_params, replicate_kv_heads
from jaxpage.models.weights import pack_params
from jaxpage.worker.input_batch import InputBatch, build_batch
from jaxpage.worker.kv_tiers import TIER_MOVES, KVTierMoves, kv_identity
from jaxpage.worker.sampler import SamplerOutput, SamplingBatch
from jaxpage.worker.step import (
    compile_step,
    layer_loop,
    make_step,
    replicated,
    substitute_placeholders,
    unrolls_weights,
    weight_shardings,
)
from jaxpage.worker.warmup import (
    WarmupProgram,
    compile_all,
    compile_threads,
    fewer_rows_inputs,
    program_inputs,
    warmup_programs,
)

log = logging.getLogger(__name__)

def step_weights(config: EngineConfig, params: dict, where, loop: str) -> tuple[dict, dict]:
    """The checkpoint's weights as the step driven by ``loop`` (step.LAYER_LOOPS) takes them, placed on ``where``
    (a device or a mesh), and their shardings: packed for oneDNN where the model packs, LoRA slots added (all
    zeros), the layers unrolled where the driver reads each layer's own buffers, the KV heads replicated where
    tensor parallelism needs it."""
    unrolled = unrolls_weights(loop)
    params = pack_params(config.step_model, params)
    if config.lora is not None:
        params = with_empty_slots(config, params)
    if unrolled:
        params = unstack_layers(params)
    params = replicate_kv_heads(params, config.model.num_kv_heads)
    shardings = weight_shardings(config, where if isinstance(where, Mesh) else None, where, unrolled=unrolled)
    return place_params(params, shardings, jnp.dtype(config.dtype)), shardings


def move_padded(moves: BlockMoves, pool, host_pool, kind: str, src: np.ndarray, dst: np.ndarray, n: int):
    """One padded call of block copies or swaps between ``pool`` and ``host_pool`` (numpy, written in place): the
    first ``n`` of ``src`` -> ``dst``; returns the pool."""
    if kind == COPY:
        return moves.copy(pool, src, dst)
    if kind == SWAP_OUT:
        moves.swap_out(pool, host_pool, src, dst[:n])
        return pool
    if kind == SWAP_IN:
        return moves.swap_in(pool, host_pool, src, dst)
    raise ValueError(kind)


@dataclasses.dataclass
class LaunchedStep:
    """A step started on the device: its rows and its sampler output, device arrays on their way to the host."""

    scheduled: list[ScheduledSeq]
    out: SamplerOutput


def placeholder_rows(scheduled: list[ScheduledSeq], previous: list[ScheduledSeq], token_rows: np.ndarray) -> np.ndarray:
    """For each token of a batch of ``scheduled`` (``token_rows``: each token's row, as TokenBatch.token_seq), the
    row of its sequence in the ``previous`` step, whose sampled token replaces a placeholder there (padding
    tokens: 0)."""
    if scheduled is previous:  # the decode fast path: the same rows, row i's token is token i
        rows = np.zeros(len(token_rows), np.int32)
        rows[:len(scheduled)] = np.arange(len(scheduled))
        return rows
    where = {id(s.seq): row for row, s in enumerate(previous)}
    return np.asarray([where.get(id(s.seq), 0) for s in scheduled], np.int32)[np.asarray(token_rows)]


class ModelRunner:
    """What runs on the device for one engine: its weights (placed, or split over its tensor-parallel mesh), the
    KV pool and the host's swap space (``config.cache.num_host_blocks``), the step's executables, and the batch's
    persistent inputs (InputBatch)."""

    supports_async_scheduling = True  # launch leaves the step running; fetch reads it

    def __init__(self, config: EngineConfig, params: dict, eos_token_ids=()):
        self.config = config
        identity = kv_identity(config, params) if config.cache.kv_offloading_dir else {}  # of the checkpoint's weights
        where = placement(config)  # the mesh of a tensor-parallel engine, else its one device
        self.mesh = where if isinstance(where, Mesh) else None
        device = self.mesh.devices.flat[0] if self.mesh is not None else where
        self._platform = device.platform
        self.layer_loop = layer_loop(config, device.platform, self.mesh)
        host_loop = self.layer_loop == "host_loop"
        # LoRA: the adapters on the host and in the device slots (all zeros until an adapter is written in)
        self.lora = WorkerLoRAManager(config) if config.lora is not None else None
        self.params, shardings = step_weights(config, params, where, self.layer_loop)
        self._lora_writer = SlotWriter(self.params) if self.lora is not None else None
        kv_dtype = jnp.dtype(config.kv_dtype)
        packed = packs_kv(config.model, config.attention_backend)
        cache = config.cache
        self.kv_pool = allocate_kv_pool(config.model, cache.num_kv_blocks, cache.block_size, kv_dtype, where,
                                        packed)
        self.host_pool = (host_kv_pool(config.model, cache.num_host_blocks, cache.block_size, kv_dtype, packed)
                          if cache.num_host_blocks else None)
        self._step = make_step(config, self.layer_loop, where, shardings)
        self._compiled: dict[WarmupProgram, object] = {}  # the warm-up's executables
        self._move_size = config.scheduler.max_num_seqs  # blocks moved per call of the copy/swap functions (padded)
        self.block_moves = BlockMoves.jit(where, kv_dtype, packed)
        # the prefix cache's host and disk tiers (the engine indexes the disk store's blocks for its KV manager)
        self.tiers = (KVTierMoves(config, kv_dtype, self.block_moves, self._move_size, identity)
                      if config.cache.num_offload_blocks else None)
        self.disk_store = self.tiers.disk_store if self.tiers is not None else None
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos_token_ids))  # min_tokens bans them
        # build_batch's persistent block tables and sampling settings; the host loop samples a step's rows only
        self.input_batch = InputBatch(config, sampled_rows_apart=host_loop and jax.process_count() == 1)
        self._substitute = jax.jit(substitute_placeholders, out_shardings=replicated(config))

    def warm_up(self, progress: bool = True) -> None:
        """Compiles every warm-up program (``warmup.warmup_programs``; on the CPU on several threads), runs each
        once, and compiles the block-move functions; serving never compiles."""
        # several processes must make the same device calls: the leader's steps stay synchronous
        substitutes = (self.config.scheduler.async_scheduling and self.supports_async_scheduling
                       and jax.process_count() == 1)
        programs = [p for p in warmup_programs(self.config, substitutes) if p not in self._compiled]
        threads = compile_threads(len(programs), self._platform)
        compiled = compile_all(self._compile, programs, threads, progress)
        for program in programs:  # in order: each run donates the pool
            self._first_run(program, compiled[program])
            self._compiled[program] = compiled[program]
        idle = np.zeros(self._move_size, np.int32)  # null block onto itself: compiles, changes nothing
        moves = self.block_moves
        self.kv_pool = moves.copy(self.kv_pool, idle, idle)
        if self.host_pool is not None or self.tiers is not None:
            self.kv_pool = moves.scatter(self.kv_pool, idle, moves.gather(self.kv_pool, idle))
        if self._lora_writer is not None:  # zeros into slot 0: compiles the slot write, changes nothing
            self.params = self._lora_writer.write(self.params, 0, None)

    def executable(self, num_tokens: int, num_loras: int = 0):
        """The compiled step of a token bucket (with ``num_loras`` adapter slots; 0: none), None before warm-up."""
        return self._compiled.get(WarmupProgram("step", num_tokens, num_loras))

    def _compile(self, program: WarmupProgram):
        """One warm-up program's executable (called on a compile thread)."""
        inputs = program_inputs(self.config, program)
        if program.kind == "substitute":
            return self._substitute.lower(*inputs).compile()
        fewer = fewer_rows_inputs(self.config, program) if self.input_batch.sampled_rows_apart else ()
        return compile_step(self._step, self.params, self.kv_pool, *inputs, fewer)

    def _first_run(self, program: WarmupProgram, compiled) -> None:
        """Runs a new executable once on zeros (a step's all-padding batch writes only the null block): the first
        run of an executable costs 0.3-0.7 s more on a CPU (one-time set-up in the runtime)."""
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), program_inputs(self.config, program))
        if program.kind == "substitute":
            jax.block_until_ready(compiled(*zeros))
            return
        out, self.kv_pool = compiled(self.params, self.kv_pool, *zeros)
        jax.block_until_ready(out)

    def apply(self, ops: DeviceOps) -> list[int]:
        """Carries out the queued block copies and swaps, in order, in padded fixed-size calls; returns the device
        blocks whose disk-tier restore failed (their files missing or bad)."""
        for kind, src, dst in ops.batches():
            if kind in TIER_MOVES:
                self.kv_pool = self.tiers.apply(self.kv_pool, kind, src, dst)
                continue
            for padded_src, padded_dst, n in padded_chunks(src, dst, self._move_size):
                self.move(kind, padded_src, padded_dst, n)
        return self.tiers.take_failed_loads() if self.tiers is not None else []

    def move(self, kind: str, src: np.ndarray, dst: np.ndarray, n: int) -> None:
        """One padded call: the first ``n`` of ``src`` -> ``dst`` (block ids, ``self._move_size`` of each)."""
        self.kv_pool = move_padded(self.block_moves, self.kv_pool, self.host_pool, kind, src, dst, n)

    def execute(self, scheduled: list[ScheduledSeq], bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Runs one step; returns the sampler's output (numpy) for each scheduled sequence, in order. bitmask
        [rows, ceil(vocab / 32)] int32: the tokens each row may sample (structured outputs); None: any."""
        return self.fetch(self.launch(scheduled, bitmask))

    def launch(self, scheduled: list[ScheduledSeq], bitmask: np.ndarray | None = None,
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Builds the batch and starts the step without waiting for it (async scheduling); the sampled tokens
        start their way to the host. previous: the step before, still running, whose sampled tokens take the
        place of this batch's placeholder token ids on the device (each row's first token: its last token, then
        any drafts)."""
        batch, sampling = build_batch(self.config, scheduled, self.eos_token_ids, self.input_batch, bitmask)
        if self.lora is not None:
            batch = self._with_lora_slots(scheduled, batch)
        if previous is not None:
            rows = placeholder_rows(scheduled, previous.scheduled, batch.token_seq)
            key = WarmupProgram("substitute", batch.token_ids.shape[0], num_sampled=previous.out.tokens.shape[0])
            substitute = self._compiled.get(key, self._substitute)
            batch = dataclasses.replace(batch, token_ids=substitute(batch.token_ids, previous.out.tokens, rows))
        out = self.run(batch, sampling)
        for leaf in jax.tree.leaves(out):
            leaf.copy_to_host_async()
        if self.tiers is not None:
            self.tiers.finish()  # the offloads' host-side stores, while the step runs
        return LaunchedStep(scheduled, out)

    def _with_lora_slots(self, scheduled: list[ScheduledSeq], batch: TokenBatch) -> TokenBatch:
        """The batch with the step's adapter slots and each token's among them (none: the base model's step), the
        step's adapters written into their slots first (those not resident: into a free slot or the least
        recently used one this step does not need)."""
        row_slots, writes = self.lora.slots_for([s.group.lora_model for s in scheduled])
        for slot, adapter in writes:
            self.params = self._lora_writer.write(self.params, slot, adapter)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        lora = self.config.lora
        mapping = lora_mapping(row_slots, batch.token_seq, num_tokens, len(scheduled), lora.max_loras,
                               lora.cpu_lora_kernel)
        return dataclasses.replace(batch, lora=mapping)

    def load_lora(self, request) -> LoRAModel:
        """A LoRARequest's adapter on the host, read from its files unless the host LRU holds it (checked: a
        ValueError naming the file and field)."""
        if self.lora is None:
            raise ValueError("a lora_request needs an engine started with enable_lora=True")
        return self.lora.get(request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forgets an adapter on the host and in its slot (no request may run with it)."""
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def fetch(self, launched: LaunchedStep) -> SamplerOutput:
        """A launched step's output (numpy) for each of its rows (with speculative decoding, then each draft
        position's), waiting for it if need be."""
        scheduled = launched.scheduled
        rows = len(scheduled) if self.config.speculative_config is None else num_sampled_rows(scheduled)
        return jax.tree.map(np.asarray, launched.out).rows(slice(rows))

    def run(self, batch: TokenBatch, sampling: SamplingBatch) -> SamplerOutput:
        """The compiled step of the batch's bucket (tokens, and adapter slots if any) on it (the pool updated in
        place)."""
        num_tokens = batch.token_ids.shape[0]
        compiled = self.executable(num_tokens, 0 if batch.lora is None else batch.lora.slots.shape[0])
        if compiled is None:
            raise RuntimeError(f"no compiled step for {num_tokens} tokens; call warm_up() first")
        out, self.kv_pool = compiled(self.params, self.kv_pool, batch, sampling)
        return out
