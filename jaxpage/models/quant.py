"""int8 (and a checkpoint's float8 and int4) weights: per-output-channel quantization and the quantized matmuls.

A kernel [*in, *out] becomes int8 values and a float32 scale [*out] (absmax over the input axes / 127, round to
nearest), so that kernel ~= values * scale. The matmul takes one of two forms:
  weight-only: x . values (converted to x's dtype inside the dot), then * scale; GPU and TPU, where XLA fuses the
    convert into the dot and the gain is the weights' memory traffic;
  dynamic: x quantized per row (absmax over its contracted axes / 127) to int8, an int8 x int8 dot accumulated in
    int32, then * row scale * scale; the CPU, where int8 dots are faster than float ones (docs/DESIGN.md §14,
    the int8 forms on the CPU).
A float8 checkpoint whose scheme quantizes activations takes ``fp8_dot``: float8 x float8 on a GPU with FP8,
upcast weights elsewhere; grouped int8 / int4 weights take ``grouped_dot`` (weight-only).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SCALE = "scale"  # Linear.scale: stays float32 in every engine dtype
ZERO = "zero"  # Linear.zero: a grouped kernel's zero points, float32 (GGUF's are fractional)
_BUILDING = contextvars.ContextVar("quantization", default=(None, None, False, ()))


@contextlib.contextmanager
def building(quantization, group_size: int | None = None, zero_point: bool = False, projections: tuple = ()):
    """Modules constructed inside take this quantization (the model builds its graph in one of these): a stored
    kind, with a scale per ``group_size`` input columns (None: per output channel; int4 is always grouped, one
    group of every input where None) and zero points; ``projections`` (ModelConfig.quantized_projections): the
    decoder Linears stored otherwise, by name, each built inside ``projection(name)``."""
    token = _BUILDING.set((quantization, group_size, zero_point, projections))
    try:
        yield
    finally:
        _BUILDING.reset(token)


@contextlib.contextmanager
def projection(name: str):
    """The decoder Linear ``name`` ("qkv", "o", "gate_up", "down") is built inside: its own stored kind, group
    size and zero points where the quantization being built gives it one."""
    projections = _BUILDING.get()[3]
    scheme = next((tuple(p[1:]) for p in projections if p[0] == name), None)
    if scheme is None:
        yield
        return
    with building(*scheme, projections=projections):
        yield


def quantization_being_built():
    return _BUILDING.get()[0]


def groups_being_built() -> tuple[int | None, bool]:
    """(group_size, zero_point) of the quantization being built."""
    return _BUILDING.get()[1:3]


def num_groups(in_shape: tuple[int, ...], group_size: int | None) -> int:
    """The groups of a kernel's flattened inputs (one where group_size is None or -1)."""
    size = int(np.prod(in_shape))
    if group_size == -1:
        return 1
    if group_size is not None and size % group_size:
        raise ValueError(f"quantization_config.config_groups.weights.group_size: {group_size} does not divide a "
                         f"Linear's {size} input columns")
    return 1 if group_size is None else size // group_size


# a quantized Linear's kernel; int4 values two to a byte along the last input axis (pack_int4): XLA:CPU keeps a
# byte per jnp.int4 value, and an int4 array placed from the host disagrees with the compiled layout
STORED = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn), "int4": jnp.dtype(jnp.uint8)}


