"""Gemma 2: norms before and after both attention and the MLP, soft-capped attention and final logits,
alternating local (sliding window) and global layers, scaled embeddings and (1 + w) RMSNorm weights."""
from __future__ import annotations

from flax import nnx

from jaxpage.config import ModelConfig
from jaxpage.models import llama
from jaxpage.models.attention import Attention
from jaxpage.models.hf_config import common_fields
from jaxpage.models.layers import MLP, RMSNorm

MODEL_TYPES = ("gemma2",)
SCALE_EMBEDDINGS = True


def read_config(hf_config, **overrides) -> ModelConfig:
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("unsupported model: use_bidirectional_attention=True (an embedding model)")
    bias = bool(getattr(hf_config, "attention_bias", False))
    fields = dict(qkv_bias=bias, o_bias=bias,
                  attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
                  final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
                  query_pre_attn_scalar=hf_config.query_pre_attn_scalar)
    cfg = ModelConfig(**common_fields(hf_config, **{**fields, **overrides}))
    if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported hidden_activation {cfg.hidden_act!r}; only 'gelu_pytorch_tanh', 'gelu'")
    return cfg


class DecoderLayer(nnx.Module):
    """x + post_norm(attn(pre_norm(x))), then the same around the MLP (Gemma 2 and 3)."""

    def __init__(self, cfg: ModelConfig):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(d, eps)
        self.attn = Attention(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm)
        self.post_attn_norm = RMSNorm(d, eps)
        self.mlp_norm = RMSNorm(d, eps)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.post_mlp_norm = RMSNorm(d, eps)

    def __call__(self, x, pool, layer, ctx):
        h, pool = self.attn(self.attn_norm(x), pool, layer, ctx)
        x = x + self.post_attn_norm(h)
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x), ctx.batch.lora)), pool


def plus_one(w):
    """Gemma's RMSNorm scales by (1 + w): folded into the weight once, at load."""
    return w + 1


def layer_weights(cfg: ModelConfig) -> dict:
    norms = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
    return {**{(ours, "weight"): (f"{theirs}.weight", plus_one) for ours, theirs in norms.items()},
            **llama.attention_weights(cfg), **llama.mlp_weights()}


def top_weights(cfg: ModelConfig) -> dict:
    return llama.top_weights(cfg, norm=plus_one)


GGUF_LAYER_NAMES = {
    **llama.GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_permuted(cfg: ModelConfig) -> bool:
    return False


def from_gguf(name: str, array):
    """llama.cpp's converter stores Gemma's norms as 1 + w; transformers' names hold w (``plus_one`` adds it
    back, exactly for weights in [0.5, 2], where the subtraction is exact)."""
    return array - 1 if name.endswith("norm.weight") else array


# llama.cpp's Gemma (swa pattern: every n-th layer global; the 27B models, by their layer count, scale queries
# by hidden_size / heads rather than head_dim), where its GGUF files hold no key for these.
_LLAMA_CPP_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}


def gguf_fields(metadata: dict, arch: str = "gemma2") -> dict:
    """Config fields a llama.cpp Gemma GGUF file holds or implies beyond transformers' GGUF key mapping."""
    pattern, layers_27b = _LLAMA_CPP_GEMMA[arch]
    n = metadata[f"{arch}.block_count"]
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", pattern)
    sliding = [bool((i + 1) % pattern) for i in range(n)] if isinstance(pattern, int) else list(pattern)
    heads = metadata[f"{arch}.attention.head_count"]
    fields = {"layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
              "query_pre_attn_scalar": (metadata[f"{arch}.embedding_length"] // heads if n == layers_27b
                                        else metadata[f"{arch}.attention.key_length"])}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in metadata:
            fields[key] = metadata[f"{arch}.{key}"]
    return fields
