"""Qwen3: Llama's layer with an RMSNorm over each head of q and k before RoPE."""
from __future__ import annotations

from jaxpage.config import ModelConfig
from jaxpage.models import llama
from jaxpage.models.hf_config import common_fields
from jaxpage.models.llama import DecoderLayer, top_weights  # noqa: F401 (the architecture's interface)

MODEL_TYPES = ("qwen3",)


def read_config(hf_config, **overrides) -> ModelConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))
    cfg = ModelConfig(**common_fields(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True, **overrides))
    if cfg.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; only 'silu'")
    return cfg


def qk_norm_weights(prefix: str = "attn") -> dict:
    same = lambda a: a  # noqa: E731
    return {(prefix, "q_norm", "weight"): ("self_attn.q_norm.weight", same),
            (prefix, "k_norm", "weight"): ("self_attn.k_norm.weight", same)}


def layer_weights(cfg: ModelConfig) -> dict:
    return {**llama.layer_weights(cfg), **qk_norm_weights()}


GGUF_LAYER_NAMES = {**llama.GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def gguf_permuted(cfg: ModelConfig) -> bool:
    """llama.cpp's qwen3 and qwen3moe architectures keep transformers' q/k row order."""
    return False
