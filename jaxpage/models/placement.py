"""The weights' transforms for tensor parallelism: KV heads repeated to fill the TP size, and each weight sent
shard by shard to its devices (the shardings come from jaxpage.distributed.parallel)."""
from __future__ import annotations

import jax
import numpy as np

from jaxpage.distributed.parallel import put
from jaxpage.models.layers import QKVParallelLinear
from jaxpage.models.quant import SCALE, weight_dtype


def replicate_kv_heads(params: dict, slots: int) -> dict:
    """The fused q/k/v projections (kernel, bias and int8 scale [..., kvh, G + 2, hd]) with each KV head
    repeated so there are ``slots`` (numpy, before placement); unchanged when they already have that many."""
    def repeat(path, a):
        names = [getattr(k, "key", None) for k in path]
        if names[-2] != "qkv" or names[-1] not in ("kernel", "bias", SCALE) or a.shape[-3] == slots:
            return a
        return QKVParallelLinear.replicate_kv_heads(np.asarray(a), slots)
    return jax.tree_util.tree_map_with_path(repeat, params)


def place_params(params: dict, shardings: dict, dtype) -> dict:
    """Each weight converted on the host and sent shard by shard to its devices (no full copy on one device)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, s: put(np.asarray(a).astype(weight_dtype(p, a, dtype)), s), params, shardings)
