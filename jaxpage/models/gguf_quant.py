"""GGUF files served with their decoder Linears as stored (``quantization="gguf"``, vLLM's name; without it a GGUF
file is dequantized to float at load): llama.cpp's block types read into the stored form of
jaxpage.models.compressed_tensors (signed values, a scale and a zero point per group of inputs), so the grouped
int4 / int8 Linears serve them. A model's mix of types (Q4_K_M: Q4_K, Q6_K and, where a row is not a multiple of
256, the Q5_0 / Q8_0 fallbacks) is kept per projection: each fused decoder Linear (qkv, o, gate_up, down) takes
the widest kind, the smallest group and zero points if any of its tensors, in any layer, needs them. The method
and the types found are recorded in the converted model's config as
``quantization_config = {"quant_method": "gguf", "ggml_types": {projection: [type, ...]}}``.

Block layouts (along the inputs of one output row; d, m, dmin float16; q unsigned, read as below):
  Q8_0 (32):  d, 32 int8 q                                  w = d * q
  Q4_0 (32):  d, 16 bytes of nibbles                        w = d * (q - 8)
  Q4_1 (32):  d, m, 16 bytes of nibbles                     w = d * q + m
  Q5_0 (32):  d, 4 bytes of high bits, 16 bytes of nibbles  w = d * (q - 16)
  Q5_1 (32):  d, m, high bits, nibbles                      w = d * q + m
    (weight j < 16: low nibble of byte j, else high nibble of byte j - 16; Q5's bit j of the high word on top)
  Q4_K (256): d, dmin, 12 bytes of 6-bit scales / mins, 128 bytes of nibbles: 8 groups of 32, w = d*sc*q - dmin*m
  Q5_K (256): as Q4_K with 32 bytes of high bits: q of 5 bits
  Q6_K (256): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d: 16 groups of 16,
              w = d * scale * (q - 32)
Stored as: w = scale * (value - zero), value signed (int4 in [-8, 7], int8 in [-128, 127]), zero float32 where
the type has a minimum (fractional: -m / d and the offset)."""
from __future__ import annotations

import numpy as np

from jaxpage.config import require

METHOD = "gguf"
# type -> (stored kind, weights a group, zero points)
TYPES = {"Q8_0": ("int8", 32, False), "Q4_0": ("int4", 32, False), "Q4_1": ("int4", 32, True),
         "Q5_0": ("int8", 32, False), "Q5_1": ("int8", 32, True),
         "Q4_K": ("int4", 32, True), "Q5_K": ("int8", 32, True), "Q6_K": ("int8", 16, False)}
OFFSETS = {"Q8_0": 0, "Q4_0": 8, "Q4_1": 8, "Q5_0": 16, "Q5_1": 16, "Q4_K": 8, "Q5_K": 16, "Q6_K": 32}  # q - offset
SUPER = 256  # the K-quants' weights a block
# transformers' projection -> the decoder Linear that holds it (fused: jaxpage.models.layers)
PROJECTIONS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
               "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
SERVED = (f"decoder Linears of the types {', '.join(TYPES)}, any mix; other files are served dequantized to "
          "float (quantization None)")


def quantized_weights(qc: dict) -> dict:
    """ModelConfig's fields of a GGUF file kept quantized: each projection's scheme (``quantized_projections``)
    from the types its tensors hold, and the widest of them as the model's (what /v1/models reports)."""
    types = qc.get("ggml_types")
    if types is None and "ggml_type" in qc:  # a file of one type, as converted before mixes were kept
        types = {linear: [qc["ggml_type"]] for linear in dict.fromkeys(PROJECTIONS.values())}
    require(isinstance(types, dict) and types, "quantization_config.ggml_types", types,
            "must map each decoder projection to its ggml types")
    kind, group, zero = projection_scheme([t for found in types.values() for t in found])
    return {"quantized_weights": kind, "quantization_group_size": group, "quantization_zero_point": zero,
            "quantized_projections": tuple((linear, *projection_scheme(found))
                                           for linear, found in sorted(types.items()))}


