"""The engine's step: one pure function from (weights, pool, batch, sampling) to (sampled tokens, pool), with the
pool donated; how its layer loop is driven on each platform; where its inputs live (weights, pool, the rest); and
its inputs' shapes per token bucket, which warm-up and the compile lanes compile it for.

The step is a sequence of stages (jaxpage.models: ``begin_layers``, ``run_layer`` per layer, ``final_norm``; then
the tail, jaxpage.worker.step_tail). Two drivers run them: one program per token bucket (``jit_step``: the layers
in a ``lax.scan`` over stacked weights, or unrolled over each layer's own buffers), or the host
(jaxpage.worker.layer_loop: each stage a program, one compiled layer called once per layer). ``LAYER_LOOP`` says
which runs where."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxpage.attention.kv_cache import jit_on_pool, packs_kv
from jaxpage.config import EngineConfig
from jaxpage.core.scheduler_output import PLACEHOLDER_TOKEN_ID
from jaxpage.distributed.parallel import placement, put, spec_shardings
from jaxpage.models import TokenBatch, abstract_params, forward_hidden_aux, partition_specs
from jaxpage.models.lora_slots import LoRAMapping, lora_buckets
from jaxpage.sampling_params import MAX_LOGIT_BIAS
from jaxpage.structured.manager import bitmask_words
from jaxpage.worker.layer_loop import LayerLoop
from jaxpage.worker.sampler import MAX_BANNED, SamplerOutput, SamplingBatch
from jaxpage.worker.pooler import pooler_output
from jaxpage.worker.step_tail import sample_tokens


# How the step's layers run (``layer_loop``), each a driver of the same stages:
#   host_loop  one compiled layer called once per layer from the host over each layer's own weight buffers
#              (layer_loop.LayerLoop): XLA:CPU and XLA:GPU copy a scanned layer's weights out of the stack before
#              its matmuls (on an H200, Llama-3-8B bfloat16, one stream: GPU busy 12.1 ms a decode step in the scan
#              against 4.9 ms here, benchmarks/RESULTS.md "Device check (GPU)"), and an unrolled program takes ~3x the
#              scan's compile time; but it is ~35 launches from Python a step.
#   scan       one program, a lax.scan over stacked weights: one launch, one compiled layer.
#   scan_dsf   the scan compiled with XLA:GPU's dynamic-slice fusion, which lets a matmul read its layer's slice of
#              the stack in place: one launch and, if it covers the layer's matmuls, no weight copies. Not measured.
#   unrolled   one program over unrolled weights (scan_layers=False on any platform): one launch, no copies.
LAYER_LOOPS = ("host_loop", "scan", "scan_dsf", "unrolled")
# one device, by platform. TPU: not measured on a chip, so the scan (the program the compile lane and the step model
# check); GPU: host_loop until the device check's layouts section (benchmarks/gpu_step_profile.py --layouts)
# measures the one-launch programs against it.
LAYER_LOOP = {"cpu": "host_loop", "gpu": "host_loop", "tpu": "scan"}
# A tensor-parallel mesh: a layer call from the host is a launch on every device of the mesh (30 of them made a
# step 4x the fused step's on 3 forced CPU devices, SmolLM2, 8 streams), so the step is one program.
MESH_LAYER_LOOP = "scan"
COMPILER_OPTIONS = {"scan_dsf": {"xla_gpu_enable_dynamic_slice_fusion": True}}


def layer_loop(config: EngineConfig, platform: str, mesh: Mesh | None = None) -> str:
    """The driver of ``config``'s layers on ``platform`` (a device's, or a mesh's), one of LAYER_LOOPS."""
    if not config.scan_layers:
        return "unrolled"
    return MESH_LAYER_LOOP if mesh is not None else LAYER_LOOP.get(platform, "scan")


def unrolls_weights(loop: str) -> bool:
    """Whether the weights of a step driven by ``loop`` hold each layer in buffers of its own."""
    return loop in ("host_loop", "unrolled")


def make_step(config: EngineConfig, loop: str, where=None, weights: dict | None = None):
    """The step of one layer-loop driver: a ``LayerLoop`` (weights: the unrolled weights' shardings) or the jitted
    program (``jit_step``)."""
    if loop == "host_loop":
        return LayerLoop.make(config, weights, where)
    return jit_step(config, where, COMPILER_OPTIONS.get(loop))


def step(config: EngineConfig, params: dict, pool: jax.Array, batch: TokenBatch,
         sampling: SamplingBatch) -> tuple[SamplerOutput, jax.Array]:
    """One engine iteration: write K/V, attend through the block tables, sample one token per sequence (with
    ``config.aux_hidden_layers``, an EAGLE-3 head's target: also every token's auxiliary hidden states)."""
    hidden, pool, aux = forward_hidden_aux(config.step_model, params, pool, batch, config.attention_backend,
                                           config.aux_hidden_layers)
    if config.pooler_config is not None:
        return pooler_output(config, hidden, batch), pool
    out = sample_tokens(config, params, hidden, batch, sampling)
    return (out if aux is None else dataclasses.replace(out, hidden_states=aux)), pool


