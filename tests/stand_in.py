"""A model-less engine for tests that need the engine core or the server but not a model: it starts in a second.

The stand-in runner (benchmarks/stand_in.py) "samples" token 7 for every row (with top log-probabilities 7, 8, ...
for beam search); an optional flag file makes the step raise, as a device error would: once (the file is
removed), or on every step while the file says "always".
"""
from __future__ import annotations

import os

from transformers import LlamaConfig

from benchmarks.stand_in import TOKEN, StandInRunner  # noqa: F401 - TOKEN: what the stand-in engine generates
from jaxpage.engine.async_engine import AsyncEngine
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.models import config_from_hf


def make_engine(*, num_kv_blocks: int = 257, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                max_model_len: int = 4096, max_seqs_per_request: int | None = None, step_seconds: float = 0.0,
                fail_flag: str | None = None) -> LLMEngine:
    model = config_from_hf(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=max_model_len))
    config = build_engine_config(model, dtype="float32", block_size=16, kv_cache_memory=None,
                                 num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                 gpu_memory_utilization=0.9, max_seqs_per_request=max_seqs_per_request)
    engine = LLMEngine(config, StandInRunner(step_seconds=step_seconds), eos_token_ids=(0,), model_name="stand-in")
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


def make_async_engine(**options) -> AsyncEngine:
    return AsyncEngine(make_engine(**options))
