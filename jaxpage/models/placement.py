"""The weights' transforms for tensor parallelism: KV heads repeated to fill the TP size (LoRA B's with them), and
each weight sent shard by shard to its devices (the shardings come from jaxpage.distributed.parallel)."""
from __future__ import annotations

import jax
import numpy as np

from jaxpage.distributed.parallel import put
from jaxpage.models.layers import QKVParallelLinear
from jaxpage.models.quant import SCALE, ZERO, weight_dtype

# the fused q/k/v leaves with a KV head axis ([..., kvh, G + 2, hd]): its output side; LoRA's B follows the kernel
KV_HEAD_LEAVES = ("kernel", "bias", SCALE, ZERO, "lora_b")


def replicate_kv_heads(params: dict, slots: int) -> dict:
    """The fused q/k/v projections (kernel, bias, int8 scale and LoRA B [..., kvh, G + 2, hd]) with each KV head
    repeated so there are ``slots`` (numpy, before placement); unchanged when they already have that many."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: replicate_kv_leaf(tuple(getattr(k, "key", None) for k in path), a, slots), params)


def replicate_kv_leaf(names: tuple, a, slots: int):
    """One weight at layer path ``names`` with its KV heads repeated to ``slots`` if it is a fused q/k/v leaf
    that has a KV head axis (``a`` itself otherwise): a LoRA adapter's B replicated as the base kernel is."""
    if len(names) < 2 or names[-2] != "qkv" or names[-1] not in KV_HEAD_LEAVES or a.shape[-3] == slots:
        return a
    return QKVParallelLinear.replicate_kv_heads(np.asarray(a), slots)


def place_params(params: dict, shardings: dict, dtype) -> dict:
    """Each weight converted on the host and sent shard by shard to its devices (no full copy on one device)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, s: put(np.asarray(a).astype(weight_dtype(p, a, dtype)), s), params, shardings)
