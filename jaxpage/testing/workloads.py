"""Seeded synthetic workloads for the throughput benchmark, shaped like the vLLM paper's (Kwon et al., SOSP 2023).

Every request arrives at t=0. Prompt token ids are drawn uniformly from the vocabulary (throughput does not
depend on which tokens they are); lengths are drawn from lognormal distributions with the paper's means and
clipped so that prompt + output fits ``max_len`` (the clipping lowers the means a little: ``describe`` reports
the means actually drawn). Lengths are drawn stratified (one per quantile slice), so small workloads are
representative.

- ``sharegpt``: long, heavy-tailed conversations, mean 161 prompt / 338 output tokens (the paper's ShareGPT).
- ``alpaca``: short instructions, mean 19 prompt / 58 output tokens (the paper's Alpaca).
- ``shared_prefix``: one long system prompt shared by every request, then a short question of its own.
- ``parallel_sampling``: Alpaca-like requests, each asking for n=4 samples of the same prompt.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

FIRST_TOKEN_ID = 10  # stay clear of the special tokens at the start of Llama-family vocabularies


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # exactly this many output tokens are generated (greedy, EOS ignored)
    n: int = 1  # parallel samples of this prompt


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    max_len: int

    @property
    def num_sequences(self) -> int:
        return sum(r.n for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.n * r.max_tokens for r in self.requests)

    def describe(self) -> dict:
        prompts = np.array([len(r.prompt_token_ids) for r in self.requests])
        outputs = np.array([r.max_tokens for r in self.requests])
        return {"name": self.name, "num_requests": len(self.requests), "num_sequences": self.num_sequences,
                "max_len": self.max_len, "mean_prompt_tokens": float(prompts.mean()),
                "mean_output_tokens": float(outputs.mean()), "max_prompt_tokens": int(prompts.max()),
                "max_output_tokens": int(outputs.max()), "total_output_tokens": self.num_output_tokens}


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    """Integer lengths >= 1 from a lognormal whose (unclipped) mean is ``mean``.

    Stratified: one draw from each of ``size`` equal-probability slices, in random order, so that a benchmark
    of a few dozen requests still sees the distribution's body and tail in proportion."""
    mu = np.log(mean) - sigma ** 2 / 2
    quantiles = (rng.permutation(size) + rng.uniform(size=size)) / size
    normal = np.array([statistics.NormalDist().inv_cdf(float(q)) for q in quantiles])
    return np.maximum(1, np.rint(np.exp(mu + sigma * normal))).astype(int)


def _random_tokens(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, n))


def _lengths_workload(name: str, num_requests: int, max_len: int, vocab_size: int, seed: int,
                      prompt_mean: float, prompt_sigma: float, output_mean: float, output_sigma: float,
                      n: int = 1, scale: float = 1.0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = np.minimum(_lognormal_lengths(rng, scale * prompt_mean, prompt_sigma, num_requests), max_len - 1)
    outputs = np.minimum(_lognormal_lengths(rng, scale * output_mean, output_sigma, num_requests),
                         max_len - prompts)
    requests = tuple(Request(_random_tokens(rng, vocab_size, int(p)), int(o), n) for p, o in zip(prompts, outputs))
    return Workload(name, requests, max_len)


def sharegpt(num_requests: int, max_len: int, vocab_size: int, seed: int = 0, scale: float = 1.0) -> Workload:
    """ShareGPT-like: mean 161 in / 338 out, heavy tails (lognormal sigma 1.0 in, 0.8 out).

    ``scale`` multiplies both means (the --quick smoke run uses a small one with a small max_len)."""
    name = "sharegpt" if scale == 1.0 else f"sharegpt_x{scale:g}"
    return _lengths_workload(name, num_requests, max_len, vocab_size, seed, 161.31, 1.0, 337.99, 0.8, scale=scale)


def alpaca(num_requests: int, max_len: int, vocab_size: int, seed: int = 0) -> Workload:
    """Alpaca-like: mean 19 in / 58 out (lognormal sigma 0.5 in, 0.8 out)."""
    return _lengths_workload("alpaca", num_requests, max_len, vocab_size, seed, 19.31, 0.5, 58.45, 0.8)


def parallel_sampling(num_requests: int, max_len: int, vocab_size: int, seed: int = 0, n: int = 4) -> Workload:
    """Alpaca-like prompts, each sampled ``n`` times (the paper's parallel-sampling experiment)."""
    return _lengths_workload("parallel_sampling", num_requests, max_len, vocab_size, seed, 19.31, 0.5, 58.45, 0.8, n)


def fixed(num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0,
          max_len: int = 1024) -> Workload:
    """Every request the same shape: the N-concurrent-streams decode measurement."""
    rng = np.random.default_rng(seed)
    requests = tuple(Request(_random_tokens(rng, vocab_size, prompt_len), output_len) for _ in range(num_requests))
    return Workload(f"fixed_{num_requests}x{prompt_len}+{output_len}", requests, max_len)


def shared_prefix(num_requests: int, max_len: int, vocab_size: int, seed: int = 0, prefix_len: int = 400,
                  question_mean: float = 24.0, output_mean: float = 64.0) -> Workload:
    """One system prompt of ``prefix_len`` tokens shared by all requests, then a question of its own."""
    rng = np.random.default_rng(seed)
    prefix_len = min(prefix_len, max_len // 2)
    prefix = _random_tokens(rng, vocab_size, prefix_len)
    questions = np.minimum(_lognormal_lengths(rng, question_mean, 0.5, num_requests), max_len - prefix_len - 1)
    outputs = np.minimum(_lognormal_lengths(rng, output_mean, 0.8, num_requests), max_len - prefix_len - questions)
    requests = tuple(Request(prefix + _random_tokens(rng, vocab_size, int(q)), int(o))
                     for q, o in zip(questions, outputs))
    return Workload("shared_prefix", requests, max_len)


WORKLOADS = {"sharegpt": sharegpt, "alpaca": alpaca, "shared_prefix": shared_prefix,
             "parallel_sampling": parallel_sampling}


def make(name: str, num_requests: int, max_len: int, vocab_size: int, seed: int = 0) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](num_requests, max_len, vocab_size, seed)
