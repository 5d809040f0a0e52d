"""Tensor parallelism on JAX's sharding machinery: a mesh with one ``model`` axis, the sizes a model allows, and
where the weights and the KV pool live on it (the weights' own transforms: jaxpage.models.placement).

The weights are split by their ``nnx.Param`` names (attention heads, MLP columns/rows, LM head columns, embedding
rows; a dimension the TP size does not divide stays whole) and GSPMD
partitions the matmuls (the o and down projections end in an all-reduce); the attention call runs under
``shard_map`` (``over_heads``), each device running the single-device code on its own heads and its slice of the
pool (split by KV head). When the TP size exceeds the KV heads, each KV head is repeated ``tp // kv_heads`` times
(vLLM's replication): the pool then has ``tp`` KV head slots, and the k/v projections are repeated at load.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.config import EngineConfig, ModelConfig
from jaxpage.distributed.vocab_shard import VocabShard

MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits over
POOL_SPEC = P(None, None, None, MODEL_AXIS, None, None)  # the pool's KV head axis
PACKED_POOL_SPEC = P(None, None, MODEL_AXIS, None, None)  # the packed pool's (jaxpage.attention.kv_cache)
SCALES_SPEC = P(None, None, None, MODEL_AXIS, None)  # an int8 pool's scales (either layout)


def pool_spec(dtype=None, packed: bool = False):
    """The pool's PartitionSpec: a ScaledPool of the values' and the scales' for an int8 pool; packed: the
    packed layout's."""
    from pallas_kernels.quant import ScaledPool

    values = PACKED_POOL_SPEC if packed else POOL_SPEC
    return ScaledPool(values, SCALES_SPEC) if dtype is not None and jnp.dtype(dtype) == jnp.int8 else values
HEADS_SPEC = P(None, MODEL_AXIS, None)  # q/k/v and attention outputs [T, heads, head_dim]


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Refuses, by name, a TP size that cannot work for this model (``make_mesh`` refuses one too large for the
    devices)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an integer >= 1")
    heads, kv = model.num_heads, model.num_kv_heads
    rules = [(heads % tp == 0, f"must divide the model's num_attention_heads={heads}"),
             (kv % tp == 0 if tp <= kv else tp % kv == 0,
              f"must divide the model's num_key_value_heads={kv}, or be a multiple of it (KV heads replicated)")]
    for ok, rule in rules:
        if not ok:
            raise ValueError(f"tensor_parallel_size={tp} {rule}")


def kv_head_slots(model: ModelConfig, tp: int) -> int:
    """KV heads in the pool: the model's, or ``tp`` when each device needs a replica of one."""
    return max(model.num_kv_heads, tp)


