"""Checkpoints published in compressed-tensors' format (llm-compressor's output, vLLM's quant_method
"compressed-tensors"): the schemes served as they are stored, read off a transformers config's
``quantization_config``, and their stored weights put into the model's quantized Linears unchanged.

Served, in every decoder Linear with the LM head left float:
  int8 weights with a scale per output channel, symmetric ("int-quantized": W8A8 int8, or W8A16);
  float8 e4m3 weights with a scale per output channel or per block ("float-quantized": FP8 dynamic, FP8_BLOCK);
  int4 or int8 weights packed eight (four) to an int32 ("pack-quantized": W4A16, W4A16_ASYM, W8A16 packed), with a
  scale per group of input columns or per output channel, and a zero point per group where asymmetric.
Anything else is refused at load, naming the field and what is served."""
from __future__ import annotations

import re

import numpy as np

from jaxpage.config import require
from jaxpage.models.fp8 import per_output_channel

METHOD = "compressed-tensors"
FORMATS = {"int-quantized": ("int", "int8"), "float-quantized": ("float", "fp8"),
           "pack-quantized": ("int", None)}  # format -> (type, stored kind; packed: by num_bits)
PACKED_KINDS = {4: "int4", 8: "int8"}
SERVED = ("int8 or float8 weights of 8 bits, symmetric, one scale per output channel (format int-quantized or "
          "float-quantized: W8A8 int8, W8A16, FP8 dynamic) or float8 weights with a scale per block (FP8_BLOCK); "
          "int4 or int8 weights packed in int32 with a scale per group or channel, symmetric or with zero points, "
          "no activation quantization (format pack-quantized: W4A16, W4A16_ASYM); targets ['Linear'], the LM head "
          "alone ignored")


def quantized_weights(qc: dict) -> dict:
    """The decoder Linears' stored weights of a compressed-tensors quantization_config, as ModelConfig's fields
    (quantized_weights: "int8", "fp8" or "int4"; quantization_group_size: input columns a scale covers, None for
    one per output channel of the int-/float-quantized formats; quantization_zero_point). A ValueError naming
    the field for anything not served."""
    fmt = qc.get("format")
    require(fmt in FORMATS, "quantization_config.format", fmt, f"is not served (served: {SERVED})")
    groups = list((qc.get("config_groups") or {}).values())
    require(len(groups) == 1, "quantization_config.config_groups", len(groups), f"must be one group ({SERVED})")
    group = groups[0]
    require(group.get("targets") == ["Linear"], "quantization_config.config_groups.targets", group.get("targets"),
            "must be ['Linear']")
    ignore = [name for name in qc.get("ignore") or [] if not _is_lm_head(name)]
    require(not ignore, "quantization_config.ignore", ignore, "must name the LM head alone")
    weights = group.get("weights") or {}
    if fmt == "pack-quantized":
        return _packed_weights(weights, group.get("input_activations"))
    block = _block(weights) if fmt == "float-quantized" and weights.get("strategy") == "block" else None
    for key, want in (("num_bits", 8), ("type", FORMATS[fmt][0]), ("symmetric", True),
                      ("strategy", "block" if block else "channel"), ("dynamic", False)):
        _require_weights(weights, key, want)
    acts = group.get("input_activations")
    require(acts is None or acts.get("dynamic") is True, "quantization_config.config_groups.input_activations",
            acts, "must be dynamic (or absent): static activation scales are not served")
    weight_only = acts is None  # W8A16 (int8 or float8): activations stay unquantized on every backend
    group_size = block[1] if block else -1 if weight_only else None
    return {"quantized_weights": FORMATS[fmt][1], "quantization_group_size": group_size,
            "quantization_zero_point": False}


def _block(weights: dict) -> list:
    block = weights.get("block_structure")
    require(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
            "quantization_config.config_groups.weights.block_structure", block, "must be two positive integers")
    return block


