"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
all experts run as one grouped matmul (``jax.lax.ragged_dot``) over the token rows sorted by expert."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.config import ModelConfig
from jaxpage.distributed.parallel import MODEL_AXIS
from jaxpage.models.layers import Linear, gated_activation, param
from jaxpage.models.lora_slots import LoRAMapping


class GroupedLinear(nnx.Module):
    """Per-expert kernels [E, in, out]: rows of x, sorted by expert, each times its expert's kernel."""

    def __init__(self, num_experts: int, d_in: int, d_out: int, names: tuple):
        self.kernel = param((num_experts, d_in, d_out), names)

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(x, self.kernel[...], group_sizes)


class MoE(nnx.Module):
    """Gated experts; their hidden (F) axis shards over the model axis, like a dense MLP's.

    round_weights: the routing weights are rounded to the activations' dtype before weighting the experts'
    outputs (Qwen3-MoE); otherwise they weight them in float32 (Mixtral), as transformers does."""

    def __init__(self, cfg: ModelConfig, round_weights: bool = False):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = Linear((d,), (e,), (None, None))
        self.gate = GroupedLinear(e, d, f, (None, None, MODEL_AXIS))
        self.up = GroupedLinear(e, d, f, (None, None, MODEL_AXIS))
        self.down = GroupedLinear(e, f, d, (None, MODEL_AXIS, None))
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.normalize, self.round_weights, self.act = cfg.norm_topk_prob, round_weights, cfg.hidden_act

    def route(self, x: jax.Array, lora: LoRAMapping | None = None) -> tuple[jax.Array, jax.Array]:
        """Each token's top-k experts [T, k] and their float32 weights [T, k]."""
        probs = jax.nn.softmax(self.router(x, lora).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def __call__(self, x: jax.Array, lora: LoRAMapping | None = None) -> jax.Array:
        """lora: the step's adapters, for the router (the experts take no adapter)."""
        weights, experts = self.route(x, lora)
        t, k = experts.shape
        flat = experts.reshape(-1)  # assignment i is token i // k's (i % k)-th choice
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        rows = x[order // k]
        h = gated_activation(self.act, self.gate(rows, sizes), self.up(rows, sizes))
        y = self.down(h, sizes)
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
        y = y[unsort].reshape(t, k, -1)
        w = weights.astype(x.dtype) if self.round_weights else weights
        return jnp.sum((y * w[..., None]).astype(x.dtype), axis=1)


def _stack_transposed(*per_expert: np.ndarray) -> np.ndarray:
    return np.stack([w.T for w in per_expert])


def moe_weights(cfg: ModelConfig, router: str, experts: str, gate: str, up: str, down: str,
                prefix: str = "mlp") -> dict:
    """transformers' per-expert tensors ``{experts}.{e}.{gate|up|down}.weight`` ([out, in]) stacked into the
    MoE module's kernels, and the router ``{router}.weight``."""
    def each(name: str) -> tuple:
        return tuple(f"{experts}.{e}.{name}.weight" for e in range(cfg.num_experts))

    return {(prefix, "router", "kernel"): (f"{router}.weight", lambda a: a.T),
            (prefix, "gate", "kernel"): (each(gate), _stack_transposed),
            (prefix, "up", "kernel"): (each(up), _stack_transposed),
            (prefix, "down", "kernel"): (each(down), _stack_transposed)}


def gguf_moe_names(router: str, experts: str, gate: str, up: str, down: str) -> dict:
    """llama.cpp's router and merged [E, ...] expert tensors -> transformers' names ({} is the expert)."""
    return {"ffn_gate_inp": router, "ffn_gate_exps": f"{experts}.{{}}.{gate}",
            "ffn_up_exps": f"{experts}.{{}}.{up}", "ffn_down_exps": f"{experts}.{{}}.{down}"}
