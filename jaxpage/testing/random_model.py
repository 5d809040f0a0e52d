"""Models of real shapes with random weights: for lowering the engine step for a target without the weights,
and for measuring it on a device (the weights do not change the cost of a step).

The pytree is jaxpage.models' stacked layout (see its docstring); ``param_shapes`` gives it as
``jax.ShapeDtypeStruct`` leaves, ``random_params`` fills it on the default device.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.models import abstract_params

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


# Checkpoints published quantized, by the decoder Linears' stored form (ModelConfig's fields): compressed-tensors'
# W8A8 and FP8 dynamic (a scale per output channel), W4A16 (GPTQ and AWQ load into the same) in groups of 64 with
# zero points, block-scaled FP8 (quant_method fp8) in blocks of 64 inputs, a GGUF file's Q4_1 kept as stored, and
# a Q4_K_M file whose rows are multiples of 256 (Llama-3-8B's): Q6_K beside Q4_K in v and down, Q4_K elsewhere
PUBLISHED_SCHEMES = {
    "int8": {"quantization": "compressed-tensors", "quantized_weights": "int8"},
    "fp8": {"quantization": "compressed-tensors", "quantized_weights": "fp8"},
    "int4": {"quantization": "compressed-tensors", "quantized_weights": "int4", "quantization_group_size": 64,
             "quantization_zero_point": True},
    "fp8-block": {"quantization": "fp8", "quantized_weights": "fp8", "quantization_group_size": 64},
    "gguf-q4_1": {"quantization": "gguf", "quantized_weights": "int4", "quantization_group_size": 32,
                  "quantization_zero_point": True},
    "gguf-q4_k_m": {"quantization": "gguf", "quantized_weights": "int8", "quantization_group_size": 16,
                    "quantization_zero_point": True,
                    "quantized_projections": (("down", "int8", 16, True), ("gate_up", "int4", 32, True),
                                              ("o", "int4", 32, True), ("qkv", "int8", 16, True))},
}


def published_quantized(cfg: ModelConfig, scheme: str) -> ModelConfig:
    """``cfg`` as a checkpoint published in ``scheme`` (PUBLISHED_SCHEMES) holds it."""
    return dataclasses.replace(cfg, **PUBLISHED_SCHEMES[scheme])


def param_shapes(cfg: ModelConfig, dtype) -> dict:
    """The weights' pytree (stacked layers) as ShapeDtypeStructs."""
    return abstract_params(cfg, dtype)


IN_AXES = {"o": 2}  # Linear modules whose kernel contracts two leading axes (heads, head_dim); others one


def random_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Random weights of ``param_shapes``: norms 1, biases 0, embeddings normal, matrices normal / sqrt(fan-in),
    so that activations stay of order 1 through the layers."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))
    key = jax.random.key(seed)

    def make(i, names, leaf):
        if names[-1] == "weight":  # norms
            return jnp.ones(leaf.shape, leaf.dtype)
        if names[-1] == "bias":
            return jnp.zeros(leaf.shape, leaf.dtype)
        fan_in = 1
        if names[-1] == "kernel":
            first = 1 if names[0] == "layers" else 0
            for size in leaf.shape[first:first + IN_AXES.get(names[-2], 1)]:
                fan_in *= size
        normal = jax.jit(lambda k: (jax.random.normal(k, leaf.shape, jnp.float32) * fan_in ** -0.5).astype(leaf.dtype))
        return normal(jax.random.fold_in(key, i))

    return jax.tree_util.tree_unflatten(treedef, [make(i, [str(getattr(p, "key", p)) for p in path], leaf)
                                                  for i, (path, leaf) in enumerate(leaves)])
