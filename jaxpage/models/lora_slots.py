"""The device half of multi-LoRA: a Linear's adapter slots and the per-token delta (vLLM's punica path, in XLA).

Built under ``building_slots(num_slots, rank)``, each Linear of the decoder layers holds every resident
adapter's A [slots, *in, R] and B [slots, R, *out], R = parts x max_lora_rank: a fused projection (q/k/v,
gate/up) gives each part its own block of R, its B rows landing on that part's output columns; slot 0 is all
zeros (no adapter); B comes scaled (alpha / r, or alpha / sqrt(r) with rsLoRA) from the host
(jaxpage.lora.models). A token adds (x @ A[slot]) @ B[slot] for its own slot: x against every slot's A, the other
slots' ranks zeroed by a one-hot, then against every slot's B: two matmuls over slots x R, no per-token gather of
weights.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

LORA_LEAVES = ("lora_a", "lora_b")  # a Linear's slot parameters
_BUILDING = contextvars.ContextVar("lora_slots", default=(0, 0))


@contextlib.contextmanager
def building_slots(num_slots: int, rank: int):
    """Linears constructed inside get ``num_slots`` adapter slots of ``rank`` per part (0 slots: none)."""
    token = _BUILDING.set((num_slots, rank))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def slots_being_built() -> tuple[int, int]:
    """(slots, rank per part) of the Linears being constructed."""
    return _BUILDING.get()


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, num_in: int) -> jax.Array:
    """x [T, *in], a [S, *in, R], b [S, R, *out], slots [T] int32 (each token's adapter slot) -> [T, *out]; a
    step whose tokens all run the base model (slot 0) skips the matmuls (``lax.cond``)."""
    def delta():
        contract = tuple(range(1, 1 + num_in))
        xa = jax.lax.dot_general(x, a.astype(x.dtype), ((contract, contract), ((), ())))  # [T, S, R]
        mine = slots[:, None] == jnp.arange(a.shape[0], dtype=slots.dtype)[None, :]
        xa = jnp.where(mine[:, :, None], xa, jnp.zeros((), xa.dtype))
        return jax.lax.dot_general(xa, b.astype(x.dtype), (((1, 2), (0, 1)), ((), ())))

    return jax.lax.cond(jnp.any(slots != 0), delta, lambda: jnp.zeros((x.shape[0], *b.shape[2:]), x.dtype))
