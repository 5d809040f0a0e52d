"""Shared fixtures: the real model is loaded once per test session, and so are its transformers reference and that
reference's greedy runs."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

os.environ.setdefault("JAXPAGE_CACHE_DIR", str(Path.home() / ".cache" / "jaxpage"))
# The test extra installs the TPU runtime for the compile lane (ahead-of-time compilation for TPU topologies);
# the tests themselves run on the CPU, and several processes (servers the tests start) may load libtpu at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _write_once(cls) -> None:
    """Makes a slots dataclass's fields write-once under the tests: the engine treats its instances as plain data
    never changed after they are made (ScheduledSeq's docstring says why the class is not frozen itself)."""
    def __setattr__(self, name, value):
        try:
            getattr(self, name)
        except AttributeError:  # not set yet: its __init__
            object.__setattr__(self, name, value)
            return
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} of a {cls.__name__} once made")
    cls.__setattr__ = __setattr__


from jaxpage.core.scheduler_output import ScheduledSeq  # noqa: E402 - after the platform is set

_write_once(ScheduledSeq)

# The longest files first (a few minutes each: child processes, servers, engines of their own), so that with
# pytest-xdist's --dist loadfile no worker starts one of them while the other has nothing left to run.
LONGEST_FIRST = ("test_tensor_parallel.py", "test_structured_outputs.py", "test_openai_api.py", "test_smollm2.py",
                 "test_benchmarks_smoke.py", "test_compile_tpu.py", "test_data_parallel.py", "test_vs_vllm.py")


# The unit lane (`pytest -m unit`): modules that load no model and start no server (the engine core over
# tests/fake_engine.py's runner, configs, parsers, the import graph, the documents' citations).
UNIT = ("test_block_pool.py", "test_config_builder.py", "test_warmup.py", "test_registry.py", "test_vocab_shard.py",
        "test_stop.py", "test_import_graph.py", "test_docs.py", "test_block_accounting.py", "test_prefill_limits.py",
        "test_requests.py", "test_routing.py", "test_chat_parsers.py", "test_structured_serving.py",
        "test_sliding_window_memory.py", "test_runner_contract.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in UNIT:
            item.add_marker(pytest.mark.unit)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def smollm2():
    from jaxpage import LLM
    from tests.factories import SMOLLM2_OPTIONS

    return LLM(**SMOLLM2_OPTIONS)


@pytest.fixture(scope="session")
def smollm2_ngram():
    """SmolLM2 as ``smollm2``, with n-gram speculative decoding of 3 tokens (lookups of 2 to 4)."""
    from jaxpage import LLM
    from tests.factories import SMOLLM2_OPTIONS

    return LLM(**SMOLLM2_OPTIONS, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 4, "prompt_lookup_min": 2})


@pytest.fixture(scope="session")
def hf_smollm2():
    """(model, tokenizer) from the same GGUF file, read independently by transformers (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpage.models.loader import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def hf_smollm2_greedy(hf_smollm2):
    """transformers' greedy runs of SmolLM2 (reference.hf_greedy), shared by the session's tests."""
    from tests.reference import GreedyRuns

    return GreedyRuns(hf_smollm2[0])


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as PEM files."""
    from tests.servers import make_certificates

    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A converted-weights cache of the module's own (the random-model test files)."""
    return tmp_path_factory.mktemp("jaxpage-cache")
