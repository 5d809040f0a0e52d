"""The device half of multi-LoRA: a Linear's adapter slots and the per-token delta (vLLM's punica path, in XLA).

Built under ``building_slots(num_slots, rank)``, each Linear of the decoder layers holds every resident
adapter's A [slots, *in, R] and B [slots, R, *out], R = parts x max_lora_rank: a fused projection (q/k/v,
gate/up) gives each part its own block of R, its B rows landing on that part's output columns; slot 0 is all
zeros (no adapter); B comes scaled (alpha / r, or alpha / sqrt(r) with rsLoRA) from the host
(jaxpage.lora.models).

A step takes part only through the slots it uses (``LoRAMapping``): the step's slots, padded to a bucket of
``lora_buckets``, and each token's index among them. A Linear takes those slots' A and B, and a token adds
(x @ A) @ B for its own: x against the step's slots' A, the other slots' ranks zeroed by a one-hot, then
against their B: two matmuls over the step's slots x R, no per-token gather of weights. A step without adapters
has no mapping and runs the base model's program.

On one CPU device with XLA's attention path and the CPU kernels built (``ModelConfig.cpu_lora_kernel``), the
delta is instead their grouped kernel (jaxpage.cpu_kernels.lora_delta): each token against its own adapter only, whatever
the number of adapters in the step, so a single slots bucket (every slot, as they lie) serves every step.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.cpu_kernels import lora_delta as cpu_lora

LORA_LEAVES = ("lora_a", "lora_b")  # a Linear's slot parameters
_BUILDING = contextvars.ContextVar("lora_slots", default=(0, 0, False))


@dataclasses.dataclass(frozen=True)
class LoRAMapping:
    """Which adapters a step runs (vLLM's LoRAMapping): slots [N], the device slots the step uses (N: a bucket of
    ``lora_buckets``, padded with slot 0; the largest: every slot in order), and token_indices [T], each token's
    index into ``slots`` (-1: the base model)."""

    token_indices: jax.Array
    slots: jax.Array


jax.tree_util.register_dataclass(LoRAMapping, data_fields=["token_indices", "slots"], meta_fields=[])


def lora_buckets(max_loras: int, grouped: bool = False) -> tuple[int, ...]:
    """The sizes a step's slot list is padded to: powers of two below ``max_loras``, then every slot
    (``max_loras + 1``, slot 0 too: the slots as they lie, no gather); ``grouped`` (the CPU's grouped kernel):
    every slot only."""
    sizes = [1 << i for i in range(max_loras.bit_length()) if 1 << i < max_loras and not grouped]
    return (*sizes, max_loras + 1) if max_loras else ()


def grouped_kernel_runs(attention_backend: str, tensor_parallel_size: int, devices) -> bool:
    """Whether an engine's LoRA deltas run the CPU's grouped kernel: one CPU device with XLA's attention path (a
    Pallas backend's config is for a TPU or GPU, even when built here), the kernels built."""
    return (attention_backend == "xla" and tensor_parallel_size == 1 and all(d.platform == "cpu" for d in devices)
            and cpu_lora.available())


@contextlib.contextmanager
def building_slots(num_slots: int, rank: int, grouped: bool = False):
    """Linears constructed inside get ``num_slots`` adapter slots of ``rank`` per part (0 slots: none), their
    deltas by the CPU's grouped kernel if ``grouped``."""
    token = _BUILDING.set((num_slots, rank, grouped))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def slots_being_built() -> tuple[int, int, bool]:
    """(slots, rank per part, grouped) of the Linears being constructed."""
    return _BUILDING.get()


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, mapping: LoRAMapping, num_in: int,
               grouped: bool = False) -> jax.Array:
    """x [T, *in], a [S, *in, R], b [S, R, *out] (every slot), mapping: the step's slots [N] and each token's
    index among them -> [T, *out]. ``grouped``: on a CPU, the grouped kernel (the mapping holds every slot, so a
    token's index is its slot)."""
    assert not grouped or mapping.slots.shape[0] == a.shape[0], "the grouped kernel's mapping holds every slot"
    if grouped:
        xla = lambda x, a, b, slots: lora_delta(x, a, b, mapping, num_in)  # noqa: E731
        return cpu_lora.LORA_DELTA(xla, x, a, b, mapping.token_indices)
    if mapping.slots.shape[0] < a.shape[0]:  # every slot (the largest bucket): no gather
        a, b = a[mapping.slots], b[mapping.slots]  # [N, *in, R], [N, R, *out]
    a, b = a.astype(x.dtype), b.astype(x.dtype)
    contract = tuple(range(1, 1 + num_in))
    xa = jax.lax.dot_general(x, a, ((contract, contract), ((), ())))  # [T, N, R]
    mine = mapping.token_indices[:, None] == jnp.arange(a.shape[0], dtype=mapping.token_indices.dtype)[None, :]
    xa = jnp.where(mine[:, :, None], xa, jnp.zeros((), xa.dtype))
    return jax.lax.dot_general(xa, b, (((1, 2), (0, 1)), ((), ())))
