"""Mixtral: Mistral's attention (its sliding window when the config sets one) with a top-k MoE of gated experts."""
from __future__ import annotations

from jaxpage.config import ModelConfig
from jaxpage.models import llama
from jaxpage.models.hf_config import common_fields
from jaxpage.models.llama import gguf_permuted, top_weights  # noqa: F401 (the architecture's interface)
from jaxpage.models.moe import MoE, gguf_moe_names, moe_weights

MODEL_TYPES = ("mixtral",)
_MOE_NAMES = ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")  # router, experts, gate/up/down


def read_config(hf_config) -> ModelConfig:
    cfg = ModelConfig(**common_fields(
        hf_config, num_experts=hf_config.num_local_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True))
    if cfg.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; only 'silu'")
    return cfg


class DecoderLayer(llama.DecoderLayer):
    feed_forward = staticmethod(MoE)


def layer_weights(cfg: ModelConfig) -> dict:
    dense = {path: w for path, w in llama.layer_weights(cfg).items() if path[0] != "mlp"}
    return {**dense, **moe_weights(cfg, *_MOE_NAMES)}


GGUF_LAYER_NAMES = {**{k: v for k, v in llama.GGUF_LAYER_NAMES.items() if not v.startswith("mlp.")},
                    **gguf_moe_names(*_MOE_NAMES)}
