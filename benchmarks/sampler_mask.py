"""The jitted sampler alone on [32, vocab] logits at temperature 1.0: every token allowed against ~64 allowed a row
(structured outputs' mask). Shows where a CPU step's sampling time goes (once the full-vocabulary sort of _filter, now bisections),
and the greedy path's argmax in its two forms.

    python benchmarks/sampler_mask.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.distributed.vocab_shard import VocabShard
from jaxpage.sampling_params import MAX_LOGIT_BIAS
from jaxpage.worker.sampler import MAX_BANNED, SamplingBatch, sample

S, V, W = 32, 49152, 1536  # rows, SmolLM2's vocabulary, bitmask words


def batch(mask: np.ndarray) -> SamplingBatch:
    f = lambda v: np.full(S, v, np.float32)  # noqa: E731
    return SamplingBatch(f(1.0), np.zeros(S, np.int32), f(1.0), f(0.0), np.arange(S, dtype=np.uint32),
                         np.zeros(S, np.int32), f(0), f(0), f(1), np.full((1, 8), -1, np.int32),
                         np.zeros(S, np.int32), np.zeros(S, np.int32), np.full((S, MAX_BANNED), -1, np.int32), np.bool_(False), mask,
                         np.full((S, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((S, MAX_LOGIT_BIAS), np.float32))


def main() -> None:
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(S, V)).astype(np.float32) * 3)
    ones = np.full((S, W), -1, np.int32)
    few = np.zeros((S, W), np.int32)
    few[:, :4] = 0x0F0F0F0F  # 16 tokens a word, 4 words: 64 allowed a row
    f = jax.jit(sample)
    for name, m in [("all allowed", ones), ("64 allowed", few)] * 2:
        print(f"{name}: {milliseconds(f, logits, batch(m)):.1f} ms a call")
    vocab = VocabShard(V, V)
    forms = {"jnp.argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1)), "VocabShard.argmax": jax.jit(vocab.argmax)}
    for name, form in list(forms.items()) * 2:  # the greedy path's reduction, each form alone
        print(f"{name} of [{S}, {V}]: {milliseconds(form, logits):.2f} ms a call")


def milliseconds(f, *args) -> float:
    """Mean of 10 calls after a warm one."""
    jax.block_until_ready(f(*args))
    started = time.perf_counter()
    for _ in range(10):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - started) * 100


if __name__ == "__main__":
    main()
