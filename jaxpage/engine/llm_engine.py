"""LLMEngine: requests in, one scheduled and executed step at a time, outputs back."""
from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import numpy as np

from jaxpage.attention.kv_cache import NULL_BLOCK, bytes_per_block
from jaxpage.config import EngineConfig, ModelConfig
from jaxpage.core.block_pool import BlockPool
from jaxpage.core.pooling import PoolingState
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.kv_disk_index import DiskKVIndex
from jaxpage.core.kv_offload import HostKVTier
from jaxpage.core.async_scheduler import AsyncScheduler
from jaxpage.core.scheduler import Scheduler
from jaxpage.core.scheduler_output import ScheduledSeq, SchedulerOutput
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.batch_queue import BatchQueue
from jaxpage.engine.config_builder import (
    draft_engine_config,
    engine_config_from_args,
    resolve_runner,
    speculative_config_of,
)
from jaxpage.engine.output_processor import OutputProcessor
from jaxpage.models import config_from_hf
from jaxpage.models.eagle3 import Eagle3Config, load_head
from jaxpage.models.loader import CLASSIFIER, default_cache_dir, load_model
from jaxpage.outputs import RequestMetrics, RequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus
from jaxpage.structured.manager import StructuredOutputManager
from jaxpage.utils import cdiv
from jaxpage.worker.compile_cache import enable_compilation_cache
from jaxpage.worker.draft_runner import DraftRunner
from jaxpage.worker.eagle3_runner import Eagle3Runner
from jaxpage.worker.kv_disk_store import DiskKVStore
from jaxpage.worker.multihost import runner_class
from jaxpage.worker.runner import Runner

log = logging.getLogger(__name__)

__all__ = ["EngineArgs", "LLMEngine", "DoesNotFitError"]


