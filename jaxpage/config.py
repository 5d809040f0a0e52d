"""The one config object: what the model is and how the engine holds it (the types and their field checks;
jaxpage.engine.config_builder makes an EngineConfig from the engine's options)."""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jaxpage.utils import cdiv

# kv_cache_dtype option -> the pool's stored dtype ("auto": the model's); pallas_kernels.quant quantizes to them
STORED_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a model, read off a transformers config by its architecture's module
    (jaxpage.models.config_from_hf)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_parameters: tuple  # sorted (key, value) pairs, hashable
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    # Per-layer attention: HF's layer_types ("full_attention" / "sliding_attention"); () means all full.
    layer_types: tuple = ()
    sliding_window: int | None = None  # keys visible to a query at p: positions in (p - window, p]
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim
    local_rope_parameters: tuple = ()  # the sliding layers' RoPE settings, rope_theta included (Gemma 3); ()=same
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    num_experts: int = 0  # routed experts per MoE layer (0: dense MLP)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # None (float weights), "int8" (the engine's own: every Linear made int8 at load, jaxpage.models.quant) or a
    # checkpoint's quant_method ("compressed-tensors", "gptq", "awq", "fp8", "gguf": models.quant_methods) with its
    # decoder layers' stored weights in quantized_weights ("int8", "fp8" or "int4"; the LM head as published,
    # float), with a scale per quantization_group_size input columns (None: per output channel; -1: per output
    # channel too, weight-only, in the grouped product where the CPU's int8 one would quantize activations) and
    # zero points where asymmetric
    quantization: str | None = None
    quantized_weights: str | None = None
    quantization_group_size: int | None = None
    quantization_zero_point: bool = False
    # decoder Linears stored otherwise than the above (a GGUF file's mix of types, jaxpage.models.gguf_quant):
    # sorted (linear, stored kind, group size, zero points), linear one of "qkv", "o", "gate_up", "down"
    quantized_projections: tuple = ()
    # each checkpoint KV head repeated this many times to fill a tensor-parallel mesh (vLLM's
    # num_kv_head_replicas; jaxpage.distributed.parallel.model_for_tp): num_kv_heads counts the repeats
    num_kv_head_replicas: int = 1
    checkpoint_dtype: str | None = None  # the checkpoint's float dtype where its config names one ("float32", ...)

    # The engine's choices that shape the step's graph are not the checkpoint's: a model as published has no
    # LoRA slots and no packed weights; StepModelConfig (EngineConfig.step_model) carries them as fields
    max_loras = 0
    max_lora_rank = 0
    cpu_lora_kernel = False
    onednn_packed_weights = False

    def layer_windows(self) -> np.ndarray:
        """int32 [num_layers]: each layer's sliding window in tokens, 0 for full attention."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return np.asarray([self.sliding_window if t == "sliding_attention" and self.sliding_window else 0
                           for t in types], np.int32)

    @property
    def layer_weights_kind(self) -> str | None:
        """The decoder layers' Linear weights: "int8", "fp8", "int4" or None (float)."""
        return "int8" if self.quantization == "int8" else self.quantized_weights

    def weights_scheme(self) -> dict:
        """How the weights are stored, as /v1/models and GetModelInfo report it: quantization (None, "int8" or
        the checkpoint's quant_method), quantized_weights (the decoder Linears' "int8", "fp8", "int4" or None),
        quantization_group_size (input columns a scale covers; None or -1: one per output channel, -1 where the
        activations stay unquantized on every backend) and quantization_zero_point; where the projections differ
        (a GGUF file's mix of types), those three are the widest kind, the smallest group and any zero points, and
        quantized_projections gives each decoder Linear's."""
        return {"quantization": self.quantization, "quantized_weights": self.layer_weights_kind,
                "quantization_group_size": self.quantization_group_size,
                "quantization_zero_point": self.quantization_zero_point,
                "quantized_projections": {name: {"quantized_weights": kind, "quantization_group_size": group,
                                                 "quantization_zero_point": zero}
                                          for name, kind, group, zero in self.quantized_projections}}

    @property
    def every_layer_windowed(self) -> bool:
        """Every layer slides (Mistral): blocks that no future token can see can go back to the pool."""
        return bool(self.layer_windows().min() > 0)