def pack_int4(values: np.ndarray, axis: int) -> np.ndarray:
    """Signed int4 values (int8 in [-8, 7]) two to a uint8 along ``axis`` (even-sized): value 2i in the low
    nibble, 2i + 1 in the high one, each offset by 8."""
    v = np.moveaxis(np.asarray(values, np.int16) + 8, axis, -1).astype(np.uint8)
    if v.shape[-1] % 2:
        raise ValueError(f"int4 weights: a Linear's last input axis ({v.shape[-1]}) must be even to pack")
    return np.moveaxis(v[..., 0::2] | (v[..., 1::2] << 4), -1, axis)


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """pack_int4 undone on the device: int8 values, ``axis`` twice as long."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1).astype(jnp.int8) - 8
    shape = list(packed.shape)
    shape[axis] *= 2
    return pairs.reshape(shape)


def weight_dtype(path: tuple, leaf, dtype):
    """The dtype a weight takes in an engine of this dtype: quantized values and their scales keep theirs."""
    if leaf.dtype in STORED.values() or getattr(path[-1], "key", None) in (SCALE, ZERO):
        return leaf.dtype
    return jnp.dtype(dtype)


def quantize_int8(w: np.ndarray, in_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values, float32 scale): the scale has w's shape without ``in_axes``; all-zero channels get scale 1."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=in_axes, keepdims=True) / 127
    scale = np.where(scale == 0, 1, scale).astype(np.float32)
    values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return values, scale.squeeze(axis=in_axes)


def _contract(x: jax.Array, kernel: jax.Array, num_in: int, **kw) -> jax.Array:
    """x [..., *in] . kernel [*in, *out] -> [..., *out]."""
    dims = ((tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in))), ((), ()))
    return jax.lax.dot_general(x, kernel, dims, **kw)


def int8_dot_weight_only(x: jax.Array, kernel: jax.Array, scale: jax.Array, num_in: int) -> jax.Array:
    return (_contract(x, kernel.astype(x.dtype), num_in) * scale).astype(x.dtype)


def int8_dot_dynamic(x: jax.Array, kernel: jax.Array, scale: jax.Array, num_in: int) -> jax.Array:
    lead = x.shape[:x.ndim - num_in]
    if np.prod(lead, dtype=int) == 1:  # XLA:CPU turns a one-row int8 dot into an int32 copy of the kernel
        pad = jnp.zeros((1,) * len(lead) + x.shape[x.ndim - num_in:], x.dtype)
        both = jnp.concatenate([x.reshape(pad.shape), pad])
        return int8_dot_dynamic(both, kernel, scale, num_in)[:1].reshape(lead + scale.shape)
    x32 = x.astype(jnp.float32)
    row_scale = jnp.max(jnp.abs(x32), axis=tuple(range(x.ndim - num_in, x.ndim)), keepdims=True) / 127
    row_scale = jnp.where(row_scale == 0, 1, row_scale)
    xq = jnp.round(x32 / row_scale).astype(jnp.int8)
    acc = _contract(xq, kernel, num_in, preferred_element_type=jnp.int32)
    row_scale = row_scale.reshape(x.shape[:x.ndim - num_in] + (1,) * scale.ndim)
    return (acc.astype(jnp.float32) * row_scale * scale).astype(x.dtype)


FP8_MAX = 448.0  # float8 e4m3's largest finite value


def fp8_dot(x: jax.Array, kernel: jax.Array, scale: jax.Array, num_in: int) -> jax.Array:
    """x [..., *in] . (kernel * scale) for a float8 e4m3 checkpoint whose scheme quantizes activations too (FP8
    dynamic, block FP8): scale [*out] per output channel, or [groups, *out] per block of inputs. On a GPU with FP8
    (compute capability 8.9 and up) x is quantized as well and the product is float8 x float8 (``fp8_native_dot``,
    vLLM's Fp8LinearMethod); elsewhere the weights are upcast to x's dtype inside the dot."""
    def upcast(x, kernel, scale):
        if scale.ndim > kernel.ndim - num_in:
            return grouped_dot(x, kernel, scale, None, num_in)
        return int8_dot_weight_only(x, kernel, scale, num_in)
    native = functools.partial(fp8_native_dot, num_in=num_in) if _gpus_have_fp8() else upcast
    return jax.lax.platform_dependent(x, kernel, scale, cuda=native, default=upcast)


def fp8_native_dot(x: jax.Array, kernel: jax.Array, scale: jax.Array, num_in: int) -> jax.Array:
    """The FP8 product: x quantized to float8 e4m3 with a scale per token (per token and block of inputs where the
    weights are in blocks: DeepSeek's 1 x block activation groups), one float8 x float8 dot per block of inputs
    accumulated in float32 (a batched FP8 GEMM), each block's sum times both scales, summed over blocks."""
    lead, out_shape = x.shape[:x.ndim - num_in], kernel.shape[num_in:]
    k, n = math.prod(x.shape[x.ndim - num_in:]), math.prod(out_shape)
    groups = scale.shape[0] if scale.ndim > len(out_shape) else 1
    xs = x.reshape(-1, groups, k // groups).astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(xs), axis=-1, keepdims=True) / FP8_MAX  # [T, groups, 1]
    x_scale = jnp.where(x_scale == 0, 1, x_scale)
    xq = (xs / x_scale).astype(kernel.dtype)
    w = kernel.reshape(groups, k // groups, n)
    acc = jax.lax.dot_general(xq, w, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
    w_scale = scale.reshape(groups, 1, n)  # acc [groups, T, n]
    y = jnp.sum(acc * jnp.transpose(x_scale, (1, 0, 2)) * w_scale, axis=0)
    return y.reshape(*lead, *out_shape).astype(x.dtype)


@functools.cache
def _gpus_have_fp8() -> bool:
    """Whether a CUDA program traced here runs on GPUs with FP8 products (compute capability 8.9 and up: Ada,
    Hopper, Blackwell). A host without GPUs (the CUDA lowering lane) is taken to target one."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return all(tuple(map(int, str(d.compute_capability).split("."))) >= (8, 9) for d in gpus)


def int8_dot(x: jax.Array, kernel: jax.Array, scale: jax.Array, num_in: int) -> jax.Array:
    """x [..., *in] . (kernel * scale) [*in, *out]: every quantized matmul of the model, in the form that suits
    the platform it is lowered for."""
    return jax.lax.platform_dependent(x, kernel, scale, cpu=lambda *a: CPU_DOT(*a, num_in),
                                      default=lambda *a: int8_dot_weight_only(*a, num_in))


def grouped_dot(x: jax.Array, kernel: jax.Array, scale: jax.Array, zero: jax.Array | None,
                num_in: int) -> jax.Array:
    """x [..., *in] . dequantized kernel: kernel [*in, *out] (int8, or int4 packed by pack_int4) whose flattened
    inputs fall in scale.shape[0] groups, w = (kernel - zero) * scale per (group, output); dequantized to x's
    dtype in the product (XLA fuses it into the dot's operand on GPU and TPU)."""
    if kernel.dtype == STORED["int4"]:
        kernel = unpack_int4(kernel, num_in - 1)
    out_shape = kernel.shape[num_in:]
    w = kernel.astype(jnp.float32).reshape(scale.shape[0], -1, *out_shape)
    if zero is not None:
        w = w - zero.astype(jnp.float32)[:, None]
    w = (w * scale[:, None]).reshape(kernel.shape).astype(x.dtype)
    return _contract(x, w, num_in)


CPU_DOT = int8_dot_dynamic  # faster than the weight-only form on XLA:CPU (docs/DESIGN.md §14)
