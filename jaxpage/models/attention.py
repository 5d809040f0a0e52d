"""The attention layer of every architecture: projections, q/k norms, RoPE, then paged attention on the pool.

What differs between layers of one model (window, RoPE frequencies) comes in ``LayerConstants``, arrays scanned
with the weights; what is the same for a whole step (the batch, the XLA path's page plans) in ``StepContext``.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxpage.attention.backends import page_pairs_by_window, select_pairs, write_and_attend
from jaxpage.config import ModelConfig
from jaxpage.distributed.parallel import MODEL_AXIS
from jaxpage.models.batch import TokenBatch
from jaxpage.models.layers import Linear, QKVParallelLinear, RMSNorm
from jaxpage.models.rope import apply_rope, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class LayerConstants:
    """Per-layer values derived from the config ([L, ...] when stacked): the layer's index in the pool, its
    sliding window (0: full attention), its RoPE inverse frequencies and which of the step's page plans it
    reads (the index of its window among the model's distinct windows)."""

    index: jax.Array
    window: jax.Array
    inv_freq: jax.Array
    plan: jax.Array


jax.tree_util.register_dataclass(
    LayerConstants, data_fields=["index", "window", "inv_freq", "plan"], meta_fields=[])


def distinct_windows(cfg: ModelConfig) -> list[int]:
    return sorted(set(cfg.layer_windows().tolist()))


def layer_constants(cfg: ModelConfig) -> LayerConstants:
    """Stacked [num_layers, ...] constants, as numpy (constants of the compiled step)."""
    windows = cfg.layer_windows()
    full = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_parameters))
    local = dict(cfg.local_rope_parameters)
    sliding = (rope_inv_freq(cfg.head_dim, local.pop("rope_theta"), local) if local else full)
    inv_freq = np.stack([sliding if w else full for w in windows])
    plan = np.asarray([distinct_windows(cfg).index(w) for w in windows.tolist()], np.int32)
    return LayerConstants(np.arange(cfg.num_layers, dtype=np.int32), windows, inv_freq, plan)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares: the batch, the attention backend and, on the XLA path, the page
    plan of each distinct window, stacked (made once per step, not once per layer)."""

    batch: TokenBatch
    backend: str
    plans: object  # PagePairs stacked over the model's distinct windows; None unless backend == "xla"

    @classmethod
    def make(cls, cfg: ModelConfig, batch: TokenBatch, backend: str, block_size: int) -> "StepContext":
        plans = None
        if backend == "xla":
            plans = page_pairs_by_window(batch.token_seq, batch.positions, batch.block_tables, block_size,
                                         distinct_windows(cfg))
        return cls(batch, backend, plans)

    def plan(self, layer: LayerConstants):
        return None if self.plans is None else select_pairs(self.plans, layer.plan)


class Attention(nnx.Module):
    """Heads shard over the model axis: the fused q/k/v projection's KV head groups, o's rows (and the pool's KV
    heads with them)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = QKVParallelLinear(d, h, kvh, hd, bias=qkv_bias)
        self.o = Linear((h, hd), (d,), (MODEL_AXIS, None, None), bias=o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.soft_cap = cfg.attn_logit_softcap
        self.windowed = bool(cfg.layer_windows().any())

    def __call__(self, x: jax.Array, pool: jax.Array, layer: LayerConstants, ctx: StepContext):
        lora = ctx.batch.lora
        q, k, v = self.qkv.split(self.qkv(x, lora))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        b = ctx.batch
        q, k = apply_rope(q, b.positions, layer.inv_freq), apply_rope(k, b.positions, layer.inv_freq)
        options = {}
        if self.windowed:
            options["window"] = layer.window
        if self.soft_cap is not None:
            options["soft_cap"] = self.soft_cap
        out, pool = write_and_attend(ctx.backend, q, k, v, pool, layer.index, b.token_seq, b.positions,
                                     b.slot_mapping, b.block_tables, scale=self.scale, pairs=ctx.plan(layer),
                                     **options)
        return self.o(out, lora), pool
