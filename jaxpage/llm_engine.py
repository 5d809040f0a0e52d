"""LLMEngine: requests in, one scheduled and executed step at a time, outputs back."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

import numpy as np

from jaxpage.beam_search import beam_search_step, final_beams
from jaxpage.block_pool import BlockPool
from jaxpage.compile_cache import enable_compilation_cache
from jaxpage.config import EngineConfig, build_engine_config
from jaxpage.models import config_from_hf
from jaxpage.detokenizer import IncrementalDetokenizer
from jaxpage.kv_cache import bytes_per_block
from jaxpage.kv_cache_manager import KVCacheManager
from jaxpage.model_loader import default_cache_dir, load_model
from jaxpage.model_runner import ModelRunner
from jaxpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpage.sampling_params import SamplingParams
from jaxpage.scheduler import Scheduler
from jaxpage.sequence import Sequence, SequenceGroup, SequenceStatus
from jaxpage.structured_matcher import StructuredOutputManager

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineArgs:
    """The engine's options, as `LLM(...)`, the CLI and the server take them."""

    model: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "xla" | "pallas_gpu" | "pallas_tpu"
    quantization: str | None = None  # None | "int8": int8 weights per output channel (jaxpage.models.quant)
    scan_layers: bool = True  # False unrolls the layers: ~4x the compile time, faster CPU steps (model.unstack_layers)
    preemption_mode: str = "recompute"
    swap_space: int = 256 << 20  # bytes of host memory for swapped-out blocks
    max_seqs_per_request: int | None = None  # bound on n / best_of of one request (None: max_num_seqs)
    cache_dir: str | None = None
    progress: bool = True


@dataclasses.dataclass
class Request:
    group: SequenceGroup
    prompt: str | None
    detokenizers: dict[int, IncrementalDetokenizer]  # by seq_id
    metrics: RequestMetrics
    prompt_token_ids: list[int]  # every output's prompt_token_ids (one list, made once, as in vLLM)
    plain: bool = False  # one sequence, no beams, no top log-probabilities: the step's lean common case
    stop_reasons: dict[int, str | int] = dataclasses.field(default_factory=dict)
    sent: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # delta mode: [tokens, chars] sent
    detok: IncrementalDetokenizer | None = None  # the lean case's one detokenizer, once made


class DoesNotFitError(ValueError):
    """The request can never fit in the KV pool (the server answers RESOURCE_EXHAUSTED)."""


