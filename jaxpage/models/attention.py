"""The attention layer of every architecture: projections, q/k norms, RoPE, then paged attention on the pool.

What differs between layers of one model (window, which RoPE frequencies) comes in ``LayerConstants``, arrays
scanned with the weights; what is the same for a whole step (the batch, the XLA path's page plans, the RoPE
cos/sin of the step's positions) in ``StepContext``.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxpage.cpu_kernels import rotary_embedding as rope_kernel
from jaxpage.attention.backends import page_pairs_by_window, select_pairs, write_and_attend
from jaxpage.config import ModelConfig
from jaxpage.distributed.parallel import MODEL_AXIS
from jaxpage.models.batch import TokenBatch
from jaxpage.models.layers import Linear, QKVParallelLinear, RMSNorm
from jaxpage.models.quant import projection
from jaxpage.models.rope import apply_rope, rope_inv_freq, rope_tables


@dataclasses.dataclass(frozen=True)
class LayerConstants:
    """Per-layer values derived from the config ([L, ...] when stacked): the layer's index in the pool, its
    sliding window (0: full attention), which of the step's RoPE tables it reads (the index of its inverse
    frequencies in ``rope_frequencies``) and which of the step's page plans (the index of its window among the
    model's distinct windows)."""

    index: jax.Array
    window: jax.Array
    rope: jax.Array
    plan: jax.Array


jax.tree_util.register_dataclass(
    LayerConstants, data_fields=["index", "window", "rope", "plan"], meta_fields=[])


def distinct_windows(cfg: ModelConfig) -> list[int]:
    return sorted(set(cfg.layer_windows().tolist()))


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The model's RoPE inverse frequencies [R, head_dim / 2]: the full-attention layers', then the sliding
    layers' where they differ (Gemma 3's local theta)."""
    full = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_parameters))
    local = dict(cfg.local_rope_parameters)
    if not local:
        return full[None]
    return np.stack([full, rope_inv_freq(cfg.head_dim, local.pop("rope_theta"), local)])


def layer_constants(cfg: ModelConfig) -> LayerConstants:
    """Stacked [num_layers, ...] constants, as numpy (constants of the compiled step)."""
    windows = cfg.layer_windows()
    rope = (windows > 0).astype(np.int32) * (len(rope_frequencies(cfg)) - 1)
    plan = np.asarray([distinct_windows(cfg).index(w) for w in windows.tolist()], np.int32)
    return LayerConstants(np.arange(cfg.num_layers, dtype=np.int32), windows, rope, plan)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares, made once per step, not once per layer: the batch, the attention
    backend, on the XLA path the page plan of each distinct window (stacked), and the RoPE cos and sin of the
    step's positions for each of the model's inverse frequencies (XLA recomputed them in every layer: 4-7 % of
    a CPU decode step, benchmarks/RESULTS.md). ``shared`` is what a caller running the layers one by one
    passes from the step's beginning to each layer."""

    batch: TokenBatch
    backend: str
    shared: tuple  # (page plans or None unless backend == "xla", (cos, sin) each [R, T, head_dim / 2] float32)

    @classmethod
    def make(cls, cfg: ModelConfig, batch: TokenBatch, backend: str, block_size: int) -> "StepContext":
        plans = None
        if backend == "xla":
            plans = page_pairs_by_window(batch.token_seq, batch.positions, batch.block_tables, block_size,
                                         distinct_windows(cfg))
        return cls(batch, backend, (plans, rope_tables(batch.positions, rope_frequencies(cfg))))

    def plan(self, layer: LayerConstants):
        plans = self.shared[0]
        return None if plans is None else select_pairs(plans, layer.plan)

    def rotary(self, layer: LayerConstants) -> tuple[jax.Array, jax.Array]:
        """The layer's RoPE (cos, sin), each [T, head_dim / 2]."""
        cos, sin = self.shared[1]
        return cos[layer.rope], sin[layer.rope]


class Attention(nnx.Module):
    """Heads shard over the model axis: the fused q/k/v projection's KV head groups, o's rows (and the pool's KV
    heads with them)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        with projection("qkv"):
            self.qkv = QKVParallelLinear(d, h, kvh, hd, bias=qkv_bias)
        with projection("o"):
            self.o = Linear((h, hd), (d,), (MODEL_AXIS, None, None), bias=o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.soft_cap = cfg.attn_logit_softcap
        self.windowed = bool(cfg.layer_windows().any())

    def __call__(self, x: jax.Array, pool: jax.Array, layer: LayerConstants, ctx: StepContext):
        lora = ctx.batch.lora
        q, k, v = self.rotated_qkv(self.qkv(x, lora), *ctx.rotary(layer))
        b = ctx.batch
        options = {}
        if self.windowed:
            options["window"] = layer.window
        if self.soft_cap is not None:
            options["soft_cap"] = self.soft_cap
        out, pool = write_and_attend(ctx.backend, q, k, v, pool, layer.index, b.token_seq, b.positions,
                                     b.slot_mapping, b.block_tables, scale=self.scale, pairs=ctx.plan(layer),
                                     **options)
        return self.o(out, lora), pool

    def rotated_qkv(self, y: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q and k (normed where the model has q/k norms, then rotated) and v from the fused q/k/v output. On the
        CPU, bfloat16 without q/k norms on one device of the model axis is one kernel (jaxpage/cpu_kernels/rotary_embedding.cc,
        vLLM's rotary_embedding), where XLA:CPU ran two fusions and a copy."""
        def xla(y, cos, sin):
            q, k, v = self.qkv.split(y)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
        if self.q_norm is not None:  # the kernel has no q/k norms
            return xla(y, cos, sin)
        return rope_kernel.ROTARY_EMBEDDING(xla, y, cos, sin)