def projection_scheme(ggml_types) -> tuple[str, int, bool]:
    """(stored kind, group size, zero points) that holds every one of these types exactly."""
    unknown = sorted(set(ggml_types) - set(TYPES))
    require(not unknown, "quantization_config.ggml_types", unknown,
            f"are not served kept quantized ({SERVED})")
    schemes = [TYPES[t] for t in ggml_types]
    return ("int8" if any(kind == "int8" for kind, _, _ in schemes) else "int4",
            min(group for _, group, _ in schemes), any(zero for _, _, zero in schemes))


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """Already in the stored form (``stored_values`` at reading)."""
    return state


def types_by_projection(tensor_types: dict[str, str]) -> dict[str, list[str]]:
    """The ggml types each decoder Linear's tensors hold (transformers' weight name -> type name), refusing
    types not served kept, with the types found."""
    found = sorted(set(tensor_types.values()))
    require(set(found) <= set(TYPES), "quantization", "gguf",
            f"keeps the types {', '.join(TYPES)}; this file's decoder Linears hold {', '.join(found)} (serve it "
            "dequantized: quantization None)")
    out: dict[str, set[str]] = {}
    for name, kind in tensor_types.items():
        out.setdefault(PROJECTIONS[name.split(".")[-2]], set()).add(kind)
    return {linear: sorted(kinds) for linear, kinds in sorted(out.items())}


def stored_values(blocks: np.ndarray, ggml_type: str, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """A tensor's raw blocks (uint8, a row's blocks after each other) of ``shape`` [out, in] as its signed values
    [out, in] (float32, exact), scales [out, in / group] and zero points alike (zeros for a symmetric type)."""
    out, num_in = shape
    group = TYPES[ggml_type][1]
    per_block = SUPER if ggml_type.endswith("_K") else 32
    raw = np.ascontiguousarray(blocks, np.uint8).reshape(out * num_in // per_block, -1)
    q, scale, minimum = _READERS[ggml_type](raw)  # w = scale * q - minimum, per group
    scale, minimum = (np.asarray(a, np.float32).reshape(out, num_in // group) for a in (scale, minimum))
    # value = q - offset, signed: w = scale * (value + offset) - minimum = scale * (value - zero)
    values = q.reshape(out, num_in).astype(np.float32) - OFFSETS[ggml_type]
    constant = scale == 0  # w = -minimum throughout: value 0, scale 1 and the zero point give it
    values = np.where(np.repeat(constant, group, axis=1), np.float32(0), values)
    safe = np.where(constant, np.float32(1), scale)
    zero = np.where(constant, minimum, minimum.astype(np.float64) / safe - OFFSETS[ggml_type]).astype(np.float32)
    return {"": values, "_scale": safe, "_zero_point": zero}


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes [blocks, n] -> [blocks, 2n]: every low nibble, then every high one."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _high_bits(raw: np.ndarray) -> np.ndarray:
    """A 32-weight block's high bits (a little-endian uint32, bit j for weight j) -> [blocks, 32] of 0/16."""
    bits = np.unpackbits(raw, axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _q8_0(raw):
    d = _f16(raw, 0)
    return raw[:, 2:].copy().view(np.int8).astype(np.int16), d, np.zeros_like(d)  # q signed already


def _q4_0(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[:, 2:]), d, d * 8


def _q4_1(raw):
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles(raw[:, 4:]), d, -m


def _q5_0(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[:, 6:]) | _high_bits(raw[:, 2:6]), d, d * 16


def _q5_1(raw):
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles(raw[:, 8:]) | _high_bits(raw[:, 4:8]), d, -m


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 groups' scales and minimums, d * sc and dmin * m, [blocks, 8]."""
    d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    s = raw[:, 4:16].reshape(-1, 3, 4)
    low, mins, both = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mins & 0x3F, (both >> 4) | ((mins >> 2) & 0x30)], axis=-1)
    return d * sc, dmin * m


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes -> [blocks, 256]: each 32 bytes hold two groups, low nibbles first."""
    chunks = packed.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, SUPER)


def _q4_k(raw):
    scale, minimum = _k_scales(raw)
    return _k_nibbles(raw[:, 16:]), scale, minimum


def _q5_k(raw):
    scale, minimum = _k_scales(raw)
    high = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_nibbles(raw[:, 48:]) | ((high & 1) << 4).reshape(-1, SUPER), scale, minimum


def _q6_k(raw):
    low = raw[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = raw[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (low & 0x0F).reshape(-1, SUPER) | ((high & 3) << 4).reshape(-1, SUPER)
    scale = _f16(raw, 208)[:, None] * raw[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, scale, scale * 32


_READERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
