"""The tests' one model-less engine: the engine core over a fake runner that keeps a *simulated* KV pool (every
slot holds a rolling hash of the token prefix whose K/V it stands for, and every read is checked against it).

``make_engine`` builds it; ``stand_in_engine`` is its preset for the server and request tests (a fixed token, a
step time, an injected device error), which start in a second. Beside it: random workloads for the block-accounting
property tests and the checks of the pool, the host slots and the queues after every action
(tests/test_block_accounting.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import weakref

import numpy as np
import pytest
import transformers
from hypothesis import strategies as st

from jaxpage.config import pick_bucket
from jaxpage.core.kv_cache_manager import COPY, NULL_HOST, SWAP_IN, SWAP_OUT
from jaxpage.worker.kv_disk_store import DiskKVStore
from jaxpage.core.kv_offload import DISK_DELETE, DISK_RESTORE, DISK_STORE, DISK_WRITE, OFFLOAD, RESTORE
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.lora.request import LoRARequest
from jaxpage.lora.worker_manager import lora_mapping
from jaxpage.models import config_from_hf
from jaxpage.models.lora_slots import lora_buckets
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpage.sequence import SequenceStatus
from jaxpage.worker.model_runner import LaunchedStep
from jaxpage.worker.sampler import SamplerOutput

VOCAB = 24  # small, so EOS (token 0) is sampled now and then and prefixes repeat
EOS = 0
BLOCK_SIZE = 8
MAX_MODEL_LEN = 64
_MOD = (1 << 61) - 1
STAND_IN_TOKEN = 7  # what a stand-in engine samples for every row (top log-probabilities: 7, 8, ...)


def prefix_hashes(token_ids: list[int], lora_int_id: int = 0) -> list[int]:
    """hash(tokens[:p + 1]) under the LoRA adapter for every position p: what the K/V at p depends on (an
    adapter computes other K/V from the same tokens). Never 0 (0 = never written)."""
    out, h = [], (7 + 104_729 * lora_int_id) % _MOD
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h or 1)
    return out


class FakeRunner:
    """The runner contract (jaxpage.worker.runner.Runner) over a simulated KV pool (see the module docstring).
    ``fixed_token``: every row samples it (else a draw that depends on the row's tokens and seed);
    ``step_seconds``: each step's time."""

    tiers = None  # no tier moves of the device's to time

    def __init__(self, config, num_host_blocks: int, fixed_token: int | None = None, step_seconds: float = 0.0):
        self.config = config
        self.supports_async_scheduling = config.scheduler.async_scheduling
        self.fixed_token, self.step_seconds = fixed_token, step_seconds
        self.pool = np.zeros((config.cache.num_kv_blocks, config.cache.block_size), np.int64)
        self.host = np.zeros((max(num_host_blocks, 1), config.cache.block_size), np.int64)
        self.num_host_blocks = num_host_blocks
        # the prefix cache's host tier (its arena) and disk tier (real files of the simulated blocks)
        self.offload = np.zeros((max(config.cache.num_offload_blocks, 1), config.cache.block_size), np.int64)
        leaves = [(np.int64, (config.cache.block_size,))]
        self.disk_store = (DiskKVStore(config.cache.kv_offloading_dir, {"model": "fake"}, leaves)
                           if config.cache.kv_offloading_dir else None)
        self.block_pool = None  # set by make_engine, to check that written blocks are held
        self.window = config.model.sliding_window if config.model.every_layer_windowed else 0
        self.moves: list[tuple[str, int, int]] = []
        self.max_rows = 0
        self._device_tokens: dict[int, int] = {}  # id(seq) -> the token in place of its placeholder (launch)

    def warm_up(self, progress: bool = False) -> None:
        pass

    def load_lora(self, request) -> None:
        """Adapters have no weights here: the simulated K/V of a token depends on its sequence's adapter id."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Nothing is held per adapter."""

    def apply(self, ops) -> list[int]:
        nb, failed_loads = self.config.cache.num_kv_blocks, []
        for kind, src, dst in ops.batches():  # one batched gather/scatter per run of one kind, as the real runner
            self.moves.extend((kind, s, d) for s, d in zip(src, dst))
            if kind == COPY:
                assert all(0 < b < nb for b in src + dst), f"copy with a bad block: {src} -> {dst}"
                self.pool[dst] = self.pool[src].copy()
            elif kind == SWAP_OUT:
                assert all(0 < b < nb for b in src) and all(0 <= s < self.num_host_blocks for s in dst), (src, dst)
                self.host[dst] = self.pool[src].copy()
            elif kind == SWAP_IN:
                assert all(0 <= s < self.num_host_blocks for s in src) and all(0 < b < nb for b in dst), (src, dst)
                self.pool[dst] = self.host[src].copy()
            elif kind == OFFLOAD:
                assert all(0 < b < nb for b in src) and all(0 <= s < self.config.cache.num_offload_blocks for s in dst)
                self.offload[dst] = self.pool[src].copy()
            elif kind == RESTORE:
                assert all(0 <= s < self.config.cache.num_offload_blocks for s in src) and all(0 < b < nb for b in dst)
                self.pool[dst] = self.offload[src].copy()
            elif kind == DISK_WRITE:
                for slot, block_hash in zip(src, dst):
                    self.disk_store.write(block_hash, [self.offload[slot]])
            elif kind == DISK_RESTORE:
                assert all(0 < b < nb for b in dst)
                for block_hash, b in zip(src, dst):
                    arrays = self.disk_store.read(block_hash)
                    if arrays is None:
                        failed_loads.append(b)
                        self.pool[b] = -1  # what a failed load leaves: nothing a read may trust
                    else:
                        self.pool[b] = arrays[0]
            elif kind == DISK_DELETE:
                for block_hash in src:
                    self.disk_store.delete(block_hash)
            elif kind == DISK_STORE:
                assert all(0 < b < nb for b in src)
                for b, block_hash in zip(src, dst):
                    self.disk_store.write(block_hash, [self.pool[b]])
            else:
                raise AssertionError(f"unknown move {kind}")
        return failed_loads

    def launch(self, scheduled, bitmask=None, previous=None):
        """Async scheduling as the device does it: a placeholder (a row's last token, counted in its sequence's
        num_placeholders by a step built before the step ``previous`` was read) is the token ``previous``
        sampled for that sequence; then the step runs at once (in launch order, as on a device) and its output
        waits in the handle for ``fetch``."""
        assert bitmask is None
        prev_rows = {id(s.seq): row for row, s in enumerate(previous.scheduled)} if previous is not None else {}
        self._device_tokens = {}
        for s in scheduled:
            if s.seq.num_placeholders:
                one = s.num_new_tokens == 1 + len(s.spec_token_ids)  # its last token, then any drafts
                assert previous is not None and s.seq.num_placeholders == 1 and one, (
                    f"seq {s.seq.seq_id} has {s.seq.num_placeholders} placeholders in a step without the one before")
                self._device_tokens[id(s.seq)] = int(previous.out.tokens[prev_rows[id(s.seq)]])
        try:
            return LaunchedStep(scheduled, self.execute(scheduled))
        finally:
            self._device_tokens = {}

    def _tokens(self, seq) -> list[int]:
        """A sequence's tokens as the device has them: with the token of the step before in place of its
        placeholder (launch)."""
        if not seq.num_placeholders:
            return seq.token_ids
        return seq.token_ids + [self._device_tokens[id(seq)]]

    def fetch(self, launched: LaunchedStep) -> SamplerOutput:
        return launched.out

    def execute(self, scheduled) -> SamplerOutput:
        cfg, bs = self.config, self.config.cache.block_size
        n = len(scheduled)
        self.max_rows = max(self.max_rows, n)
        assert n <= cfg.scheduler.max_num_seqs, f"{n} sequences in one step, max_num_seqs={cfg.scheduler.max_num_seqs}"
        drafts = [(s, j) for s in scheduled for j in range(len(s.spec_token_ids))]  # a sampled row each, after
        assert n + len(drafts) <= cfg.max_sampled_rows, f"{n} rows and {len(drafts)} draft rows in one step"
        assert n > 0
        assert len({id(s.seq) for s in scheduled}) == n, "a sequence scheduled twice in one step"
        total = sum(s.num_new_tokens for s in scheduled)
        budget = cfg.scheduler.max_num_batched_tokens
        assert total <= budget, f"{total} tokens > budget {budget}"
        loras = {s.group.lora_int_id for s in scheduled} - {0}
        assert len(loras) <= cfg.step_model.max_loras, f"adapters {sorted(loras)} in one step: more than the slots"
        row_adapters = self._row_adapters(scheduled)
        hashes = {}
        for s in scheduled:  # writes first (the real step writes a layer's K/V before attending)
            seq = s.seq
            assert s.group.status == SequenceStatus.RUNNING and not seq.is_finished
            if s.logits_of is not None:
                assert s.num_new_tokens == 0 and s.logits_of.seq_id != seq.seq_id
                continue
            first, count = seq.num_computed_tokens, s.num_new_tokens
            ids = self._tokens(seq) + list(s.spec_token_ids)  # speculative decoding: the drafts follow its last token
            assert not s.spec_token_ids or first == seq.num_tokens - 1, "drafts after a prompt chunk"
            assert 0 < count <= len(ids) - first, (first, count, len(ids))
            assert s.samples == (first + count == len(ids))
            table = s.block_ids  # the runner reads the KV manager's table through the row
            assert len(table) * bs >= first + count, "block table too short for the chunk"
            assert seq.lora_int_id == s.group.lora_int_id, "a sequence computed with another adapter"
            h = hashes[seq.seq_id] = prefix_hashes(ids, row_adapters[id(s)])
            for p in range(first, first + count):
                block = table[p // bs]
                assert 0 < block < cfg.cache.num_kv_blocks and self.block_pool.ref_counts[block] >= 1, block
                self.pool[block, p % bs] = h[p]
        for s in scheduled:  # then every sequence reads its whole context (with a window: what its chunk sees)
            if s.logits_of is not None:
                continue
            seq, end = s.seq, s.seq.num_computed_tokens + s.num_new_tokens
            h = hashes[seq.seq_id]
            seen = range(max(0, seq.num_computed_tokens - self.window + 1) if self.window else 0, end)
            table = s.block_ids
            got = {p: int(self.pool[table[p // bs], p % bs]) for p in seen}
            bad = [p for p in seen if got[p] != h[p]]
            assert not bad, (f"seq {seq.seq_id} reads wrong K/V at positions {bad[:10]} (blocks "
                             f"{[table[p // bs] for p in bad[:10]]}, table {table})")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if cfg.pooler_config is not None:
            return pooled_output(scheduled, hashes, cfg.pooler_config.pooling_type)
        rows = n + len(drafts)
        if self.fixed_token is not None:
            return fixed_output(rows, self.fixed_token)
        tokens = np.zeros(rows, np.int64)
        logprobs = np.zeros(rows, np.float64)
        top_ids = np.zeros((rows, MAX_LOGPROBS), np.int64)
        top_lps = np.zeros((rows, MAX_LOGPROBS), np.float64)
        # each row samples after its tokens (a speculating row: after its drafts; a draft row: after drafts[:j])
        contexts = [(self._tokens(s.logits_of or s.seq) + list(s.spec_token_ids), s) for s in scheduled]
        contexts += [(self._tokens(s.seq) + list(s.spec_token_ids[:j]), s) for s, j in drafts]
        for row, (context, s) in enumerate(contexts):
            ids, lps, pick = fake_draw(context, s.seq.seed, s.group.params.temperature)
            top_ids[row], top_lps[row] = ids, lps
            tokens[row], logprobs[row] = ids[pick], lps[pick]
        return SamplerOutput(tokens, logprobs, top_ids, top_lps)


    def _row_adapters(self, scheduled) -> dict[int, int]:
        """id(scheduled row) -> the adapter the step's LoRAMapping (the runner's, over slots 1.. for the step's
        adapters) gives its tokens, which the simulated K/V then depends on; the mapping's slot list is a bucket
        holding the step's adapters."""
        counts = [s.num_new_tokens for s in scheduled]
        token_rows = np.repeat(np.arange(len(scheduled)), counts)
        adapters = sorted({s.group.lora_int_id for s in scheduled} - {0})
        slot_of = {0: 0, **{a: i + 1 for i, a in enumerate(adapters)}}
        row_slots = np.asarray([slot_of[s.group.lora_int_id] for s in scheduled], np.int32)
        mapping = lora_mapping(row_slots, token_rows, len(token_rows), len(scheduled), self.config.step_model.max_loras,
                               self.config.step_model.cpu_lora_kernel)
        if mapping is None:
            assert not adapters, "a step with adapters got no LoRA mapping"
            return {id(s): 0 for s in scheduled}
        buckets = lora_buckets(self.config.step_model.max_loras, self.config.step_model.cpu_lora_kernel)
        assert len(mapping.slots) in buckets and len(mapping.slots) >= len(adapters)
        tokens = np.where(mapping.token_indices >= 0, mapping.slots[mapping.token_indices], 0)
        adapter_in = {slot: a for a, slot in slot_of.items()}
        starts = np.cumsum([0, *counts])
        out = {}
        for row, s in enumerate(scheduled):
            mine = {adapter_in[int(t)] for t in tokens[starts[row]:starts[row + 1]]}
            assert len(mine) <= 1, f"row {row}'s tokens under adapters {mine}"
            out[id(s)] = mine.pop() if mine else 0
        return out


def fake_hidden(prefix_hash: int) -> np.ndarray:
    """The fake model's final hidden state at a position: a function of its prefix (as its K/V)."""
    return np.array([prefix_hash % 1009, prefix_hash % 1013], np.float64)


def pooled_output(scheduled, hashes: dict, pooling: str) -> SamplerOutput:
    """A pooling step's rows (jaxpage.worker.pooler's rule) over fake_hidden: the chunk's last position (LAST),
    the sum over the chunk (MEAN) or its first position (CLS)."""
    pooled = np.zeros((len(scheduled), 2))
    for row, s in enumerate(scheduled):
        first, h = s.seq.num_computed_tokens, hashes[s.seq.seq_id]
        chunk = [fake_hidden(h[p]) for p in range(first, first + s.num_new_tokens)]
        pooled[row] = {"LAST": chunk[-1], "MEAN": np.sum(chunk, axis=0), "CLS": chunk[0]}[pooling]
    out = fixed_output(len(scheduled), 0)
    return dataclasses.replace(out, pooled=pooled)


def fake_pooled(prompt: list[int], pooling: str, lora_int_id: int = 0) -> np.ndarray:
    """What a pooling request of ``prompt`` must give: fake_hidden over the whole prompt, pooled."""
    hidden = [fake_hidden(h) for h in prefix_hashes(prompt, lora_int_id)]
    return {"LAST": hidden[-1], "MEAN": np.mean(hidden, axis=0), "CLS": hidden[0]}[pooling]


def fixed_output(rows: int, token: int) -> SamplerOutput:
    top_ids = np.tile(np.arange(token, token + MAX_LOGPROBS), (rows, 1))
    top_logprobs = np.tile(-np.arange(1, MAX_LOGPROBS + 1, dtype=np.float64), (rows, 1))
    return SamplerOutput(np.full(rows, token), np.full(rows, -1.0), top_ids, top_logprobs)


def fake_draw(context: list[int], seed: int, temperature: float) -> tuple[np.ndarray, np.ndarray, int]:
    """The fake runner's draw after ``context``: (top ids, their log-probabilities, the index picked), a function
    of the tokens (of the base model's K/V) and the seed only, so speculation and async scheduling change none."""
    rng = np.random.default_rng([prefix_hashes(context)[-1], seed % 5])
    ids = rng.permutation(VOCAB)[:MAX_LOGPROBS]
    lps = np.sort(rng.uniform(-9.0, -0.05, MAX_LOGPROBS))[::-1]
    return ids, lps, 0 if temperature == 0 else int(rng.integers(0, 3))


class FakeDraftProposer:
    """Speculative decoding over the fake runner: drafts that its greedy draws confirm for a first few tokens
    (how many: a function of the tokens, 0 to num_tokens), then a token they reject; so accepted runs of every
    length, stops inside them and rollbacks all happen (an n-gram proposal over VOCAB random tokens would be
    rejected nearly always)."""

    def propose(self, seq, num_tokens: int) -> list[int]:
        context, draft = list(seq.token_ids), []
        right = prefix_hashes(context)[-1] % (num_tokens + 2)
        for j in range(num_tokens):
            ids, _, _ = fake_draw(context, seq.seed, 0.0)
            token = int(ids[0]) if j < right else int(ids[1])
            draft.append(token)
            context.append(token)
        return draft


def make_engine(*, num_kv_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                mode: str = "recompute", num_host_blocks: int = 0, prefix_caching: bool = True,
                max_model_len: int = MAX_MODEL_LEN, window: int = 0,
                long_prefill_token_threshold: int = EngineArgs.long_prefill_token_threshold,
                max_num_partial_prefills: int = EngineArgs.max_num_partial_prefills,
                max_long_partial_prefills: int = EngineArgs.max_long_partial_prefills,
                wave_prefill: bool = EngineArgs.wave_prefill,
                prefill_into_padding: bool = EngineArgs.prefill_into_padding, async_scheduling: bool = True,
                max_loras: int = 0,
                speculative: int = 0, disable_by_batch_size: int | None = None, num_offload_blocks: int = 0,
                offload_disk: bool | str = False, offload_disk_bytes: int = 1 << 30, vocab_size: int = VOCAB,
                block_size: int = BLOCK_SIZE, max_seqs_per_request: int | None = None,
                fixed_token: int | None = None, step_seconds: float = 0.0, refuse_unfittable: bool = False,
                model_name: str = "", pooling: str | None = None) -> LLMEngine:
    """speculative: draft tokens a step (speculative decoding, FakeDraftProposer's drafts); 0: off.
    num_offload_blocks: the prefix cache's host tier in blocks (0: off); offload_disk: its disk tier, in a
    directory of the engine's own (True, removed with the engine) or the one given (a path). fixed_token,
    step_seconds: FakeRunner's. refuse_unfittable: the engine's own check of groups that can never fit (off: these
    tests drive the scheduler's own safety net for them). pooling: a pooling model's pooling type (runner "pooling",
    not normalized: the fake runner pools ``fake_hidden``); None: it generates."""
    model = config_from_hf(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=max_model_len))
    if window:  # every layer slides (Mistral)
        model = dataclasses.replace(model, sliding_window=window, layer_types=("sliding_attention",))
    config = build_engine_config(model, dtype="float32", block_size=block_size, kv_cache_memory=None,
                                 num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 gpu_memory_utilization=0.9, enable_prefix_caching=prefix_caching,
                                 preemption_mode=mode, long_prefill_token_threshold=long_prefill_token_threshold,
                                 max_num_partial_prefills=max_num_partial_prefills,
                                 max_long_partial_prefills=max_long_partial_prefills,
                                 wave_prefill=wave_prefill, prefill_into_padding=prefill_into_padding,
                                 async_scheduling=async_scheduling,
                                 async_prompt_steps=True, enable_lora=max_loras > 0, max_loras=max(max_loras, 1),
                                 max_seqs_per_request=max_seqs_per_request,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": speculative,
                                                     "disable_by_batch_size": disable_by_batch_size}
                                 if speculative else None, runner="pooling" if pooling else "generate",
                                 pooler_config={"pooling_type": pooling, "normalize": False} if pooling else None)
    own_dir = offload_disk is True and tempfile.mkdtemp(prefix="jaxpage-kv-disk-")
    config = dataclasses.replace(config, cache=dataclasses.replace(  # a swap space and a host tier in blocks
        config.cache, num_host_blocks=num_host_blocks, num_offload_blocks=num_offload_blocks,
        kv_offloading_dir=(own_dir or offload_disk or None) if num_offload_blocks else None,
        kv_offloading_disk_bytes=offload_disk_bytes))
    runner = FakeRunner(config, num_host_blocks, fixed_token, step_seconds)
    engine = LLMEngine(config, runner, eos_token_ids=(EOS,), model_name=model_name)
    if own_dir:
        weakref.finalize(engine, shutil.rmtree, own_dir, True)
    if speculative:
        engine.scheduler.drafts.proposer = FakeDraftProposer()
    runner.block_pool = engine.block_pool
    check_each_schedule(engine.scheduler)
    engine.refuse_unfittable = refuse_unfittable
    return engine


def stand_in_engine(*, num_kv_blocks: int = 257, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                    max_model_len: int = 4096, max_seqs_per_request: int | None = None, step_seconds: float = 0.0,
                    fail_flag: str | None = None) -> LLMEngine:
    """The engine of the server and request tests: every row samples STAND_IN_TOKEN, steps run in order (no
    async scheduling) after ``step_seconds``; an optional flag file makes a step raise, as a device error would:
    once (the file is removed), or on every step while the file says "always"."""
    engine = make_engine(num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         async_scheduling=False, vocab_size=256, block_size=16,
                         max_seqs_per_request=max_seqs_per_request, fixed_token=STAND_IN_TOKEN,
                         step_seconds=step_seconds, refuse_unfittable=True, model_name="stand-in")
    if fail_flag is not None:
        step = engine.step

        def step_that_fails_once_flagged():
            if os.path.exists(fail_flag):
                with open(fail_flag) as f:
                    if f.read().strip() != "always":  # a transient error: the next engine runs
                        os.unlink(fail_flag)
                raise RuntimeError("injected device error")
            return step()

        engine.step = step_that_fails_once_flagged
    return engine


def check_each_schedule(scheduler) -> None:
    """Wraps the scheduler's schedule(): each step's prefill rows keep to the partial-prefill options
    (check_prefill_limits), except in a step that began with fewer decodes than prompts that could compute in it
    (running ones with tokens left, queued ones up to the free rows), with wave_prefill on; then only the token
    budget bounds them (the fake runner checks that)."""
    schedule, cfg = scheduler.schedule, scheduler.config

    def checked():
        left = [len(s.token_ids) - s.num_computed_tokens for g in scheduler.running for s in g.live_seqs]
        free_rows = cfg.scheduler.max_num_seqs - len(left)
        decodes = sum(n == 1 for n in left)
        prompts = sum(n > 1 for n in left) + min(len(scheduler.waiting), free_rows)
        out = schedule()
        if not (cfg.scheduler.wave_prefill and decodes < prompts):
            check_prefill_limits(cfg, out.scheduled)
        return out
    scheduler.schedule = checked


def check_prefill_limits(cfg, scheduled) -> None:
    """The step's prefill rows (more than one token left to compute) keep to the partial-prefill options: each
    at most long_prefill_token_threshold tokens, at most max_num_partial_prefills of them, at most
    max_long_partial_prefills with more than the threshold left. With prefill_into_padding, chunks may pass the
    threshold by the padding rows of the step's token bucket only: the step pads to the bucket it would with
    every chunk at the threshold."""
    threshold = cfg.scheduler.long_prefill_token_threshold
    prefills = [(s.num_new_tokens, s.seq.num_tokens - s.seq.num_computed_tokens) for s in scheduled
                if s.logits_of is None and s.seq.num_tokens - s.seq.num_computed_tokens > 1]
    assert len(prefills) <= cfg.scheduler.max_num_partial_prefills, f"{len(prefills)} prefills in one step: {prefills}"
    if threshold:
        over = sum(max(n - threshold, 0) for n, _ in prefills)
        total = sum(s.num_new_tokens for s in scheduled)
        assert not over or cfg.scheduler.prefill_into_padding, f"a chunk over the threshold {threshold}: {prefills}"
        buckets = cfg.token_buckets()
        assert pick_bucket(buckets, max(total, 1)) == pick_bucket(buckets, max(total - over, 1)), (
            f"chunks past the threshold {threshold} beyond the step's padding: {prefills}, {total} tokens")
        long = sum(left > threshold for _, left in prefills)
        assert long <= cfg.scheduler.max_long_partial_prefills, f"{long} long prefills in one step: {prefills}"


def check_accounting(engine: LLMEngine) -> None:
    sched, pool, kv = engine.scheduler, engine.block_pool, engine.kv
    groups = sched.running + sched.waiting + sched.swapped
    assert len({id(g) for g in groups}) == len(groups), "a group in two queues"
    assert {g.request_id for g in groups} == set(engine.requests), "queues and unfinished requests differ"
    for status, queue in ((SequenceStatus.RUNNING, sched.running), (SequenceStatus.WAITING, sched.waiting),
                          (SequenceStatus.SWAPPED, sched.swapped)):
        for g in queue:
            assert g.status == status, f"{g.request_id} is {g.status} in the {status.value} queue"
            for s in g.seqs + g.finished_seqs:
                if s.is_finished:
                    assert s not in kv.seq_blocks, f"finished seq {s.seq_id} of {g.request_id} still holds blocks"
            if status == SequenceStatus.WAITING:
                assert not any(s in kv.seq_blocks for s in g.live_seqs), f"waiting {g.request_id} holds blocks"
    flight = engine.batch_queue.in_flight  # async scheduling: the step whose sampled tokens are placeholders
    rows = [flight.launched.scheduled[i] for i in flight.rows] if flight is not None else []
    ahead = {id(r.seq) for r in rows if r.samples}
    for g in groups:
        for s in g.seqs:
            assert s.num_placeholders == (id(s) in ahead), f"seq {s.seq_id} counts {s.num_placeholders} placeholders"
    holders = {s for g in sched.running + sched.swapped for s in g.live_seqs}
    assert set(kv.seq_blocks) <= holders, "the KV manager keeps blocks of sequences that ended or wait"
    tables = [kv.block_ids(s) for g in sched.running for s in g.live_seqs]
    pool.check(tables)
    assert pool.num_free + pool.num_used == pool.num_blocks - 1
    assert 0 <= pool.num_cached_free <= pool.num_free
    held = {b for g in sched.swapped for s in g.live_seqs for b in kv.block_ids(s)} - {NULL_HOST}
    free_slots = list(kv.host_free)
    assert len(set(free_slots)) == len(free_slots), f"a host slot free twice: {sorted(free_slots)}"
    assert not held & set(free_slots), f"host slots both free and held: {sorted(held & set(free_slots))}"
    assert all(0 <= b < kv.num_host_blocks for b in held | set(free_slots))
    assert len(free_slots) + len(held) == kv.num_host_blocks, (
        f"{len(free_slots)} free + {len(held)} held host slots != {kv.num_host_blocks}")
    if kv.host_tier is not None:  # the prefix cache's host tier: every slot free or holding one block
        kv.host_tier.check()
        assert len(kv.host_tier) <= kv.host_tier.num_blocks
    store = engine.runner.disk_store
    if store is not None:  # its disk tier: the files are the index's blocks, within the cap, their bytes counted
        store.flush()
        files = list(store.directory.glob("*.kvblock"))
        # files damaged by a scenario ("damage") stay in the index until a read finds them bad; a file the index
        # let go is deleted by the next step's moves
        on_disk = {bytes.fromhex(f.name[:-len(".kvblock")]) for f in files}
        deleting = {src for kind, src, _ in kv.ops.moves if kind == DISK_DELETE}
        assert on_disk - deleting <= set(kv.disk_index), "a file on disk that the index does not know"
        assert len(kv.disk_index) <= kv.disk_index.capacity
        assert store.num_bytes == sum(f.stat().st_size for f in files)


def record_prompt_rows_ahead(engine: LLMEngine) -> list[int]:
    """Records, for each step the engine schedules while the one before runs, how many of its rows compute more
    than one token (a prompt or its chunk); a synchronous engine's scheduler never schedules ahead."""
    prompt_rows = []
    if not engine.async_scheduling:
        return prompt_rows
    schedule_ahead = engine.scheduler.schedule_ahead

    def recording():
        out = schedule_ahead()
        if out is not None:
            prompt_rows.append(sum(s.num_new_tokens > 1 for s in out.scheduled))
        return out
    engine.scheduler.schedule_ahead = recording
    return prompt_rows


def check_all_free(engine: LLMEngine) -> None:
    check_accounting(engine)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_pool.num_free == engine.config.cache.num_kv_blocks - 1, "blocks still in use at the end"
    assert sorted(engine.kv.host_free) == list(range(engine.kv.num_host_blocks)), "host slots still held"
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def _params(draw, max_num_seqs: int) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "sample", "best_of", "beam", "penalized"]))
    max_tokens = draw(st.integers(1, 24))
    ignore_eos = draw(st.booleans())
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if kind == "sample":
        n = draw(st.integers(1, min(4, max_num_seqs)))
        return SamplingParams(n=n, temperature=1.0, seed=draw(st.integers(0, 2**32 - 1)), max_tokens=max_tokens,
                              ignore_eos=ignore_eos, logprobs=draw(st.sampled_from([None, 2])),
                              stop_token_ids=draw(st.sampled_from([[], [3, 5]])))
    if kind == "penalized":  # needs its tokens on the host before the next step: async scheduling waits for them
        return SamplingParams(temperature=1.0, seed=draw(st.integers(0, 2**32 - 1)), max_tokens=max_tokens,
                              ignore_eos=ignore_eos, presence_penalty=0.5, min_tokens=min(2, max_tokens))
    if kind == "best_of":
        best_of = draw(st.integers(2, min(4, max_num_seqs)))
        return SamplingParams(n=draw(st.integers(1, best_of)), best_of=best_of, temperature=0.8,
                              max_tokens=max_tokens, ignore_eos=ignore_eos)
    width = draw(st.integers(1, min(4, max_num_seqs)))
    return SamplingParams(n=draw(st.integers(1, width)), best_of=width, use_beam_search=True, temperature=0.0,
                          max_tokens=max_tokens, ignore_eos=ignore_eos,
                          length_penalty=draw(st.sampled_from([0.0, 1.0, 2.0])))


@st.composite
def scenarios(draw, tiers: bool = False):
    """tiers: the prefix cache's host tier always on (the disk tier half the time), over a small pool."""
    mode = draw(st.sampled_from(["recompute", "swap"]))
    max_num_seqs = draw(st.sampled_from([4, 8]))
    partial = draw(st.sampled_from([1, 2, 4]))
    setup = {
        "mode": mode,
        "num_host_blocks": draw(st.integers(0, 16)) if mode == "swap" else 0,  # small: swap sometimes falls back
        "num_kv_blocks": draw(st.integers(MAX_MODEL_LEN // BLOCK_SIZE + 1, 16 if tiers else 40)),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": draw(st.sampled_from([8, 16, 32, 64])),
        "prefix_caching": tiers or draw(st.booleans()),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 8, 20])),
        "max_num_partial_prefills": partial,
        "max_long_partial_prefills": draw(st.integers(1, partial)),
        "wave_prefill": draw(st.booleans()),
        "prefill_into_padding": draw(st.booleans()),
        "max_loras": draw(st.sampled_from([0, 1, 2])),  # LoRA adapter slots (0: no LoRA)
    }
    if setup["prefix_caching"]:  # the prefix cache's host tier (small: its LRU evicts) and disk tier
        setup["num_offload_blocks"] = draw(st.sampled_from([2, 6, 24] if tiers else [0, 0, 2, 6, 24]))
        setup["offload_disk"] = bool(setup["num_offload_blocks"]) and (tiers or draw(st.booleans()))
        setup["offload_disk_bytes"] = draw(st.sampled_from([1 << 30, 2000]))  # 2000: a few files, trimmed
    loras = [None] + list(range(1, 4)) if setup["max_loras"] else [None]
    # with the tiers: prefixes of 2+ blocks, every prompt on one, so prefixes come back after their eviction
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=BLOCK_SIZE * (1 + tiers), max_size=40),
                             min_size=1, max_size=3))
    actions = []
    for _ in range(draw(st.integers(3, 30))):
        what = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "preempt"] + ["damage"] * tiers))
        if what == "add":
            base = draw(st.sampled_from(prefixes if tiers else [[]] + prefixes))
            suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
            prompt = (base + suffix)[:MAX_MODEL_LEN - 1]
            actions.append(("add", prompt, _params(draw, max_num_seqs), draw(st.sampled_from([-1, 0, 0, 1])),
                            draw(st.sampled_from(loras))))
        elif what == "step":
            actions.append(("step", draw(st.integers(1, 6))))
        else:
            actions.append((what, draw(st.integers(0, 1000))))
    return setup, actions


