"""LLMEngine: requests in, one scheduled and executed step at a time, outputs back."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path

from jaxpage.block_pool import BlockPool
from jaxpage.compile_cache import enable_compilation_cache
from jaxpage.config import ModelConfig, build_engine_config
from jaxpage.detokenizer import IncrementalDetokenizer
from jaxpage.model_loader import default_cache_dir, load_model
from jaxpage.model_runner import ModelRunner
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import SamplingParams
from jaxpage.scheduler import Scheduler
from jaxpage.sequence import Sequence

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineArgs:
    """The engine's options, as `LLM(...)` and the CLI take them."""

    model: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    cache_dir: str | None = None
    progress: bool = True


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    detokenizer: IncrementalDetokenizer


class LLMEngine:
    def __init__(self, args: EngineArgs):
        cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        enable_compilation_cache(cache_dir)
        started = time.perf_counter()
        loaded = load_model(args.model, cache_dir)
        self.load_seconds = time.perf_counter() - started
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.config = build_engine_config(
            ModelConfig.from_hf(loaded.hf_config), dtype=args.dtype, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)
        self.runner = ModelRunner(self.config, loaded.params)
        self.block_pool = BlockPool(self.config.num_kv_blocks)
        self.scheduler = Scheduler(self.config, self.block_pool)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        started = time.perf_counter()
        self.runner.warm_up(progress=args.progress)
        self.warmup_seconds = time.perf_counter() - started

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, token_ids = self._prompt_tokens(prompt)
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len={max_len} to leave room for one generated token")
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt_token_ids must lie in [0, {vocab})")
        if params.max_tokens is not None:
            max_len = min(max_len, len(token_ids) + params.max_tokens)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(token_ids),
                       num_prompt_tokens=len(token_ids), params=params, max_len=max_len, seed=seed)
        self.requests[request_id] = Request(request_id, text, seq, IncrementalDetokenizer(self.tokenizer, token_ids))
        self.scheduler.add(seq)

    def _prompt_tokens(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError("prompt_token_ids is empty")
            if not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be integers")
            return None, ids
        raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.seq.is_finished:
            self.scheduler.finish(request.seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one iteration; returns an output for every request that got a token."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        tokens, logprobs = self.runner.execute(scheduled)
        outputs = []
        for s, token, logprob in zip(scheduled, tokens.tolist(), logprobs.tolist()):
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            if samples:
                outputs.append(self._append_token(s.seq, token, logprob))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: float) -> RequestOutput:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        request = self.requests[seq.request_id]
        request.detokenizer.add(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return self._output(request)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return "stop"
        if seq.num_tokens >= seq.max_len:
            return "length"
        return None

    def _output(self, request: Request) -> RequestOutput:
        seq = request.seq
        completion = CompletionOutput(index=0, text=request.detokenizer.text, token_ids=list(seq.output_token_ids),
                                      finish_reason=seq.finish_reason, cumulative_logprob=seq.cumulative_logprob)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], outputs=[completion],
                             finished=seq.is_finished)
