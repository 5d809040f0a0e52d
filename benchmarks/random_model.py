"""Models of real shapes with random weights: for lowering the engine step for a target without the weights,
and for measuring it on a device (the weights do not change the cost of a step).

The pytree is jaxpage.model's stacked layout (see its docstring); ``param_shapes`` gives it as
``jax.ShapeDtypeStruct`` leaves, ``random_params`` fills it on the default device.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig

LLAMA3_8B = ModelConfig(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_parameters=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                     ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
    max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False, o_bias=False)

SMOLLM2_135M = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_parameters=(("rope_type", "default"),),
    max_position_embeddings=8192, tie_word_embeddings=True, qkv_bias=False, o_bias=False)

# A few-layer model of SmolLM2's head shapes, for smoke runs on a CPU
TINY = dataclasses.replace(SMOLLM2_135M, vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)


def param_shapes(cfg: ModelConfig, dtype) -> dict:
    """The weights' pytree (stacked layers) as ShapeDtypeStructs."""
    d, f, heads, kv, hd, layers = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.num_layers)
    shapes = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    layer = {"attn_norm": (d,), "wq": (d, heads, hd), "wk": (d, kv, hd), "wv": (d, kv, hd), "wo": (heads, hd, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    if cfg.qkv_bias:
        layer.update(bq=(heads, hd), bk=(kv, hd), bv=(kv, hd))
    if cfg.o_bias:
        layer["bo"] = (d,)
    tree = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
    tree["layers"] = {k: jax.ShapeDtypeStruct((layers,) + s, dtype) for k, s in layer.items()}
    return tree


FAN_IN_AXES = {"lm_head": (-2,), "wq": (-3,), "wk": (-3,), "wv": (-3,), "wo": (-3, -2), "w_gate": (-2,),
               "w_up": (-2,), "w_down": (-2,)}


def random_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Random weights of ``param_shapes``: norms 1, biases 0, embeddings normal, matrices normal / sqrt(fan-in),
    so that activations stay of order 1 through the layers."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    key = jax.random.key(seed)

    def make(i, name, leaf):
        if "norm" in name:
            return jnp.ones(leaf.shape, leaf.dtype)
        if name.startswith("b"):
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = 1
        for axis in FAN_IN_AXES.get(name, ()):
            fan_in *= leaf.shape[axis]
        normal = jax.jit(lambda k: (jax.random.normal(k, leaf.shape, jnp.float32) * fan_in ** -0.5).astype(leaf.dtype))
        return normal(jax.random.fold_in(key, i))

    return jax.tree_util.tree_unflatten(treedef, [make(i, path[-1].key, leaf)
                                                  for i, (path, leaf) in enumerate(leaves)])
