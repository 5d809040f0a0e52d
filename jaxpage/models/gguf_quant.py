"""GGUF files served with their decoder Linears as stored (``quantization="gguf"``, vLLM's name; without it a GGUF
file is dequantized to float at load): llama.cpp's block types read into the stored form of
jaxpage.models.compressed_tensors (signed values, a scale and a zero point per group of 32 inputs), so the grouped
int4 / int8 Linears serve them. The method is recorded in the converted model's config as
``quantization_config = {"quant_method": "gguf", "ggml_type": ...}``.

Block layouts (32 weights a block, along the inputs of one output row; d and m float16):
  Q8_0: d, 32 int8 q              w = d * q
  Q4_0: d, 16 bytes of nibbles    w = d * (q - 8)     q of weight j < 16: low nibble of byte j, else high of j - 16
  Q4_1: d, m, 16 bytes of nibbles w = d * q + m       = d * ((q - 8) - zero), zero = -m / d - 8 (fractional)
Every decoder Linear must hold the same type (a model's K-quant mixes, Q4_K / Q6_K, are not served kept)."""
from __future__ import annotations

import numpy as np

from jaxpage.config import require

METHOD = "gguf"
TYPES = {"Q8_0": ("int8", False), "Q4_0": ("int4", False), "Q4_1": ("int4", True)}  # -> (stored kind, zero points)
BLOCK = 32
SERVED = (f"one of {', '.join(TYPES)} in every decoder Linear (blocks of {BLOCK}); other files are served "
          "dequantized to float (quantization None)")


def quantized_weights(qc: dict) -> dict:
    """ModelConfig's fields of a GGUF file kept quantized (its decoder Linears' ``ggml_type``)."""
    kind = qc.get("ggml_type")
    require(kind in TYPES, "quantization_config.ggml_type", kind, f"is not served kept quantized ({SERVED})")
    return {"quantized_weights": TYPES[kind][0], "quantization_group_size": BLOCK,
            "quantization_zero_point": TYPES[kind][1]}


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """Already in the stored form (``stored_values`` at reading)."""
    return state


def linear_type(tensor_types: dict[str, str]) -> str:
    """The one ggml type of a file's decoder Linear weights (name -> type name); a ValueError naming the types
    found where they differ or are not served."""
    found = sorted(set(tensor_types.values()))
    require(len(found) == 1 and found[0] in TYPES, "quantization", "gguf",
            f"needs one ggml type in every decoder Linear, served: {', '.join(TYPES)}; this file holds "
            f"{', '.join(found)} (serve it dequantized: quantization None)")
    return found[0]


def stored_values(blocks: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """A tensor's raw blocks (uint8, a row's blocks after each other) of ``shape`` [out, in] as its signed values
    [out, in] (float32, exact), scales [out, in / 32] and, for Q4_1, zero points alike."""
    out, num_in = shape
    raw = np.ascontiguousarray(blocks, np.uint8).reshape(out, num_in // BLOCK, -1)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if ggml_type == "Q8_0":
        return {"": raw[..., 2:].copy().view(np.int8).reshape(out, num_in).astype(np.float32), "_scale": d}
    packed = raw[..., 4:] if ggml_type == "Q4_1" else raw[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(out, num_in).astype(np.float32) - 8
    if ggml_type == "Q4_0":
        return {"": q, "_scale": d}
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    constant = d == 0  # a constant block (all q 0): scale 1, and the zero point gives w = -8 - zero = m
    scale = np.where(constant, np.float32(1), d)
    zero = np.where(constant, -8 - m, -(m.astype(np.float64) / np.where(constant, 1, d)) - 8).astype(np.float32)
    return {"": q, "_scale": scale, "_zero_point": zero}
