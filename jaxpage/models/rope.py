"""Rotary position embeddings: the inverse frequencies of each RoPE variant, and their application."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, params: dict) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] (default, linear and llama3 scaling), in float32 arithmetic as
    transformers computes them, so that positions far out rotate identically."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(theta) ** exponent)
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq.astype(np.float32)
    if kind == "linear":
        return (inv_freq / params["factor"]).astype(np.float32)
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params).astype(np.float32)
    raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def read_rope_parameters(hf_config) -> dict:
    """Rotary settings across transformers versions (rope_parameters in v5, rope_theta/rope_scaling before).
    Models with per-layer-type settings (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}) give
    the full-attention layers' here; ``read_rope_parameters(hf_config, "sliding_attention")`` the others'."""
    return _rope_parameters(hf_config, "full_attention")


def _rope_parameters(hf_config, layer_type: str) -> dict:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    return {k: v for k, v in params.items() if isinstance(v, (int, float, str))}


def sliding_rope_parameters(hf_config) -> dict:
    return _rope_parameters(hf_config, "sliding_attention")


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [R, T, hd/2] of positions [T] times each row of inv_freq [R, hd/2], in float32."""
    freqs = positions.astype(jnp.float32)[None, :, None] * jnp.asarray(inv_freq, jnp.float32)[:, None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, rotate-half convention (as transformers): x [T, heads, hd], cos and sin [T, hd/2]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
