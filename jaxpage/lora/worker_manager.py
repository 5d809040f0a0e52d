"""The runner's adapters (vLLM's LRUCacheWorkerLoRAManager): an LRU of adapters loaded on the host
(``max_cpu_loras``), which adapter sits in each of the device's ``max_loras`` slots (slot 0: none), and the writes
of an adapter into a free or least recently used slot between steps.

The scheduler never runs more distinct adapters in one step than there are slots, so a step's adapters always
fit: a slot is taken back only from an adapter the step does not use.
"""
from __future__ import annotations

import collections

import jax
import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.distributed.parallel import put, without_axis
from jaxpage.lora.models import LoRAModel, load_lora_model
from jaxpage.models import abstract_params
from jaxpage.models.lora_slots import LORA_LEAVES, LoRAMapping, lora_buckets


class WorkerLoRAManager:
    def __init__(self, config: EngineConfig):
        self.model = config.step_model
        self.max_loras, self.max_cpu_loras = config.lora.max_loras, config.lora.max_cpu_loras
        self._host: collections.OrderedDict[int, LoRAModel] = collections.OrderedDict()  # least recent first
        self._slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # lora_int_id -> slot, LRU first
        self.num_loads = 0  # adapters read from disk
        self.num_slot_writes = 0  # adapters written into a device slot

    def get(self, request) -> LoRAModel:
        """The request's adapter, from the host LRU or read from its directory (the least recently used dropped
        beyond max_cpu_loras). A missing or malformed adapter raises ValueError naming the file and field."""
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_lora_model(request.lora_int_id, request.lora_path, self.model)
            self.num_loads += 1
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter on the host; its slot is reused when needed (requests must not use it meanwhile)."""
        self._host.pop(lora_int_id, None)
        self._slots.pop(lora_int_id, None)

    def slots_for(self, adapters: list) -> tuple[np.ndarray, list[tuple[int, LoRAModel]]]:
        """Each row's slot (a LoRAModel or None per row: the adapter its request holds) and the (slot, adapter)
        writes the device needs first."""
        wanted = {a.lora_int_id: a for a in adapters if a is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} distinct LoRA adapters in one step, max_loras={self.max_loras}")
        for lora in wanted:
            if lora in self._slots:
                self._slots.move_to_end(lora)
        writes = []
        for lora, adapter in wanted.items():
            if lora not in self._slots:
                used = set(self._slots.values())
                free = [s for s in range(1, self.max_loras + 1) if s not in used]
                slot = free[0] if free else self._slots.pop(next(x for x in self._slots if x not in wanted))
                self._slots[lora] = slot
                writes.append((slot, adapter))
        self.num_slot_writes += len(writes)
        return np.asarray([self._slots[a.lora_int_id] if a is not None else 0 for a in adapters], np.int32), writes

    def resident(self) -> dict[int, int]:
        """lora_int_id -> device slot, of the adapters in the slots now."""
        return dict(self._slots)


def with_empty_slots(config: EngineConfig, params: dict) -> dict:
    """The loaded weights (numpy, layers stacked) with every Linear's adapter slots, all zeros."""
    shapes = abstract_params(config.step_model, np.float32)["layers"]

    def fill(shape_tree, tree):
        out = dict(tree)
        for key, sub in shape_tree.items():
            if key in LORA_LEAVES:
                out[key] = np.zeros(sub.shape, np.float32)
            elif isinstance(sub, dict):
                out[key] = fill(sub, tree.get(key, {}))
        return out

    return {**params, "layers": fill(shapes, params["layers"])}


def token_slots(row_slots: np.ndarray, token_rows: np.ndarray, num_tokens: int, num_rows: int) -> np.ndarray:
    """Each token's adapter slot [T] from its row's (``token_rows``, the batch's token_seq); the padding tokens
    after the first ``num_tokens`` (and any row past ``num_rows``) get slot 0."""
    padded = np.zeros(max(len(token_rows), num_rows, 1), np.int32)
    padded[:num_rows] = row_slots
    slots = padded[np.asarray(token_rows)]
    slots[num_tokens:] = 0
    return slots


