"""PenaltyHistory: the token ids of the sequences with penalties, kept on the device between steps, so that a step
sends down only the tokens new since the last one (a sequence's whole history goes down once, when it first runs).

The penalties need each row's tokens so far (prompt, then output); on the device they are a table
``[slots, max_model_len]`` (-1 after a sequence's tokens; slot 0 is all -1, the slot of rows without penalties),
which the step reads through a slot per row (SamplingBatch.history_rows)."""
from __future__ import annotations

import jax
import numpy as np

from jaxpage.distributed.parallel import put
from jaxpage.sequence import Sequence


def _write_row(table: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
    return table.at[slot].set(row)


def _append(table: jax.Array, slots: jax.Array, positions: jax.Array, tokens: jax.Array) -> jax.Array:
    return table.at[slots, positions].set(tokens, mode="drop")  # padding entries name slot len(table): dropped


class PenaltyHistory:
    """Slots of the table, each held by one sequence (keyed by the Sequence object, as InputBatch's rows), with
    how many of its tokens the device has. Slots of sequences gone are taken back when the slots run out; one
    step's rows (at most max_num_seqs) always fit."""

    def __init__(self, max_num_seqs: int, max_model_len: int, sharding=None, max_new_tokens: int = 1):
        """sharding: where the table and its updates live (the engine's device or mesh; None: the default
        device). max_new_tokens: the most tokens a sequence gains a step (speculative decoding: 1 + its drafts),
        appended; a sequence that gained more, or none of whose tokens are on the device, is written whole."""
        self.num_slots, self.max_model_len = max_num_seqs + 1, max_model_len
        self.max_new_tokens, self.max_appends = max_new_tokens, max_num_seqs * max_new_tokens
        self.table = put(np.full((self.num_slots, max_model_len), -1, np.int32), sharding)
        self._held: dict[Sequence, list[int]] = {}  # sequence -> [slot, tokens of it on the device]
        self._free = list(range(self.num_slots - 1, 0, -1))
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)  # noqa: E731
        table = i32(self.num_slots, max_model_len)
        # compiled now, so that serving never compiles (the table is donated: updated in place)
        self._write_row = jax.jit(_write_row, donate_argnums=0).lower(table, i32(), i32(max_model_len)).compile()
        appends = i32(self.max_appends)
        self._append = jax.jit(_append, donate_argnums=0).lower(table, appends, appends, appends).compile()

    def slots(self, seqs: list[Sequence], running: set[Sequence]) -> list[int]:
        """Each sequence's slot, the device's copy of its tokens brought up to date; ``running``: the sequences
        of this step, whose slots are kept."""
        slots, appends = [], []
        for seq in seqs:
            held = self._held.get(seq)
            if held is None:
                held = self._held[seq] = [self._take(running), 0]
            slot, synced = held
            num_tokens = len(seq.token_ids)
            if synced and 0 < num_tokens - synced <= self.max_new_tokens:  # the tokens of the last step
                appends.extend((slot, at, seq.token_ids[at]) for at in range(synced, num_tokens))
            elif num_tokens != synced:
                row = np.full(self.max_model_len, -1, np.int32)
                row[:num_tokens] = seq.token_ids
                self.table = self._write_row(self.table, np.int32(slot), row)
            held[1] = num_tokens
            slots.append(slot)
        if appends:
            update = np.full((3, self.max_appends), self.num_slots, np.int32)
            update[:, :len(appends)] = np.array(appends, np.int32).T
            self.table = self._append(self.table, *update)
        return slots

    def forget(self, seqs: list[Sequence]) -> None:
        """The sequences' tokens changed other than by appending (a draft model's steps extend them with drafts
        for a while): each one's row is written whole when it next runs."""
        for seq in seqs:
            if seq in self._held:
                self._held[seq][1] = 0

    def _take(self, running: set[Sequence]) -> int:
        if not self._free:
            for gone in [seq for seq in self._held if seq not in running]:
                self._free.append(self._held.pop(gone)[0])
        return self._free.pop()
