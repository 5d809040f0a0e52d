"""The Llama-family transformer as pure functions over a stacked-weights pytree and the paged KV pool.

Weights (head axes explicit, so they can be sharded over heads later without changing shape logic):
  embed [V, D], final_norm [D], lm_head [D, V] (absent when tied), and under ``layers`` with a leading
  layer axis L: attn_norm [L, D], wq [L, D, H, hd], wk/wv [L, D, KVH, hd], wo [L, H, hd, D],
  optional bq [L, H, hd], bk/bv [L, KVH, hd], bo [L, D], mlp_norm [L, D], w_gate/w_up [L, D, F], w_down [L, F, D].
``layers`` is either that stacked dict (the model runs as a scan over layers: one compiled layer body) or a list
of L per-layer dicts of the same names without the layer axis (``unstack_layers``: the layers are unrolled).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.attention import page_pairs, write_and_attend
from jaxpage.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """The device half of one step's flat batch (all int32, padded to a bucket).

    token_ids, positions, slot_mapping, token_seq: [T]; block_tables: [S, W]; logits_indices: [S].
    Padding tokens write into the null block and belong to an all-null block-table row.
    """

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    logits_indices: jax.Array


jax.tree_util.register_dataclass(
    TokenBatch, data_fields=[f.name for f in dataclasses.fields(TokenBatch)], meta_fields=[])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, rotate-half convention (as transformers): x [T, heads, hd]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _attention_block(cfg: ModelConfig, lp: dict, x: jax.Array, pool: jax.Array, layer: jax.Array,
                     batch: TokenBatch, inv_freq: jax.Array, backend: str, pairs):
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("td,dhk->thk", h, lp["wq"])
    k = jnp.einsum("td,dhk->thk", h, lp["wk"])
    v = jnp.einsum("td,dhk->thk", h, lp["wv"])
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = apply_rope(q, batch.positions, inv_freq)
    k = apply_rope(k, batch.positions, inv_freq)
    attn, pool = write_and_attend(backend, q, k, v, pool, layer, batch.token_seq, batch.positions,
                                  batch.slot_mapping, batch.block_tables, scale=cfg.head_dim ** -0.5, pairs=pairs)
    out = jnp.einsum("thk,hkd->td", attn, lp["wo"])
    if cfg.o_bias:
        out = out + lp["bo"]
    return x + out, pool


def _mlp_block(cfg: ModelConfig, lp: dict, x: jax.Array) -> jax.Array:
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = jax.nn.silu(h @ lp["w_gate"])
    return x + (gate * (h @ lp["w_up"])) @ lp["w_down"]


def unstack_layers(params: dict) -> dict:
    """The same weights with ``layers`` as a list of per-layer dicts, so that the model unrolls its layers.

    A scan over stacked weights slices each layer's weights out of the stack at run time, and XLA:CPU copies
    every slice before its matmul (a quarter of the XLA thread time of a SmolLM2 decode step); unrolled layers
    read their own buffers in place (11-15 % faster steps there), at the price of compiling every layer (about
    4x the compile time). The engine's ``scan_layers=False``."""
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda a: a[i], layers) for i in range(num_layers)]}


def forward_hidden(cfg: ModelConfig, params: dict, pool: jax.Array, batch: TokenBatch, backend: str = "xla"):
    """Runs all layers over the flat batch; returns final-normed hidden states [T, D] and the updated pool.

    Unrolls the layers when ``params["layers"]`` is a list (``unstack_layers``), scans over them otherwise.
    backend: the attention backend (jaxpage.attention.BACKENDS, resolved), static under jit."""
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    x = params["embed"][batch.token_ids]
    block_size = pool.shape[4]  # the XLA attention's plan is the same in every layer: made once per step
    pairs = page_pairs(batch.token_seq, batch.positions, batch.block_tables, block_size) if backend == "xla" else None

    def layer_fn(carry, xs):
        x, pool = carry
        lp, layer = xs
        x, pool = _attention_block(cfg, lp, x, pool, layer, batch, inv_freq, backend, pairs)
        return (_mlp_block(cfg, lp, x), pool), None

    if isinstance(params["layers"], list):
        for i, lp in enumerate(params["layers"]):
            (x, pool), _ = layer_fn((x, pool), (lp, jnp.int32(i)))
    else:
        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, pool), _ = jax.lax.scan(layer_fn, (x, pool), (params["layers"], layers))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), pool


def compute_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """float32 logits [N, V] for hidden states [N, D]."""
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("nd,vd->nv", hidden, params["embed"])
    else:
        logits = hidden @ params["lm_head"]
    return logits.astype(jnp.float32)


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The stacked weights pytree as shapes only (``jax.ShapeDtypeStruct``), for ahead-of-time compilation."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"attn_norm": (n, d), "mlp_norm": (n, d), "wq": (n, d, h, hd), "wk": (n, d, kvh, hd),
              "wv": (n, d, kvh, hd), "wo": (n, h, hd, d), "w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d)}
    if cfg.qkv_bias:
        shapes.update(bq=(n, h, hd), bk=(n, kvh, hd), bv=(n, kvh, hd))
    if cfg.o_bias:
        shapes["bo"] = (n, d)
    params = {"embed": (v, d), "final_norm": (d,), "layers": shapes}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (d, v)
    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), params,
                        is_leaf=lambda x: isinstance(x, tuple))
