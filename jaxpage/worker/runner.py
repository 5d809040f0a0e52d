"""The runner contract: what the engine drives on the device side (vLLM's model runner). ``ModelRunner`` is the
engine's; ``multihost.LeaderRunner`` broadcasts each device call to the other processes; the tests' FakeRunner
simulates the pool on the host. Everything a runner needs comes through its constructor (the config, the
weights, the EOS token ids), and the engine reads nothing of it beyond these members."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.kv_cache_manager import DeviceOps
from jaxpage.core.scheduler_output import ScheduledSeq
from jaxpage.worker.kv_disk_store import DiskKVStore
from jaxpage.worker.sampler import SamplerOutput


class Runner(Protocol):
    config: EngineConfig
    # launch leaves a step running and fetch reads it (async scheduling); False: the engine's steps stay in order
    supports_async_scheduling: bool
    disk_store: DiskKVStore | None  # the prefix cache's disk tier's files, which the engine indexes (None: off)
    # the prefix cache's tier moves (worker.kv_tiers.KVTierMoves): their store/restore seconds, for the stats
    tiers: object | None

    def warm_up(self, progress: bool = True) -> None:
        """Compiles (or prepares) every program a step may run: serving compiles nothing."""

    def apply(self, ops: DeviceOps) -> list[int]:
        """The scheduler's block copies, swaps and tier moves, in order, before the step that needs them;
        returns the device blocks whose disk-tier restore failed (vLLM's invalid_block_ids)."""

    def execute(self, scheduled: list[ScheduledSeq], bitmask: np.ndarray | None = None) -> SamplerOutput:
        """One step, waited for: the sampler's output (numpy) for each scheduled row, in order."""

    def launch(self, scheduled: list[ScheduledSeq], bitmask: np.ndarray | None = None, previous=None):
        """One step started, not waited for; ``previous`` (a launched step) fills this one's placeholders."""

    def fetch(self, launched) -> SamplerOutput:
        """A launched step's output, waiting for it if need be."""

    def load_lora(self, request):
        """A LoRARequest's adapter on the host (a ValueError naming the field where it cannot be)."""

    def remove_lora(self, lora_int_id: int) -> None:
        """Forgets an adapter (no request may run with it)."""
