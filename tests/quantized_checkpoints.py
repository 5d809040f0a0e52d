"""Compressed-tensors checkpoints of small transformers models, as llm-compressor's data-free schemes publish them.

llm-compressor itself is not a dependency (it pins an older transformers): its data-free path is applying a
preset scheme, min-max weight scales, and compressed-tensors' ModelCompressor, which is what this does.
"""
from __future__ import annotations

import copy
import json

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
    if args.strategy == QuantizationStrategy.BLOCK:
        bo, bi = args.block_structure
        blocks = weight.unflatten(1, (-1, bi)).unflatten(0, (-1, bo))
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
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

    `scheme` is "W8A8" (int-quantized), "FP8_DYNAMIC" or "FP8_BLOCK" (float-quantized; blocks of `group_size`
    squared, 64 by default), "W4A16" or "W4A16_ASYM" (pack-quantized, groups of `group_size` columns, 64 by
    default): compressed-tensors' preset, targets ["Linear"], ignore ["lm_head"], static weight scales (and zero
    points) from min-max over each channel, group or block, activations (where any) dynamic.
    """
    model = plain_copy(model)
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if scheme in GROUP_SIZES:
        qscheme.weights = qscheme.weights.model_copy(update={"group_size": group_size or GROUP_SIZES[scheme]})
    if scheme == "FP8_BLOCK":  # blocks of group_size x group_size (64 by default: SmolLM2's 576 columns)
        size = group_size or 64
        qscheme.weights = qscheme.weights.model_copy(update={"block_structure": [size, size]})
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


# ------------------------------------------------------------------------------------------- GPTQ and AWQ
# The published formats (GPTQ: AutoGPTQ / GPTQModel's QuantLinear; AWQ: AutoAWQ's GEMM layout) written from a
# pack-quantized checkpoint's integers, so transformers loading that checkpoint is the reference for both.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ word position j holds column 8w + AWQ_ORDER[j]


def _pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed 32 / bits to an int32 along ``dim``, value j of a word in bits [j*bits, ...)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (torch.arange(per) * bits)
    words = v.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


def _stored_integers(path):
    """Every quantized Linear of the compressed-tensors checkpoint at ``path`` (pack-quantized, or int-quantized
    with a scale per channel): name -> (unsigned weights
    [out, in], unsigned zero points [out, groups] or None, scales [out, groups]), with the other tensors and the
    quantization's bits and group size."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    weights = next(iter(json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
                        .values()))["weights"]
    bits, offset = weights["num_bits"], 2 ** (weights["num_bits"] - 1)
    linears = {}
    for name in [n[:-len(".weight_packed")] for n in state if n.endswith(".weight_packed")]:
        shape = torch.Size(state.pop(name + ".weight_shape").tolist())
        q = unpack_from_int32(state.pop(name + ".weight_packed"), bits, shape).to(torch.int64) + offset
        zero = state.pop(name + ".weight_zero_point", None)
        scale = state.pop(name + ".weight_scale")
        zero = (None if zero is None else
                unpack_from_int32(zero, bits, torch.Size(scale.shape), packed_dim=0).to(torch.int64) + offset)
        linears[name] = (q, zero, scale)
    for name in [n[:-len(".weight_scale")] for n in state if n.endswith(".weight_scale")]:  # int-quantized
        linears[name] = (state.pop(name + ".weight").to(torch.int64) + offset, None, state.pop(name + ".weight_scale"))
    return linears, state, bits, weights.get("group_size") or -1


