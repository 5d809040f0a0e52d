"""The step's host driver (jaxpage.worker.step, ``host_loop``): one compiled decoder layer, called once per layer
from the host, and the tail's stages (jaxpage.worker.step_tail) as programs of their own.

In a ``lax.scan`` over stacked weights XLA:CPU copies each layer's weights out of the stack before its matmuls
(36 % of a one-stream SmolLM2 step); unrolled layers read their own buffers but take ~3x the compile time. Here
each layer keeps its own weight buffers (the unrolled layout) and one executable per token bucket runs any of
them, so the compile time stays a scan's. The pool is donated to every layer call (updated in place), and the
calls are dispatched asynchronously: the host runs ahead of the device.

The tail is split the same way: the sampler's executable depends on the sequence bucket only, so the token buckets
of one sequence bucket share it (it is most of a small model's compile time), and the prompt logprobs' executable
runs only in steps with a prompt target. A step with LoRA adapters differs from the base step in its layer only:
its variants (one per adapter slots bucket) share the stages around it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxpage.attention.kv_cache import jit_on_pool, packs_kv
from jaxpage.config import EngineConfig
from jaxpage.distributed.parallel import put
from jaxpage.models import begin_layers, concat_aux, final_norm, run_layer, top_weights
from jaxpage.models.attention import layer_constants
from jaxpage.worker.pooler import pooler_output
from jaxpage.worker.sampler import is_plain_greedy
from jaxpage.worker.step_tail import greedy_rows, has_greedy_path, prompt_logprobs_of, sample_rows


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """The step as functions called from the host like the fused step: (params, pool, batch, sampling) ->
    (sampler output, pool), params with the layers unrolled. ``make`` gives them jitted; ``compile``, one bucket's
    executables."""

    begin: object  # (top weights, batch) -> (x, what the layers share: page plans, RoPE tables)
    layer: object  # (layer weights, layer constants, x, pool, batch, shared) -> (x, pool)
    end: object  # (top weights, x, batch) -> (final-normed x, its rows at the batch's logits indices)
    # (rows, like) -> the first len(like) rows: a step whose sampled rows are fewer than its bucket's sequences
    first_rows: object
    sampler: object  # (top weights, rows, sampling) -> sampler output (step_tail.sample_rows)
    # (top weights, rows) -> the sampler's output where every row is plain greedy (greedy_rows); None where the
    # step returns each row's distribution (a draft model's runner)
    greedy: object
    prompt: object  # (top weights, final-normed x, prompt targets) -> prompt logprobs (step_tail.prompt_logprobs_of)
    consts: tuple  # each layer's LayerConstants, on the device(s)
    inputs: object  # the batch's sharding, placed once for all layers
    # the compiled begin, end, sampler and prompt stages (futures) by their inputs' shapes, shared by the buckets.
    # A compiled LayerLoop holds first_rows, sampler and greedy by the number of rows they sample.
    compiled: dict
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # buckets compile on several threads
    # a pooling model's tail instead of the sampler's: (final-normed x, batch) -> pooler output
    # (jaxpage.worker.pooler.pooler_output); None: a generating model
    pooler: object = None
    aux_layers: tuple[int, ...] = ()  # EngineConfig.aux_hidden_layers
    aux: object = None  # (each auxiliary hidden state) -> them side by side (causal_lm.concat_aux)

    def __call__(self, params: dict, pool, batch, sampling):
        top, layers = top_weights(params), params["layers"]
        # host arrays placed; a device array (async scheduling's token ids) stays where it is, not read back
        batch = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else put(np.asarray(a), self.inputs), batch)
        base = dataclasses.replace(batch, lora=None)  # the layers alone take the adapters
        x, shared = self.begin(top, base)
        taken = []  # the auxiliary hidden states (EngineConfig.aux_hidden_layers), in their order
        for i, consts in enumerate(self.consts):
            taken += [x] * self.aux_layers.count(i)
            x, pool = self.layer(layers[i], consts, x, pool, batch, shared)
        x, rows = self.end(top, x, base)
        if self.pooler is not None:
            return self.pooler(x, base), pool
        targets, num_sampled = sampling.prompt_targets, np.shape(sampling.temperature)[0]
        if num_sampled < rows.shape[0]:  # InputBatch.sampled_rows_apart
            rows = self.for_rows("first_rows", num_sampled)(rows, sampling.temperature)
        if self.greedy is not None and is_plain_greedy(sampling):
            out = self.for_rows("greedy", num_sampled)(top, rows)
        else:
            out = self.for_rows("sampler", num_sampled)(top, rows, dataclasses.replace(sampling, prompt_targets=None))
        if targets is not None and (isinstance(targets, jax.Array) or np.any(np.asarray(targets) >= 0)):
            out = dataclasses.replace(out, prompt=self.prompt(top, x, targets))
        if taken:
            out = dataclasses.replace(out, hidden_states=self.aux(*taken))
        return out, pool

    @classmethod
    def make(cls, config: EngineConfig, weights: dict, where=None) -> "LayerLoop":
        """weights: the unrolled weights' shardings; where: the device (one device only: a mesh's layer call is a
        launch on each of its devices, see ``step.MESH_LAYER_LOOP``)."""
        cfg, backend = config.step_model, config.attention_backend

        def begin(top, batch):
            return begin_layers(cfg, top, batch, backend, config.cache.block_size)

        def one_layer(layer, consts, x, pool, batch, shared):
            return run_layer(cfg, layer, consts, x, pool, batch, shared, backend)

        def end(top, x, batch):
            x = final_norm(cfg, top, x)
            return x, x[batch.logits_indices]

        inputs = SingleDeviceSharding(where or jax.devices()[0])
        consts = layer_constants(cfg)
        consts = tuple(jax.tree.map(lambda a, i=i: put(a[i], inputs), consts) for i in range(cfg.num_layers))
        layer_step = jit_on_pool(one_layer, 6, 3, "pair", where, {0: weights["layers"][0]}, config.kv_dtype,
                                 packs_kv(config.model, config.attention_backend))
        return cls(jax.jit(begin), layer_step, jax.jit(end), jax.jit(_first_rows),
                   jax.jit(functools.partial(sample_rows, config)),
                   jax.jit(functools.partial(greedy_rows, config)) if has_greedy_path(config) else None,
                   jax.jit(functools.partial(prompt_logprobs_of, config)), consts, inputs, {},
                   pooler=jax.jit(functools.partial(pooler_output, config)) if config.pooler_config else None,
                   aux_layers=config.aux_hidden_layers, aux=jax.jit(lambda *taken: concat_aux(list(taken))))

    def compile(self, params: dict, pool, batch, sampling, fewer_rows: tuple = ()) -> "LayerLoop":
        """The jitted loop compiled for these (abstract or concrete) inputs: params with the layers unrolled; its
        tail also for each of ``fewer_rows``, sampling inputs of fewer rows than the batch's sequences."""
        top, layer, base = top_weights(params), params["layers"][0], dataclasses.replace(batch, lora=None)
        x, shared = jax.eval_shape(self.begin, top, base)
        _, rows = jax.eval_shape(self.end, top, x, base)
        if self.pooler is not None:  # no sampler to compile
            return dataclasses.replace(
                self, begin=self._shared("begin", self.begin, top, base),
                layer=self.layer.lower(layer, self.consts[0], x, pool, batch, shared).compile(),
                end=self._shared("end", self.end, top, x, base), pooler=self._shared("pooler", self.pooler, x, base),
                first_rows={}, sampler={}, greedy=None, prompt=None)
        targets = sampling.prompt_targets
        tails = {np.shape(s.temperature)[0]: dataclasses.replace(s, prompt_targets=None)
                 for s in (sampling, *fewer_rows)}
        rows_of = {n: jax.ShapeDtypeStruct((n, *rows.shape[1:]), rows.dtype) for n in tails}
        placed = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.inputs)  # noqa: E731 (no weights)
        return dataclasses.replace(
            self, begin=self._shared("begin", self.begin, top, base),
            layer=self.layer.lower(layer, self.consts[0], x, pool, batch, shared).compile(),
            end=self._shared("end", self.end, top, x, base),
            first_rows={n: self._shared("first_rows", self.first_rows, placed(rows), placed(s.temperature))
                        for n, s in tails.items() if n < rows.shape[0]},
            sampler={n: self._shared("sampler", self.sampler, top, rows_of[n], s) for n, s in tails.items()},
            greedy=({n: self._shared("greedy", self.greedy, top, rows_of[n]) for n in tails}
                    if self.greedy is not None else None),
            prompt=self._shared("prompt", self.prompt, top, x, targets) if targets is not None else None,
            aux=self._shared("aux", self.aux, *[x] * len(self.aux_layers)) if self.aux_layers else None)

    def _shared(self, name: str, jitted, *args):
        """``jitted`` compiled for these inputs once, for every bucket (and adapter slots bucket) that has them."""
        key = (name, *((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
        with self.lock:  # the first thread to ask compiles it; the others wait for its result
            future = self.compiled.get(key)
            first = future is None
            if first:
                future = self.compiled[key] = concurrent.futures.Future()
        if first:
            try:
                future.set_result(self._compile_stage(name, jitted, args))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    @staticmethod
    def _compile_stage(name: str, jitted, args):
        compiled = jitted.lower(*args).compile()
        if name in ("greedy", "first_rows"):  # stages the runner's first run on padding does not run: their
            # first run (0.3-0.7 s of the runtime's set-up on a CPU for the sampler) is taken here
            zeros = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else np.zeros(a.shape, a.dtype), args)
            jax.block_until_ready(compiled(*zeros))
        return compiled

    def for_rows(self, stage: str, num_rows: int):
        """The tail stage ``stage`` ("first_rows", "sampler", "greedy") for ``num_rows`` sampled rows: the jitted
        function, or in a compiled LayerLoop its executable for them."""
        found = getattr(self, stage)
        return found[num_rows] if isinstance(found, dict) else found

    def as_text(self) -> str:
        """The compiled executables' HLO, as a compiled step's ``as_text`` (the tail's of its bucket's rows)."""
        stages = (self.begin, self.layer, self.end, *(max(s.items())[1] for s in (self.sampler, self.greedy)
                                                      if s), self.prompt, self.pooler)
        return "\n".join(f.as_text() for f in stages if f is not None)


def _first_rows(rows, like):
    return rows[:like.shape[0]]
