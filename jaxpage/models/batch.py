"""The device half of one step's flat batch, as every architecture's forward pass takes it."""
from __future__ import annotations

import dataclasses

import jax

from jaxpage.models.lora_slots import LoRAMapping


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """The device half of one step's flat batch (all int32, padded to a bucket).

    token_ids, positions, slot_mapping, token_seq: [T]; block_tables: [S, W]; logits_indices: [S].
    Padding tokens write into the null block and belong to an all-null block-table row. lora: the step's adapter
    slots and each token's among them, in a step of an engine with LoRA that runs an adapter (None otherwise: the
    step is the base model's program).
    """

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    token_seq: jax.Array
    block_tables: jax.Array
    logits_indices: jax.Array
    lora: LoRAMapping | None = None


jax.tree_util.register_dataclass(
    TokenBatch, data_fields=[f.name for f in dataclasses.fields(TokenBatch)], meta_fields=[])
