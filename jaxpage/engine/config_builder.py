"""Builds the EngineConfig from the engine's options: validates each (a ValueError naming the field) and sizes
the KV pool from a memory budget. The one place an EngineConfig is made."""
from __future__ import annotations

import dataclasses
import logging

import jax

from jaxpage.cpu_kernels import onednn
from jaxpage.attention import kv_cache
from jaxpage.attention.backends import resolve_backend
from jaxpage.config import (
    DEVICE_DRAFT_METHODS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    RoutingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StepModelConfig,
    check_quantization,
    kv_storage_dtype,
    require,
    resolve_dtype,
)
from jaxpage.core.scheduler import PREEMPTION_MODES
from jaxpage.distributed.parallel import device_group, make_mesh, model_for_tp
from jaxpage.engine.arg_utils import RUNNERS, EngineArgs
from jaxpage.models.causal_lm import weight_bytes
from jaxpage.models.lora_slots import grouped_kernel_runs
from jaxpage.models.weight_packing import packs_weights
from jaxpage.utils import cdiv
from pallas_kernels.kv_write.tpu import tile_rows

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


def build_engine_config(model: ModelConfig, args: EngineArgs | None = None, *, data_parallel_rank: int = 0,
                        draft_model: ModelConfig | None = None, async_prompt_steps: bool | None = None,
                        aux_hidden_layers: tuple[int, ...] = (), **options) -> EngineConfig:
    """Validates the engine options and sizes the KV pool and the host's swap space (bytes, used with
    preemption_mode swap), for ``model`` (the checkpoint's shapes). args: the engine's options (EngineArgs, the
    one declaration of each option, its default, flag and help); ``options``: EngineArgs fields set over args'.
    data_parallel_rank: which of ``data_parallel_size`` replicas this is; draft_model: the draft's shapes with
    speculative decoding's draft_model or eagle3 method (its pool has the target's block ids, so each block's bytes
    are both models'); async_prompt_steps: EngineConfig's (None: on off the CPU); aux_hidden_layers: an EAGLE-3
    head's (EngineConfig's)."""
    args = dataclasses.replace(args or EngineArgs(), **options)
    dtype, block_size, max_num_seqs = args.dtype, args.block_size, args.max_num_seqs
    max_num_batched_tokens, quantization = args.max_num_batched_tokens, args.quantization
    tensor_parallel_size, data_parallel_size = args.tensor_parallel_size, args.data_parallel_size
    kv_cache_dtype, preemption_mode, async_scheduling = args.kv_cache_dtype, args.preemption_mode, args.async_scheduling
    enable_prefix_caching, num_kv_blocks = args.enable_prefix_caching, args.num_kv_blocks
    max_cpu_loras, kv_offloading_dir = args.max_cpu_loras, args.kv_offloading_dir
    speculative_config = speculative_config_of(args.speculative_config)
    assert (draft_model is not None) == (speculative_config is not None
                                         and speculative_config.method in DEVICE_DRAFT_METHODS), "its shapes"
    check_quantization(quantization)
    if model.quantized_weights is not None:  # a checkpoint published quantized
        require(quantization in (None, model.quantization), "quantization", quantization,
                f"differs from the checkpoint's quant_method {model.quantization!r}")
        quantization = model.quantization
    else:
        require(quantization in (None, "int8"), "quantization", quantization,
                "is a checkpoint's quant_method, and this checkpoint's weights are float (made at load: 'int8')")
    dtype = resolve_dtype(dtype, cpu_bfloat16=cpu_serves_bfloat16(model, quantization))
    model = dataclasses.replace(model, quantization=quantization)
    group = device_group(tensor_parallel_size, data_parallel_size, data_parallel_rank)
    backend = resolve_backend(args.attention_backend)
    lora = (_lora_config(args.max_loras, args.max_lora_rank, max_cpu_loras,
                         grouped_kernel_runs(backend, tensor_parallel_size, group)) if args.enable_lora else None)
    model = model_for_tp(model, tensor_parallel_size)
    require(kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", kv_cache_dtype,
            f"must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}")
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    require(block_size in (8, 16, 32, 64, 128), "block_size", block_size, "must be one of 8, 16, 32, 64, 128")
    _check_tpu_tiles(backend, kv_dtype, block_size, max_num_batched_tokens)
    packed = packs_weights(dtype, backend, quantization, tensor_parallel_size, group)
    require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "must be >= 1")
    require(max_num_batched_tokens >= max_num_seqs, "max_num_batched_tokens", max_num_batched_tokens,
            f"must be >= max_num_seqs={max_num_seqs}")
    limit = model.max_position_embeddings
    max_model_len = args.max_model_len or limit
    require(1 <= max_model_len <= limit, "max_model_len", max_model_len,
            f"must be between 1 and the model's max_position_embeddings={limit}")
    step_model = StepModelConfig.of(model, lora, packed)  # its weights (LoRA slots included) take device memory
    models = (step_model,) if draft_model is None else (step_model, draft_model)  # a draft: the target's 1st device
    per_block = [kv_cache.device_bytes_per_block(m, block_size, kv_dtype, kv_cache.packs_kv(m, backend), shards)
                 for m, shards in zip(models, (tensor_parallel_size, 1))]
    if num_kv_blocks is None:
        num_kv_blocks = _blocks_for_memory(models, dtype, block_size, sum(per_block), max_model_len,
                                           args.kv_cache_memory, args.gpu_memory_utilization, tensor_parallel_size,
                                           group)
    else:
        _check_num_kv_blocks(num_kv_blocks, block_size, max_model_len)
    log.info("KV pool: %d blocks of %d tokens, %s", num_kv_blocks, block_size, ", ".join(
        f"{num_kv_blocks * b} bytes{' per device' if tensor_parallel_size > 1 and not i else ''} for the "
        f"{('target', 'draft')[i]} model" for i, b in enumerate(per_block)))
    require(preemption_mode in PREEMPTION_MODES, "preemption_mode", preemption_mode, "must be 'recompute' or 'swap'")
    long_prefill_token_threshold = _long_prefill_token_threshold(
        args.long_prefill_token_threshold, args.max_num_partial_prefills, args.max_long_partial_prefills,
        max_model_len)
    host_per_block = sum(kv_cache.bytes_per_block(m, block_size, kv_dtype) for m in models)  # each model swaps
    num_host_blocks = args.swap_space // host_per_block if preemption_mode == "swap" else 0
    num_offload_blocks = _num_offload_blocks(args.kv_offloading_size, args.kv_offloading_backend, kv_offloading_dir,
                                             args.kv_offloading_disk_size, host_per_block, enable_prefix_caching)
    pooler = pooler_config_of(args.runner, args.pooler_config)
    if pooler is not None:
        require(speculative_config is None, "speculative_config", args.speculative_config,
                "is for generating models, not runner 'pooling'")
        async_scheduling = False  # a pooling step samples nothing for the next step to take
        if pooler.needs_whole_prompt and enable_prefix_caching:
            log.info("pooling_type %s reads every prompt token's hidden state: prefix caching is off",
                     pooler.pooling_type)
            enable_prefix_caching = False
    if speculative_config is not None and speculative_config.method in DEVICE_DRAFT_METHODS and async_scheduling:
        log.info("speculative decoding (%s): async scheduling is off (the draft computes each step's tokens from "
                 "the host's view of them)", speculative_config.method)
        async_scheduling = False
    cache = CacheConfig(block_size, num_kv_blocks, kv_cache_dtype, enable_prefix_caching, num_host_blocks,
                        num_offload_blocks, kv_offloading_dir, int(args.kv_offloading_disk_size * (1 << 30)))
    scheduler = SchedulerConfig(
        max_model_len, max_num_seqs, max_num_batched_tokens, preemption_mode, args.max_seqs_per_request,
        async_scheduling, jax.default_backend() != "cpu" if async_prompt_steps is None else async_prompt_steps,
        long_prefill_token_threshold, args.max_num_partial_prefills, args.max_long_partial_prefills,
        args.wave_prefill, args.prefill_into_padding)
    parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, data_parallel_rank, RoutingConfig(
        args.data_parallel_routing, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold))
    config = EngineConfig(model, dtype, cache, scheduler, parallel, lora, backend, packed, args.scan_layers,
                          speculative_config, pooler_config=pooler, aux_hidden_layers=tuple(aux_hidden_layers))
    require(config.scheduler.seqs_per_request >= 1, "max_seqs_per_request", args.max_seqs_per_request, "must be >= 1")
    return config


