"""Compressed-tensors checkpoints of small transformers models, as llm-compressor's data-free schemes publish them.

llm-compressor itself is not a dependency (it pins an older transformers): its data-free path is applying a
preset scheme, min-max weight scales, and compressed-tensors' ModelCompressor, which is what this does.
"""
from __future__ import annotations

import copy

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

GROUP_SIZES = {"W4A16": 64, "W4A16_ASYM": 64}  # SmolLM2's 576 columns: not a multiple of the presets' 128


def _weight_min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's min-max observer on a weight: extremes per output channel or per (channel, group)."""
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    if args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.unflatten(-1, (-1, args.group_size))
        return grouped.amin(dim=-1), grouped.amax(dim=-1)
    raise NotImplementedError(f"weight strategy {args.strategy}")


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` transformers will save: one loaded from a GGUF file is marked quantized (gguf), so its
    weights go into a fresh model of the same config without that mark."""
    if getattr(model.config, "quantization_config", None) is None:
        return copy.deepcopy(model)
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = type(model)(config).to(torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    return plain.eval()


@torch.no_grad()
def save_compressed(model: torch.nn.Module, path, scheme: str, group_size: int | None = None) -> None:
    """Save a copy of `model` (left untouched) to the directory `path` as a compressed-tensors checkpoint.

    `scheme` is "W8A8" (int-quantized), "FP8_DYNAMIC" (float-quantized), "W4A16" or "W4A16_ASYM" (pack-quantized,
    groups of `group_size` columns, 64 by default): compressed-tensors' preset, targets ["Linear"], ignore
    ["lm_head"], static weight scales (and zero points) from min-max over each channel or group, activations
    (where any) dynamic per token.
    """
    model = plain_copy(model)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if scheme in GROUP_SIZES:
        qscheme.weights = qscheme.weights.model_copy(update={"group_size": group_size or GROUP_SIZES[scheme]})
    config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if is_module_quantized(module):
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*_weight_min_max(module.weight, args), args)
            module.weight_scale.copy_(scale)
            module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


def load_reference(path) -> torch.nn.Module:
    """The checkpoint at `path` loaded by transformers with its weights decompressed to float32, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    return model.eval()