def lora_mapping(row_slots: np.ndarray, token_rows: np.ndarray, num_tokens: int, num_rows: int,
                 max_loras: int, grouped: bool = False) -> LoRAMapping | None:
    """The step's LoRAMapping: its slots (ascending, padded with slot 0 to the least bucket of
    ``lora_buckets(max_loras, grouped)`` that holds them; the largest: every slot) and each token's index among
    them (-1: none); None when no token runs an adapter (the base model's step)."""
    slots = token_slots(row_slots, token_rows, num_tokens, num_rows)
    used = np.unique(slots[slots != 0])
    if not used.size:
        return None
    size = next(n for n in lora_buckets(max_loras, grouped) if n >= used.size)
    if size > max_loras:  # every slot, as they lie: a token's index is its slot (slot 0 is zeros)
        return LoRAMapping(slots.astype(np.int32), np.arange(size, dtype=np.int32))
    step = np.zeros(size, np.int32)
    step[:used.size] = used
    indices = np.where(slots != 0, np.searchsorted(used, slots), -1).astype(np.int32)
    return LoRAMapping(indices, step)


class SlotWriter:
    """Writes one adapter into one slot of the runner's weights (a pytree, layers stacked or unrolled: each
    LoRA leaf [L, slots, ...] or, per layer, [slots, ...]): one jitted update of every LoRA leaf, the slot a
    traced argument, so one compile serves every slot. Under tensor parallelism each device is sent its own part
    of the adapter (the leaf's sharding less the slot axis) and updates its own part of the slot: nothing is
    gathered."""

    def __init__(self, params: dict):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path) for path, _ in flat]
        self.lora = [i for i, path in enumerate(self.paths) if path[-1] in LORA_LEAVES]
        # the slot axis: ("layers", i, ...) is one layer's [slots, ...], ("layers", ...) the stack [L, slots, ...]
        self.axes = tuple(0 if isinstance(self.paths[i][1], int) else 1 for i in self.lora)
        shardings = [getattr(flat[i][1], "sharding", None) for i in self.lora]  # None: numpy leaves
        self._value_shardings = [None if s is None else without_axis(s, axis) for s, axis in zip(shardings, self.axes)]
        placed = all(s is not None for s in shardings)
        self._set = jax.jit(_set_slot, static_argnums=3, **({"out_shardings": shardings} if placed else {}))

    def write(self, params: dict, slot: int, adapter: LoRAModel | None) -> dict:
        """params with ``adapter`` (None: zeros) in ``slot``."""
        leaves = jax.tree_util.tree_leaves(params)
        new = self._set(*self._arguments(leaves, slot, adapter))
        for i, leaf in zip(self.lora, new):
            leaves[i] = leaf
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def lower(self, params: dict, slot: int, adapter: LoRAModel | None):
        """The write's lowering (``jax.stages.Lowered``), for checking what it runs."""
        return self._set.lower(*self._arguments(jax.tree_util.tree_leaves(params), slot, adapter))

    def _arguments(self, leaves: list, slot: int, adapter: LoRAModel | None) -> tuple:
        values = []
        for i, axis, sharding in zip(self.lora, self.axes, self._value_shardings):
            path, leaf = self.paths[i], leaves[i]
            key = path[2:] if axis == 0 else path[1:]
            full = adapter.weights.get(key) if adapter is not None else None
            shape = leaf.shape[1:] if axis == 0 else (leaf.shape[0], *leaf.shape[2:])
            value = np.zeros(shape, np.float32) if full is None else (full[path[1]] if axis == 0 else full)
            values.append(value if sharding is None else put(np.ascontiguousarray(value), sharding))
        return [leaves[i] for i in self.lora], np.int32(slot), values, self.axes


def _set_slot(leaves: list, slot, values: list, axes: tuple) -> list:
    return [_set_one(a, slot, v, axis) for a, v, axis in zip(leaves, values, axes)]


def _set_one(a, slot, value, axis: int):
    index = (slice(None),) * axis + (slot,)
    return a.at[index].set(value.astype(a.dtype))
