"""Shared fixtures: the real model is loaded once per test session, and so is its transformers reference."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAXPAGE_CACHE_DIR", str(Path.home() / ".cache" / "jaxpage"))
# The test extra installs the TPU runtime for the compile lane (ahead-of-time compilation for TPU topologies);
# the tests themselves run on the CPU, and several processes (servers the tests start) may load libtpu at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

def run_on_forced_devices(test_file: str, num_devices: int, child_flag: str) -> None:
    """Runs ``test_file``'s tests in a child pytest on ``num_devices`` forced CPU devices (XLA reads the count once,
    when it starts), with the environment variable ``child_flag`` set to 1; fails with the child's output."""
    env = {**os.environ, child_flag: "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                         cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"child pytest failed:\n{run.stdout[-8000:]}\n{run.stderr[-4000:]}"


SMOLLM2_OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, dtype="float32",
                       kv_cache_memory=256 << 20, progress=False)


@pytest.fixture(scope="session")
def smollm2():
    from jaxpage import LLM

    return LLM(**SMOLLM2_OPTIONS)


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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A converted-weights cache of the module's own (the random-model test files)."""
    return tmp_path_factory.mktemp("jaxpage-cache")
