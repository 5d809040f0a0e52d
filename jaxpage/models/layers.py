"""The layers every architecture is built from, as Flax NNX modules.

Parameters are ``nnx.Param`` with ``out_sharding`` names (``MODEL_AXIS`` where a tensor-parallel mesh splits them:
attention heads, MLP columns/rows, experts' columns), never sharded eagerly: the engine places the weights.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.cpu_kernels import onednn
from jaxpage.cpu_kernels import rms_norm as norm_kernel
from jaxpage.cpu_kernels import silu_and_mul as silu_kernel
from jaxpage.distributed.parallel import MODEL_AXIS
from jaxpage.models.lora_slots import LoRAMapping, lora_delta, slots_being_built
from jaxpage.models.quant import (
    STORED,
    fp8_dot,
    grouped_dot,
    groups_being_built,
    int8_dot,
    num_groups,
    projection,
    quantization_being_built,
)
from jaxpage.models.weight_packing import linear_packs, packing_being_built


def param(shape: tuple[int, ...], names: tuple, dtype=jnp.float32) -> nnx.Param:
    """A zero-filled parameter (weights are always loaded, never initialised) with its partitioning names."""
    assert len(names) == len(shape), (shape, names)
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32. Gemma's (1 + weight) form is folded into the weight at load. On the
    CPU, bfloat16 on one device of the model axis is one kernel (jaxpage/cpu_kernels/rms_norm.cc, vLLM's rms_norm and
    fused_add_rms_norm), where XLA:CPU ran four thunks, and five with the residual add before it."""

    def __init__(self, dim: int, eps: float):
        self.weight = param((dim,), (None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return norm_kernel.RMS_NORM(self._xla, x, self.weight[...], eps=self.eps)

    def add_and_norm(self, x: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(x + h, self(x + h)): the residual stream and its norm, in one pass where ``__call__`` has a kernel."""
        def xla(x, h, weight):
            residual = x + h
            return residual, self._xla(residual, weight)
        return norm_kernel.FUSED_ADD_RMS_NORM(xla, x, h, self.weight[...], eps=self.eps)

    def _xla(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def dense(x: jax.Array, kernel: jax.Array, num_in: int, *, transposed: bool = False,
          packed: bool = False) -> jax.Array:
    """x [..., *in] . kernel [*in, *out] (kernel [out, in] with ``transposed``, one axis each): on the CPU,
    bfloat16 runs oneDNN's matmul (jaxpage.cpu_kernels.onednn: XLA:CPU converts bfloat16 dots to float32 every call);
    every other platform and dtype, XLA's dot. ``packed``: the kernel holds oneDNN's packed bytes
    (jaxpage.models.weight_packing), which only the CPU's matmul reads."""
    in_axes = (1,) if transposed else tuple(range(num_in))
    dims = ((tuple(range(x.ndim - num_in, x.ndim)), in_axes), ((), ()))
    xla = functools.partial(jax.lax.dot_general, dimension_numbers=dims)
    if packed:  # packed only on one CPU device (weight_packing.packs_weights), whose bytes only oneDNN reads
        assert onednn.DENSE.enabled(x, kernel), "packed weights need oneDNN's bfloat16 matmul"
        return onednn.dense(x, kernel, num_in=num_in, transposed=transposed, packed=True)
    return onednn.DENSE(xla, x, kernel, num_in=num_in, transposed=transposed)


class Linear(nnx.Module):
    """y = x . kernel (+ bias), contracting x's trailing ``in_shape`` axes; kernel [*in_shape, *out_shape].
    The one place a matmul with weights happens. Built under ``quant.building("int8")`` (or "fp8"), the kernel is
    int8 (float8 e4m3) with a float32 ``scale`` [*out_shape] per output channel (sharded as the kernel's output
    axes); under a grouped quantization (a checkpoint's int4, packed two to a byte along the last input axis),
    ``scale`` is [num_groups, *out_shape] over groups of the flattened inputs, with float32 ``zero`` points alike
    where asymmetric. Built under ``lora_slots.building_slots``, it holds adapter slots (``lora_a``, ``lora_b``)
    for its ``parts`` projections, and a call given each token's slot adds that adapter's delta."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], names: tuple, bias: bool = False,
                 parts: int = 1):
        self.kind = kind = quantization_being_built()  # the stored kind: "int8", "fp8", "int4" or None (float)
        quantized = kind is not None
        packed_in = (*in_shape[:-1], in_shape[-1] // 2) if kind == "int4" else in_shape  # two values a byte
        self.kernel = param((*packed_in, *out_shape), names, STORED[kind] if quantized else jnp.float32)
        # bfloat16 packed for oneDNN (weight_packing): pack_params packs exactly the Linears that say so
        self.packed = packing_being_built() and not quantized and linear_packs(in_shape, out_shape)
        in_names, out_names = names[:len(in_shape)], names[len(in_shape):]
        group_size, zero_point = groups_being_built()
        # float8 weights of a scheme that quantizes the activations too (not weight-only: group_size -1)
        self.fp8_activations = kind == "fp8" and group_size != -1
        self.num_groups = num_groups(in_shape, group_size) if kind == "int4" or group_size else None
        if self.num_groups:  # groups split as the first input axis is (row-parallel): a device holds its own
            grouped = (in_names[0], *out_names)
            self.scale = param((self.num_groups, *out_shape), grouped)
            self.zero = param((self.num_groups, *out_shape), grouped) if zero_point else None
        else:
            self.zero = None
            if quantized:
                self.scale = param(out_shape, out_names)
        self.bias = param(out_shape, out_names) if bias else None
        self.num_in, self.num_out = len(in_shape), len(out_shape)
        num_slots, rank, self.lora_grouped = slots_being_built()
        if num_slots:
            self.lora_a = param((num_slots, *in_shape, parts * rank), (None, *in_names, None))
            self.lora_b = param((num_slots, parts * rank, *out_shape), (None, None, *out_names))
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array, lora: LoRAMapping | None = None) -> jax.Array:
        """lora: the step's adapter slots and each token's among them (x [T, *in_shape]); None: the base weights
        alone."""
        kernel = self.kernel[...]
        if self.fp8_activations:
            y = fp8_dot(x, kernel, self.scale[...], self.num_in)
        elif self.num_groups:
            y = grouped_dot(x, kernel, self.scale[...], None if self.zero is None else self.zero[...], self.num_in)
        elif kernel.dtype == jnp.int8:
            y = int8_dot(x, kernel, self.scale[...], self.num_in)
        else:
            y = dense(x, kernel, self.num_in, packed=self.packed)
        if self.lora_a is not None and lora is not None:
            y = y + lora_delta(x, self.lora_a[...], self.lora_b[...], lora, self.num_in,
                               self.lora_grouped).astype(y.dtype)
        return y if self.bias is None else y + self.bias[...]

    def part_sizes(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output width of each projection this kernel [*in, *out] fuses (one: its whole output)."""
        return (math.prod(kernel_shape[self.num_in:]),)

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
        return dense(hidden, self.embedding[...], 1, transposed=True)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def gated_activation(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up, computed in float32 and given back in gate's dtype: in bfloat16 XLA:CPU rounds after each of
    the activation's ops, and that made SmolLM2's [96, 1536] product 0.34 ms a layer, as long as its gate/up
    matmul (RESULTS.md, "The mixed step")."""
    f32 = jnp.float32
    return (activation(name)(gate.astype(f32)) * up.astype(f32)).astype(gate.dtype)


def fused_gated_activation(name: str, gate_up: jax.Array) -> jax.Array:
    """``gated_activation`` of the gate/up matmul's output [..., 2, I]. On the CPU, silu in bfloat16 on one device
    of the model axis is one kernel (jaxpage/cpu_kernels/silu_and_mul.cc, vLLM's SiluAndMul): XLA:CPU's fusion took ~0.1 ms
    a layer at 32 rows of 1,536 (RESULTS.md, "The attention fold and SiluAndMul")."""
    def xla(y):
        return gated_activation(name, y[..., 0, :], y[..., 1, :])
    if name != "silu":
        return xla(gate_up)
    return silu_kernel.SILU_AND_MUL(xla, gate_up)


class QKVParallelLinear(Linear):
    """q, k and v projections as one matmul (vLLM's QKVParallelLinear). The kernel [D, kv_slots, G + 2, hd]
    groups each KV head slot's G = heads / kv_slots query heads, then its key head, then its value head, so a
    split over the slots (the model axis) gives each device whole groups: its own q|k|v columns, at every TP size
    that divides the slots. Bias and int8 scale [kv_slots, G + 2, hd] alike."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        group = num_heads // num_kv_heads
        super().__init__((dim,), (num_kv_heads, group + 2, head_dim), (None, MODEL_AXIS, None, None), bias=bias,
                         parts=3)
        self.group = group

    def part_sizes(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        """q's, k's and v's output widths."""
        kv_slots, width, hd = kernel_shape[-3:]
        return kv_slots * (width - 2) * hd, kv_slots * hd, kv_slots * hd

    def split(self, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The fused output [..., kv_slots, G + 2, hd] as q [..., heads, hd], k and v [..., kv_slots, hd]."""
        g = self.group
        q = y[..., :g, :].reshape(*y.shape[:-3], y.shape[-3] * g, y.shape[-1])
        return q, y[..., g, :], y[..., g + 1, :]

    @staticmethod
    def fuse(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Head-explicit q [..., heads, hd], k and v [..., kv_heads, hd] (kernels, biases) in the fused layout."""
        kvh, hd = k.shape[-2:]
        grouped = q.reshape(*q.shape[:-2], kvh, q.shape[-2] // kvh, hd)
        return np.concatenate([grouped, k[..., None, :], v[..., None, :]], axis=-2)

    @staticmethod
    def replicate_kv_heads(a: np.ndarray, slots: int) -> np.ndarray:
        """A fused kernel, bias or scale [..., kv_heads, G + 2, hd] with each KV head repeated to fill ``slots``
        (vLLM's replication under TP): the repeats split the head's query group between them."""
        kvh, width, hd = a.shape[-3:]
        repeats, group = slots // kvh, width - 2
        q = a[..., :group, :].reshape(*a.shape[:-3], slots, group // repeats, hd)
        return np.concatenate([q, np.repeat(a[..., group:, :], repeats, axis=-3)], axis=-2)


class MergedColumnParallelLinear(Linear):
    """Several projections of one input to the same width as one matmul (vLLM's MergedColumnParallelLinear):
    kernel [D, count, F], its columns F split over the model axis, so each device holds its own columns of every
    projection. ``split`` gives the ``count`` outputs [..., F]."""

    def __init__(self, dim: int, width: int, count: int):
        super().__init__((dim,), (count, width), (None, None, MODEL_AXIS), parts=count)
        self.count = count

    def part_sizes(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (kernel_shape[-1],) * self.count

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(y[..., i, :] for i in range(self.count))

    @staticmethod
    def fuse(*kernels: np.ndarray) -> np.ndarray:
        """Kernels [D, F] (one per projection) in the fused layout."""
        return np.stack(kernels, axis=-2)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up one matmul; their columns and down's rows shard over
    the model axis."""

    def __init__(self, dim: int, hidden: int, act: str):
        with projection("gate_up"):
            self.gate_up = MergedColumnParallelLinear(dim, hidden, 2)
        with projection("down"):
            self.down = Linear((hidden,), (dim,), (MODEL_AXIS, None))
        self.act = act

    def __call__(self, x: jax.Array, lora: LoRAMapping | None = None) -> jax.Array:
        return self.down(fused_gated_activation(self.act, self.gate_up(x, lora)), lora)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def embed_scale(dim: int, dtype) -> jax.Array:
    """Gemma's sqrt(hidden_size) embedding normalizer, rounded to the activations' dtype as transformers does."""
    return jnp.asarray(math.sqrt(dim), dtype)