def _contained(failed: dict[str, Exception], request_id: str, fn, *args):
    """fn(*args), or None with the error recorded against the request."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one request's failure must not stop the engine
        failed.setdefault(request_id, e)
        return None


class LLMEngine:
    """The engine over any runner with ``warm_up``, ``apply(DeviceOps)`` and ``execute(scheduled)``."""

    def __init__(self, config: EngineConfig, runner, *, tokenizer=None, eos_token_ids=(), model_name: str = "",
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute", num_host_blocks: int = 0,
                 max_seqs_per_request: int | None = None):
        self.config = config
        self.max_seqs_per_request = min(max_seqs_per_request or config.max_num_seqs, config.max_num_seqs)
        if self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request={max_seqs_per_request} must be >= 1")
        # Refuse at admission a request whose sequences can never all fit in the pool (its worst case); off only
        # in tests of the scheduler's own safety net for such groups (they end with finish_reason 'abort')
        self.refuse_unfittable = True
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name
        self.block_pool = BlockPool(config.num_kv_blocks, enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, config.block_size, num_host_blocks)
        self.scheduler = Scheduler(config, self.kv, preemption_mode)
        self.scheduler.max_wide_seqs = self.max_seqs_per_request
        self._seq_ids = itertools.count()
        self.scheduler._next_seq_id = lambda: next(self._seq_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.finished_metrics: collections.deque[RequestMetrics] = collections.deque(maxlen=1000)
        self.peak_kv = {"blocks_used": 0, "kv_tokens_stored": 0, "kv_slots_allocated": 0}
        self.load_seconds = self.warmup_seconds = 0.0
        self.structured: StructuredOutputManager | None = None  # made with the first constrained request

    @classmethod
    def from_args(cls, args: EngineArgs) -> "LLMEngine":
        """Loads the model, sizes the pool, compiles every bucket: the engine ready to serve."""
        cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        enable_compilation_cache(cache_dir)
        started = time.perf_counter()
        loaded = load_model(args.model, cache_dir, args.quantization)
        load_seconds = time.perf_counter() - started
        config = build_engine_config(
            config_from_hf(loaded.hf_config), dtype=args.dtype, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
            attention_backend=args.attention_backend, scan_layers=args.scan_layers, quantization=args.quantization)
        per_block = bytes_per_block(config.model, config.block_size, config.dtype)
        num_host_blocks = args.swap_space // per_block if args.preemption_mode == "swap" else 0
        runner = ModelRunner(config, loaded.params, num_host_blocks)
        runner.eos_token_ids = tuple(sorted(loaded.eos_token_ids))
        engine = cls(config, runner, tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                     model_name=loaded.name, enable_prefix_caching=args.enable_prefix_caching,
                     preemption_mode=args.preemption_mode, num_host_blocks=num_host_blocks,
                     max_seqs_per_request=args.max_seqs_per_request)
        started = time.perf_counter()
        runner.warm_up(progress=args.progress)
        engine.load_seconds, engine.warmup_seconds = load_seconds, time.perf_counter() - started
        return engine

    # --- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams, priority: int = 0) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, token_ids = self._prompt_tokens(prompt)
        max_len = self.config.max_model_len
        self._check_width(params)
        if params.max_tokens is not None:
            max_len = min(max_len, len(token_ids) + params.max_tokens)
        self._check_fits(len(token_ids), params.best_of, max_len)
        if params.structured_outputs is not None and self.structured is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a model with a tokenizer")
            self.structured = StructuredOutputManager(self.tokenizer, self.config.model.vocab_size,
                                                      sorted(self.eos_token_ids))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        seq = Sequence(seq_id=next(self._seq_ids), token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                       max_len=max_len, seed=seed)
        group = SequenceGroup(request_id, [seq], params, arrival=next(self._arrivals), priority=priority)
        plain = params.best_of == 1 and not params.use_beam_search and params.logprobs is None
        self.requests[request_id] = Request(group, text, {}, RequestMetrics(time.monotonic()), list(token_ids), plain)
        self.scheduler.add(group)

    def _check_length(self, num_tokens: int) -> None:
        max_len = self.config.max_model_len
        if num_tokens >= max_len:
            raise ValueError(f"prompt has {num_tokens} tokens; it must be shorter than "
                             f"max_model_len={max_len} to leave room for one generated token")

    def _check_width(self, params: SamplingParams) -> None:
        """One request may hold at most max_seqs_per_request sequences, so it cannot take every batch slot."""
        cap = self.max_seqs_per_request
        if params.best_of > cap:
            field = "best_of" if params.best_of != params.n else "n"
            limit = (f"max_seqs_per_request={cap}" if cap < self.config.max_num_seqs
                     else f"max_num_seqs={self.config.max_num_seqs}")
            raise ValueError(f"SamplingParams.{field}={params.best_of} exceeds {limit} "
                             "(the sequences one request may hold at once)")

    def _check_fits(self, num_prompt_tokens: int, width: int, max_len: int) -> None:
        """Refuses a request that can never fit in the pool: the prompt's full blocks, shared by its width
        sequences, plus each sequence's own blocks up to max_len (its worst case, every sequence at full length)."""
        bs, pool = self.config.block_size, self.config.num_kv_blocks - 1  # the null block is never handed out
        shared = num_prompt_tokens // bs
        needed = shared + width * (-(-max_len // bs) - shared)
        if self.refuse_unfittable and needed > pool:
            raise DoesNotFitError(
                f"the request needs up to {needed} KV blocks ({num_prompt_tokens} prompt tokens, {width} "
                f"sequence(s) of up to {max_len} tokens, {bs} tokens a block); the pool has {pool}: "
                "shorten the prompt or lower max_tokens or n")

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
            vocab = self.config.model.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
            return prompt.get("prompt"), ids
        raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        """Ends the request now and returns its blocks to the pool."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish_group(request.group, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one iteration; returns an output for every request that got a token."""
        out = self.scheduler.schedule()
        self.runner.apply(out.ops)
        outputs = [self._fail(group) for group in self.scheduler.take_failed()]
        if not out.scheduled:
            return outputs
        failed: dict[str, Exception] = {}  # request id -> what went wrong in its per-request work
        bitmask = self.structured.bitmask(out.scheduled, failed) if self.structured is not None else None
        sampled = (self.runner.execute(out.scheduled) if bitmask is None
                   else self.runner.execute(out.scheduled, bitmask))
        now = time.monotonic()
        tokens, logprobs = np.asarray(sampled.tokens).tolist(), np.asarray(sampled.logprobs).tolist()
        bs, requests, finished, eos = self.config.block_size, self.requests, SequenceStatus.FINISHED, self.eos_token_ids
        touched: dict[str, Request] = {}
        deferred: list[int] = []  # places in outputs held by requests whose output waits for the whole step
        beams = False
        for row, s in enumerate(out.scheduled):
            try:
                seq, group = s.seq, s.group
                if s.logits_of is None:
                    seq.num_computed_tokens += s.num_new_tokens
                else:  # a fork holds exactly the prompt its parent's row computed (the parent may be gone already)
                    seq.num_computed_tokens = seq.num_tokens
                if len(seq.block_hashes) < seq.num_computed_tokens // bs:  # a block was filled: cache it
                    self.kv.cache_full_blocks(seq)
                if not s.samples or group.status is finished:
                    continue
                request_id, p = group.request_id, group.params
                request = requests[request_id]
                if request.plain:  # its only sequence: no other row and no beam step changes its output
                    # _append_token, inlined: this runs for every sequence at every step
                    token, token_ids, seq_id = tokens[row], seq.token_ids, seq.seq_id
                    token_ids.append(token)
                    seq.cumulative_logprob += logprobs[row]
                    detok = request.detok
                    if detok is None:
                        detok = request.detok = request.detokenizers.get(seq_id)
                        if detok is None:
                            detok = request.detok = request.detokenizers[seq_id] = IncrementalDetokenizer(
                                self.tokenizer, token_ids[:seq.num_prompt_tokens], p.skip_special_tokens, p.stop)
                    detok.add(token)
                    if (p.stop or p.stop_token_ids or len(token_ids) >= seq.max_len
                            or (token in eos and not p.ignore_eos)):  # else it cannot have finished
                        reason = self._finish_reason(request, seq, token, detok)
                        if reason is not None:
                            self.scheduler.finish_seq(group, seq, reason)
                    if request.metrics.first_token_time is None:
                        request.metrics.first_token_time = now
                    if seq.finish_reason is not None:  # done: finished once the step is through
                        deferred.append(len(outputs))
                        outputs.append(request)
                        continue
                    kind = p.output_kind
                    if kind == "final_only":
                        continue
                    # as _output(request, False), made now: _completion(request, seq, 0, False), inlined
                    text = detok.output_text(False)
                    if kind == "delta":  # what is new since the last output
                        sent = request.sent.get(seq_id)
                        if sent is None:  # [tokens, chars] sent, updated in place (_completion reads it as a pair)
                            sent = request.sent[seq_id] = [0, 0]
                        tokens_from, text_from = sent
                        new_ids = token_ids[seq.num_prompt_tokens + tokens_from:]
                        sent[0], sent[1] = tokens_from + len(new_ids), len(text)
                        if text_from:
                            text = text[text_from:]
                    else:
                        new_ids = token_ids[seq.num_prompt_tokens:]
                    outputs.append(RequestOutput(request_id, request.prompt, request.prompt_token_ids, [
                        CompletionOutput(0, text, new_ids, seq.cumulative_logprob, None, None,
                                         request.stop_reasons.get(seq_id))], False, request.metrics))
                    continue
                if p.use_beam_search:
                    seq.pending_top = (sampled.top_ids[row], sampled.top_logprobs[row])
                    beams = True
                else:  # the top log-probabilities are read only when the request asked for them
                    top = (sampled.top_ids[row], sampled.top_logprobs[row]) if p.logprobs is not None else None
                    self._append_token(request, seq, tokens[row], logprobs[row], top)
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                if request_id in touched:
                    continue
                touched[request_id] = request  # outputs come in the order of the requests' first rows
                deferred.append(len(outputs))  # made once every row and beam step is in
                outputs.append(request)
            except Exception as e:  # noqa: BLE001 - a failure in one request's host work ends that request alone
                failed.setdefault(s.group.request_id, e)
        if beams:
            for request in touched.values():
                if request.group.params.use_beam_search and request.group.request_id not in failed:
                    _contained(failed, request.group.request_id, self._advance_beams, request)
        self._track_peak_kv()
        for i in deferred:
            request_id = outputs[i].group.request_id
            outputs[i] = (None if request_id in failed else
                          _contained(failed, request_id, self._finish_if_done, outputs[i], now))
        if failed:
            outputs = [o for o in outputs if o is not None and o.request_id not in failed]
            return outputs + [self._error(request_id, e, touched.get(request_id)) for request_id, e in failed.items()]
        return [o for o in outputs if o is not None] if deferred else outputs

    def _error(self, request_id: str, error: Exception, request: Request | None) -> RequestOutput:
        """Ends a request whose host-side work raised (a bug or an input validation missed): it alone fails."""
        log.error("request %s failed on the engine thread; it is ended, the others go on", request_id,
                  exc_info=error)
        request = self.requests.pop(request_id, None) or request  # it may have been forgotten as it finished
        message = f"the request failed on the engine: {type(error).__name__}: {error}"
        if request is None:
            return RequestOutput(request_id, None, [], [], True, None, error=message)
        group = request.group
        self.scheduler.finish_group(group, "error")
        completions = [CompletionOutput(i, "", [], finish_reason="error") for i in range(group.params.n)]
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, completions, True,
                             request.metrics, error=message)

    def _fail(self, group: SequenceGroup) -> RequestOutput:
        """A request that cannot fit in the pool even alone: it ends with finish_reason 'abort'."""
        log.warning("request %s needs more KV blocks than the pool has; aborted", group.request_id)
        request = self.requests.pop(group.request_id)
        return self._output(request, finished=True)

    def _append_token(self, request: Request, seq: Sequence, token: int, logprob: float, top) -> None:
        p = request.group.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if p.logprobs is not None:
            ids, lps = top
            entry = {int(i): float(v) for i, v in zip(ids[:p.logprobs], lps[:p.logprobs])}
            entry[token] = logprob
            seq.output_logprobs.append(entry)
        detok = request.detokenizers.get(seq.seq_id)
        if detok is None:
            detok = request.detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], p.skip_special_tokens, p.stop)
        detok.add(token)
        if (p.stop or p.stop_token_ids or len(seq.token_ids) >= seq.max_len
                or (token in self.eos_token_ids and not p.ignore_eos)):  # else it cannot have finished
            reason = self._finish_reason(request, seq, token, detok)
            if reason is not None:
                self.scheduler.finish_seq(request.group, seq, reason)

    def _finish_reason(self, request: Request, seq: Sequence, token: int, detok) -> str | None:
        p = request.group.params
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                request.stop_reasons[seq.seq_id] = token
                return "stop"
            if token in self.eos_token_ids and not p.ignore_eos:
                return "stop"
            stop = detok.find_stop(p.stop, p.include_stop_str_in_output) if p.stop else None
            if stop is not None:
                request.stop_reasons[seq.seq_id] = stop
                return "stop"
        if num_tokens >= seq.max_len:
            return "length"
        return None

    def _advance_beams(self, request: Request) -> None:
        group = request.group
        live = group.live_seqs
        if not live or any(getattr(s, "pending_top", None) is None for s in live):
            return  # some beam is still recomputing after a preemption
        beam_search_step(group, self.eos_token_ids, self.scheduler, lambda: next(self._seq_ids))

    def _finish_if_done(self, request: Request, now: float) -> RequestOutput | None:
        group = request.group
        done = not group.live_seqs
        if done:
            request.metrics.finished_time = now
            request.metrics.num_output_tokens = max(s.num_output_tokens for s in group.seqs + group.finished_seqs)
            self.finished_metrics.append(request.metrics)
            self.scheduler.finish_group(group, "stop")
            del self.requests[group.request_id]
        if not done and group.params.output_kind == "final_only":
            return None
        return self._output(request, done)

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        group, p = request.group, request.group.params
        if p.use_beam_search:
            seqs = (final_beams(group) or group.seqs[:p.n]) if finished else group.live_seqs  # or aborted
        elif finished and p.best_of > p.n:
            seqs = sorted(group.seqs, key=lambda s: -s.cumulative_logprob)[:p.n]
        else:
            seqs = group.seqs[:p.n] if finished else group.seqs
        completions = ([self._completion(request, seqs[0], 0, finished)] if len(seqs) == 1 else
                       [self._completion(request, seq, index, finished) for index, seq in enumerate(seqs)])
        return RequestOutput(group.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             request.metrics)

    def _completion(self, request: Request, seq: Sequence, index: int, finished: bool) -> CompletionOutput:
        p, seq_id = request.group.params, seq.seq_id
        done = finished or seq.finish_reason is not None
        detok = request.detokenizers.get(seq_id)
        text = detok.output_text(done) if detok else ""
        if p.use_beam_search and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        tokens_from = 0
        if p.output_kind == "delta":  # what is new since the last output
            tokens_from, text_from = request.sent.get(seq_id, (0, 0))
            token_ids = seq.token_ids[seq.num_prompt_tokens + tokens_from:]
            request.sent[seq_id] = [tokens_from + len(token_ids), len(text)]
            if text_from:
                text = text[text_from:]
        else:
            token_ids = seq.token_ids[seq.num_prompt_tokens:]
        logprobs = seq.output_logprobs[tokens_from:] if p.logprobs is not None else None
        return CompletionOutput(index, text, token_ids, seq.cumulative_logprob, logprobs,
                                seq.finish_reason if done else None, request.stop_reasons.get(seq_id))

    # --- stats ----------------------------------------------------------------------------------------
    def _kv_occupancy(self) -> tuple[int, int]:
        """(tokens stored, slots allocated) over the blocks that sequences hold, each block counted once."""
        bs = self.config.block_size
        if not self.block_pool.num_shared:  # every block has one holder: no block can be counted twice
            stored = sum([s.num_computed_tokens for g in self.scheduler.running for s in g.seqs
                          if s.finish_reason is None])  # the live sequences
            return stored, self.block_pool.num_used * bs
        filled: dict[int, int] = {}
        for group in self.scheduler.running:
            for seq in group.live_seqs:
                for i, block in enumerate(seq.block_table):
                    n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                    filled[block] = max(filled.get(block, 0), n)
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
        return {
            "num_blocks": self.config.num_kv_blocks - 1,  # the null block is never handed out
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
        }
