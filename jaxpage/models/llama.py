"""Llama, Mistral (with its sliding window) and Qwen2: pre-norm decoder layers of attention and a gated MLP."""
from __future__ import annotations

from flax import nnx

from jaxpage.config import ModelConfig
from jaxpage.models.attention import Attention
from jaxpage.models.hf_config import common_fields
from jaxpage.models.layers import MLP, MergedColumnParallelLinear, QKVParallelLinear, RMSNorm

MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_config(hf_config) -> ModelConfig:
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("unsupported model: mlp_bias=True")
    bias = bool(getattr(hf_config, "attention_bias", False))
    qwen2 = hf_config.model_type == "qwen2"
    cfg = ModelConfig(**common_fields(hf_config, qkv_bias=qwen2 or bias, o_bias=not qwen2 and bias))
    if cfg.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; only 'silu'")
    return cfg


class DecoderLayer(nnx.Module):
    """Subclasses replace ``feed_forward`` (MoE architectures)."""

    def __init__(self, cfg: ModelConfig):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.feed_forward(cfg)

    @staticmethod
    def feed_forward(cfg: ModelConfig) -> nnx.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def __call__(self, x, pool, layer, ctx):
        h, pool = self.attn(self.attn_norm(x), pool, layer, ctx)
        x, normed = self.mlp_norm.add_and_norm(x, h)
        return x + self.mlp(normed, ctx.batch.lora), pool


def _t(w):
    return w.T


def attention_weights(cfg: ModelConfig, prefix: str = "attn") -> dict:
    """transformers' self_attn tensors ([out, in]) to the Attention module's head-explicit kernels, q/k/v fused."""
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = tuple(f"self_attn.{p}_proj" for p in "qkv")

    def kernels(q, k, v):
        return QKVParallelLinear.fuse(q.T.reshape(d, h, hd), k.T.reshape(d, kvh, hd), v.T.reshape(d, kvh, hd))

    w = {(prefix, "qkv", "kernel"): (tuple(f"{p}.weight" for p in qkv), kernels),
         (prefix, "o", "kernel"): ("self_attn.o_proj.weight", lambda a: a.T.reshape(h, hd, d))}
    if cfg.qkv_bias:
        w[(prefix, "qkv", "bias")] = (tuple(f"{p}.bias" for p in qkv), lambda q, k, v: QKVParallelLinear.fuse(
            q.reshape(h, hd), k.reshape(kvh, hd), v.reshape(kvh, hd)))
    if cfg.o_bias:
        w[(prefix, "o", "bias")] = ("self_attn.o_proj.bias", lambda b: b)
    return w


def mlp_weights(prefix: str = "mlp") -> dict:
    """gate and up fused (MergedColumnParallelLinear), down."""
    return {(prefix, "gate_up", "kernel"): (("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                                            lambda g, u: MergedColumnParallelLinear.fuse(g.T, u.T)),
            (prefix, "down", "kernel"): ("mlp.down_proj.weight", _t)}


def layer_weights(cfg: ModelConfig) -> dict:
    """Layer param path -> (tensor name under model.layers.{i}., transform to jaxpage's layout)."""
    same = lambda a: a  # noqa: E731
    return {("attn_norm", "weight"): ("input_layernorm.weight", same),
            ("mlp_norm", "weight"): ("post_attention_layernorm.weight", same),
            **attention_weights(cfg), **mlp_weights()}


def top_weights(cfg: ModelConfig, norm=lambda a: a) -> dict:
    w = {("embed", "embedding"): ("model.embed_tokens.weight", lambda a: a),
         ("final_norm", "weight"): ("model.norm.weight", norm)}
    if not cfg.tie_word_embeddings:
        w[("lm_head", "kernel")] = ("lm_head.weight", _t)
    return w


GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_permuted(cfg: ModelConfig) -> bool:
    """llama.cpp interleaves the rotary halves of q/k rows for its llama architecture (Llama, Mistral)."""
    return cfg.model_type != "qwen2"
