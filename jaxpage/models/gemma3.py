"""Gemma 3 (text): Gemma 2's layer with RMSNorm over each head of q and k (no attention soft cap by default),
local layers with their own RoPE base, global RoPE with optional linear scaling, 5 local : 1 global."""
from __future__ import annotations

from jaxpage.config import ModelConfig
from jaxpage.models import gemma2
from jaxpage.models.gemma2 import SCALE_EMBEDDINGS, DecoderLayer, from_gguf, gguf_permuted, plus_one, top_weights

MODEL_TYPES = ("gemma3_text",)
__all__ = ["SCALE_EMBEDDINGS", "DecoderLayer", "from_gguf", "gguf_permuted", "top_weights", "read_config",
           "layer_weights", "GGUF_LAYER_NAMES", "gguf_fields"]


def read_config(hf_config) -> ModelConfig:
    return gemma2.read_config(hf_config, qk_norm=True)


def layer_weights(cfg: ModelConfig) -> dict:
    return {**gemma2.layer_weights(cfg),
            ("attn", "q_norm", "weight"): ("self_attn.q_norm.weight", plus_one),
            ("attn", "k_norm", "weight"): ("self_attn.k_norm.weight", plus_one)}


GGUF_LAYER_NAMES = {**gemma2.GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def gguf_fields(metadata: dict) -> dict:
    """Gemma 2's, and RoPE per layer type: llama.cpp's local base is 10000 unless the file says otherwise."""
    full = {"rope_type": "default", "rope_theta": float(metadata.get("gemma3.rope.freq_base", 1e6))}
    if metadata.get("gemma3.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(metadata["gemma3.rope.scaling.factor"]))
    local = {"rope_type": "default", "rope_theta": float(metadata.get("gemma3.rope.freq_base_swa", 10000.0))}
    return {**gemma2.gguf_fields(metadata, "gemma3"),
            "rope_parameters": {"full_attention": full, "sliding_attention": local}}
