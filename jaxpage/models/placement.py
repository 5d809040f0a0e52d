"""The weights' transforms for tensor parallelism: KV heads repeated to fill the TP size, and each weight sent
shard by shard to its devices (the shardings come from jaxpage.distributed.parallel)."""
from __future__ import annotations

import jax
import numpy as np

from jaxpage.distributed.parallel import put
from jaxpage.models.quant import SCALE, weight_dtype


def replicate_kv_heads(params: dict, slots: int) -> dict:
    """The k/v projections (kernel [.., D, kvh, hd], bias [.., kvh, hd]) with each KV head repeated so there
    are ``slots`` (numpy, before placement); unchanged when they already have that many."""
    def repeat(path, a):
        names = [getattr(k, "key", None) for k in path]
        if names[-2] not in ("k", "v") or names[-1] not in ("kernel", "bias", SCALE):
            return a
        axis = a.ndim - 2  # kernel [..., D, kvh, hd], bias and int8 scale [..., kvh, hd]: KV heads second to last
        return a if a.shape[axis] == slots else np.repeat(a, slots // a.shape[axis], axis=axis)
    return jax.tree_util.tree_map_with_path(repeat, params)


def place_params(params: dict, shardings: dict, dtype) -> dict:
    """Each weight converted on the host and sent shard by shard to its devices (no full copy on one device)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, s: put(np.asarray(a).astype(weight_dtype(p, a, dtype)), s), params, shardings)
