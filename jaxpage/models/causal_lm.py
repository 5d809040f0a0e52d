"""The decoder-only language model every architecture shares: embeddings, the decoder layers (stacked and
scanned, or unrolled), the final norm and the LM head; and the pure functions the jitted step calls.

The weights travel as a plain pytree (the NNX state as a pure dict), so the step stays a pure function of
(weights, pool, batch): ``forward_hidden`` merges them into the architecture's module graph, which is built once
per config (``model_graph``). The layout of the pure dict (paths as ``nnx.state`` gives them):
  embed/embedding [V, D], final_norm/weight [D], lm_head/kernel [D, V] (absent when tied, unless int8 or
  packed), and ``layers``:
  stacked, each layer weight with a leading layer axis (one compiled layer body, run by ``lax.scan``), or
  unrolled, ``{0: layer, 1: layer, ...}`` (``unstack_layers``: every layer compiled, read in place).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.attention.kv_cache import pool_block_size
from jaxpage.config import ModelConfig
from jaxpage.distributed.parallel import MODEL_AXIS, spec_fitting
from jaxpage.models.attention import LayerConstants, StepContext, layer_constants
from jaxpage.models.batch import TokenBatch
from jaxpage.models.layers import Embedding, Linear, RMSNorm, embed_scale, soft_cap
from jaxpage.models.lora_slots import building_slots
from jaxpage.models.quant import building, weight_dtype
from jaxpage.models.registry import architecture
from jaxpage.models.weight_packing import packing, unties_lm_head


class CausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, unrolled: bool = False):
        with packing(cfg.onednn_packed_weights):
            self._build(cfg, unrolled)

    def _build(self, cfg: ModelConfig, unrolled: bool) -> None:
        arch = architecture(cfg.model_type)
        layer_cls = arch.DecoderLayer
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        # with LoRA, every Linear of the decoder layers gets adapter slots (the LM head none)
        with (building(cfg.layer_weights_kind, cfg.quantization_group_size, cfg.quantization_zero_point,
                       cfg.quantized_projections),
              building_slots(cfg.max_loras + 1 if cfg.max_loras else 0, cfg.max_lora_rank, cfg.cpu_lora_kernel)):
            if unrolled:
                self.layers = nnx.List([layer_cls(cfg) for _ in range(cfg.num_layers)])
            else:
                make = nnx.vmap(lambda: layer_cls(cfg), axis_size=cfg.num_layers,
                                transform_metadata={nnx.PARTITION_NAME: None})
                self.layers = make()
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # quantized by the engine or packed, a tied head is a Linear of its own (made from the embedding at load):
        # its matmul is int8, or oneDNN's on packed weights (weight_packing.unties_lm_head); a quantized
        # checkpoint's head is as published
        own_int8 = cfg.quantization == "int8"
        with building("int8" if own_int8 else None):
            self.lm_head = (None if cfg.tie_word_embeddings and not own_int8 and not unties_lm_head(cfg)
                            else Linear((cfg.hidden_size,), (cfg.vocab_size,), (None, MODEL_AXIS)))
        self.scale_embeddings = getattr(arch, "SCALE_EMBEDDINGS", False)  # Gemma: x * sqrt(hidden_size)
        self.cfg = cfg

    def begin(self, batch: TokenBatch, backend: str, block_size: int) -> tuple[jax.Array, StepContext]:
        """The embedded tokens and what every layer of the step shares."""
        x = self.embed(batch.token_ids)
        if self.scale_embeddings:
            x = x * embed_scale(self.cfg.hidden_size, x.dtype)
        return x, StepContext.make(self.cfg, batch, backend, block_size)

    def raw_logits(self, hidden: jax.Array) -> jax.Array:
        """The LM head's output in the weights' dtype, before the float32 cast and the soft cap."""
        return self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return soft_cap(self.raw_logits(hidden).astype(jnp.float32), self.cfg.final_logit_softcap)


def _is_unrolled(params: dict) -> bool:
    return not isinstance(params["layers"], dict) or all(isinstance(k, int) for k in params["layers"])


def _abstract_model(cfg: ModelConfig, unrolled: bool = False) -> CausalLM:
    """The model with shapes only, built outside any ambient mesh (under one, nnx.eval_shape would place each
    parameter on it by its sharding names, and fail on a mesh without a model axis)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(lambda: CausalLM(cfg, unrolled))


