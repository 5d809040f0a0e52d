"""A model-less runner for the engine core (the tests' stand-in engine and server; the host-overhead benchmark).

It "samples" token 7 for every row (with top log-probabilities 7, 8, ... for beam search) after ``step_seconds``;
given ``build_batches``, it first builds the real flat batch as ModelRunner does (over a persistent InputBatch)
and times that, so a step costs what the host does and nothing of the device.
"""
from __future__ import annotations

import time

import numpy as np

from jaxpage.sampling_params import MAX_LOGPROBS
from jaxpage.worker.input_batch import InputBatch, build_batch
from jaxpage.worker.sampler import SamplerOutput

TOKEN = 7


class StandInRunner:
    def __init__(self, config=None, step_seconds: float = 0.0, build_batches: bool = False):
        self.config = config
        self.step_seconds = step_seconds
        self.steps = 0
        self.input_batch = InputBatch(config) if build_batches else None  # as ModelRunner keeps it between steps
        self.build_seconds: list[float] = []

    def warm_up(self, progress: bool = True) -> None:
        pass

    def apply(self, ops) -> None:
        pass

    def execute(self, scheduled) -> SamplerOutput:
        self.steps += 1
        if self.input_batch is not None:
            t = time.perf_counter()
            build_batch(self.config, scheduled, (), self.input_batch)
            self.build_seconds.append(time.perf_counter() - t)
        if self.step_seconds:  # time.sleep(0) alone costs ~0.1 ms, a tenth of the host's step
            time.sleep(self.step_seconds)
        n = len(scheduled)
        top_ids = np.tile(np.arange(TOKEN, TOKEN + MAX_LOGPROBS), (n, 1))
        top_logprobs = np.tile(-np.arange(1, MAX_LOGPROBS + 1, dtype=np.float64), (n, 1))
        return SamplerOutput(np.full(n, TOKEN), np.full(n, -1.0), top_ids, top_logprobs)
