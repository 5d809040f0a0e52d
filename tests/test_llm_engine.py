"""Engine behaviour on the real model: no compiles after warm-up, clear errors, every block returned."""
from __future__ import annotations

import random
import subprocess
import sys

import jax
import pytest

from jaxpage import LLM, SamplingParams
from tests.compiles import CompileCounter


def test_serving_varied_lengths_after_warm_up_compiles_nothing(smollm2):
    counter = CompileCounter()
    rng = random.Random()
    vocab = smollm2.engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 150))]} for _ in range(12)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                             max_tokens=rng.randint(1, 12), ignore_eos=True) for _ in prompts]
    counter.active = True
    outs = smollm2.generate(prompts, params)
    counter.active = False
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert counter.events == [], f"compiled while serving: {counter.events}"
    # the counter does see compiles: a fresh jit of a new function is one
    counter.active = True
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7))
    counter.active = False
    assert counter.events, "compile counter saw nothing; the check above would prove nothing"


def _all_blocks_free(llm) -> bool:
    return llm.engine.block_pool.num_free == llm.engine.config.cache.num_kv_blocks - 1


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(max_tokens=4), "prompt is empty"),
    ({"prompt_token_ids": []}, SamplingParams(max_tokens=4), "prompt_token_ids is empty"),
    ({"prompt_token_ids": [1] * 1024}, SamplingParams(max_tokens=4), "max_model_len=1024"),
    ({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4), "prompt_token_ids must be integers in"),
    (42, SamplingParams(max_tokens=4), "prompt must be a string"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(smollm2, prompt, params, message):
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=message):
        smollm2.generate([good, prompt], params)
    assert _all_blocks_free(smollm2) and not smollm2.engine.has_unfinished_requests()
    out = smollm2.generate([good], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert _all_blocks_free(smollm2)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens=0 must be an integer >= 1"),
    ("temperature", -1.0, r"temperature=-1.0 must be 0 \(greedy\) or in \[0.01, 100.0\]"),
    ("top_p", 0.0, "top_p=0.0 must be in"),
    ("top_k", -2, "top_k=-2"),
])
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_generation_longer_than_max_model_len_is_cut_with_length(smollm2):
    prompt = {"prompt_token_ids": [5] * 1020}
    out = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_missing_model_path_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope.gguf"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such/model.gguf", "hi"], "does not exist"),
    (["generate", "--max-tokens", "0", "hi"], "max_tokens=0"),
    (["generate", ""], "prompt is empty"),
])
def test_cli_bad_input_exits_nonzero_with_a_message(args, message):
    result = _cli(*args)
    assert result.returncode != 0
    assert message in result.stderr


def test_cli_streams_generation_and_refuses_overlong_prompt():
    small = ["--max-model-len", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "8"]
    result = _cli("generate", *small, "--max-tokens", "8", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    result = _cli("generate", *small, "word " * 100)
    assert result.returncode != 0 and "max_model_len=64" in result.stderr