@functools.lru_cache(maxsize=32)
def model_graph(cfg: ModelConfig, unrolled: bool = False):
    """The module graph (``nnx.GraphDef``) of a config, built once, without allocating weights."""
    return nnx.graphdef(_abstract_model(cfg, unrolled))


def top_weights(params: dict) -> dict:
    """The weights outside the decoder layers (embedding, final norm, LM head)."""
    return {k: v for k, v in params.items() if k != "layers"}


@functools.lru_cache(maxsize=32)
def _layer_shapes(cfg: ModelConfig) -> dict:
    return abstract_params(cfg, np.float32)["layers"]


def _bind_top(cfg: ModelConfig, params: dict) -> CausalLM:
    """The model over its top weights only; its layers hold shapes (for what never runs a layer)."""
    return nnx.merge(model_graph(cfg), {**top_weights(params), "layers": _layer_shapes(cfg)})


@functools.lru_cache(maxsize=32)
def _layer_graph(cfg: ModelConfig):
    return nnx.graphdef(_abstract_model(cfg, unrolled=True).layers[0])


def forward_hidden(cfg: ModelConfig, params: dict, pool: jax.Array, batch: TokenBatch, backend: str = "xla"):
    """Runs all layers over the flat batch inside one program (``run_layers``); returns final-normed hidden states
    [T, D] and the updated pool. backend: the attention backend (jaxpage.attention.backends.BACKENDS, resolved),
    static under jit."""
    hidden, pool, _ = forward_hidden_aux(cfg, params, pool, batch, backend)
    return hidden, pool


def forward_hidden_aux(cfg: ModelConfig, params: dict, pool: jax.Array, batch: TokenBatch, backend: str = "xla",
                       aux_layers: tuple[int, ...] = ()):
    """``forward_hidden`` and the auxiliary hidden states an EAGLE-3 head reads (``run_layers``; None without
    ``aux_layers``)."""
    top = top_weights(params)
    x, shared = begin_layers(cfg, top, batch, backend, pool_block_size(pool))
    x, pool, aux = run_layers(cfg, params["layers"], x, pool, batch, shared, backend, aux_layers)
    return final_norm(cfg, top, x), pool, aux


def begin_layers(cfg: ModelConfig, top: dict, batch: TokenBatch, backend: str, block_size: int):
    """What runs before the first layer, for a caller that runs the layers one by one (``run_layer``): the
    embedded tokens [T, D] and what the step's layers share (``StepContext.shared``: page plans, RoPE tables)."""
    x, ctx = _bind_top(cfg, top).begin(batch, backend, block_size)
    return x, ctx.shared


def run_layer(cfg: ModelConfig, layer: dict, consts: LayerConstants, x: jax.Array, pool: jax.Array,
              batch: TokenBatch, shared, backend: str) -> tuple[jax.Array, jax.Array]:
    """One decoder layer (its weights: one entry of the unrolled ``layers``; its constants: one row of
    ``layer_constants``); returns (x, pool)."""
    return nnx.merge(_layer_graph(cfg), layer)(x, pool, consts, StepContext(batch, backend, shared))


def run_layers(cfg: ModelConfig, layers: dict, x: jax.Array, pool: jax.Array, batch: TokenBatch, shared,
               backend: str, aux_layers: tuple[int, ...] = ()):
    """Every decoder layer in turn, inside the caller's program: ``run_layer`` in a ``lax.scan`` over stacked
    weights (one compiled layer body) or once per layer over unrolled ones (each layer compiled, reading its own
    buffers). jaxpage.worker.layer_loop drives the same ``run_layer`` from the host instead. Returns (x, pool,
    aux): aux, the residual stream entering each layer of ``aux_layers``, side by side [T, len(aux_layers) * D];
    None without aux_layers."""
    consts = layer_constants(cfg)
    if _is_unrolled({"layers": layers}):
        taken = []
        for i in range(cfg.num_layers):
            taken += [x] * aux_layers.count(i)
            x, pool = run_layer(cfg, layers[i], jax.tree.map(lambda a, i=i: a[i], consts), x, pool, batch, shared,
                                backend)
        return x, pool, concat_aux(taken)

    def body(carry, xs):
        x, pool, taken = carry
        layer, layer_consts = xs
        taken = tuple(jnp.where(layer_consts.index == i, x, t) for i, t in zip(aux_layers, taken))
        return (*run_layer(cfg, layer, layer_consts, x, pool, batch, shared, backend), taken), None

    zeros = tuple(jnp.zeros_like(x) for _ in aux_layers)
    (x, pool, taken), _ = jax.lax.scan(body, (x, pool, zeros), (layers, jax.tree.map(jnp.asarray, consts)))
    return x, pool, concat_aux(list(taken))


