"""Every driver of the step's layer loop (jaxpage.worker.step.LAYER_LOOPS: the host loop, the scan, the scan
compiled with XLA's dynamic-slice fusion, the unrolled program) on one tiny random Llama in float32, with the
same requests: plain greedy ones (the tail's short sampler), greedy with top logprobs and a penalty, seeded
random sampling, and prompt logprobs. Greedy tokens are transformers' (up to a near-tie); every driver's tokens
are the host loop's and its log-probabilities within 1e-5; every block comes back.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpage import LLM, SamplingParams
from jaxpage.worker import step
from tests.factories import SEED, engine_options, tiny_llama
from tests.reference import assert_greedy_matches, hf_greedy, save_random_model

NEW_TOKENS = 12
REQUESTS = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=2),
            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, presence_penalty=0.5),
            SamplingParams(temperature=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_random_model(tiny_llama(), path, seed=SEED)


def generate(path, cache_dir, loop: str, prompts, params):
    """The requests through an engine whose step runs ``loop`` (the CPU's entry of LAYER_LOOP, or unrolled)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(step.LAYER_LOOP, "cpu", "host_loop" if loop == "unrolled" else loop)
        llm = LLM(str(path), cache_dir=str(cache_dir), **engine_options(max_model_len=64, scan_layers=loop != "unrolled"))
    assert llm.engine.runner.layer_loop == loop
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], list(params))
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], (loop, stats)
    return outs


def test_every_driver_gives_the_host_loop_s_outputs(model, tmp_path):
    path, hf = model
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 17, 9, 12)]
    single = [(p, r) for p in prompts for r in REQUESTS[:1]]  # every prompt plain greedy: the short sampler
    mixed = list(zip(prompts, REQUESTS))
    runs = {loop: [generate(path, tmp_path / loop, loop, *zip(*case)) for case in (single, mixed)]
            for loop in step.LAYER_LOOPS}
    with torch.no_grad():
        refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for loop, outs in runs.items():
        for p, out, (ref, ref_logits) in zip(prompts, outs[0], refs):
            assert_greedy_matches(list(out.outputs[0].token_ids), ref, ref_logits, f"{loop}, seed {SEED}, {len(p)}")
        for got, want in zip(sum(outs, []), sum(runs["host_loop"], [])):
            a, b = got.outputs[0], want.outputs[0]
            assert a.token_ids == b.token_ids, (loop, SEED, a.token_ids, b.token_ids)
            if b.logprobs:
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.keys() == y.keys(), (loop, SEED)
                    np.testing.assert_allclose(list(x.values()), list(y.values()),
                                               atol=1e-5, err_msg=f"{loop}, seed {SEED}")
            if want.prompt_logprobs:
                for x, y in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
                    np.testing.assert_allclose(sorted(x.values()), sorted(y.values()), atol=1e-5)
