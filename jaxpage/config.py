"""The one config object: what the model is and how the engine holds it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a Llama-family model, read off a transformers config."""

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
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    num_experts: int = 0  # routed experts per MoE layer (0: dense MLP)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def layer_windows(self) -> np.ndarray:
        """int32 [num_layers]: each layer's sliding window in tokens, 0 for full attention."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return np.asarray([self.sliding_window if t == "sliding_attention" and self.sliding_window else 0
                           for t in types], np.int32)

    @property
    def every_layer_windowed(self) -> bool:
        """Every layer slides (Mistral): blocks that no future token can see can go back to the pool."""
        return bool(self.layer_windows().min() > 0)

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model architecture {model_type!r} "
                f"(architectures={getattr(hf_config, 'architectures', None)}); "
                f"jaxpage supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
        _refuse_sliding_window(hf_config)
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("unsupported model: mlp_bias=True")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only 'silu'")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope = dict(_rope_parameters(hf_config))
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope.pop("rope_theta")),
            rope_parameters=tuple(sorted(rope.items())),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
        )

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies for rotary embeddings (default, linear and llama3 scaling)."""
        # float32 arithmetic, as transformers computes it, so positions far out rotate identically
        exponent = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        inv_freq = np.float32(1.0) / (np.float32(self.rope_theta) ** exponent)
        params = dict(self.rope_parameters)
        kind = params.get("rope_type", "default")
        if kind == "default":
            return inv_freq.astype(np.float32)
        if kind == "linear":
            return (inv_freq / params["factor"]).astype(np.float32)
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, params).astype(np.float32)
        raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _rope_parameters(hf_config) -> dict:
    """Rotary settings across transformers versions (rope_parameters in v5, rope_theta/rope_scaling before)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    return {k: v for k, v in params.items() if isinstance(v, (int, float, str))}


def _refuse_sliding_window(hf_config) -> None:
    window = getattr(hf_config, "sliding_window", None)
    used = getattr(hf_config, "use_sliding_window", True)
    if window is not None and used and window < hf_config.max_position_embeddings:
        raise ValueError(
            f"unsupported model: sliding_window={window} is smaller than max_position_embeddings="
            f"{hf_config.max_position_embeddings}; jaxpage implements full attention only")


def _llama3_inv_freq(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine was asked for, resolved to concrete values once."""

    model: ModelConfig
    dtype: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str = "xla"  # resolved: xla, pallas_gpu or pallas_tpu
    scan_layers: bool = True  # one compiled layer in a scan (fast compile), or unrolled layers (faster CPU steps)
    # A bucket of one token under the others: a lone decode step's matmuls are then matrix-vector products, which
    # XLA:CPU runs about twice as fast as the same weights at 8 rows (in plain JAX; EngineArgs.single_token_bucket)
    single_token_bucket: bool = False

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def token_buckets(self) -> list[int]:
        """Padded sizes of the flat token axis: 8, 16, then powers of two and the halfway sizes between them
        (24, 32, 48, 64, 96, ...) up to the token budget. The halfway sizes cut the padding of a step from up
        to 50% to up to 33% (a step costs in proportion to its padded tokens on a CPU) for one compile more per
        octave."""
        octaves = _powers(8, 2, self.max_num_batched_tokens)
        halves = [size * 3 // 2 for size in octaves[1:-1]]
        single = [1] if self.single_token_bucket else []
        return sorted(set(single + octaves + [h for h in halves if h < self.max_num_batched_tokens]))

    def num_seqs_for(self, num_tokens_bucket: int) -> int:
        """The sequence axis is tied to the token axis, so the bucket grid stays two-dimensional."""
        return min(num_tokens_bucket, self.max_num_seqs)


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


DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


def resolve_dtype(dtype: str) -> str:
    """'auto' is float32 on the CPU (exactness first) and bfloat16 on accelerators."""
    import jax

    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be one of 'auto', 'float32', 'bfloat16', 'float16'")
    return dtype


def build_engine_config(model: ModelConfig, *, dtype: str, block_size: int, kv_cache_memory: int | None,
                        num_kv_blocks: int | None, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int | None, gpu_memory_utilization: float,
                        attention_backend: str = "auto", scan_layers: bool = True,
                        single_token_bucket: bool = False) -> EngineConfig:
    """Validates the engine options and sizes the KV pool; the one place an EngineConfig is made."""
    import jax

    from jaxpage import kv_cache
    from jaxpage.attention import resolve_backend
    from pallas_kernels.kv_write_tpu import tile_rows

    dtype = resolve_dtype(dtype)
    _require(block_size in (8, 16, 32, 64, 128), "block_size", block_size, "must be one of 8, 16, 32, 64, 128")
    backend = resolve_backend(attention_backend)
    if backend == "pallas_tpu" or jax.default_backend() == "tpu":  # every TPU step writes with write_kv_tpu
        _require(block_size % tile_rows(dtype) == 0, "block_size", block_size,
                 f"must be a multiple of {tile_rows(dtype)} for a {dtype} KV cache on TPU (its K/V write moves "
                 f"whole ({tile_rows(dtype)}, 128) tiles of a page)")
    if backend == "pallas_tpu":
        _require(max_num_batched_tokens % 8 == 0, "max_num_batched_tokens", max_num_batched_tokens,
                 "must be a multiple of 8 on TPU (the attention kernel takes tokens in blocks of 8 or 16)")
    _require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "must be >= 1")
    _require(max_num_batched_tokens >= max_num_seqs, "max_num_batched_tokens", max_num_batched_tokens,
             f"must be >= max_num_seqs={max_num_seqs}")
    limit = model.max_position_embeddings
    max_model_len = max_model_len or limit
    _require(1 <= max_model_len <= limit, "max_model_len", max_model_len,
             f"must be between 1 and the model's max_position_embeddings={limit}")
    if num_kv_blocks is not None:
        needed = -(-max_model_len // block_size) + 1
        _require(num_kv_blocks >= needed, "num_kv_blocks", num_kv_blocks,
                 f"must be >= {needed}: one sequence of max_model_len={max_model_len} needs that many "
                 f"blocks of {block_size} tokens, plus the null block")
    else:
        budget = kv_cache_memory or kv_cache.device_kv_budget(gpu_memory_utilization)
        budget = budget or DEFAULT_CPU_KV_CACHE_MEMORY
        num_kv_blocks = kv_cache.num_blocks_for_budget(model, block_size, dtype, budget, max_model_len)
    return EngineConfig(model=model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens,
                        attention_backend=backend, scan_layers=scan_layers,
                        single_token_bucket=single_token_bucket and backend == "xla")  # Pallas kernels: 8s


def _require(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} {rule}")
