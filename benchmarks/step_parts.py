"""Where a CPU engine step goes: the host layer loop's executables timed one by one, per token bucket.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/step_parts.py [--buckets 1 8 32] [--json out.json]

SmolLM2-135M (float32 and int8 weights), the engine's own compiled executables for each bucket: 30 calls of the
layer, then the end (final norm, tied LM head, sampler), on an all-padding batch (the attention reads one page
per token, so its cost is mostly left out) whose rows sample greedily with no penalty, no ban and every token
allowed, as a plain greedy request does. Also the LM head's matmul alone (the same weights, jitted by itself), so
that the end splits into head and sampler. Medians of 7 runs, both weight forms side by side in one process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from jaxpage import LLM
from jaxpage.models import compute_logits, top_weights
from jaxpage.worker.step import abstract_step_inputs

OPTIONS = dict(max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024, dtype="float32",
               kv_cache_memory=256 << 20, progress=False)


def greedy_padding(config, num_tokens: int):
    """An all-padding (batch, sampling) for the bucket, every row a plain greedy request."""
    batch, sampling = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_step_inputs(config, num_tokens))
    rows = sampling.temperature.shape
    return batch, dataclasses.replace(sampling, top_p=np.ones(rows, np.float32),
                                      repetition_penalty=np.ones(rows, np.float32),
                                      banned=np.full_like(sampling.banned, -1),
                                      allowed=np.full_like(sampling.allowed, -1),
                                      logit_bias_ids=np.full_like(sampling.logit_bias_ids, -1))


def median_ms(fn, repeats: int = 7) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def parts(llm: LLM, num_tokens: int) -> dict:
    runner = llm.engine.runner
    loop, config = runner.executable(num_tokens), runner.config
    batch, sampling = greedy_padding(config, num_tokens)
    batch = jax.tree.map(lambda a: jax.device_put(a, loop.inputs), batch)
    top, layers = top_weights(runner.params), runner.params["layers"]
    x, shared = loop.begin(top, batch)

    def all_layers():
        nonlocal x
        y = x
        for i, consts in enumerate(loop.consts):
            y, runner.kv_pool = loop.layer(layers[i], consts, y, runner.kv_pool, batch, shared)
        return y
    rows = sampling.temperature.shape[0]
    head = jax.jit(lambda top, h: compute_logits(config.model, top, h))
    hidden = jax.numpy.ones((rows, config.model.hidden_size), np.float32)
    per_row = dataclasses.replace(sampling, prompt_targets=None)  # the tail without prompt logprobs
    tail = lambda: loop.for_rows("sampler", rows)(top, loop.end(top, x, batch)[1], per_row)  # noqa: E731
    return {"layers_ms": median_ms(all_layers), "end_ms": median_ms(tail),
            "lm_head_ms": median_ms(lambda: head(top, hidden)), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--json")
    args = parser.parse_args()
    engines = {"float32": LLM(**OPTIONS), "int8": LLM(quantization="int8", **OPTIONS)}
    results = {name: {n: parts(llm, n) for n in args.buckets} for name, llm in engines.items()}
    print("| bucket | weights | rows | 30 layers | end (final norm, LM head, greedy sampler) | LM head alone |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.buckets:
        for name in engines:
            r = results[name][n]
            print(f"| {n} | {name} | {r['rows']} | {r['layers_ms']:.1f} ms | {r['end_ms']:.1f} ms | "
                  f"{r['lm_head_ms']:.1f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args), "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
