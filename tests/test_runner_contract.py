"""The runner contract (jaxpage.worker.runner.Runner): the engine's ModelRunner, the multi-host LeaderRunner and
the tests' FakeRunner each have every member the engine reads, and a ModelRunner's EOS ids come through its
constructor (min_tokens bans them in the sampler's inputs)."""
from __future__ import annotations

import typing

import jax.numpy as jnp
import pytest

from jaxpage.engine.config_builder import build_engine_config
from jaxpage.testing import random_model
from jaxpage.worker.model_runner import ModelRunner
from jaxpage.worker.multihost import LeaderRunner
from jaxpage.worker.runner import Runner
from tests.fake_engine import make_engine

MEMBERS = sorted({*typing.get_type_hints(Runner), *(n for n in vars(Runner) if not n.startswith("_"))})


@pytest.fixture(scope="module")
def model_runner():
    config = build_engine_config(random_model.TINY, dtype="float32", block_size=16, kv_cache_memory=None,
                                 num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                 gpu_memory_utilization=0.9)
    return ModelRunner(config, random_model.random_params(random_model.TINY, jnp.float32), eos_token_ids={9, 2})


def test_the_contract_names_what_the_engine_reads():
    assert {"config", "supports_async_scheduling", "disk_store", "tiers", "warm_up", "apply", "execute", "launch",
            "fetch", "load_lora", "remove_lora"} <= set(MEMBERS)


def test_every_runner_has_every_member(model_runner):
    fake = make_engine(num_kv_blocks=16).runner
    for runner in (model_runner, fake):
        missing = [name for name in MEMBERS if not hasattr(runner, name)]
        assert not missing, (type(runner).__name__, missing)
    missing = [name for name in MEMBERS if not hasattr(LeaderRunner, name) and not hasattr(model_runner, name)]
    assert not missing and issubclass(LeaderRunner, ModelRunner), missing


def test_eos_ids_come_through_the_constructor(model_runner):
    assert model_runner.eos_token_ids == (2, 9)


def test_a_steps_rows_are_never_changed_once_made():
    """Under the tests a row's fields are write-once (tests/conftest.py): any code changing a row after the
    scheduler made it fails here, in every test; a row with other values is a new one (dataclasses.replace)."""
    import dataclasses

    from jaxpage.core.scheduler_output import ScheduledSeq
    from jaxpage.sequence import Sequence

    row = ScheduledSeq(Sequence(0, [1, 2], 2, 8), 2, None, True, block_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError, match="num_new_tokens"):
        row.num_new_tokens = 1
    again = dataclasses.replace(row, spec_token_ids=(3,), num_new_tokens=2)
    assert again.spec_token_ids == (3,) and row.spec_token_ids == () and again.block_ids is row.block_ids