def cpu_serves_bfloat16(model: ModelConfig, quantization: str | None) -> bool:
    """dtype "auto" on a CPU: bfloat16 where it serves faster than float32 (oneDNN's bfloat16 matmul on a CPU
    with bfloat16 dot instructions: RESULTS.md, "Packed oneDNN weights"), for float weights of a checkpoint that
    is not float32 (a float32 checkpoint keeps its precision; int8 weights keep their measured float32 path)."""
    return quantization is None and model.checkpoint_dtype != "float32" and onednn.fast_bfloat16()


def pooler_config_of(runner: str, options: dict | None) -> PoolerConfig | None:
    """The pooler of runner "pooling" (vLLM's pooler_config dict checked; "auto" is "generate" here: the
    engine's loader resolves it from the checkpoint, ``resolve_runner``), None for a generating model."""
    require(runner in RUNNERS, "runner", runner, f"must be one of {', '.join(RUNNERS)}")
    if runner != "pooling":
        require(options is None, "pooler_config", options, "is for runner 'pooling'")
        return None
    unknown = sorted(set(options or {}) - {f.name for f in dataclasses.fields(PoolerConfig)})
    require(not unknown, "pooler_config", options, f"has unknown fields {unknown} (pooling_type, normalize)")
    return PoolerConfig(**(options or {}))


