"""Which module implements each architecture (Hugging Face ``model_type`` -> module under jaxpage.models)."""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

from jaxpage.config import ModelConfig
from jaxpage.models.quant_methods import quantized_weights

# An architecture module gives: MODEL_TYPES; read_config(hf_config) -> ModelConfig; DecoderLayer (an nnx.Module
# called as layer(x, pool, LayerConstants, StepContext) -> (x, pool)); layer_weights(cfg) and top_weights(cfg)
# (param path -> (transformers tensor name, transform); a tuple of names, one per expert, gives the transform all of
# them); GGUF_LAYER_NAMES (llama.cpp -> transformers names; "{}" in a name: a merged [E, ...] experts' tensor) and
# gguf_permuted(cfg) (whether llama.cpp interleaved the q/k rotary halves). Optional: SCALE_EMBEDDINGS;
# from_gguf(name, array) (undoes what llama.cpp's converter changed in a tensor, given transformers' name);
# gguf_fields(metadata) (config fields a GGUF file holds or implies beyond transformers' GGUF key mapping).
_MODULES = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama",
    "qwen3": "qwen3", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
    "gemma2": "gemma2", "gemma3_text": "gemma3",
}
SUPPORTED_MODEL_TYPES = tuple(_MODULES)


def architecture(model_type: str) -> ModuleType:
    if model_type not in _MODULES:
        raise ValueError(f"unsupported model architecture {model_type!r}; jaxpage supports: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return importlib.import_module(f"jaxpage.models.{_MODULES[model_type]}")


def config_from_hf(hf_config) -> ModelConfig:
    """The engine's ModelConfig of a transformers config; refuses what jaxpage cannot run, naming it."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _MODULES:
        raise ValueError(
            f"unsupported model architecture {model_type!r} "
            f"(architectures={getattr(hf_config, 'architectures', None)}); "
            f"jaxpage supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
    cfg = architecture(model_type).read_config(hf_config)
    stored = quantized_weights(getattr(hf_config, "quantization_config", None))
    return cfg if stored is None else dataclasses.replace(cfg, **stored)