def _save_with(path, source, state: dict, quantization_config: dict) -> None:
    import shutil

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json", "recipe.yaml"):
            shutil.copy(f, path / f.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def save_gptq(source, path, checkpoint_format: str = "gptq") -> None:
    """The pack-quantized checkpoint at ``source`` rewritten as GPTQ (desc_act off): qweight int32 [in / per,
    out] packed along the inputs, qzeros int32 [groups, out / per] packed along the outputs (format "gptq" stores
    each zero minus one, "gptq_v2" the zero), scales [groups, out] in the source's dtype, g_idx [in]."""
    linears, state, bits, group_size = _stored_integers(source)
    sym = all(zero is None for _, zero, _ in linears.values())
    for name, (q, zero, scale) in linears.items():
        zero = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int64) if zero is None else zero
        if checkpoint_format == "gptq" and bool((zero == 0).any()):
            raise ValueError(f"{name}: a zero point of 0 cannot be stored in format gptq (zero minus one)")
        stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
        state[name + ".qweight"] = _pack_words(q.T, bits, dim=0)
        state[name + ".qzeros"] = _pack_words(stored_zero.T, bits, dim=1)
        state[name + ".scales"] = scale.T  # the source's dtype (published: float16), so the reference is exact
        state[name + ".g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // (
            q.shape[1] if group_size == -1 else group_size)
    _save_with(path, source, state, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": sym,
        "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True})


def save_awq(source, path) -> None:
    """The pack-quantized 4-bit checkpoint with zero points at ``source`` rewritten as AWQ's GEMM layout: qweight
    int32 [in, out / 8] and qzeros int32 [groups, out / 8], both packed along the outputs in AWQ's order,
    scales [groups, out]."""
    linears, state, bits, group_size = _stored_integers(source)
    order = torch.tensor(AWQ_ORDER)
    for name, (q, zero, scale) in linears.items():
        interleave = (torch.arange(q.shape[0]).reshape(-1, 8)[:, order]).reshape(-1)
        state[name + ".qweight"] = _pack_words(q.T[:, interleave], bits, dim=1)
        state[name + ".qzeros"] = _pack_words(zero.T[:, interleave], bits, dim=1)
        state[name + ".scales"] = scale.T  # the source's dtype (published: float16), so the reference is exact
    _save_with(path, source, state, {"quant_method": "awq", "bits": bits, "group_size": group_size,
                                     "zero_point": True, "version": "gemm", "modules_to_not_convert": None})


@torch.no_grad()
def save_fp8_blocks(model: torch.nn.Module, path, block: tuple[int, int] = (128, 128)) -> None:
    """A copy of ``model`` saved as transformers' block-scaled FP8 checkpoint (quant_method "fp8", what Qwen3-FP8
    publishes): every decoder Linear's weight float8 e4m3 with ``weight_scale_inv`` [out / block[0], in /
    block[1]], each block's absmax over 448 (e4m3's largest value)."""
    from safetensors.torch import load_file, save_file

    plain_copy(model).save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    bo, bi = block
    for name in [n for n in state if ".layers." in n and n.endswith("proj.weight")]:
        w = state[name].float()
        out, num_in = w.shape
        padded = torch.nn.functional.pad(w, (0, -num_in % bi, 0, -out % bo))
        blocks = padded.unflatten(1, (-1, bi)).unflatten(0, (-1, bo))
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448
        spread = scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :num_in]
        state[name] = (w / spread).to(torch.float8_e4m3fn)
        state[name[:-len("weight")] + "weight_scale_inv"] = scale
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": None}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def requantized_gguf(source, path, ggml_type):
    """The GGUF file at ``source`` written to ``path`` with every decoder layer's 2-D tensor requantized to
    ``ggml_type`` (a type name, or a function of the tensor's name and row length giving one, as llama.cpp's
    mixes choose) from its dequantized values: by gguf-py, the K-quants by tests/gguf_k_quants.py; metadata,
    tokenizer and other tensors copied."""
    import gguf
    import numpy as np

    from tests import gguf_k_quants

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    choose = ggml_type if callable(ggml_type) else lambda name, cols: ggml_type
    for t in reader.tensors:
        data, raw_type = np.asarray(t.data), t.tensor_type
        if t.name.startswith("blk.") and len(t.shape) == 2:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape([int(d) for d in reversed(t.shape)])
            kind = choose(t.name, w.shape[1])
            raw_type = gguf.GGMLQuantizationType[kind]
            data = (gguf_k_quants.quantize(w, kind) if kind in gguf_k_quants.QUANTIZERS
                    else gguf.quants.quantize(w, raw_type))
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
