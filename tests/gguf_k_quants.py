"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) written from float weights in numpy: gguf-py reads them
(``gguf.quants.dequantize``) but has no quantizer for them. Min-max scales per group, rounded to the blocks'
6-bit / int8 super-scales, as llama.cpp lays the bytes out (not its search for the best scales): what the tests
need is real blocks that gguf-py, transformers and llama.cpp read, not llama.cpp's exact numbers."""
from __future__ import annotations

import numpy as np

SUPER = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _super_scale(x: np.ndarray) -> np.ndarray:
    """A block's float16 super-scale (1 where its groups are all zero: their scales are then 0)."""
    x = x.astype(np.float16).astype(np.float32)
    return np.where(x == 0, np.float32(1), x)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins a block -> llama.cpp's 12 bytes (gguf.quants.Q4_K.get_scale_min undoes it)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mins = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    both = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mins, both], axis=1)


def _min_max_k(w: np.ndarray, levels: int):
    """Blocks [n, 256] -> (q [n, 256] in [0, levels], d, dmin [n], sc, m [n, 8]): w ~ d*sc*q - dmin*m."""
    g = w.reshape(-1, 8, 32)
    low = np.minimum(g.min(axis=-1), 0)
    scale = (g.max(axis=-1) - low) / levels
    d, dmin = _super_scale(scale.max(axis=-1) / 63), _super_scale(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(scale / d[:, None]), 0, 63)
    m = np.clip(np.rint(-low / dmin[:, None]), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((g + (dmin[:, None] * m)[..., None]) / np.where(step == 0, 1, step)), 0, levels)
    return q.reshape(-1, SUPER).astype(np.uint8), d, dmin, sc, m


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] values < 16 -> 128 bytes: each 32 bytes two groups, the first in the low nibbles."""
    g = q.reshape(-1, 4, 2, 32)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _min_max_k(w.reshape(-1, SUPER), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), _k_nibbles(q)], axis=1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, m = _min_max_k(w.reshape(-1, SUPER), 31)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for i in range(8):
        qh |= high[:, i] << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qh, _k_nibbles(q & 0x0F)],
                          axis=1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    g = w.reshape(-1, 16, 16)
    scale = np.abs(g).max(axis=-1) / 31
    d = _super_scale(scale.max(axis=-1) / 127)
    scales = np.clip(np.rint(scale / d[:, None]), -128, 127)
    step = (d[:, None] * scales)[..., None]
    q = (np.clip(np.rint(g / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = q >> 4
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, scales.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, ggml_type: str) -> np.ndarray:
    """w [rows, cols] (cols a multiple of 256) -> uint8 [rows, bytes a row], as gguf.quants.quantize gives."""
    rows, cols = w.shape
    blocks = QUANTIZERS[ggml_type](np.asarray(w, np.float32))
    return blocks.reshape(rows, cols // SUPER * blocks.shape[1])


FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for rows not a multiple of 256


def q4_k_m(num_layers: int):
    """llama.cpp's Q4_K_M choice for a decoder tensor (its name, its row length): Q6_K for attn_v and ffn_down in
    the layers use_more_bits picks (the first and last eighth, every third between), Q4_K elsewhere, and the
    fallback type where a row is not a multiple of 256."""
    def more_bits(layer: int) -> bool:
        eighth = num_layers // 8
        return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2

    def choose(name: str, cols: int) -> str:
        layer, tensor = int(name.split(".")[1]), name.split(".")[2]
        kind = "Q6_K" if tensor in ("attn_v", "ffn_down") and more_bits(layer) else "Q4_K"
        return kind if cols % SUPER == 0 else FALLBACKS[kind]
    return choose
