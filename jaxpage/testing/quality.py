"""Teacher-forced quality of a quantized configuration against the float32 one, on varied text (for the tests).

A variant is a set of options (today ``kv_cache_dtype``; int8 weights add their own key): ``variant_pool`` and
``variant_params`` turn it into the pool and the weights the forward pass runs on, so a new quantization is one
more key handled there and one more row in tests/test_kv_quant.py's VARIANTS. ``teacher_forced_log_probs`` and
``agreement`` measure one sequence against a reference's log-probabilities (int8 weights against transformers).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention.kv_cache import allocate_kv_pool
from jaxpage.config import kv_storage_dtype
from jaxpage.models import TokenBatch, compute_logits, forward_hidden

REPO = Path(__file__).resolve().parents[2]
# prose, Python, a results table of numbers, a protobuf IDL: four kinds of text, SEGMENT tokens each
SOURCES = ("README.md", "jaxpage/core/scheduler.py", "benchmarks/RESULTS-ARCHIVE.md", "serving/generation.proto")
SEGMENT = 512


def varied_segments(tokenizer, segment: int = SEGMENT) -> list[list[int]]:
    segments = []
    for source in SOURCES:
        ids = tokenizer.encode((REPO / source).read_text())
        assert len(ids) >= segment, f"{source} has only {len(ids)} tokens"
        segments.append(ids[:segment])
    return segments


def variant_pool(config, num_blocks: int, variant: dict):
    kv_dtype = kv_storage_dtype(variant.get("kv_cache_dtype", "auto"), config.dtype)
    return allocate_kv_pool(config.model, num_blocks, config.cache.block_size, kv_dtype)


def variant_params(params: dict, variant: dict) -> dict:
    unknown = set(variant) - {"kv_cache_dtype"}
    assert not unknown, f"no quality harness for {unknown} yet"
    return params


def segments_batch(segments: list[list[int]], block_size: int) -> TokenBatch:
    """All segments as one flat batch, each its own sequence on its own blocks (1, 2, ...)."""
    n, num_seqs = len(segments[0]), len(segments)
    width = -(-n // block_size)
    tables = (1 + np.arange(num_seqs * width, dtype=np.int32)).reshape(num_seqs, width)
    pos = np.tile(np.arange(n, dtype=np.int32), num_seqs)
    seq = np.repeat(np.arange(num_seqs, dtype=np.int32), n)
    slots = tables[seq, pos // block_size] * block_size + pos % block_size
    return TokenBatch(np.concatenate(segments).astype(np.int32), pos, slots.astype(np.int32), seq, tables,
                      np.zeros(num_seqs, np.int32))


@functools.partial(jax.jit, static_argnums=0)
def _hidden(model_cfg, params, pool, batch):
    return forward_hidden(model_cfg, params, pool, batch)[0]


def teacher_forced_hidden(config, params, segments, variant: dict) -> jax.Array:
    batch = segments_batch(segments, config.cache.block_size)
    pool = variant_pool(config, 1 + batch.block_tables.size, variant)
    return _hidden(config.step_model, variant_params(params, variant), pool, batch)


@functools.partial(jax.jit, static_argnums=0)
def _compare(model_cfg, ref_params, params, ref_hidden, hidden):
    """(top-1 agreements, sum of KL(reference || variant)) over one slice of positions."""
    ref = jax.nn.log_softmax(compute_logits(model_cfg, ref_params, ref_hidden))
    got = jax.nn.log_softmax(compute_logits(model_cfg, params, hidden))
    agree = jnp.sum(ref.argmax(-1) == got.argmax(-1))
    return agree, jnp.sum(jnp.exp(ref) * (ref - got))


def quality(config, params, segments, variant: dict, reference: jax.Array, chunk: int = 256) -> dict:
    """top1 agreement and mean KL divergence (nats per token) of ``variant`` against ``reference`` hidden."""
    hidden = teacher_forced_hidden(config, params, segments, variant)
    ours = variant_params(params, variant)
    agree = kl = 0.0
    for i in range(0, hidden.shape[0], chunk):  # logits of every position at once would be 2 x 400 MB
        a, k = _compare(config.step_model, params, ours, reference[i:i + chunk], hidden[i:i + chunk])
        agree, kl = agree + float(a), kl + float(k)
    return {"top1": agree / hidden.shape[0], "kl": kl / hidden.shape[0], "tokens": int(hidden.shape[0])}


def one_sequence_batch(n: int, block_size: int, max_blocks: int) -> TokenBatch:
    pos = np.arange(n, dtype=np.int32)
    tables = np.zeros((1, max_blocks), np.int32)
    tables[0, :-(-n // block_size)] = 1 + np.arange(-(-n // block_size))
    return TokenBatch(np.zeros(n, np.int32), pos, (tables[0, pos // block_size] * block_size + pos % block_size),
                      np.zeros(n, np.int32), tables, np.zeros(1, np.int32))


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(model_cfg, params, pool, batch):
    hidden, _ = forward_hidden(model_cfg, params, pool, batch)
    return jax.nn.log_softmax(compute_logits(model_cfg, params, hidden))


def teacher_forced_log_probs(model_cfg, params, pool, ids: list[int], block_size: int) -> np.ndarray:
    """log-softmax [n, V] at every position of ``ids``, one sequence on blocks 1, 2, ... of ``pool``."""
    batch = one_sequence_batch(len(ids), block_size, pool.shape[1] - 1)
    batch = dataclasses.replace(batch, token_ids=np.asarray(ids, np.int32))
    return np.asarray(_log_probs(model_cfg, params, pool, batch))


def agreement(ref_log_probs: np.ndarray, log_probs: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || ours) in nats) over the positions."""
    top1 = float(np.mean(ref_log_probs.argmax(-1) == log_probs.argmax(-1)))
    kl = np.sum(np.exp(ref_log_probs) * (ref_log_probs - log_probs), axis=-1, dtype=np.float64)
    return top1, float(kl.mean())


def agreement_with_transformers(hf_model, tokenizer, model_cfg, params, pool_dtype,
                                block_size: int = 16) -> tuple[float, float, list[float], list[float]]:
    """(mean top-1, mean KL, per-source top-1s, per-source KLs) of this configuration's teacher-forced
    log-probabilities against a transformers model's (float32: the reference) over ``varied_segments``."""
    import torch

    pool = allocate_kv_pool(model_cfg, 1 + SEGMENT // block_size, block_size, pool_dtype)
    top1s, kls = [], []
    for ids in varied_segments(tokenizer):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
        top1, kl = agreement(ref, teacher_forced_log_probs(model_cfg, params, pool, ids, block_size))
        top1s.append(top1)
        kls.append(kl)
    return float(np.mean(top1s)), float(np.mean(kls)), top1s, kls