def substitute_placeholders(token_ids: jax.Array, sampled: jax.Array, rows: jax.Array) -> jax.Array:
    """Async scheduling (tpu-inference's _substitute_placeholder_token): each placeholder token id of a batch
    built while the step before ran becomes the token that step sampled for its sequence, ``sampled[rows[i]]``,
    without the token going through the host."""
    return jnp.where(token_ids == PLACEHOLDER_TOKEN_ID, sampled[rows].astype(token_ids.dtype), token_ids)


def jit_step(config: EngineConfig, where=None, compiler_options: dict | None = None):
    """``step`` jitted with the pool donated and in its one format: the one-program driver, and what the compile
    lane compiles ahead of time for other targets. where: a device, or the mesh of a tensor-parallel config (the
    weights split as ``weight_shardings`` says); compiler_options: XLA's (``COMPILER_OPTIONS``)."""
    arg_shardings = {0: weight_shardings(config, where)} if isinstance(where, Mesh) else None
    return jit_on_pool(functools.partial(step, config), 4, 1, "pair", where, arg_shardings, config.kv_dtype,
                       packs_kv(config.model, config.attention_backend), compiler_options)


def compile_step(jitted, params, pool, batch, sampling, fewer_rows: tuple = ()):
    """A bucket's executable of ``jit_step`` or a jitted ``LayerLoop``, for these (abstract) inputs; a
    LayerLoop's also samples each of ``fewer_rows`` (abstract sampling inputs of fewer rows than the bucket's)."""
    if isinstance(jitted, LayerLoop):
        return jitted.compile(params, pool, batch, sampling, fewer_rows)
    return jitted.lower(params, pool, batch, sampling).compile()


def weight_shardings(config: EngineConfig, mesh: Mesh | None, device=None, unrolled: bool | None = None):
    """Where each weight goes: split over ``mesh`` by the parameters' names, or whole on ``device`` (default:
    the default device); a tree matching the stacked or (``unrolled``, default: not ``config.scan_layers``)
    unrolled weights."""
    specs, shapes = partition_specs(config.step_model), abstract_params(config.step_model, np.float32)
    if unrolled is None:
        unrolled = not config.scan_layers
    if unrolled:  # each layer's entry: the stacked one less its layer axis
        def per_layer(tree, drop_layer_axis):
            layer = jax.tree.map(drop_layer_axis, tree["layers"], is_leaf=lambda x: isinstance(x, PartitionSpec))
            return {**tree, "layers": {i: layer for i in range(config.model.num_layers)}}
        specs = per_layer(specs, lambda s: PartitionSpec(*s[1:]))
        shapes = per_layer(shapes, lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype))
    if mesh is not None:
        return spec_shardings(specs, shapes, mesh)
    device = SingleDeviceSharding(device or jax.devices()[0])
    return jax.tree.map(lambda _: device, shapes)


def replicated(config: EngineConfig):
    """The sharding of the step's inputs other than weights and pool: the engine's device, or every device of
    its tensor-parallel mesh."""
    where = placement(config)
    return NamedSharding(where, PartitionSpec()) if isinstance(where, Mesh) else SingleDeviceSharding(where)


def abstract_step_inputs(config: EngineConfig, num_tokens: int, num_loras: int | None = None,
                         num_sampled: int | None = None):
    """The shapes of one bucket's (batch, sampling) inputs, for compiling ahead of time; with ``num_loras``
    adapter slots in the step (0: none; None: an engine with LoRA's largest slots bucket, every slot) and
    ``num_sampled`` sampled rows (None: the bucket's sequence count; fewer: InputBatch.sampled_rows_apart)."""
    num_seqs = config.num_seqs_for(num_tokens)
    if num_loras is None:
        num_loras = lora_buckets(config.step_model.max_loras)[-1] if config.step_model.max_loras else 0
    rows = num_seqs if num_sampled is None else num_sampled
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    batch = TokenBatch(i32(num_tokens), i32(num_tokens), i32(num_tokens), i32(num_tokens),
                       i32(num_seqs, config.max_blocks_per_seq), i32(num_seqs),
                       LoRAMapping(i32(num_tokens), i32(num_loras)) if num_loras else None)
    sampling = SamplingBatch(f32(rows), i32(rows), f32(rows), f32(rows),
                             jax.ShapeDtypeStruct((rows,), jnp.uint32), i32(rows),
                             f32(rows), f32(rows), f32(rows),
                             i32(config.scheduler.max_num_seqs + 1, config.scheduler.max_model_len), i32(rows),
                             i32(rows),
                             i32(rows, MAX_BANNED), jax.ShapeDtypeStruct((), jnp.bool_),
                             i32(rows, bitmask_words(config.model.vocab_size)),
                             i32(rows, MAX_LOGIT_BIAS), f32(rows, MAX_LOGIT_BIAS), i32(num_tokens),
                             *((i32(rows), f32(rows, config.model.vocab_size))
                               if config.verifies_draft_probs else (None, None)),
                             i32(rows, config.num_draft_tokens) if config.num_draft_tokens else None)
    return batch, sampling


@functools.lru_cache(maxsize=64)
def all_allowed(num_seqs: int, vocab_size: int, sharding=None) -> jax.Array:
    """The bitmask of a batch without structured outputs, on the device(s) once per shape: such batches pay no
    transfer for it."""
    return put(np.full((num_seqs, bitmask_words(vocab_size)), -1, np.int32), sharding)  # no compile
