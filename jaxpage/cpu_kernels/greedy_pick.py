"""The plain greedy sampler's token and log-probability as one FFI call on the CPU (jaxpage/cpu_kernels/greedy_pick.cc)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.cpu_kernels.custom_op import CustomOp
from jaxpage.cpu_kernels.library import ffi_call

__all__ = ["GREEDY_PICK", "greedy_pick"]


def greedy_pick(logits: jax.Array, soft_cap: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """logits [S, V] (float32 or bfloat16) -> (tokens [S] int32: the first of each row's largest values,
    logprobs [S] float32: the log-softmax at that token), the logits soft-capped first where ``soft_cap`` > 0.
    CPU only (GREEDY_PICK chooses)."""
    rows = logits.shape[0]
    out = (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32))
    return ffi_call("jaxpage_greedy_pick", out)(logits, soft_cap=np.float32(soft_cap or 0.0))


GREEDY_PICK = CustomOp("greedy_pick", greedy_pick)