def _packed_weights(weights: dict, acts) -> dict:
    require(weights.get("num_bits") in PACKED_KINDS, "quantization_config.config_groups.weights.num_bits",
            weights.get("num_bits"), f"must be 4 or 8 for format pack-quantized ({SERVED})")
    require(acts is None, "quantization_config.config_groups.input_activations", acts,
            "must be absent for format pack-quantized (weight-only: W4A16)")
    for key, want in (("type", "int"), ("dynamic", False)):
        _require_weights(weights, key, want)
    strategy = weights.get("strategy")
    require(strategy in ("group", "channel"), "quantization_config.config_groups.weights.strategy", strategy,
            "must be 'group' or 'channel' for format pack-quantized")
    size = weights.get("group_size") if strategy == "group" else -1  # -1: per channel, weight-only
    require(strategy == "channel" or (isinstance(size, int) and size > 0),
            "quantization_config.config_groups.weights.group_size", size, "must be a positive integer")
    require(weights.get("actorder") in (None, "weight"), "quantization_config.config_groups.weights.actorder",
            weights.get("actorder"), "must be None or 'weight' (activation-ordered groups are not served)")
    return {"quantized_weights": PACKED_KINDS[weights["num_bits"]], "quantization_group_size": size,
            "quantization_zero_point": weights.get("symmetric") is False}


def _require_weights(weights: dict, key: str, want) -> None:
    require(weights.get(key) == want, f"quantization_config.config_groups.weights.{key}", weights.get(key),
            f"must be {want!r} ({SERVED})")


def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.startswith("re:") and re.fullmatch(name[3:], "lm_head") is not None


def unpack_words(packed: np.ndarray, num_bits: int, axis: int) -> np.ndarray:
    """Unsigned values out of int32 words along ``axis``, 32 / num_bits a word, value i in bits
    [i * num_bits, (i + 1) * num_bits) of its word (the packing of compressed-tensors, GPTQ and AWQ), as int16."""
    words = np.moveaxis(np.asarray(packed, np.int32), axis, -1).astype(np.uint32)
    shifts = np.arange(0, 32, num_bits, dtype=np.uint32)
    values = (words[..., None] >> shifts) & np.uint32((1 << num_bits) - 1)
    return np.moveaxis(values.reshape(*words.shape[:-1], -1).astype(np.int16), -1, axis)


def unpack_int32(packed: np.ndarray, num_bits: int, length: int, axis: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32 undone: the first ``length`` values along ``axis``, stored with an
    offset of 2**(num_bits - 1), as signed int8."""
    values = np.take(unpack_words(packed, num_bits, axis), np.arange(length), axis=axis)
    return (values - (1 << (num_bits - 1))).astype(np.int8)


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """A pack-quantized checkpoint's tensors (int4 or int8 weights) with every ``X.weight_packed``
    (int32 [out, in / words]) read into ``X.weight`` (its signed values [out, in], as float32, exact) and every
    packed zero point (int32 [out / words, groups]) into its values [out, groups]; a block-scaled one's scales
    [out blocks, in blocks] held per output channel; other checkpoints' unchanged."""
    weights = next(iter(qc["config_groups"].values())).get("weights") or {}
    if weights.get("strategy") == "block":
        return per_output_channel(state, "_scale", *weights["block_structure"])
    num_bits = weights.get("num_bits")
    state = dict(state)
    for name in [n for n in state if n.endswith(".weight_packed")]:
        base = name[:-len("_packed")]
        shape = [int(s) for s in np.asarray(state.pop(base + "_shape")).reshape(-1)]
        state[base] = unpack_int32(state.pop(name), num_bits, shape[1], axis=1).astype(np.float32)
        zero = state.get(base + "_zero_point")
        if zero is not None and np.asarray(zero).dtype == np.int32:
            state[base + "_zero_point"] = unpack_int32(zero, num_bits, shape[0], axis=0).astype(np.float32)
    return state