def resolve_runner(args: EngineArgs, architectures: list[str], pooler_defaults: dict | None) -> EngineArgs:
    """args with runner "auto" made concrete (pooling for a base model's checkpoint, architecture *Model, and a
    classifier's, *ForSequenceClassification) and a pooling model's pooler_config filled from the checkpoint (a
    classifier pools the last token; a sentence-transformers directory's modules) where args say nothing of it."""
    runner, classifier = args.runner, any(a.endswith("ForSequenceClassification") for a in architectures)
    if runner == "auto":
        runner = "pooling" if classifier or any(a.endswith("Model") for a in architectures) else "generate"
    pooler = args.pooler_config
    if runner == "pooling":
        head = {"pooling_type": "LAST", "normalize": False} if classifier else {}  # transformers' classifier
        pooler = {**head, **(pooler_defaults or {}), **(pooler or {})}
    return dataclasses.replace(args, runner=runner, pooler_config=pooler)


def speculative_config_of(options: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The speculative_config option as a SpeculativeConfig (vLLM's dict checked), or None."""
    if options is None or isinstance(options, SpeculativeConfig):
        return options
    return SpeculativeConfig.from_dict(options)


def engine_config_from_args(args: EngineArgs, model: ModelConfig, data_parallel_rank: int = 0,
                            draft_model: ModelConfig | None = None, aux_hidden_layers: tuple[int, ...] = ()
                            ) -> EngineConfig:
    """The EngineConfig of every engine option in ``args``, for ``model`` (see ``build_engine_config``)."""
    return build_engine_config(model, args, data_parallel_rank=data_parallel_rank, draft_model=draft_model,
                               aux_hidden_layers=aux_hidden_layers)


def draft_engine_config(config: EngineConfig, draft: ModelConfig) -> EngineConfig:
    """The draft model's EngineConfig (speculative decoding's draft_model method): the target's options and pool
    geometry (its blocks are the target's block ids: jaxpage/worker/draft_runner.py) on the draft's model, no
    speculation or async scheduling of its own, room in its first step's budget for a token of each row that
    lags the target by one, and one device (vLLM's draft_tensor_parallel_size 1): the first of the target's."""
    name = "speculative_config.model"
    require(draft.vocab_size == config.model.vocab_size, name, config.speculative_config.model,
            f"must have the target's vocabulary ({config.model.vocab_size} tokens), not {draft.vocab_size}")
    require(draft.max_position_embeddings >= config.scheduler.max_model_len, name, config.speculative_config.model,
            f"must take max_model_len={config.scheduler.max_model_len} positions "
            f"(it takes {draft.max_position_embeddings})")
    require(jax.process_count() == 1, name, config.speculative_config.model,
            "a draft model runs on one host only (not built beyond)")
    require(not draft.every_layer_windowed, name, config.speculative_config.model,
            "must attend to every position (a sliding-window draft is not built)")
    require(not config.cache.num_offload_blocks, "kv_offloading_size", config.cache.num_offload_blocks,
            "is not built with a draft model (speculative_config.model): its pool would need tiers of its own")
    limits = config.scheduler
    budget = cdiv(limits.max_num_batched_tokens + limits.max_num_seqs, 8) * 8  # TPU kernels take blocks of 8
    tp, rank = config.parallel.tensor_parallel_size, config.parallel.data_parallel_rank
    # under tensor parallelism the draft runs whole on the first device of the target's group: device_group of
    # TP 1 over dp x tp ranks of one device each names that device
    return dataclasses.replace(
        config, model=draft, lora=None, speculative_config=None, sampler_returns_probs=True, aux_hidden_layers=(),
        scheduler=dataclasses.replace(config.scheduler, async_scheduling=False, max_num_batched_tokens=budget),
        parallel=dataclasses.replace(config.parallel, tensor_parallel_size=1,
                                     data_parallel_size=config.parallel.data_parallel_size * tp,
                                     data_parallel_rank=rank * tp))


def _lora_config(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 cpu_lora_kernel: bool) -> LoRAConfig:
    """The adapter slots (under tensor parallelism sharded as their base projections) and the host's LRU size
    (default: max_loras)."""
    require(max_loras >= 1, "max_loras", max_loras, "must be >= 1")
    require(max_lora_rank >= 1, "max_lora_rank", max_lora_rank, "must be >= 1")
    max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
    require(max_cpu_loras >= max_loras, "max_cpu_loras", max_cpu_loras, f"must be >= max_loras={max_loras}")
    require(jax.process_count() == 1, "enable_lora", True, "runs on one host only (the followers' replay "
            "carries no adapter slots yet)")
    return LoRAConfig(max_loras, max_lora_rank, max_cpu_loras, cpu_lora_kernel)


def _num_offload_blocks(size_gib: float, backend: str | None, directory: str | None, disk_gib: float,
                        per_block: int, enable_prefix_caching: bool) -> int:
    """The host tier's blocks for kv_offloading_size GiB of blocks in the pool's format (scales included)."""
    require(isinstance(size_gib, (int, float)) and size_gib >= 0, "kv_offloading_size", size_gib,
            "must be a number of GiB >= 0 (0: off)")
    require(backend in (None, "native"), "kv_offloading_backend", backend, "must be 'native' (or unset)")
    require(disk_gib > 0, "kv_offloading_disk_size", disk_gib, "must be > 0 GiB")
    require(directory is None or size_gib > 0, "kv_offloading_dir", directory,
            "needs kv_offloading_size > 0 (blocks reach the disk tier from the host tier)")
    if not size_gib:
        return 0
    require(enable_prefix_caching, "kv_offloading_size", size_gib,
            "needs enable_prefix_caching (the tiers hold blocks by their prefix hash)")
    require(jax.process_count() == 1, "kv_offloading_size", size_gib, "runs on one host only (the followers' "
            "replay carries no offload moves yet)")
    blocks = int(size_gib * (1 << 30)) // per_block
    require(blocks >= 1, "kv_offloading_size", size_gib, f"must hold at least one block of {per_block} bytes")
    return blocks


def _long_prefill_token_threshold(threshold: int, max_partial: int, max_long: int, max_model_len: int) -> int:
    """Checks the partial-prefill options (vLLM's rules) and returns the threshold: with several partial
    prefills and no threshold given, 4 % of max_model_len, as vLLM's SchedulerConfig sets it."""
    require(max_partial >= 1, "max_num_partial_prefills", max_partial, "must be >= 1")
    require(1 <= max_long <= max_partial, "max_long_partial_prefills", max_long,
            f"must be >= 1 and <= max_num_partial_prefills={max_partial}")
    require(threshold >= 0, "long_prefill_token_threshold", threshold, "must be >= 0 (0: no cap)")
    if max_partial > 1 and threshold == 0:
        return max(int(max_model_len * 0.04), 1)
    return threshold


def _check_tpu_tiles(backend: str, kv_dtype, block_size: int, max_num_batched_tokens: int) -> None:
    if backend == "pallas_tpu" or jax.default_backend() == "tpu":  # every TPU step writes with write_kv_tpu
        require(block_size % tile_rows(kv_dtype) == 0, "block_size", block_size,
                f"must be a multiple of {tile_rows(kv_dtype)} for a {kv_dtype} KV cache on TPU (its K/V write "
                f"moves whole ({tile_rows(kv_dtype)}, 128) tiles of a page)")
    if backend == "pallas_tpu":
        require(max_num_batched_tokens % 8 == 0, "max_num_batched_tokens", max_num_batched_tokens,
                "must be a multiple of 8 on TPU (the attention kernel takes tokens in blocks of 8 or 16)")


def _check_num_kv_blocks(num_kv_blocks: int, block_size: int, max_model_len: int) -> None:
    needed = cdiv(max_model_len, block_size) + 1
    require(num_kv_blocks >= needed, "num_kv_blocks", num_kv_blocks,
            f"must be >= {needed}: one sequence of max_model_len={max_model_len} needs that many "
            f"blocks of {block_size} tokens, plus the null block")


def _blocks_for_memory(models: tuple[ModelConfig, ...], dtype, block_size: int, per_block: int, max_model_len: int,
                       kv_cache_memory: int | None, gpu_memory_utilization: float, tensor_parallel_size: int,
                       group) -> int:
    """The blocks (null block included) of ``per_block`` device bytes (every model's pool) the byte budget
    holds: kv_cache_memory, or gpu_memory_utilization of the device memory less the weights of ``models``
    (the target split over the tensor-parallel group, a draft on its first device), or on a device that does
    not say, 1 GiB."""
    name, budget = "kv_cache_memory", kv_cache_memory
    if not budget:
        devices = make_mesh(tensor_parallel_size, group).devices.flat
        weights = sum(weight_bytes(m, dtype, shards) for m, shards in zip(models, (tensor_parallel_size, 1)))
        name, budget = "gpu_memory_utilization", kv_cache.device_kv_budget(gpu_memory_utilization, weights, devices)
    if budget is None:
        name, budget = "kv_cache_memory", DEFAULT_CPU_KV_CACHE_MEMORY
    return kv_cache.num_blocks_for_budget(per_block, block_size, budget, max_model_len, name,
                                          per_device=tensor_parallel_size > 1)
