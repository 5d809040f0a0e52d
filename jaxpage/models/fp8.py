"""Block-scaled FP8 checkpoints (quant_method "fp8" with weight_block_size: transformers' FineGrainedFP8 format, as
Qwen3-*-FP8 and DeepSeek publish them), read into the stored form of jaxpage.models.compressed_tensors so the
float8 weights are served by the grouped Linears.

The format, per quantized Linear X: ``X.weight`` float8 e4m3 [out, in] and ``X.weight_scale_inv`` float32
[ceil(out / block_out), ceil(in / block_in)], a weight being its value times its block's scale. A block's scale
is held once per output channel of its group of block_in inputs ([out, in / block_in]); activations stay in the
model's dtype on every backend (weight-only: the dynamic activation scheme's per-token FP8 product is not built)."""
from __future__ import annotations

import numpy as np

from jaxpage.config import require

METHOD = "fp8"
SERVED = ("float8 e4m3 weights in blocks of weight_block_size [out, in] with a scale each (scale_inv), dynamic "
          "activations; each Linear's inputs a multiple of the block's")


def quantized_weights(qc: dict) -> dict:
    """ModelConfig's fields of an FP8 quantization_config; a ValueError naming the field for what is not served."""
    block = qc.get("weight_block_size")
    require(isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
            "quantization_config.weight_block_size", block,
            f"must be two positive integers (per-tensor FP8 is not served: {SERVED})")
    require(qc.get("activation_scheme", "dynamic") == "dynamic", "quantization_config.activation_scheme",
            qc.get("activation_scheme"), f"must be 'dynamic' (static input scales are not served: {SERVED})")
    require(qc.get("fmt", "e4m3") == "e4m3", "quantization_config.fmt", qc.get("fmt"), "must be 'e4m3'")
    return {"quantized_weights": "fp8", "quantization_group_size": block[1], "quantization_zero_point": False}


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with every ``X.weight_scale_inv`` [out blocks, in blocks] as ``X.weight_scale``
    [out, in blocks] (each block's scale on each of its output channels)."""
    return per_output_channel(state, "_scale_inv", *qc["weight_block_size"])


def per_output_channel(state: dict[str, np.ndarray], suffix: str, block_out: int, block_in: int) -> dict:
    """``state`` with every ``X.weight + suffix`` block scale [out blocks, in blocks] as ``X.weight_scale``
    [out, in blocks] (each block's scale on each of its output channels)."""
    state = dict(state)
    for name in [n for n in state if n.endswith(".weight" + suffix)]:
        base = name[:-len(suffix)]
        out, num_in = state[base].shape
        if num_in % block_in:
            raise ValueError(f"quantization_config: the block size {block_in} does not divide {base}'s {num_in} "
                             f"inputs (partial blocks are not served)")
        scale = np.asarray(state.pop(name), np.float32)
        state[base + "_scale"] = np.repeat(scale, block_out, axis=0)[:out]
    return state