def concat_aux(taken: list[jax.Array]) -> jax.Array | None:
    """The auxiliary hidden states side by side [T, len * D], in the order taken; None for none."""
    return jnp.concatenate(taken, axis=-1) if taken else None


def final_norm(cfg: ModelConfig, top: dict, x: jax.Array) -> jax.Array:
    return _bind_top(cfg, top).final_norm(x)


def compute_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """float32 logits [N, V] for hidden states [N, D] (params: all the weights, or ``top_weights``)."""
    return _bind_top(cfg, params).logits(hidden)


def compute_raw_logits(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """``compute_logits`` before its float32 cast and ``cfg.final_logit_softcap`` (a kernel that takes both)."""
    return _bind_top(cfg, params).raw_logits(hidden)


def unstack_layers(params: dict) -> dict:
    """The same weights with the layers unrolled (``{i: layer i}``), each layer in its own buffers: a scan slices
    each layer's weights out of the stack at run time, and XLA:CPU copies every slice before its matmul. The
    engine's layout for ``scan_layers=False`` (every layer compiled into the step) and on the CPU (one compiled
    layer called per layer, ``run_layer``)."""
    if _is_unrolled(params):
        return params
    layers = params["layers"]
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers)}}


def stack_layers(params: dict) -> dict:
    """The inverse of ``unstack_layers``."""
    if not _is_unrolled(params):
        return params
    layers = [params["layers"][i] for i in range(len(params["layers"]))]
    return {**params, "layers": jax.tree.map(lambda *a: np.stack(a) if isinstance(a[0], np.ndarray)
                                             else jnp.stack(a), *layers)}


def layer_linears(cfg: ModelConfig) -> dict[tuple, Linear]:
    """Every Linear of a decoder layer by its path in the layer (("attn", "qkv"), ("mlp", "down"), ...), as
    modules of shapes only."""
    model = _abstract_model(cfg)
    return {tuple(path): module for path, module in nnx.iter_graph(model.layers) if isinstance(module, Linear)}


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    """The stacked weights as shapes only (``jax.ShapeDtypeStruct``), for ahead-of-time compilation."""
    state = nnx.state(_abstract_model(cfg))
    return jax.tree_util.tree_map_with_path(lambda p, a: jax.ShapeDtypeStruct(a.shape, weight_dtype(p, a, dtype)),
                                            nnx.to_pure_dict(state))


def weight_bytes(cfg: ModelConfig, dtype, tp: int = 1) -> int:
    """The weights' bytes on each device of a tensor-parallel group of ``tp`` as placed in an engine of ``dtype``
    (int8 weights and their scales as stored; a dimension the model axis does not divide stays whole), from the
    shapes alone: what the KV budget leaves for them before they are placed."""
    def shard_bytes(spec, leaf):
        split = tuple(spec_fitting(spec, leaf.shape, tp))
        return math.prod(d // tp if i < len(split) and split[i] == MODEL_AXIS else d
                         for i, d in enumerate(leaf.shape)) * leaf.dtype.itemsize

    shards = jax.tree.map(shard_bytes, partition_specs(cfg), abstract_params(cfg, dtype),
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return sum(jax.tree.leaves(shards))


def cast_weights(params: dict, dtype) -> dict:
    """The weights on the device in the engine's dtype (int8 kernels and their scales keep theirs)."""
    return jax.tree_util.tree_map_with_path(lambda p, a: jnp.asarray(a, weight_dtype(p, a, dtype)), params)


def partition_specs(cfg: ModelConfig) -> dict:
    """Each stacked weight's ``PartitionSpec`` over the mesh axis ``MODEL_AXIS``, from the parameters' names."""
    state = nnx.state(_abstract_model(cfg))
    return nnx.to_pure_dict(nnx.get_partition_spec(state))