@dataclasses.dataclass(frozen=True)
class StepModelConfig(ModelConfig):
    """The model as the engine compiles its step: the checkpoint's ModelConfig and the engine's choices that shape
    the graph, made from the EngineConfig's groups (``EngineConfig.step_model``), never set by hand."""

    # LoRA adapter slots on the device (EngineConfig.lora): max_loras adapters of rank up to max_lora_rank in
    # every decoder Linear (jaxpage.models.lora_slots); 0: none, the base model's graph
    max_loras: int = 0
    max_lora_rank: int = 0
    # the adapters' deltas by the CPU's grouped kernel (lora_slots.grouped_kernel_runs): one slots bucket
    cpu_lora_kernel: bool = False
    # bfloat16 Linear kernels packed for oneDNN's CPU matmul (EngineConfig.onednn_packed_weights;
    # jaxpage.models.weight_packing)
    onednn_packed_weights: bool = False

    @classmethod
    def of(cls, model: ModelConfig, lora: "LoRAConfig | None", onednn_packed_weights: bool) -> "StepModelConfig":
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
        if lora is not None:
            fields.update(max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
                          cpu_lora_kernel=lora.cpu_lora_kernel)
        return cls(**fields, onednn_packed_weights=onednn_packed_weights)


SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix", "eagle3")  # vLLM's method names jaxpage implements
# the methods whose drafts come from a model of their own run on the device before the target's step
# (jaxpage/worker/draft_runner.py, jaxpage/worker/eagle3_runner.py); the others propose on the host
DEVICE_DRAFT_METHODS = ("draft_model", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config and its names): each step a sequence's next tokens are
    proposed by ``method`` and verified by the target model in the same step (jaxpage/spec_decode/).

    ngram: prompt lookup over the sequence's own prompt and output; the longest n-gram of prompt_lookup_max down
    to prompt_lookup_min tokens that ends the sequence and occurred before proposes the tokens that followed it.
    draft_model: ``model`` (a path the loader takes: GGUF or an HF directory), a smaller model of the same
    vocabulary, run for num_speculative_tokens steps per target step (its own runner and KV pool).
    eagle3: ``model`` (an EAGLE-3 head's directory: the speculators library's layout or the original release's),
    one decoder layer over the target's auxiliary hidden states, run for num_speculative_tokens steps per target
    step (jaxpage/worker/eagle3_runner.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5  # vLLM's defaults when neither is given
    prompt_lookup_min: int = 5
    model: str | None = None  # draft_model, eagle3: the draft's path
    draft_tensor_parallel_size: int = 1  # draft_model: only 1 (the draft runs on one device)
    # suffix: vLLM's names and defaults (Arctic Inference's SuffixDecodingCache)
    suffix_decoding_max_tree_depth: int = 24  # the longest match and draft the trees hold
    suffix_decoding_max_cached_requests: int = 10000  # earlier requests' outputs in the global tree (0: none)
    suffix_decoding_max_spec_factor: float = 1.0  # a draft is at most this times its match's length
    suffix_decoding_min_token_prob: float = 0.1  # each draft token's estimated probability at least this
    disable_by_batch_size: int | None = None  # vLLM's: no drafts in a step of this many running sequences or more

    @classmethod
    def from_dict(cls, options: dict) -> "SpeculativeConfig":
        """The config of vLLM's dict (``{"method": "ngram", "num_speculative_tokens": 4, ...}``), each field
        checked (a ValueError naming it). As vLLM: num_speculative_tokens must be given, and one of
        prompt_lookup_max/min given alone sets the other."""
        require(isinstance(options, dict), "speculative_config", options, "must be a dict (JSON object)")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        require(not unknown, "speculative_config", unknown, f"has unknown keys; known: {', '.join(sorted(fields))}")
        method = options.get("method", "ngram")
        require(method in SPECULATIVE_METHODS, "speculative_config.method", method,
                f"must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}")
        require("num_speculative_tokens" in options, "speculative_config.num_speculative_tokens", None,
                "must be given")
        k = options["num_speculative_tokens"]
        require(type(k) is int and 1 <= k <= 16, "speculative_config.num_speculative_tokens", k,
                "must be an integer in [1, 16]")
        lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = cls.prompt_lookup_min, cls.prompt_lookup_max
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            require(type(value) is int and value >= 1, f"speculative_config.{name}", value, "must be an integer >= 1")
        require(lo <= hi, "speculative_config.prompt_lookup_min", lo, f"must be <= prompt_lookup_max={hi}")
        model, draft_tp = options.get("model"), options.get("draft_tensor_parallel_size", 1)
        if method in DEVICE_DRAFT_METHODS:
            require(isinstance(model, str) and model, "speculative_config.model", model,
                    "must be the draft model's path (a .gguf file or an HF directory) for method 'draft_model'"
                    if method == "draft_model" else "must be the EAGLE-3 head's directory for method 'eagle3'")
            require(draft_tp == 1, "speculative_config.draft_tensor_parallel_size", draft_tp,
                    "must be 1 (the draft runs on one device)")
        else:
            require(model is None, "speculative_config.model", model,
                    f"is only for methods 'draft_model' and 'eagle3', not {method!r}")
        off = options.get("disable_by_batch_size")
        require(off is None or type(off) is int and off >= 2, "speculative_config.disable_by_batch_size", off,
                "must be an integer >= 2 (or unset)")
        return cls(method, k, hi, lo, model, draft_tp, **_suffix_options(options), disable_by_batch_size=off)


def _suffix_options(options: dict) -> dict:
    """The suffix_decoding_* fields given, each checked (a ValueError naming it)."""
    out = {k: v for k, v in options.items() if k.startswith("suffix_decoding_")}
    for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
        value = out.get(name, 1)
        require(type(value) is int and value >= (name.endswith("depth")), f"speculative_config.{name}", value,
                f"must be an integer >= {int(name.endswith('depth'))}")
    factor, prob = out.get("suffix_decoding_max_spec_factor", 1.0), out.get("suffix_decoding_min_token_prob", 0.1)
    require(isinstance(factor, (int, float)) and factor > 0, "speculative_config.suffix_decoding_max_spec_factor",
            factor, "must be a number > 0")
    require(isinstance(prob, (int, float)) and 0 <= prob <= 1, "speculative_config.suffix_decoding_min_token_prob",
            prob, "must be a number in [0, 1]")
    return out


ROUTING_POLICIES = ("load", "cache_aware")  # the data-parallel front end's (jaxpage/engine/routing.py)


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """How the data-parallel front end picks a replica: ``load`` (the fewest requests in flight) or
    ``cache_aware`` (sglang-router's policy and option names): the replica whose prompts so far share the longest
    prefix with this one, when that prefix beyond the prompt's shared head (engine/routing.py) is at least
    cache_threshold of the prompt beyond it and the replica is not much busier than the least loaded (more than
    balance_abs_threshold requests more and balance_rel_threshold times as many)."""

    policy: str = "cache_aware"  # fewer prompt tokens computed on benchmarks/multi_turn.py (RESULTS.md)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self):
        require(self.policy in ROUTING_POLICIES, "data_parallel_routing", self.policy,
                f"must be one of {', '.join(map(repr, ROUTING_POLICIES))}")
        require(0.0 <= self.cache_threshold <= 1.0, "cache_threshold", self.cache_threshold, "must be in [0, 1]")
        require(type(self.balance_abs_threshold) is int and self.balance_abs_threshold >= 0,
                "balance_abs_threshold", self.balance_abs_threshold, "must be an integer >= 0")
        require(self.balance_rel_threshold >= 1.0, "balance_rel_threshold", self.balance_rel_threshold,
                "must be >= 1")


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """vLLM's: how a pooling model (runner "pooling") makes one vector of a prompt's final-normed hidden states:
    the last token's (LAST), their mean (MEAN) or the first token's (CLS); normalize: to unit length (a request's
    PoolingParams.normalize may say otherwise)."""
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        require(self.pooling_type in POOLING_TYPES, "pooler_config.pooling_type", self.pooling_type,
                f"must be one of {', '.join(POOLING_TYPES)}")

    @property
    def needs_whole_prompt(self) -> bool:
        """Whether every prompt token's hidden state counts (MEAN; CLS the first's): a prefix-cache hit would
        skip them, so such a model runs without prefix caching."""
        return self.pooling_type != "LAST"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """vLLM's cache_config: the KV pool and its tiers."""

    block_size: int
    num_kv_blocks: int
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), int8 or fp8 (e4m3): see STORED_DTYPES
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before (core.block_pool)
    num_host_blocks: int = 0  # the host's swap space in KV blocks (swap_space's bytes with preemption_mode swap)
    # The prefix cache's host and disk tiers (core/kv_offload.py, core/kv_disk_index.py): the host tier's blocks
    # (kv_offloading_size's bytes; 0: off), the disk tier's directory (None: off) and its cap in bytes
    num_offload_blocks: int = 0
    kv_offloading_dir: str | None = None
    kv_offloading_disk_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """vLLM's scheduler_config: what a step may hold and how the scheduler fills it."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str = "recompute"  # a preempted request's blocks: recomputed later, or swapped to the host
    max_seqs_per_request: int | None = None  # most sequences (n, best_of, beams) one request holds (None: any)
    async_scheduling: bool = True  # schedule step N+1 while step N runs, its sampled tokens kept on the device
    # async scheduling of steps with prompts too (admission, chunks, first decodes), not only the decode fast
    # path: off on a CPU, where the host's pass competes with the step for the same cores (build_engine_config)
    async_prompt_steps: bool = True
    # The prompt tokens a step computes beside its decodes (core/prefill_limits.py, vLLM's options): a prefill
    # takes at most long_prefill_token_threshold tokens a step (0: no cap); at most max_num_partial_prefills
    # prefills a step, max_long_partial_prefills of them with more than the threshold left
    long_prefill_token_threshold: int = 64
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # a step whose decodes are fewer than the prompts that could compute in it lifts those caps (prefill_limits.py)
    wave_prefill: bool = True
    # a chunk cut short by long_prefill_token_threshold also takes the padding rows of the token bucket its step
    # pads to anyway (Scheduler._prefill_into_padding)
    prefill_into_padding: bool = True

    @property
    def seqs_per_request(self) -> int:
        """The most sequences one request may hold at once: max_seqs_per_request, at most (and by default)
        max_num_seqs."""
        return min(self.max_seqs_per_request or self.max_num_seqs, self.max_num_seqs)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """vLLM's parallel_config: the devices the engine runs on."""

    tensor_parallel_size: int = 1  # devices the model is split over (model's KV heads already replicated to fit)
    data_parallel_size: int = 1  # engine replicas, each on its own group of tensor_parallel_size devices
    data_parallel_rank: int = 0  # this replica's group: devices [rank * tp, (rank + 1) * tp) (parallel.device_group)
    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)  # the data-parallel front end's choice


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """vLLM's lora_config (None on an engine without LoRA)."""

    max_loras: int = 1  # adapters in the device's slots at once (a step's distinct adapters)
    max_lora_rank: int = 16  # the slots' rank: an adapter of rank up to this
    max_cpu_loras: int = 1  # LoRA adapters kept loaded on the host (an LRU; max_loras of them on the device)
    # the adapters' deltas by the CPU's grouped kernel (the engine's choice: lora_slots.grouped_kernel_runs)
    cpu_lora_kernel: bool = False


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine was asked for, resolved to concrete values once, grouped as vLLM's VllmConfig."""

    model: ModelConfig
    dtype: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None
    attention_backend: str = "xla"  # resolved: xla, pallas_gpu or pallas_tpu
    onednn_packed_weights: bool = False  # bfloat16 Linear kernels packed for oneDNN (models/weight_packing.py)
    scan_layers: bool = True  # one compiled layer in a scan (fast compile), or unrolled layers (faster CPU steps)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    sampler_returns_probs: bool = False  # a draft model's runner: the step returns each row's distribution (q)
    # EAGLE-3's target: the layers whose input (the residual stream) the step returns for every token, side by
    # side (SamplerOutput.hidden_states); empty: none
    aux_hidden_layers: tuple[int, ...] = ()
    pooler_config: PoolerConfig | None = None  # runner "pooling": the step pools instead of sampling; None: generate

    @functools.cached_property
    def step_model(self) -> StepModelConfig:
        """The model as the step compiles it: ``model`` with the LoRA slots and weight packing chosen here."""
        return StepModelConfig.of(self.model, self.lora, self.onednn_packed_weights)

    @property
    def runner(self) -> str:
        """vLLM's runner type: "generate" or "pooling"."""
        return "generate" if self.pooler_config is None else "pooling"

    @property
    def verifies_draft_probs(self) -> bool:
        """A draft model's or EAGLE-3 head's target: its batches carry the drafts' tokens and distributions
        (rejection sampling)."""
        return self.speculative_config is not None and self.speculative_config.method in DEVICE_DRAFT_METHODS

    @property
    def num_draft_tokens(self) -> int:
        """The most draft tokens a row carries a step (0: no speculative decoding)."""
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def kv_dtype(self) -> str:
        """The pool's stored dtype."""
        return kv_storage_dtype(self.cache.kv_cache_dtype, self.dtype).name

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.scheduler.max_model_len, self.cache.block_size)

    def token_buckets(self) -> list[int]:
        """Padded sizes of the flat token axis: 8, 16, then powers of two up to the token budget. On the CPU
        (the XLA path) a step costs in proportion to its padded tokens, so the halfway sizes (24, 48, 96, ...)
        come in too, cutting a step's padding from up to 50% to up to 33% for one compile more per octave, and a
        1-token bucket comes first: a lone decode step then reads the weights for one row, not eight (the Pallas
        kernels take tokens in blocks of 8). A TPU or GPU step below a few hundred tokens is bound by its weight
        and K/V reads (``jaxpage/testing/step_model.py``), which padding does not add to: there each halfway size
        would cost a compile at start for a step a few percent shorter. With speculative decoding the CPU also gets
        one sequence's verify step (1 + num_draft_tokens: its token and its drafts), which would otherwise pad to
        8."""
        limit = self.scheduler.max_num_batched_tokens
        octaves = _powers(8, 2, limit)
        if self.attention_backend != "xla":
            return octaves
        halves = [size * 3 // 2 for size in octaves[1:-1]]
        verify = [1 + self.num_draft_tokens] if 1 + self.num_draft_tokens < limit else []
        return sorted(set([1] + verify + octaves + [h for h in halves if h < limit]))

    def num_seqs_for(self, num_tokens_bucket: int) -> int:
        """The sequence axis is tied to the token axis, so the bucket grid stays two-dimensional."""
        return min(num_tokens_bucket, self.max_sampled_rows)

    def sampled_row_buckets(self) -> list[int]:
        """The sizes the sampled rows pad to where they are not tied to the token bucket (the host layer loop,
        whose sampler stages are programs of their own): the token buckets' sequence counts, so a step of a few
        rows in a large token bucket samples a few rows, not ``num_seqs_for`` its bucket."""
        return sorted({self.num_seqs_for(b) for b in self.token_buckets()})

    @property
    def max_sampled_rows(self) -> int:
        """The most rows a step samples: a row per sequence, and with speculative decoding one per draft position
        too (so that max_num_seqs decoding sequences still have rows for their drafts)."""
        return self.scheduler.max_num_seqs * (1 + self.num_draft_tokens)


def _powers(start: int, base: int, limit: int) -> list[int]:
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= base
    sizes.append(limit)
    return sizes


def pick_bucket(buckets: list[int], n: int) -> int:
    for size in buckets:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# the weights': jaxpage.models.quant, then the checkpoints' quant_methods (jaxpage.models.quant_methods)
QUANTIZATIONS = (None, "int8", "compressed-tensors", "gptq", "awq", "fp8", "gguf")


def resolve_dtype(dtype: str, cpu_bfloat16: bool = False) -> str:
    """'auto' is bfloat16 on accelerators; on the CPU, bfloat16 where ``cpu_bfloat16`` (the engine's choice:
    bfloat16 serves faster there and the checkpoint is not float32), else float32."""
    import jax

    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" and not cpu_bfloat16 else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of 'auto', 'float32', 'bfloat16', 'float16'")
    return dtype


def kv_storage_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The pool's stored dtype: the model's for "auto", else int8 or float8_e4m3fn."""
    return jnp.dtype(STORED_DTYPES.get(kv_cache_dtype, dtype))


def check_quantization(quantization) -> None:
    require(quantization in QUANTIZATIONS, "quantization", quantization,
            f"must be one of {', '.join(map(repr, QUANTIZATIONS))}")


def require(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} {rule}")