def step_checked(engine: LLMEngine, finished: dict, params: dict) -> None:
    for out in engine.step():
        assert out.request_id not in finished, f"output for {out.request_id} after it finished"
        p = params[out.request_id]
        if out.finished and isinstance(p, PoolingParams):
            finished[out.request_id] = out
        elif out.finished:
            finished[out.request_id] = out
            assert len(out.outputs) == p.n
            for c in out.outputs:
                # "abort": a group that can never fit in the pool (e.g. samples recomputed without prefix caching)
                assert len(c.token_ids) <= p.max_tokens and c.finish_reason in ("stop", "length", "abort")
        check_accounting(engine)


def play(engine: LLMEngine, actions: list[tuple]) -> dict:
    """Carries out a scenario's actions, checking the accounting after each; then drains the engine (a group
    that still cannot fit after 300 steps is aborted) and checks that every block and host slot is free. Returns
    the final output of each request that finished while stepped (request id -> RequestOutput)."""
    finished: dict = {}
    params: dict[str, SamplingParams] = {}
    check_accounting(engine)
    for i, action in enumerate(actions):
        kind = action[0]
        if kind == "add":
            _, prompt, p, priority, *lora = action
            lora = LoRARequest(f"adapter{lora[0]}", lora[0], "/no/weights") if lora and lora[0] else None
            params[f"r{i}"] = p
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p, priority=priority, lora_request=lora)
        elif kind == "step":
            for _ in range(action[1]):
                step_checked(engine, finished, params)
        elif kind == "abort":  # a request that is unfinished once the step in flight is read
            engine.wait_for_step()
            ids = sorted(engine.requests)
            if ids:
                engine.abort_request(ids[action[1] % len(ids)])
        elif kind == "damage":  # a disk-tier file corrupted or deleted behind the engine's back
            damage_a_disk_file(engine.runner.disk_store, action[1])
        elif kind == "preempt":  # as the scheduler preempts: with no step in flight
            engine.wait_for_step()
            running = engine.scheduler.running
            if running:
                engine.scheduler.preempt(running[action[1] % len(running)])
        check_accounting(engine)
    for _ in range(300):  # drain; whatever is left after that (a group that cannot fit) is aborted
        if not engine.has_unfinished_requests():
            break
        step_checked(engine, finished, params)
    for request_id in sorted(engine.requests):
        engine.abort_request(request_id)
        check_accounting(engine)
    engine.step()  # applies any moves still queued; schedules nothing
    check_all_free(engine)
    return finished


def damage_a_disk_file(store, pick: int) -> None:
    """Corrupts (``pick`` even) or deletes one of the store's files, if it has any; the engine must never serve it."""
    if store is None:
        return
    store.flush()
    files = sorted(store.directory.glob("*.kvblock"))
    if not files:
        return
    path = files[pick % len(files)]
    if pick % 2:
        store.num_bytes -= path.stat().st_size  # the store counts its files' bytes
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def run_checked(engine: LLMEngine, max_steps: int = 500) -> dict:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            check_accounting(engine)
            if out.finished:
                finished[out.request_id] = out
    s = engine.stats()
    pytest.fail(f"no progress after {max_steps} steps: running={s['num_running']} waiting={s['num_waiting']} "
                f"swapped={s['num_swapped']} free blocks={s['num_free_blocks']}/{s['num_blocks']} "
                f"preemptions={s['num_preemptions']}")
