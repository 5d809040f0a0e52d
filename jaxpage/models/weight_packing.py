"""bfloat16 weights packed for oneDNN's matmul on the CPU (jaxpage.cpu_kernels.onednn), as vLLM's CPU backend prepacks
its oneDNN weights at load.

oneDNN's kernel reorders plain weights into its own blocked layout inside every call; packed once at load, a
decode step's matmuls ran 2-2.6x faster at one row and ~2x at 8 (benchmarks/RESULTS.md). A packed kernel keeps its
array's shape and dtype (its bytes are only reordered; ``onednn.packs`` admits only layouts that pad nothing),
so shapes, shardings and the pure-dict layout stay as they are; only ``Linear`` reads the bytes, through the
packed matmul. Engines pack where they run the weights on one CPU device in bfloat16 with the XLA attention path
(``packs_weights``); the step's model config carries the choice (``StepModelConfig.onednn_packed_weights``) so
the traced graph and the placed weights agree.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxpage.cpu_kernels import onednn

_BUILDING = contextvars.ContextVar("onednn_packed_weights", default=False)


@contextlib.contextmanager
def packing(enabled: bool):
    """Linears built inside take packed bfloat16 kernels where their shapes allow (``linear_packs``)."""
    token = _BUILDING.set(enabled)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def packing_being_built() -> bool:
    return _BUILDING.get()


def packs_weights(dtype: str, attention_backend: str, quantization: str | None, tensor_parallel_size: int,
                  devices) -> bool:
    """Whether an engine packs its weights: bfloat16 on one CPU device, XLA's attention path, float weights, and
    oneDNN's bfloat16 matmul running here."""
    return (dtype == "bfloat16" and attention_backend == "xla" and quantization is None
            and tensor_parallel_size == 1 and all(d.platform == "cpu" for d in devices) and onednn.bfloat16_matmul())


def linear_packs(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """Whether a Linear's [*in, *out] kernel is packed when its model packs (its layout pads nothing)."""
    return onednn.packs(math.prod(in_shape), math.prod(out_shape), jnp.bfloat16)


def unties_lm_head(cfg) -> bool:
    """Whether a tied LM head gets a packed copy of its own (a Linear made from the embedding at load, as int8's):
    the embedding stays plain for the lookup, and the head's matmul, 1.5-1.9x faster packed at 1-8 rows
    (docs/DESIGN.md §14), costs a second copy of the embedding's bytes."""
    return (cfg.onednn_packed_weights and cfg.tie_word_embeddings and cfg.quantization is None
            and linear_packs((cfg.hidden_size,), (cfg.vocab_size,)))


def pack_kernel(kernel: np.ndarray, num_in: int, num_out: int) -> np.ndarray:
    """A Linear's kernel [*layers, *in, *out] (float) in bfloat16, each layer's [in, out] matrix packed."""
    num_lead = kernel.ndim - num_in - num_out
    k = math.prod(kernel.shape[num_lead:num_lead + num_in])
    n = math.prod(kernel.shape[num_lead + num_in:])
    flat = np.asarray(kernel).astype(ml_dtypes.bfloat16).reshape(-1, k, n)
    return np.stack([onednn.pack(m) for m in flat]).reshape(kernel.shape)
