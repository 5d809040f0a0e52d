"""Qwen3-MoE: Qwen3's attention (q/k norms) with a top-k MoE of gated experts in every layer."""
from __future__ import annotations

import functools

from jaxpage.config import ModelConfig
from jaxpage.models import llama, qwen3
from jaxpage.models.llama import top_weights  # noqa: F401 (the architecture's interface)
from jaxpage.models.moe import MoE, gguf_moe_names, moe_weights
from jaxpage.models.qwen3 import gguf_permuted  # noqa: F401

MODEL_TYPES = ("qwen3_moe",)
_MOE_NAMES = ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")


def read_config(hf_config) -> ModelConfig:
    step, dense_only = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or ())
    dense = [i for i in range(hf_config.num_hidden_layers) if i in dense_only or (i + 1) % step != 0]
    if dense or not hf_config.num_experts:
        raise ValueError(f"unsupported qwen3_moe config: dense MLP layers {dense or 'all'} (mlp_only_layers="
                         f"{hf_config.mlp_only_layers}, decoder_sparse_step={step}); jaxpage runs MoE in every layer")
    return qwen3.read_config(hf_config, num_experts=hf_config.num_experts,
                             num_experts_per_tok=hf_config.num_experts_per_tok,
                             moe_intermediate_size=hf_config.moe_intermediate_size,
                             norm_topk_prob=bool(hf_config.norm_topk_prob))


class DecoderLayer(llama.DecoderLayer):
    feed_forward = staticmethod(functools.partial(MoE, round_weights=True))


def layer_weights(cfg: ModelConfig) -> dict:
    dense = {path: w for path, w in qwen3.layer_weights(cfg).items() if path[0] != "mlp"}
    return {**dense, **moe_weights(cfg, *_MOE_NAMES)}


GGUF_LAYER_NAMES = {**{k: v for k, v in qwen3.GGUF_LAYER_NAMES.items() if not v.startswith("mlp.")},
                    **gguf_moe_names(*_MOE_NAMES)}
