"""A model-less runner for the engine core (the tests' stand-in engine and server; the host-overhead benchmark).

It "samples" token 7 for every row (with top log-probabilities 7, 8, ... for beam search) after ``step_seconds``;
given ``build_batches``, it first builds the real flat batch as ModelRunner does (over a persistent InputBatch)
and times that, so a step costs what the host does and nothing of the device. With ``simulated_device`` it takes
part in async scheduling: a step launched runs ``step_seconds`` on a simulated device that runs one step at a time
in launch order, and the time that device waits for the host between steps is recorded (``device_idle_seconds``).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxpage.sampling_params import MAX_LOGPROBS
from jaxpage.worker.input_batch import InputBatch, build_batch
from jaxpage.worker.sampler import SamplerOutput

TOKEN = 7


@dataclasses.dataclass
class StandInStep:
    """A launched step: its rows, its output and when the simulated device finishes it."""

    scheduled: list
    out: SamplerOutput
    done_at: float


class StandInRunner:
    def __init__(self, config=None, step_seconds: float = 0.0, build_batches: bool = False,
                 simulated_device: bool = False):
        self.config = config
        self.step_seconds = step_seconds
        self.supports_async_scheduling = simulated_device
        self.device_idle_seconds: list[float] = []  # simulated device: its wait for the host before each step
        self._device_free_at = 0.0
        self.steps = 0
        self.input_batch = InputBatch(config) if build_batches else None  # as ModelRunner keeps it between steps
        self.build_seconds: list[float] = []

    def warm_up(self, progress: bool = True) -> None:
        pass

    def apply(self, ops) -> None:
        pass

    def execute(self, scheduled) -> SamplerOutput:
        if self.supports_async_scheduling:
            return self.fetch(self.launch(scheduled))
        self._build(scheduled)
        if self.step_seconds:  # time.sleep(0) alone costs ~0.1 ms, a tenth of the host's step
            time.sleep(self.step_seconds)
        return _output(len(scheduled))

    def launch(self, scheduled, bitmask=None, previous=None) -> StandInStep:
        """The batch built, then the step queued on the simulated device: it starts when the one before ends or
        now, whichever is later (the device waited for the host for the difference)."""
        self._build(scheduled)
        now = time.perf_counter()
        if self._device_free_at:
            self.device_idle_seconds.append(max(0.0, now - self._device_free_at))
        self._device_free_at = max(now, self._device_free_at) + self.step_seconds
        return StandInStep(scheduled, _output(len(scheduled)), self._device_free_at)

    def fetch(self, launched: StandInStep) -> SamplerOutput:
        wait = launched.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return launched.out

    def _build(self, scheduled) -> None:
        self.steps += 1
        if self.input_batch is not None:
            t = time.perf_counter()
            build_batch(self.config, scheduled, (), self.input_batch)
            self.build_seconds.append(time.perf_counter() - t)


def _output(n: int) -> SamplerOutput:
    top_ids = np.tile(np.arange(TOKEN, TOKEN + MAX_LOGPROBS), (n, 1))
    top_logprobs = np.tile(-np.arange(1, MAX_LOGPROBS + 1, dtype=np.float64), (n, 1))
    return SamplerOutput(np.full(n, TOKEN), np.full(n, -1.0), top_ids, top_logprobs)


def start_decoding(engine, num_seqs: int, max_tokens: int, seed: int = 0) -> None:
    """Adds ``num_seqs`` random prompts of 50-400 tokens (greedy, EOS ignored, streamed as served) and steps the
    engine until every sequence is decoding."""
    from jaxpage.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    for i in range(num_seqs):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(0, 49152, rng.integers(50, 400)).tolist()},
                           params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                          for g in engine.scheduler.running for s in g.seqs):
        engine.step()  # prefill until every sequence is decoding


def smollm2_shaped_config(num_seqs: int):
    """An engine config of SmolLM2-135M's shapes (float32, 64 blocks a sequence) for ``num_seqs`` sequences."""
    from transformers import LlamaConfig

    from jaxpage.engine.config_builder import build_engine_config
    from jaxpage.models import config_from_hf

    model = config_from_hf(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                       max_position_embeddings=8192))
    return build_engine_config(model, dtype="float32", block_size=16, kv_cache_memory=None,
                               num_kv_blocks=num_seqs * 64 + 1, max_num_seqs=num_seqs,
                               max_num_batched_tokens=4096, max_model_len=2048, gpu_memory_utilization=0.9)
