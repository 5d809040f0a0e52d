"""The step on a CPU: one compiled decoder layer, called once per layer from the host.

In a ``lax.scan`` over stacked weights XLA:CPU copies each layer's weights out of the stack before its matmuls
(36 % of a one-stream SmolLM2 step); unrolled layers read their own buffers but take ~3x the compile time. Here
each layer keeps its own weight buffers (the unrolled layout) and one executable per token bucket runs any of
them, so the compile time stays a scan's. The pool is donated to every layer call (updated in place), and the
calls are dispatched asynchronously: the host runs ahead of the device.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxpage.attention.kv_cache import jit_on_pool
from jaxpage.config import EngineConfig
from jaxpage.distributed.parallel import put
from jaxpage.models import begin_layers, final_norm, run_layer, top_weights
from jaxpage.models.attention import layer_constants


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """The step as three functions, called like the fused step: (params, pool, batch, sampling) -> (sampler
    output, pool), params with the layers unrolled. ``make`` gives them jitted; ``compile``, one bucket's
    executables."""

    begin: object  # (top weights, batch) -> (x, page plans)
    layer: object  # (layer weights, layer constants, x, pool, batch, page plans) -> (x, pool)
    end: object  # (top weights, x, batch, sampling) -> sampler output
    consts: tuple  # each layer's LayerConstants, on the device(s)
    inputs: object  # the batch's sharding, placed once for all layers

    def __call__(self, params: dict, pool, batch, sampling):
        top, layers = top_weights(params), params["layers"]
        # host arrays placed; a device array (async scheduling's token ids) stays where it is, not read back
        batch = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else put(np.asarray(a), self.inputs), batch)
        x, plans = self.begin(top, batch)
        for i, consts in enumerate(self.consts):
            x, pool = self.layer(layers[i], consts, x, pool, batch, plans)
        return self.end(top, x, batch, sampling), pool

    @classmethod
    def make(cls, config: EngineConfig, sample_tokens, weights: dict, where=None) -> "LayerLoop":
        """sample_tokens(config, top, hidden, batch, sampling): the step's tail; weights: the unrolled weights'
        shardings; where: the device (one device only: a mesh's layer call is a launch on each of its devices, see
        ``model_runner.HOST_LAYER_LOOP_PLATFORMS``)."""
        cfg, backend = config.model, config.attention_backend

        def begin(top, batch):
            return begin_layers(cfg, top, batch, backend, config.block_size)

        def one_layer(layer, consts, x, pool, batch, plans):
            return run_layer(cfg, layer, consts, x, pool, batch, plans, backend)

        def end(top, x, batch, sampling):
            return sample_tokens(config, top, final_norm(cfg, top, x), batch, sampling)

        inputs = SingleDeviceSharding(where or jax.devices()[0])
        consts = layer_constants(cfg)
        consts = tuple(jax.tree.map(lambda a, i=i: put(a[i], inputs), consts) for i in range(cfg.num_layers))
        layer_step = jit_on_pool(one_layer, 6, 3, "pair", where, {0: weights["layers"][0]}, config.kv_dtype)
        return cls(jax.jit(begin), layer_step, jax.jit(end), consts, inputs)

    def compile(self, params: dict, pool, batch, sampling) -> "LayerLoop":
        """The jitted loop compiled for these (abstract or concrete) inputs: params with the layers unrolled."""
        top, layer = top_weights(params), params["layers"][0]
        x, plans = jax.eval_shape(self.begin, top, batch)
        return dataclasses.replace(self, begin=self.begin.lower(top, batch).compile(),
                                   layer=self.layer.lower(layer, self.consts[0], x, pool, batch, plans).compile(),
                                   end=self.end.lower(top, x, batch, sampling).compile())

    def as_text(self) -> str:
        """The three compiled executables' HLO, as a compiled step's ``as_text``."""
        return "\n".join(f.as_text() for f in (self.begin, self.layer, self.end))

