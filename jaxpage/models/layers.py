"""The layers every architecture is built from, as Flax NNX modules.

Parameters are ``nnx.Param`` with ``out_sharding`` names (``MODEL_AXIS`` where a tensor-parallel mesh splits them:
attention heads, MLP columns/rows, experts' columns), never sharded eagerly: the engine places the weights.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpage.distributed.parallel import MODEL_AXIS
from jaxpage.models.quant import int8_dot, quantization_being_built


def param(shape: tuple[int, ...], names: tuple, dtype=jnp.float32) -> nnx.Param:
    """A zero-filled parameter (weights are always loaded, never initialised) with its partitioning names."""
    assert len(names) == len(shape), (shape, names)
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32. Gemma's (1 + weight) form is folded into the weight at load."""

    def __init__(self, dim: int, eps: float):
        self.weight = param((dim,), (None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Module):
    """y = x . kernel (+ bias), contracting x's trailing ``in_shape`` axes; kernel [*in_shape, *out_shape].
    The one place a matmul with weights happens. Built under ``quant.building("int8")``, the kernel is int8 with
    a float32 ``scale`` [*out_shape] per output channel (sharded as the kernel's output axes)."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], names: tuple, bias: bool = False):
        quantized = quantization_being_built() is not None
        self.kernel = param((*in_shape, *out_shape), names, jnp.int8 if quantized else jnp.float32)
        out_names = names[len(in_shape):]
        if quantized:
            self.scale = param(out_shape, out_names)
        self.bias = param(out_shape, out_names) if bias else None
        self.num_in, self.num_out = len(in_shape), len(out_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if kernel.dtype == jnp.int8:
            y = int8_dot(x, kernel, self.scale[...], self.num_in)
        else:
            y = jax.lax.dot_general(x, kernel, ((tuple(range(x.ndim - self.num_in, x.ndim)),
                                                 tuple(range(self.num_in))), ((), ())))
        return y if self.bias is None else y + self.bias[...]

    def in_axes(self, ndim: int) -> tuple[int, ...]:
        """The input axes of this kernel's array with ``ndim`` dimensions (leading axes: layers, stacked)."""
        return tuple(range(ndim - self.num_out - self.num_in, ndim - self.num_out))


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int):
        self.embedding = param((vocab_size, dim), (MODEL_AXIS, None))  # vocab rows: a tied LM head then splits too

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return self.embedding[...][token_ids]

    def attend(self, hidden: jax.Array) -> jax.Array:
        """Tied LM head: hidden [N, D] against every embedding row."""
        return jnp.einsum("nd,vd->nv", hidden, self.embedding[...])


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); columns of gate/up and rows of down shard over the model axis."""

    def __init__(self, dim: int, hidden: int, act: str):
        self.gate = Linear((dim,), (hidden,), (None, MODEL_AXIS))
        self.up = Linear((dim,), (hidden,), (None, MODEL_AXIS))
        self.down = Linear((hidden,), (dim,), (MODEL_AXIS, None))
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(activation(self.act)(self.gate(x)) * self.up(x))


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def embed_scale(dim: int, dtype) -> jax.Array:
    """Gemma's sqrt(hidden_size) embedding normalizer, rounded to the activations' dtype as transformers does."""
    return jnp.asarray(math.sqrt(dim), dtype)