def _load_draft(args: EngineArgs, cache_dir: Path, target):
    """The draft model (a LoadedModel) when speculative decoding's method is draft_model (else None): loaded
    from ``speculative_config.model``, checked to share the target's tokenizer's vocabulary (when both have one);
    a bad draft is a ValueError naming speculative_config.model. Loaded before the KV pool is sized: its pool
    has the target's block ids, and its bytes and weights count in the budget."""
    spec = speculative_config_of(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    try:
        loaded = load_model(spec.model, cache_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from e
    tokenizers = (target.tokenizer, loaded.tokenizer)
    if None not in tokenizers and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ValueError(f"speculative_config.model={spec.model!r}: its tokenizer is not the target's")
    return loaded


def _disk_index(config: EngineConfig, store: DiskKVStore | None) -> DiskKVIndex | None:
    """The scheduler's index of the disk tier's blocks, from the store's directory (file names only)."""
    if store is None:
        return None
    capacity = config.cache.kv_offloading_disk_bytes // store.file_bytes
    if capacity < 1:
        raise ValueError(f"kv_offloading_disk_size: {config.cache.kv_offloading_disk_bytes} bytes hold no block "
                         f"(a block's file is {store.file_bytes} bytes)")
    return DiskKVIndex(capacity, store.stored())


def _load_head(args: EngineArgs, target) -> tuple[Eagle3Config, dict] | None:
    """The EAGLE-3 head (its config and weights) when speculative decoding's method is eagle3 (else None), read
    from ``speculative_config.model`` for the target (``target``: the LoadedModel); a bad head is a ValueError
    naming speculative_config.model."""
    spec = speculative_config_of(args.speculative_config)
    if spec is None or spec.method != "eagle3":
        return None
    return load_head(spec.model, config_from_hf(target.hf_config), np.asarray(target.params["embed"]["embedding"]))


def _draft_runner(config: EngineConfig, draft_model: ModelConfig, draft, head,
                  eos_token_ids) -> DraftRunner | Eagle3Runner:
    """The draft's runner (``draft``: the LoadedModel, or ``head``: an EAGLE-3 head's config and weights, which
    bans the target's ``eos_token_ids`` as it does; ``draft_model``: its shapes) over its own pool of the target's
    geometry (``draft_engine_config`` checks the draft against the target: vocabulary, positions)."""
    if head is not None:
        return Eagle3Runner(draft_engine_config(config, draft_model), *head, eos_token_ids)
    return DraftRunner(draft_engine_config(config, draft_model), draft.params, draft.eos_token_ids)


# what a pooling request runs with: one token past its prompt (never shown), then it ends
POOLING_SAMPLING = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind="final_only")


class DoesNotFitError(ValueError):
    """The request can never fit in the KV pool (the server answers RESOURCE_EXHAUSTED)."""


class LLMEngine:
    """The engine over a runner (jaxpage.worker.runner.Runner)."""

    def __init__(self, config: EngineConfig, runner: Runner, *, tokenizer=None, eos_token_ids=(), model_name: str = "",
                 drafter: DraftRunner | Eagle3Runner | None = None, classifier=None):
        self.config = config
        # a pooling model's classification head ([num_labels, hidden], numpy; None: it embeds)
        self.classifier = classifier
        self.drafter = drafter  # speculative decoding's draft model or EAGLE-3 head: its runner and pool
        self.max_seqs_per_request = config.scheduler.seqs_per_request
        # Refuse at admission a request whose sequences can never all fit in the pool (its worst case); off only
        # in tests of the scheduler's own safety net for such groups (they end with finish_reason 'abort')
        self.refuse_unfittable = True
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name
        self.block_pool = BlockPool(config.cache.num_kv_blocks, config.cache.enable_prefix_caching)
        window = config.model.sliding_window if config.model.every_layer_windowed else 0
        host_tier = HostKVTier(config.cache.num_offload_blocks) if config.cache.num_offload_blocks else None
        self.kv = KVCacheManager(self.block_pool, config.cache.block_size, config.cache.num_host_blocks, window,
                                 host_tier,
                                 _disk_index(config, runner.disk_store))
        self._seq_ids = itertools.count()
        # Async scheduling, where the runner can leave a step running (launch/fetch; not across several hosts)
        self.async_scheduling = config.scheduler.async_scheduling and runner.supports_async_scheduling
        scheduler = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler(config, self.kv, self.eos_token_ids, next_seq_id=self._seq_ids.__next__)
        self.batch_queue = BatchQueue(self)
        self.output_processor = OutputProcessor(tokenizer, self._end)
        self.requests = self.output_processor.requests  # request id -> RequestState, while unfinished
        self.finished_metrics = self.output_processor.finished_metrics
        self._arrivals = itertools.count()
        self.peak_kv = {"blocks_used": 0, "kv_tokens_stored": 0, "kv_slots_allocated": 0}
        self.load_seconds = self.warmup_seconds = 0.0
        self.structured: StructuredOutputManager | None = None  # made with the first constrained request

    @classmethod
    def from_args(cls, args: EngineArgs, data_parallel_rank: int | None = None) -> "LLMEngine":
        """Loads the model, sizes the pool, compiles every bucket: the engine ready to serve. data_parallel_rank:
        which replica of ``args.data_parallel_size`` this is (jaxpage.engine.data_parallel); None: the only engine."""
        if data_parallel_rank is None and args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size!r}: one engine (LLM, `jaxpage generate`) "
                             "is one replica; replicas are served by `jaxpage serve` (jaxpage.engine.data_parallel)")
        cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        enable_compilation_cache(cache_dir)
        started = time.perf_counter()
        loaded = load_model(args.model, cache_dir, args.quantization)
        load_seconds = time.perf_counter() - started
        args = resolve_runner(args, list(getattr(loaded.hf_config, "architectures", None) or []),
                              loaded.pooler_defaults)
        draft, head = _load_draft(args, cache_dir, loaded), _load_head(args, loaded)
        draft_model = config_from_hf(draft.hf_config) if draft is not None else head[0].model if head else None
        config = engine_config_from_args(args, config_from_hf(loaded.hf_config), data_parallel_rank or 0, draft_model,
                                         head[0].aux_layer_ids if head else ())
        params = dict(loaded.params)
        classifier = params.pop(CLASSIFIER, None)  # a classification head: the pooler's, on the host
        runner = runner_class()(config, params, loaded.eos_token_ids)  # process 0 of several: broadcasts
        drafter = (_draft_runner(config, draft_model, draft, head, loaded.eos_token_ids)
                   if draft_model is not None else None)
        engine = cls(config, runner, tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                     model_name=loaded.name, drafter=drafter,
                     classifier=None if classifier is None else classifier["weight"])
        started = time.perf_counter()
        runner.warm_up(progress=args.progress)
        if drafter is not None:
            drafter.warm_up(progress=args.progress)
        engine.load_seconds, engine.warmup_seconds = load_seconds, time.perf_counter() - started
        return engine

    # --- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams | PoolingParams,
                    priority: int = 0, lora_request=None) -> None:
        """params: SamplingParams on a generating model, PoolingParams on a pooling one (runner "pooling").
        lora_request: a jaxpage.lora.request.LoRARequest (the engine started with enable_lora), its adapter read
        and checked here; None: the base model."""
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        params, pooling = self._pooling(params)
        text, token_ids = self._prompt_tokens(prompt)
        max_len = self.config.scheduler.max_model_len
        self._check_width(params)
        self._check_logit_bias(params)
        if params.max_tokens is not None:
            max_len = min(max_len, len(token_ids) + params.max_tokens)
        self._check_fits(len(token_ids), params.best_of, max_len)
        lora_model = self.runner.load_lora(lora_request) if lora_request is not None else None
        if params.structured_outputs is not None and self.structured is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a model with a tokenizer")
            self.structured = StructuredOutputManager(self.tokenizer, self.config.model.vocab_size,
                                                      sorted(self.eos_token_ids))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        seq = Sequence(seq_id=next(self._seq_ids), token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                       max_len=max_len, seed=seed, lora_int_id=lora_request.lora_int_id if lora_request else 0)
        group = SequenceGroup(request_id, [seq], params, arrival=next(self._arrivals), priority=priority,
                              lora_request=lora_request, lora_model=lora_model, pooling=pooling)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first prompt token's: nothing precedes it
        self.output_processor.add_request(group, text, list(token_ids), RequestMetrics(time.monotonic()))
        self.scheduler.add(group)

    def _pooling(self, params: SamplingParams | PoolingParams) -> tuple[SamplingParams, PoolingState | None]:
        """The request's SamplingParams and, on a pooling model, its pooled vector's state: a pooling request
        runs as a prompt whose one greedy token (the step's zeros) ends it, its blocks freed."""
        pooler = self.config.pooler_config
        if pooler is None:
            if isinstance(params, PoolingParams):
                raise ValueError("PoolingParams: this model generates (runner 'generate'); start it with "
                                 "runner='pooling' to embed")
            return params, None
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this is a pooling model (runner 'pooling'): give PoolingParams, not "
                             f"{type(params).__name__} (LLM.embed, /v1/embeddings)")
        hidden = self.config.model.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise ValueError(f"PoolingParams.dimensions={params.dimensions} exceeds the model's hidden size "
                             f"{hidden}")
        classifies = self.classifier is not None
        if classifies and params.task == "embed":
            raise ValueError("PoolingParams.task='embed': this model classifies (a classification head); give task "
                             "'classify', 'score' or 'encode'")
        if not classifies and params.task in ("classify", "score"):
            raise ValueError(f"PoolingParams.task={params.task!r}: this model has no classification head; give "
                             "task 'embed' or 'encode'")
        return POOLING_SAMPLING, PoolingState(pooler, params, self.classifier)

    def _check_length(self, num_tokens: int) -> None:
        max_len = self.config.scheduler.max_model_len
        if num_tokens >= max_len:
            raise ValueError(f"prompt has {num_tokens} tokens; it must be shorter than "
                             f"max_model_len={max_len} to leave room for one generated token")

    def _check_width(self, params: SamplingParams) -> None:
        """One request may hold at most max_seqs_per_request sequences, so it cannot take every batch slot."""
        cap = self.max_seqs_per_request
        if params.best_of > cap:
            field = "best_of" if params.best_of != params.n else "n"
            limit = (f"max_seqs_per_request={cap}" if cap < self.config.scheduler.max_num_seqs
                     else f"max_num_seqs={self.config.scheduler.max_num_seqs}")
            raise ValueError(f"SamplingParams.{field}={params.best_of} exceeds {limit} "
                             "(the sequences one request may hold at once)")

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.config.model.vocab_size
        outside = sorted(t for t in params.logit_bias if t >= vocab)
        if outside:
            raise ValueError(f"SamplingParams.logit_bias: token ids {outside[:5]} are not in the vocabulary "
                             f"[0, {vocab})")

    def _check_fits(self, num_prompt_tokens: int, width: int, max_len: int) -> None:
        """Refuses a request that can never fit in the pool: the prompt's full blocks, shared by its width
        sequences, plus each sequence's own blocks up to max_len (its worst case, every sequence at full length)."""
        cache = self.config.cache
        bs, pool = cache.block_size, cache.num_kv_blocks - 1  # the null block is never handed out
        shared = num_prompt_tokens // bs
        needed = shared + width * (cdiv(max_len, bs) - shared)
        if self.refuse_unfittable and needed > pool:
            raise DoesNotFitError(
                f"the request needs up to {needed} KV blocks ({num_prompt_tokens} prompt tokens, {width} "
                f"sequence(s) of up to {max_len} tokens, {bs} tokens a block); the pool has {pool}: "
                "shorten the prompt or lower max_tokens or n")

    def check_token_ids(self, ids: list) -> None:
        """ValueError unless every id is an integer in the model's vocabulary."""
        vocab = self.config.model.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")

    def _prompt_tokens(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenize(prompt)
            self._check_length(len(ids))
            return prompt, ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:  # with "prompt": its text, tokenized already
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError("prompt_token_ids is empty")
            self._check_length(len(ids))  # before the per-token check: this runs on the engine thread
            self.check_token_ids(ids)
            return prompt.get("prompt"), ids
        raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def add_lora(self, lora_request) -> None:
        """Reads and checks a LoRARequest's adapter onto the host (vLLM's add_lora), as a request's would be: a
        ValueError naming the file and field for a missing or malformed adapter."""
        self.runner.load_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter on the host and in its slot (vLLM's remove_lora), unless an unfinished request runs
        with it: then it stays until they finish (the host LRU drops it in time) and this returns False."""
        if any(r.group.lora_int_id == lora_int_id for r in self.requests.values()):
            return False
        self.runner.remove_lora(lora_int_id)
        return True

    def abort_request(self, request_id: str) -> None:
        """Ends the request now and returns its blocks to the pool."""
        self.batch_queue.drop(request_id)
        request = self.output_processor.abort(request_id)
        if request is not None:
            self._end(request.group, None, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.batch_queue.ready) or self.scheduler.has_unfinished()

    # --- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one iteration; returns an output for every request that got a token. With async
        scheduling, jaxpage.engine.batch_queue's step (the device runs a step while the next is scheduled)."""
        if self.async_scheduling:
            return self.batch_queue.step()
        scheduled, outputs = self.schedule()
        if not scheduled:
            return outputs
        failed: dict[str, Exception] = {}  # request id -> what went wrong in its per-request work
        scheduled, bitmask = self.prepare(scheduled, failed)
        sampled = self.runner.execute(scheduled) if bitmask is None else self.runner.execute(scheduled, bitmask)
        if sampled.hidden_states is not None:  # an EAGLE-3 head's input
            self.drafter.take_hidden_states(scheduled, sampled)
        return outputs + self.update(scheduled, sampled, failed)

    def schedule(self) -> tuple[list[ScheduledSeq], list[RequestOutput]]:
        """The scheduler's next step, its block moves applied (``apply``), and the outputs of the requests that
        can never fit (ended with finish_reason 'abort')."""
        scheduled = self.apply(self.scheduler.schedule())
        return scheduled, [self._fail(group) for group in self.scheduler.take_failed()]

    def apply(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """A scheduled step's block moves carried out (the draft model's pool too); returns its rows, less those
        of requests sent back to compute a prefix the disk tier failed to load (Scheduler.recompute_failed_loads;
        the rows themselves when every load succeeded)."""
        failed_loads = self.runner.apply(out.ops)
        if self.drafter is not None:
            self.drafter.apply(out.ops)
        if not failed_loads:
            return out.scheduled
        self.scheduler.recompute_failed_loads(failed_loads)
        return [s for s in out.scheduled if s.group.status == SequenceStatus.RUNNING]

    def prepare(self, scheduled: list[ScheduledSeq], failed: dict[str, Exception]):
        """The per-request work before a step runs: (the rows, with the draft model's drafts where it makes them;
        the structured outputs' bitmask, None where no row is constrained); a request whose work fails goes into
        ``failed``."""
        if self.drafter is not None:  # speculative decoding's draft model fills in the pending drafts
            scheduled = self.drafter.propose(scheduled)
        return scheduled, self.structured.bitmask(scheduled, failed) if self.structured is not None else None

    def update(self, scheduled, sampled, failed: dict[str, Exception]) -> list[RequestOutput]:
        """A step's sampled tokens taken by the scheduler, then the outputs of the requests that got one."""
        now = time.monotonic()
        got_token = self.scheduler.update_from_output(scheduled, sampled, failed)
        outputs = self.output_processor.process_outputs(got_token, failed, now)
        self._track_peak_kv()
        return outputs

    def wait_for_step(self) -> None:
        """Waits for the step in flight or unread, if any (async scheduling), and takes its tokens: the queues are
        then as after a synchronous step. Its outputs come with the next ``step()``."""
        self.batch_queue.wait()

    def close(self) -> None:
        """A graceful end: with the disk tier, every cached block it lacks (on the device or in the host tier)
        written to it, so that a restarted engine finds this one's prefix cache, then its writer flushed and
        stopped; the engine takes no more steps. (Without it, the writer's queue is still flushed when the
        interpreter exits.)"""
        if self.runner.disk_store is None:
            return
        self.batch_queue.wait()
        failed = self.runner.apply(self.kv.flush_to_disk())
        assert not failed, "a flush to disk restores nothing"
        if self.runner.tiers is not None:
            self.runner.tiers.finish()  # the host-side work of the moves: the blocks handed to the disk's writer
        self.runner.disk_store.close()

    def _end(self, group: SequenceGroup, seq: Sequence | None, reason: FinishReason) -> None:
        """Ends a sequence (``seq``) or a whole request (None) outside the scheduler's own update (its stop
        tokens, lengths and beams): an abort, a stop string, a request done or failed. Its blocks go back now."""
        if seq is None:
            self.scheduler.finish_group(group, reason)
        else:
            self.scheduler.finish_seq(group, seq, reason)

    def _fail(self, group: SequenceGroup) -> RequestOutput:
        """A request that cannot fit in the pool even alone: it ends with finish_reason 'abort'."""
        log.warning("request %s needs more KV blocks than the pool has; aborted", group.request_id)
        return self.output_processor.output(self.output_processor.abort(group.request_id), finished=True)

    # --- stats ----------------------------------------------------------------------------------------
    def _kv_occupancy(self) -> tuple[int, int]:
        """(tokens stored that a query can still see, slots allocated) over the blocks that sequences hold, each
        block counted once."""
        bs, visible = self.config.cache.block_size, self.kv.visible_tokens
        if not self.block_pool.num_shared:  # every block has one holder: no block can be counted twice
            stored = sum(hi - lo for lo, hi in (visible(s) for g in self.scheduler.running for s in g.seqs
                                                if s.finish_reason is None))  # the live sequences
            return stored, self.block_pool.num_used * bs
        filled: dict[int, int] = {}
        for group in self.scheduler.running:
            for seq in group.live_seqs:
                lo, hi = visible(seq)
                for i, block in enumerate(self.kv.block_ids(seq)):
                    n = max(0, min(hi, (i + 1) * bs) - max(lo, i * bs))
                    filled[block] = max(filled.get(block, 0), n)
        filled.pop(NULL_BLOCK, None)
        return sum(filled.values()), self.block_pool.num_used * bs

    def _track_peak_kv(self) -> None:
        used = self.block_pool.num_used
        if used > self.peak_kv["blocks_used"]:
            stored, allocated = self._kv_occupancy()
            self.peak_kv = {"blocks_used": used, "kv_tokens_stored": stored, "kv_slots_allocated": allocated}

    def stats(self) -> dict:
        stored, allocated = self._kv_occupancy()
        peak = self.peak_kv
        requests = list(self.finished_metrics)
        spec = self.scheduler.spec_stats.as_stats() if self.scheduler.spec_stats is not None else {}
        return {
            "num_blocks": self.config.cache.num_kv_blocks - 1,  # the null block is never handed out
            "num_free_blocks": self.block_pool.num_free,
            "num_cached_free_blocks": self.block_pool.num_cached_free,
            "num_running": self.scheduler.num_running_seqs(),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "kv_tokens_stored": stored,
            "kv_slots_allocated": allocated,
            "kv_waste": 1 - stored / allocated if allocated else 0.0,
            "peak_blocks_used": self.block_pool.peak_used,
            "kv_waste_at_peak": (1 - peak["kv_tokens_stored"] / peak["kv_slots_allocated"]
                                 if peak["kv_slots_allocated"] else 0.0),
            "requests": [{"ttft": m.ttft, "time_per_output_token": m.time_per_output_token,
                          "e2e_latency": m.e2e_latency, "num_output_tokens": m.num_output_tokens}
                         for m in requests],
            **spec,  # speculative decoding's acceptance counters (jaxpage/spec_decode/metrics.py), when it is on
            **self._offload_stats(),
        }

    def _offload_stats(self) -> dict:
        """The prefix cache's host and disk tiers, when on: hits in blocks and bytes per tier, offloads and
        restores (blocks, and the host's seconds spent on them), and vLLM's external_prefix_cache_* in tokens."""
        kv, tiers = self.kv, self.runner.tiers
        if kv.host_tier is None:
            return {}
        c, disk = kv.offload, self.runner.disk_store
        per_block = bytes_per_block(self.config.model, self.config.cache.block_size, self.config.kv_dtype)
        return {
            "external_prefix_cache_queries": kv.prefix_cache_queries,
            "external_prefix_cache_hits": c.hit_tokens,
            "kv_offload_host_blocks": len(kv.host_tier),
            "kv_offload_host_capacity_blocks": kv.host_tier.num_blocks,
            "kv_offload_host_hits": c.host_hits,
            "kv_offload_host_hit_bytes": c.host_hits * per_block,
            "kv_offload_disk_hits": c.disk_hits,
            "kv_offload_disk_hit_bytes": c.disk_hits * per_block,
            "kv_offload_stores": c.stores,
            "kv_offload_store_bytes": c.stores * per_block,
            "kv_offload_restores": c.host_hits + c.disk_hits,
            "kv_offload_disk_writes": c.disk_writes,
            "kv_offload_dropped": c.dropped,
            "kv_offload_disk_failed": c.disk_failed,
            "kv_offload_disk_rejected": disk.rejected if disk is not None else 0,
            "kv_offload_disk_bytes": disk.num_bytes if disk is not None else 0,
            "kv_offload_store_seconds": tiers.store_seconds if tiers is not None else 0.0,
            "kv_offload_restore_seconds": tiers.restore_seconds if tiers is not None else 0.0,
            "kv_offload_disk_read_seconds": disk.read_seconds if disk is not None else 0.0,
            "kv_offload_disk_write_seconds": disk.write_seconds if disk is not None else 0.0,
        }
