"""What prompt logprobs cost, on SmolLM2.

1. The step's tail (worker/step.py sample_tokens: the LM head at each row's last token, the sampler, and the
   prompt-logprob loop) on random final hidden states, jitted three ways and timed side by side, interleaved:
   ``before`` (a batch without prompt targets: the tail as it was before prompt logprobs), ``none asks`` (targets
   all -1: every chunk's lax.cond skips its LM head) and ``all ask`` (every token has a target); for a decode
   bucket (8 rows, 8 tokens) and a prefill bucket (64 tokens of one row).
2. End to end: LLM.generate of 4 fresh random 128-token prompts, 1 new token each, with prompt_logprobs=1
   against without (no prefix-cache hit either way: fresh tokens every round), interleaved.

    python -m benchmarks.prompt_logprobs_cost [--rounds 20] [--out benchmarks/results/prompt_logprobs_cost.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from jaxpage import LLM, SamplingParams
from jaxpage.models import TokenBatch, top_weights
from jaxpage.worker.sampler import SamplingBatch
from jaxpage.worker.step import abstract_step_inputs, sample_tokens

OPTIONS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, dtype="float32",
               kv_cache_memory=256 << 20, progress=False)
# SamplingBatch fields whose neutral value is not 0 (greedy rows, nothing banned, biased or masked)
NEUTRAL = {"top_p": 1, "repetition_penalty": 1, "history": -1, "banned": -1, "allowed": -1, "logit_bias_ids": -1,
           "prompt_targets": -1}


def tail_inputs(config, num_tokens: int, rng):
    """Random final hidden states [T, D], a batch whose rows sample their last tokens, neutral sampling rows."""
    batch, sampling = abstract_step_inputs(config, num_tokens)
    sampling = SamplingBatch(**{f.name: np.full(getattr(sampling, f.name).shape, NEUTRAL.get(f.name, 0),
                                                getattr(sampling, f.name).dtype)
                                for f in dataclasses.fields(SamplingBatch)})
    num_seqs = batch.logits_indices.shape[0]
    batch = TokenBatch(*(np.zeros(a.shape, a.dtype) for a in dataclasses.astuple(batch)[:5]),
                       np.arange(num_seqs, dtype=np.int32) % num_tokens)
    hidden = rng.normal(size=(num_tokens, config.model.hidden_size)).astype(np.float32)
    return hidden, batch, sampling


def time_tail(llm: LLM, rounds: int) -> dict:
    config, rng = llm.engine.config, np.random.default_rng(0)
    top = top_weights(llm.engine.runner.params)
    tail = jax.jit(functools.partial(sample_tokens, config))
    out = {}
    for name, num_tokens in (("decode, 8 rows", 8), ("prefill, 64 tokens", 64)):
        hidden, batch, sampling = tail_inputs(config, num_tokens, rng)
        asks = rng.integers(0, config.model.vocab_size, num_tokens).astype(np.int32)
        forms = {"before": dataclasses.replace(sampling, prompt_targets=None), "none asks": sampling,
                 "all ask": dataclasses.replace(sampling, prompt_targets=asks)}
        times = {form: [] for form in forms}
        for s in forms.values():  # compile and run once
            jax.block_until_ready(tail(top, hidden, batch, s))
        for _ in range(rounds):
            for form, s in forms.items():
                started = time.perf_counter()
                jax.block_until_ready(tail(top, hidden, batch, s))
                times[form].append(time.perf_counter() - started)
        out[name] = {form: statistics.median(t) * 1e3 for form, t in times.items()}
        print(name, {form: f"{ms:.2f} ms" for form, ms in out[name].items()})
    return out


def time_generate(llm: LLM, rounds: int) -> dict:
    rng, vocab = np.random.default_rng(1), llm.engine.config.model.vocab_size
    forms = {"without": SamplingParams(max_tokens=1, temperature=0),
             "prompt_logprobs=1": SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)}
    times = {form: [] for form in forms}
    for i in range(rounds + 1):  # the first round warms up
        for form, params in forms.items():
            prompts = [{"prompt_token_ids": rng.integers(0, vocab, 128).tolist()} for _ in range(4)]
            started = time.perf_counter()
            llm.generate(prompts, params)
            if i:
                times[form].append(time.perf_counter() - started)
    out = {form: statistics.median(t) * 1e3 for form, t in times.items()}
    print("generate, 4 x 128 prompt tokens", {form: f"{ms:.0f} ms" for form, ms in out.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/prompt_logprobs_cost.json")
    args = parser.parse_args()
    llm = LLM(**OPTIONS)
    result = {"load_before": os.getloadavg(), "tail_ms": time_tail(llm, args.rounds),
              "generate_ms": time_generate(llm, max(3, args.rounds // 4)), "load_after": os.getloadavg(),
              "rounds": args.rounds}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
