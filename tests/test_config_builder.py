"""The engine config from its options: pool sizing from a byte budget or the device's memory, token buckets,
start-up refusals, every option carried, the dtype chosen."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from jaxpage.attention.kv_cache import bytes_per_block
from jaxpage.config import ModelConfig
from jaxpage.engine.config_builder import build_engine_config
from jaxpage.models import config_from_hf


def _smollm2_shape() -> ModelConfig:
    return config_from_hf(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                           max_position_embeddings=8192))


def _engine(model, **kw):
    options = dict(dtype="float32", block_size=16, kv_cache_memory=None, num_kv_blocks=None, max_num_seqs=8,
                   max_num_batched_tokens=64, max_model_len=None, gpu_memory_utilization=0.9)
    return build_engine_config(model, **{**options, **kw})


def test_pool_is_sized_from_the_byte_budget():
    model = _smollm2_shape()
    per_block = 30 * 2 * 3 * 16 * 64 * 4
    assert bytes_per_block(model, 16, "float32") == per_block
    assert _engine(model, kv_cache_memory=1000 * per_block + 5).cache.num_kv_blocks == 1000


@pytest.mark.parametrize("budget", [8, 24, 64, 100, 256, 512])
def test_token_buckets_leave_at_most_a_third_of_a_step_as_padding(budget):
    from jaxpage.config import pick_bucket

    config = _engine(_smollm2_shape(), num_kv_blocks=600, max_num_batched_tokens=budget, max_num_seqs=8)
    buckets = config.token_buckets()
    assert config.attention_backend == "xla" and buckets[0] == 1  # a lone decode step pays for one token
    assert buckets == sorted(set(buckets)) and buckets[-1] == budget and all(b % 8 == 0 for b in buckets[1:-1])
    for n in range(1, budget + 1):
        bucket = pick_bucket(buckets, n)
        assert n <= bucket and (bucket <= 16 or bucket - n <= bucket // 3), (n, bucket)
    with pytest.raises(ValueError):
        pick_bucket(buckets, budget + 1)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_accelerator_token_buckets_are_powers_of_two(backend):
    """A TPU/GPU step is bound by its reads, not its padded tokens: no halfway buckets (fewer compiles at start),
    every bucket a whole number of the Pallas kernels' 8-token blocks."""
    from jaxpage.config import pick_bucket

    config = _engine(_smollm2_shape(), num_kv_blocks=600, max_num_batched_tokens=512, attention_backend=backend)
    assert config.token_buckets() == [8, 16, 32, 64, 128, 256, 512]
    odd = _engine(_smollm2_shape(), num_kv_blocks=600, max_num_batched_tokens=200, attention_backend=backend)
    assert odd.token_buckets() == [8, 16, 32, 64, 128, 200]
    assert all(pick_bucket(odd.token_buckets(), n) < 2 * n for n in range(8, 201))


def test_budget_too_small_for_one_sequence_says_how_much_is_needed():
    model = _smollm2_shape()
    per_block = bytes_per_block(model, 16, "float32")
    with pytest.raises(ValueError, match=f"needs 513 .*{513 * per_block} bytes"):
        _engine(model, kv_cache_memory=100 * per_block)
    with pytest.raises(ValueError, match="num_kv_blocks=10 must be >= 513"):
        _engine(model, num_kv_blocks=10)


def _tiny_llama_shape() -> ModelConfig:
    from tests.factories import TINY_LLAMA

    return config_from_hf(LlamaConfig(**TINY_LLAMA))


def _llama_block_bytes(model: ModelConfig, block_size: int, itemsize: int) -> int:
    return model.num_layers * 2 * model.num_kv_heads * block_size * model.head_dim * itemsize


def _llama_weight_bytes(hf: LlamaConfig, dtype_bytes: int, int8: bool = False) -> int:
    """An untied Llama's weights from its config: embedding, LM head, final norm, and per layer the q/k/v and o
    projections, gate/up and down, two norms; int8: every matrix but the embedding int8 with a float32 scale per
    output channel."""
    d, i, v, hd = hf.hidden_size, hf.intermediate_size, hf.vocab_size, hf.hidden_size // hf.num_attention_heads
    qkv_out = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hd
    matrices = [(d, v), (d, qkv_out), (hf.num_attention_heads * hd, d), (d, 2 * i), (i, d)]  # (in, out)
    counts = [1] + [hf.num_hidden_layers] * 4
    vectors = (v * d + d + 2 * d * hf.num_hidden_layers) * dtype_bytes  # embedding and norms
    if int8:
        return vectors + sum(n * (a * b + 4 * b) for n, (a, b) in zip(counts, matrices))
    return vectors + sum(n * a * b for n, (a, b) in zip(counts, matrices)) * dtype_bytes