def model_for_tp(model: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs at TP size ``tp``: the model's, with the KV heads replicated where needed."""
    check_tensor_parallel(model, tp)
    slots = kv_head_slots(model, tp)
    return dataclasses.replace(model, num_kv_heads=slots,
                               num_kv_head_replicas=model.num_kv_head_replicas * slots // model.num_kv_heads)


def checkpoint_model(model: ModelConfig) -> ModelConfig:
    """The model's shapes as its checkpoint (and a LoRA adapter of it) has them: the KV heads before
    ``model_for_tp`` repeated them."""
    if model.num_kv_head_replicas == 1:
        return model
    return dataclasses.replace(model, num_kv_heads=model.num_kv_heads // model.num_kv_head_replicas,
                               num_kv_head_replicas=1)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh of the first ``tp`` devices, axis ``model``; GSPMD (Auto) partitions everything outside the
    attention call."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {len(devices)} devices available")
    devices = devices[:tp]
    return Mesh(np.array(devices), (MODEL_AXIS,), axis_types=(AxisType.Auto,))


def device_group(tp: int, dp: int = 1, rank: int = 0, devices=None) -> list:
    """Data-parallel replica ``rank``'s devices: ``[rank * tp, (rank + 1) * tp)`` of all of them (every process's,
    when several run one mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"data_parallel_size={dp!r} must be an integer >= 1")
    if not 0 <= rank < dp:
        raise ValueError(f"data_parallel_rank={rank!r} must be in [0, data_parallel_size={dp})")
    if dp > 1 and dp * tp > len(devices):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} devices exceeds the "
                         f"{len(devices)} devices available")
    return devices[rank * tp:(rank + 1) * tp]


def placement(config: EngineConfig):
    """Where an engine's arrays live: the mesh of its device group when it is tensor-parallel, else the group's
    one device."""
    tp = config.parallel.tensor_parallel_size
    group = device_group(tp, config.parallel.data_parallel_size, config.parallel.data_parallel_rank)
    return make_mesh(tp, group) if tp > 1 else group[0]


def spec_fitting(spec: P, shape: tuple[int, ...], tp: int) -> P:
    """``spec`` without the model axis on dimensions it does not divide (e.g. a vocabulary): those stay
    replicated rather than padded."""
    return P(*(None if name == MODEL_AXIS and dim % tp else name for name, dim in zip(spec, shape)))


def spec_shardings(specs: dict, shapes: dict, mesh: Mesh) -> dict:
    """NamedShardings on ``mesh`` from a tree of PartitionSpecs and one of shapes (``spec_fitting`` applied)."""
    tp = mesh.shape[MODEL_AXIS]
    return jax.tree.map(lambda s, a: NamedSharding(mesh, spec_fitting(s, a.shape, tp)), specs, shapes,
                        is_leaf=lambda x: isinstance(x, P))


def without_axis(sharding, axis: int):
    """The sharding of one index along ``axis`` of an array sharded as ``sharding`` (one LoRA slot of the slots):
    the same devices, the spec less that axis (a device's own part of the index, nothing gathered)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, P(*spec[:axis], *spec[axis + 1:]))


def put(x: np.ndarray, sharding=None) -> jax.Array:
    """``x`` on the devices of ``sharding`` (None: the default device), each of this process's devices getting its
    part of this process's copy. Unlike ``jax.device_put``, no cross-process check that every process's copy is
    the same (a collective), so a process may place arrays when the others do not (jaxpage.worker.multihost)."""
    if sharding is None:
        return jax.device_put(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def model_axis_size() -> int:
    """The size of the model axis of the mesh a trace runs under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or MODEL_AXIS not in mesh.axis_names else mesh.shape[MODEL_AXIS]


def over_heads(fn, q, k, v, pool, shared: dict):
    """``fn(q, k, v, pool, **shared) -> (out, pool)`` on every device of the model axis, over its own heads: q/k/v
    split by heads, the pool by KV head slots, ``shared`` (arrays or None) replicated."""
    values = jax.tree.leaves(pool)[0]
    spec = pool_spec(values.dtype, packed=values.ndim == 5)
    return jax.shard_map(lambda q, k, v, pool, shared: fn(q, k, v, pool, **shared),
                         in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, spec, P()),
                         out_specs=(HEADS_SPEC, spec), check_vma=False)(q, k, v, pool, shared)


def over_vocab(fn, logits, noise, shared, split_fields: tuple[str, ...] = ()):
    """``fn(logits, shared, vocab, noise) -> outputs`` on every device of the model axis, over its own slice of the
    vocabulary: logits and noise [rows, V] split by vocabulary (``noise`` passed on as a callable), ``shared`` (a
    dataclass) replicated but for its ``split_fields`` [rows, V], split as the logits; ``vocab`` the device's
    ``VocabShard``; the outputs (alike on every device) replicated."""
    vocab, split = logits.shape[1], P(None, MODEL_AXIS)
    specs = P() if not split_fields else dataclasses.replace(
        jax.tree.map(lambda _: P(), shared), **{f: split for f in split_fields if getattr(shared, f) is not None})

    def shard(logits, noise, shared):
        return fn(logits, shared, VocabShard(logits.shape[1], vocab, MODEL_AXIS), lambda: noise)
    return jax.shard_map(shard, in_specs=(split, split, specs), out_specs=P(), check_vma=False)(logits, noise, shared)


def with_mesh(fn, mesh: Mesh | None):
    """``fn`` traced under ``mesh`` (what ``model_axis_size`` and ``over_heads`` read); ``fn`` itself without
    one."""
    if mesh is None:
        return fn

    def traced(*args):
        ambient = jax.sharding.get_abstract_mesh()
        if not ambient.empty and ambient.shape_tuple == mesh.abstract_mesh.shape_tuple:
            return fn(*args)  # the caller's abstract mesh, e.g. naming other devices to lower for (CUDA lane)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)
    return traced
