"""The two systems paging is measured against, on jaxpage's own model code and weights, with the same KV memory.

A contiguous cache of B slots x max_len tokens is written in jaxpage's pool layout: slot i statically owns the
blocks ``1 + i*M ... (i+1)*M`` (M = max_len / block_size) of a pool of ``B*M + 1`` blocks (block 0 is the null
block). That reservation is made whether the tokens are ever written or not, exactly as a ``[B, max_len]``
K/V tensor would be, and it lets the baselines run the very same step as the paged engine, on the weights as it
holds them (``model_runner.step_weights``), driven as the engine drives it there (``jaxpage.worker.step.LAYER_LOOP``:
the host layer loop on one CPU or GPU device, else one program).
Until 2026-12-04 the baselines ran the fused scan step on every device, whose weight copies the paged engine's
layer loop does not make. B = budget_blocks // M, so the reserved memory equals the budget.

- ``StaticBatching``: FCFS batches of B requests. Prompts are padded to the batch's longest prompt (right
  padding: the padding tokens are computed, write to the null block, and positions mask them); one prefill of
  the padded [B, L] prompt (chunked under the same token budget as the engine), then decode steps over all B
  rows until the longest output is done. Finished rows keep their slot and keep generating padding.
- ``SlotBatching``: continuous batching over B fixed slots (JetStream/MaxText before paging): a finished
  sequence's slot is refilled at the next step. Tuned as far as the layout allows: the same unified flat batch
  as the engine (decode tokens of every active slot plus prefill chunks of newly admitted prompts, under one
  token budget), only active slots computed, the same power-of-two token buckets, the pool donated.

Both are driven from numpy with vectorized batch building (their host work is smaller than the engine's).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.testing.workloads import Workload
from jaxpage.attention.kv_cache import NULL_BLOCK, allocate_kv_pool, packs_kv
from jaxpage.config import ModelConfig, pick_bucket
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.models import TokenBatch
from jaxpage.sampling_params import MAX_LOGIT_BIAS
from jaxpage.structured.manager import bitmask_words
from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch
from jaxpage.worker.model_runner import step_weights
from jaxpage.worker.step import layer_loop, make_step, unrolls_weights, weight_shardings


@dataclasses.dataclass
class RunStats:
    """What one system did on one workload, or in a measured window of it; KV figures in token slots.

    Time is the system's own: the clock runs only while one of its steps runs (``resume``/``pause``), so that
    systems can be interleaved step by step (``interleave``) and see the same machine load, however it drifts.

    Two ways to run: drain the workload (``duration`` None), or, with a backlog larger than the machine gets
    through, run ``warmup`` seconds unmeasured (every system starts by admitting and prefilling as much as it
    can hold: a transient that a short window would overweight) and then measure ``duration`` seconds of
    saturated steady state. Throughput counts every output token generated in the window, finished request or
    not. ``requests_per_s`` is that token throughput over the workload's mean output tokens per request: when a
    run drains the workload it is exactly requests / seconds; in a window it is the long-run request rate at
    saturation, without the bias of counting only the requests that happened to finish inside it.
    """

    tokens_per_request: float  # the workload's mean output tokens per request (n samples count n times)
    num_requests: int = 0  # in the workload
    duration: float | None = None  # measured seconds after the warm-up (None: drain the workload)
    warmup: float = 0.0
    progress: object = None  # () -> dict of monotone counters: "tokens", "completed", "execute" (seconds), ...
    num_preemptions: int = 0
    running: list[int] = dataclasses.field(default_factory=list)  # live sequences after each step
    stored: list[int] = dataclasses.field(default_factory=list)  # tokens whose K/V live sequences hold
    allocated: list[int] = dataclasses.field(default_factory=list)  # slots reserved for live sequences
    times: list[float] = dataclasses.field(default_factory=list)  # own seconds since the start, after each step
    window: dict = dataclasses.field(default_factory=dict)  # counters, time, CPU time and step at the window start
    totals: dict = dataclasses.field(default_factory=dict)  # counters over the window, set by stop()
    drained: bool = False  # every request finished
    own: float = 0.0  # seconds of this system's steps so far
    own_cpu: float = 0.0  # process CPU seconds (all threads) during them
    _mark: tuple | None = None

    @classmethod
    def for_workload(cls, workload: Workload, duration: float | None, warmup: float = 0.0) -> "RunStats":
        return cls(tokens_per_request=workload.num_output_tokens / len(workload.requests),
                   num_requests=len(workload.requests), duration=duration or None,
                   warmup=warmup if duration else 0.0)

    def resume(self) -> None:
        self._mark = (time.perf_counter(), time.process_time())

    def pause(self) -> None:
        t, c = self._mark
        self.own += time.perf_counter() - t
        self.own_cpu += time.process_time() - c
        self._mark = None

    def _now(self) -> tuple[float, float]:
        if self._mark is None:
            return self.own, self.own_cpu
        t, c = self._mark
        return self.own + time.perf_counter() - t, self.own_cpu + time.process_time() - c

    def start(self, progress) -> None:
        self.progress = progress
        if not self.warmup:
            self._open_window()

    def _open_window(self) -> None:
        t, cpu = self._now()
        self.window = {"t": t, "cpu": cpu, "step": len(self.times), **self.progress()}

    def expired(self) -> bool:
        return self.duration is not None and self._now()[0] >= self.warmup + self.duration

    def record(self, running: int, stored: int, allocated: int) -> None:
        self.times.append(self._now()[0])
        self.running.append(running)
        self.stored.append(stored)
        self.allocated.append(allocated)
        if not self.window and self.times[-1] >= self.warmup:
            self._open_window()

    def stop(self) -> None:
        if not self.window:  # drained before the warm-up was over: measure the whole run
            self.window = {"t": 0.0, "cpu": 0.0, "step": 0, **{k: 0 for k in self.progress()}}
        t, cpu = self._now()
        end = {"t": t, "cpu": cpu, **self.progress()}
        self.totals = {k: end[k] - self.window[k] for k in end}
        self.drained = self.progress()["completed"] == self.num_requests

    def summary(self) -> dict:
        w = self.window["step"]
        stored, allocated = np.array(self.stored[w:], float), np.array(self.allocated[w:], float)
        running = np.array(self.running[w:])
        has = allocated > 0
        peak = int(np.lexsort((stored, allocated))[-1])  # most memory reserved; ties: most tokens stored
        step_s = np.diff(np.array(self.times[w:]), prepend=self.window["t"])
        seconds, tokens = self.totals["t"], self.totals["tokens"]
        return {
            "requests_per_s": tokens / seconds / self.tokens_per_request,
            "output_tokens_per_s": tokens / seconds,
            "output_tokens_per_cpu_s": tokens / self.totals["cpu"],
            "seconds": seconds,
            "cpu_seconds": self.totals["cpu"],
            "warmup_seconds": self.window["t"],
            "drained": self.drained,
            "completed_requests": self.totals["completed"],
            "num_output_tokens": tokens,
            "tokens_per_request": self.tokens_per_request,
            "num_steps": len(step_s),
            "peak_concurrency": int(running.max()),
            "mean_concurrency": float(running.mean()),
            # reserved-but-unused share of the KV memory held by live sequences, over all steps (slot-steps)
            "kv_waste_frac": float(1 - stored[has].sum() / allocated[has].sum()),
            "kv_waste_mean_of_steps": float(np.mean(1 - stored[has] / allocated[has])),
            "kv_waste_at_peak": float(1 - stored[peak] / allocated[peak]) if allocated[peak] else 0.0,
            "peak_kv_slots_allocated": int(allocated[peak]),
            "peak_kv_tokens_stored": int(stored[peak]),
            "num_preemptions": self.num_preemptions,
            "execute_seconds": self.totals["execute"],
            "outside_execute_seconds": seconds - self.totals["execute"],
            "median_step_ms": float(1e3 * np.median(step_s)),
        }


def interleave(runs: dict) -> None:
    """Runs ``{name: (steps generator, RunStats)}`` one step of each in turn, each on its own clock, until each
    has drained its workload or used its time; every system thus runs under the same machine load."""
    active = dict(runs)
    while active:
        for name, (steps, stats) in list(active.items()):
            stats.resume()
            try:
                next(steps)
                done = stats.expired()
            except StopIteration:
                done = True
            stats.pause()
            if done:
                steps.close()
                stats.stop()
                del active[name]


def run_alone(steps, stats: RunStats) -> RunStats:
    interleave({"": (steps, stats)})
    return stats


class ContiguousCache:
    """B slots of max_len tokens each, expressed as fixed block tables over jaxpage's pool; runs jaxpage's step."""

    def __init__(self, model: ModelConfig, params: dict, dtype: str, num_slots: int, max_len: int,
                 block_size: int, max_num_batched_tokens: int, attention_backend: str = "auto"):
        if max_len % block_size:
            raise ValueError(f"max_len={max_len} must be a multiple of block_size={block_size}")
        self.num_slots, self.max_len, self.block_size = num_slots, max_len, block_size
        self.blocks_per_slot = max_len // block_size
        self.config = build_engine_config(
            model, dtype=dtype, block_size=block_size, kv_cache_memory=None,
            num_kv_blocks=num_slots * self.blocks_per_slot + 1, max_num_seqs=num_slots,
            max_num_batched_tokens=max(max_num_batched_tokens, num_slots), max_model_len=max_len,
            gpu_memory_utilization=0.9, attention_backend=attention_backend)
        self.tables = (1 + np.arange(num_slots * self.blocks_per_slot, dtype=np.int32)).reshape(
            num_slots, self.blocks_per_slot)
        device = jax.devices()[0]
        # the weights and the step as the paged runner has them (the host layer loop where it runs one)
        self.params, _ = step_weights(self.config, params, device, layer_loop(self.config, device.platform))
        self.pool = allocate_kv_pool(model, self.config.cache.num_kv_blocks, block_size, jnp.dtype(dtype),
                                     packed=packs_kv(model, self.config.attention_backend))
        self._step = _jitted_step(self.config)
        self._greedy = {}

    @property
    def reserved_blocks(self) -> int:
        return self.num_slots * self.blocks_per_slot

    def _sampling(self, num_seqs: int) -> SamplingBatch:
        if num_seqs not in self._greedy:
            f, i = np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.int32)
            self._greedy[num_seqs] = SamplingBatch(
                f, i, np.ones(num_seqs, np.float32), f, np.zeros(num_seqs, np.uint32), i, f, f,
                np.ones(num_seqs, np.float32), np.full((1, self.max_len), -1, np.int32), i, i,
                np.full((num_seqs, MAX_BANNED), -1, np.int32), np.bool_(False),
                np.full((num_seqs, bitmask_words(self.config.model.vocab_size)), -1, np.int32),
                np.full((num_seqs, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((num_seqs, MAX_LOGIT_BIAS), np.float32))
        return self._greedy[num_seqs]

    def warm_up(self) -> None:
        """Compiles every token bucket (an all-padding batch writes only the null block)."""
        for num_tokens in self.config.token_buckets():
            z = np.zeros(0, np.int32)
            self.execute(z, z, z, z, np.zeros(0, bool), z, num_tokens=num_tokens)

    def execute(self, row_slots: np.ndarray, token_ids: np.ndarray, positions: np.ndarray, token_row: np.ndarray,
                real: np.ndarray, logits_indices: np.ndarray, num_tokens: int | None = None) -> np.ndarray:
        """One step over a flat batch: per token its id, position, row and whether it is real (not padding);
        per row its slot and the flat index whose logits it samples from. Returns one greedy token per row."""
        n, rows = len(token_ids), len(row_slots)
        bucket = pick_bucket(self.config.token_buckets(), max(n, rows, num_tokens or 1))
        num_seqs = self.config.num_seqs_for(bucket)
        bs = self.block_size
        slots = np.where(real, self.tables[row_slots[token_row], positions // bs] * bs + positions % bs,
                         NULL_BLOCK * bs) if n else np.zeros(0, np.int32)
        tables = np.zeros((num_seqs, self.blocks_per_slot), np.int32)
        tables[:rows] = self.tables[row_slots]
        batch = TokenBatch(_pad(token_ids, bucket), _pad(positions, bucket), _pad(slots, bucket),
                           _pad(token_row, bucket), tables, _pad(logits_indices, num_seqs))
        out, self.pool = self._step(self.params, self.pool, batch, self._sampling(num_seqs))
        return np.asarray(out.tokens)[:rows]


@functools.lru_cache(maxsize=8)
def _jitted_step(config) -> object:
    """One jitted step per configuration, shared by the caches that have it (compiled once): the paged runner's
    (the host layer loop over unrolled weights where the runner runs one, else the fused step)."""
    device = jax.devices()[0]
    loop = layer_loop(config, device.platform)
    return make_step(config, loop, device, weight_shardings(config, None, device, unrolled=unrolls_weights(loop)))


def _pad(values: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, np.int32)
    out[:len(values)] = values
    return out


@dataclasses.dataclass
class _Seq:
    request: int
    prompt: np.ndarray
    max_tokens: int
    computed: int = 0  # tokens whose K/V are in the slot
    generated: int = 0
    last: int = 0  # the latest sampled token (its K/V is written by the next step)


def _sequences(workload: Workload) -> list[_Seq]:
    """A request with n samples becomes n sequences: a contiguous cache cannot share the prompt between them."""
    return [_Seq(i, np.asarray(r.prompt_token_ids, np.int32), r.max_tokens)
            for i, r in enumerate(workload.requests) for _ in range(r.n)]


class _ContiguousSystem:
    """A batching policy over a ContiguousCache; ``steps`` yields after every step (so systems can interleave)."""

    def __init__(self, cache: ContiguousCache):
        self.cache = cache

    def run(self, workload: Workload, duration: float | None = None, warmup: float = 0.0) -> RunStats:
        stats = RunStats.for_workload(workload, duration, warmup)
        return run_alone(self.steps(workload, stats), stats)

    def steps(self, workload: Workload, stats: RunStats):
        raise NotImplementedError


class SlotBatching(_ContiguousSystem):
    """Continuous batching over B contiguous slots, refilled as soon as they free up."""

    name = "slot_contiguous"

    def steps(self, workload: Workload, stats: RunStats):
        """Yields after every step."""
        c = self.cache
        seqs = _sequences(workload)
        queue = seqs[::-1]
        slots: list[_Seq | None] = [None] * c.num_slots
        budget = c.config.scheduler.max_num_batched_tokens
        clock = {"execute": 0.0}
        stats.start(lambda: {**_progress(seqs), **clock})
        while queue or any(slots):
            for i in range(c.num_slots):  # refill every free slot at once
                if slots[i] is None and queue:
                    slots[i] = queue.pop()
            decode = [i for i, s in enumerate(slots) if s is not None and s.computed >= len(s.prompt)]
            pieces = []  # (slot, tokens, first position); decode rows first, then prompt chunks
            for i in decode:
                pieces.append((i, np.array([slots[i].last], np.int32), slots[i].computed))
            room = budget - len(decode)
            for i, s in enumerate(slots):
                if room <= 0:
                    break
                if s is not None and s.computed < len(s.prompt):
                    chunk = s.prompt[s.computed:s.computed + room]
                    pieces.append((i, chunk, s.computed))
                    room -= len(chunk)
            t = time.perf_counter()
            sampled = _run_pieces(c, pieces)
            clock["execute"] += time.perf_counter() - t
            for (i, chunk, first), token in zip(pieces, sampled):
                s = slots[i]
                s.computed = first + len(chunk)
                if s.computed < len(s.prompt):
                    continue  # a prompt chunk that does not reach the end samples nothing
                s.last, s.generated = int(token), s.generated + 1
                if s.generated == s.max_tokens:
                    slots[i] = None
            live = [s for s in slots if s is not None]
            stats.record(len(live), sum(s.computed for s in live), len(live) * c.max_len)
            yield


def _progress(seqs: list[_Seq]) -> dict:
    """Output tokens generated so far (padding excluded), and requests whose every sequence is done."""
    pending = {s.request for s in seqs if s.generated < s.max_tokens}
    return {"tokens": sum(min(s.generated, s.max_tokens) for s in seqs),
            "completed": len({s.request for s in seqs} - pending)}


class StaticBatching(_ContiguousSystem):
    """FCFS static batches of B requests, padded prompts, each batch run until its longest output is done."""

    name = "static_contiguous"

    def steps(self, workload: Workload, stats: RunStats):
        """Yields after every step."""
        seqs = _sequences(workload)
        clock = {"execute": 0.0}
        stats.start(lambda: {**_progress(seqs), **clock})
        for first in range(0, len(seqs), self.cache.num_slots):
            yield from self._batch_steps(seqs[first:first + self.cache.num_slots], stats, clock)

    def _batch_steps(self, batch: list[_Seq], stats: RunStats, clock: dict):
        c = self.cache
        rows = np.arange(len(batch), dtype=np.int32)
        lens = np.array([len(s.prompt) for s in batch])
        padded_len = int(lens.max())
        reserved = len(batch) * c.max_len  # the whole [batch, max_len] reservation, used or not
        # The padded prompt [rows, padded_len], flattened row by row and run in chunks under the token budget.
        flat_ids = np.zeros((len(batch), padded_len), np.int32)
        for r, s in enumerate(batch):
            flat_ids[r, :len(s.prompt)] = s.prompt
        flat_ids = flat_ids.reshape(-1)
        flat_pos = np.tile(np.arange(padded_len, dtype=np.int32), len(batch))
        flat_row = np.repeat(rows, padded_len)
        flat_real = flat_pos < lens[flat_row]
        budget = c.config.scheduler.max_num_batched_tokens
        for lo in range(0, len(flat_ids), budget):
            hi = min(lo + budget, len(flat_ids))
            present = np.unique(flat_row[lo:hi])  # rows with tokens in this chunk, in order
            local_row = np.searchsorted(present, flat_row[lo:hi]).astype(np.int32)
            last_real = present * padded_len + lens[present] - 1  # flat index of each row's last prompt token
            samples = (last_real >= lo) & (last_real < hi)
            logits = np.where(samples, last_real - lo, 0).astype(np.int32)
            t = time.perf_counter()
            sampled = c.execute(present.astype(np.int32), flat_ids[lo:hi], flat_pos[lo:hi], local_row,
                                flat_real[lo:hi], logits)
            clock["execute"] += time.perf_counter() - t
            for r, token, done in zip(present, sampled, samples):
                s = batch[r]
                s.computed = int(min(lens[r], hi - r * padded_len))
                if done:
                    s.last, s.generated = int(token), 1
            live = [s for s in batch if s.generated < s.max_tokens]
            stats.record(len(live), sum(s.computed for s in live), reserved)
            yield
        # Decode until the longest output is done; finished rows generate padding into the null block.
        for _ in range(max(s.max_tokens for s in batch) - 1):
            live = np.array([s.generated < s.max_tokens for s in batch])
            pos = np.minimum(np.array([len(s.prompt) + s.generated - 1 for s in batch]), c.max_len - 1)
            tokens = np.array([s.last for s in batch], np.int32)
            t = time.perf_counter()
            sampled = c.execute(rows, tokens, pos.astype(np.int32), rows, live, rows)
            clock["execute"] += time.perf_counter() - t
            for s, token, is_live in zip(batch, sampled, live):
                s.last, s.generated = int(token), s.generated + 1  # padding rows too, as a [B] tensor would
                if is_live:
                    s.computed += 1
            live = [s for s in batch if s.generated < s.max_tokens]
            stats.record(len(live), sum(s.computed for s in live), reserved)
            yield


def _run_pieces(c: ContiguousCache, pieces: list[tuple[int, np.ndarray, int]]) -> np.ndarray:
    """Flat batch of one piece (a decode token or a prompt chunk) per row; samples at each piece's last token."""
    lengths = np.array([len(chunk) for _, chunk, _ in pieces])
    token_ids = np.concatenate([chunk for _, chunk, _ in pieces])
    positions = np.concatenate([np.arange(first, first + len(chunk), dtype=np.int32)
                                for _, chunk, first in pieces])
    token_row = np.repeat(np.arange(len(pieces), dtype=np.int32), lengths)
    row_slots = np.array([i for i, _, _ in pieces], np.int32)
    return c.execute(row_slots, token_ids, positions, token_row, np.ones(len(token_ids), bool),
                     (np.cumsum(lengths) - 1).astype(np.int32))