class _FakeDevice:
    def __init__(self, bytes_limit: int, bytes_in_use: int):
        self.stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("quantization, dtype, dtype_bytes", [(None, "float32", 4), ("int8", "bfloat16", 2)])
def test_gpu_memory_utilization_leaves_out_the_weights_of_target_and_draft(monkeypatch, quantization, dtype,
                                                                          dtype_bytes):
    """As vLLM means it: the KV pool gets gpu_memory_utilization of the device memory less what is in use and
    less the weights still to be placed (the target's, int8 as int8, and a draft model's), at the bytes of a block
    of both pools; too little memory is refused naming gpu_memory_utilization."""
    from types import SimpleNamespace

    import numpy as np

    from jaxpage.engine import config_builder
    from tests.factories import TINY_LLAMA

    hf = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=False)
    target, draft = config_from_hf(hf), _tiny_llama_shape()
    weights = _llama_weight_bytes(hf, dtype_bytes, quantization == "int8")
    draft_weights = _llama_weight_bytes(LlamaConfig(**TINY_LLAMA), dtype_bytes)  # the draft is not quantized
    target_block, draft_block = (_llama_block_bytes(m, 16, dtype_bytes) for m in (target, draft))
    limit = 8 << 30
    # in use: what leaves the pool 4,000 blocks of both models less one byte, so the draft's weights (less than
    # a block) decide the last block
    in_use = int(0.9 * limit) - (weights + draft_weights + 4000 * (target_block + draft_block) - 1)
    device = _FakeDevice(limit, in_use)
    mesh = SimpleNamespace(devices=np.array([device]))  # the one device the pool is sized for
    monkeypatch.setattr(config_builder, "make_mesh", lambda tp, group: mesh)
    free = int(0.9 * limit) - in_use
    options = dict(dtype=dtype, quantization=quantization)
    assert _engine(target, **options).cache.num_kv_blocks == (free - weights) // target_block
    with_draft = _engine(target, **options, draft_model=draft,
                         speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    assert with_draft.cache.num_kv_blocks == (free - weights - draft_weights) // (target_block + draft_block) == 3999
    device.stats["bytes_limit"] = int((weights + in_use) / 0.9)  # no byte left for the pool
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9: .* raise gpu_memory_utilization"):
        _engine(target, **options)


def test_a_draft_models_pool_counts_in_kv_cache_memory_and_swap_space(caplog):
    """kv_cache_memory and swap_space hold blocks of both pools (the draft's has the target's block ids); the
    pool's bytes, each model's, are logged at start-up."""
    import logging

    target, draft = _smollm2_shape(), _tiny_llama_shape()
    per_block = _llama_block_bytes(target, 16, 4) + _llama_block_bytes(draft, 16, 4)
    budget = 600 * per_block + per_block // 2
    spec = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    with caplog.at_level(logging.INFO, logger="jaxpage.engine.config_builder"):
        config = _engine(target, kv_cache_memory=budget, draft_model=draft, speculative_config=spec,
                         preemption_mode="swap", swap_space=10 * per_block + 1)
    assert (config.cache.num_kv_blocks, config.cache.num_host_blocks) == (600, 10)
    assert (f"KV pool: 600 blocks of 16 tokens, {600 * _llama_block_bytes(target, 16, 4)} bytes for the target "
            f"model, {600 * _llama_block_bytes(draft, 16, 4)} bytes for the draft model") in caplog.messages


def test_shapes_the_tpu_kernels_cannot_take_are_refused_at_start_up():
    """bfloat16 pages move in (16, 128) tiles; token blocks of 8 (what the compile lane compiles)."""
    model = _smollm2_shape()
    with pytest.raises(ValueError, match="block_size=8 must be a multiple of 16 for a bfloat16 KV cache on TPU"):
        _engine(model, num_kv_blocks=1100, attention_backend="pallas_tpu", dtype="bfloat16", block_size=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 must be a multiple of 8 on TPU"):
        _engine(model, num_kv_blocks=600, attention_backend="pallas_tpu", max_num_batched_tokens=100)
    assert _engine(model, num_kv_blocks=1100, attention_backend="pallas_tpu", dtype="float32", block_size=8)
    assert _engine(model, num_kv_blocks=1100, attention_backend="xla", dtype="bfloat16", block_size=8)  # on a CPU


def test_every_engine_option_is_in_the_engine_config():
    """What LLMEngine, its scheduler and its runner read comes from the EngineConfig: every EngineArgs option is
    a field of it but those spent on loading the model or sizing its pools (the host's swap space in blocks, and
    with preemption_mode swap only; the prefix cache's host tier in blocks, its disk tier's cap in bytes)."""
    from jaxpage.config import CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, RoutingConfig, SchedulerConfig
    from jaxpage.engine.arg_utils import EngineArgs
    from jaxpage.engine.config_builder import engine_config_from_args

    groups = (EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)  # vLLM's VllmConfig's
    args, fields = dataclasses.fields(EngineArgs), {f.name for g in groups for f in dataclasses.fields(g)}
    # (model: the checkpoint's path in EngineArgs, its shapes in EngineConfig; quantization: in those shapes;
    # enable_lora: whether lora is set; the data-parallel router's, in routing; runner: whether pooler_config is
    # set)
    routing = {"data_parallel_routing", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold"}
    assert {f.name for f in args} - fields == {"cache_dir", "progress", "quantization", "kv_cache_memory",
                                               "gpu_memory_utilization", "swap_space", "enable_lora",
                                               "kv_offloading_size",
                                               "kv_offloading_backend", "kv_offloading_disk_size", "runner",
                                               *routing}
    model = _smollm2_shape()
    per_block = bytes_per_block(model, 16, "float32")
    options = dict(num_kv_blocks=600, dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    config = engine_config_from_args(EngineArgs(**options, enable_prefix_caching=False, preemption_mode="swap",
                                                swap_space=10 * per_block + 1, max_seqs_per_request=3), model)
    assert (config.cache.enable_prefix_caching, config.scheduler.preemption_mode, config.cache.num_host_blocks,
            config.scheduler.seqs_per_request) == (False, "swap", 10, 3)
    routed = engine_config_from_args(EngineArgs(**options, data_parallel_routing="load", cache_threshold=0.5,
                                                balance_abs_threshold=8, balance_rel_threshold=1.25), model)
    assert routed.parallel.routing == RoutingConfig("load", 0.5, 8, 1.25)
    default = engine_config_from_args(EngineArgs(**options), model)
    assert default.parallel.routing == RoutingConfig()
    assert (default.cache.enable_prefix_caching, default.scheduler.preemption_mode, default.cache.num_host_blocks,
            default.scheduler.seqs_per_request) == (True, "recompute", 0, 8)
    assert engine_config_from_args(EngineArgs(**options, swap_space=10 * per_block), model).cache.num_host_blocks == 0
    with pytest.raises(ValueError, match="preemption_mode='drop' must be 'recompute' or 'swap'"):
        _engine(model, num_kv_blocks=600, preemption_mode="drop")
    with pytest.raises(ValueError, match="max_seqs_per_request=-1 must be >= 1"):
        _engine(model, num_kv_blocks=600, max_seqs_per_request=-1)


def test_auto_dtype_on_the_cpu_follows_the_checkpoint_and_the_cpu():
    """dtype "auto" on a CPU: bfloat16 only where it serves faster (oneDNN with bfloat16 dot instructions) for a
    checkpoint that is not float32 with float weights; a float32 checkpoint and int8 weights keep float32."""
    from jaxpage.cpu_kernels import onednn

    half = dataclasses.replace(_smollm2_shape(), checkpoint_dtype="bfloat16")
    full = dataclasses.replace(_smollm2_shape(), checkpoint_dtype="float32")
    unnamed = _smollm2_shape()  # a GGUF file's config names no dtype
    fast = "bfloat16" if onednn.fast_bfloat16() else "float32"
    assert _engine(half, dtype="auto").dtype == fast
    assert _engine(unnamed, dtype="auto").dtype == fast
    assert _engine(full, dtype="auto").dtype == "float32"
    assert _engine(half, dtype="auto", quantization="int8").dtype == "float32"
    assert _engine(half, dtype="float32").dtype == "float32"
    engine = _engine(half, dtype="auto")
    assert engine.onednn_packed_weights == (fast == "bfloat16")  # packed where bfloat16 runs oneDNN's matmul
