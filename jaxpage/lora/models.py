"""LoRAModel (vLLM's): one PEFT adapter read from its directory and laid out as the device slots hold it.

A PEFT adapter is ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
``adapter_model.safetensors``: for each adapted module of layer i, ``base_model.model.model.layers.{i}.{module}``
``.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], so that the module computes W x + scale B A x with
scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). The modules are transformers' names of the
projections every architecture's ``layer_weights`` maps onto a Linear (q/k/v/o, gate/up/down, a router); the
embedding and the LM head take no adapter here. A fused Linear (q/k/v, gate/up) gives part p the rank block
[p * max_lora_rank, p * max_lora_rank + r) of its slots; its B rows are placed on the part's output columns by
the architecture's own weight transform (the one that fuses the checkpoint's kernels), so the layout has one
source of truth. Under tensor parallelism with KV heads replicated, k/v's B columns are repeated as the base
kernel's are (jaxpage.models.placement); each device then gets its part of the slots (SlotWriter).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxpage.config import ModelConfig, StepModelConfig
from jaxpage.distributed.parallel import checkpoint_model
from jaxpage.models import abstract_params, architecture, layer_linears
from jaxpage.models.placement import replicate_kv_leaf

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
REFUSED_MODULES = ("embed_tokens", "lm_head")  # the embedding and the LM head: no adapter slots
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class Target:
    """A checkpoint projection an adapter may adapt: its Linear (path in a decoder layer), which of the Linear's
    fused parts it is, and the architecture's transform of the parts' [out, in] kernels into the Linear's."""

    path: tuple
    part: int
    part_sizes: tuple[int, ...]  # every part's output width
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    transform: object


@dataclasses.dataclass(frozen=True)
class LoRAModel:
    """An adapter in the slots' layout (numpy float32, zero-padded to max_lora_rank per part, B scaled):
    ``weights[(*linear path, "lora_a")]`` [num_layers, *in, R], ``[(*linear path, "lora_b")]`` [num_layers, R, *out],
    for every adapted Linear; Linears it does not adapt are absent (zeros in its slot)."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[tuple, np.ndarray]


@functools.lru_cache(maxsize=8)
def lora_targets(cfg: ModelConfig) -> dict[str, Target]:
    """transformers' module names (``self_attn.q_proj``, ...) that map onto a decoder Linear of this model."""
    linears = layer_linears(cfg)
    shapes = abstract_params(StepModelConfig.of(cfg, None, cfg.onednn_packed_weights), np.float32)["layers"]
    targets = {}
    for path, (names, transform) in architecture(cfg.model_type).layer_weights(cfg).items():
        linear = linears.get(path[:-1])
        if path[-1] != "kernel" or linear is None:
            continue
        kernel_shape = _at(shapes, path).shape[1:]  # less the layer axis
        names = names if isinstance(names, tuple) else (names,)
        for part, name in enumerate(names):
            targets[name.removesuffix(".weight")] = Target(
                path[:-1], part, linear.part_sizes(kernel_shape), tuple(kernel_shape[:linear.num_in]),
                tuple(kernel_shape[linear.num_in:]), transform)
    return targets


def load_lora_model(lora_int_id: int, lora_path: str, cfg: ModelConfig) -> LoRAModel:
    """The adapter at ``lora_path`` for this model (with its slots: cfg.max_loras, cfg.max_lora_rank). A missing or
    malformed adapter is a ValueError naming the file and the field."""
    directory = Path(lora_path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"{config_file}: no such file (a PEFT LoRA adapter directory holds {CONFIG_FILE} "
                         f"and {WEIGHTS_FILE})")
    try:
        conf = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: not a JSON file ({e})") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    checkpoint = checkpoint_model(cfg)  # the adapter's shapes are the checkpoint's: KV heads not replicated
    rank, scaling = _check_config(config_file, conf, checkpoint)
    if not weights_file.is_file():
        raise ValueError(f"{weights_file}: no such file (only safetensors adapters are read)")
    tensors = _read_tensors(weights_file)
    weights = _layout(weights_file, tensors, rank, scaling, checkpoint)
    # under tensor parallelism, k/v's B columns repeated with their KV heads, as the base kernel's are
    return LoRAModel(lora_int_id, rank, scaling,
                     {path: replicate_kv_leaf(path, w, cfg.num_kv_heads) for path, w in weights.items()})


def _check_config(file: Path, conf: dict, cfg: ModelConfig) -> tuple[int, float]:
    """(rank, scale) of a valid adapter_config.json; a ValueError naming the file and field otherwise."""
    def require(ok, field, rule):
        if not ok:
            raise ValueError(f"{file}: {field}={conf.get(field)!r} {rule}")

    require(conf.get("peft_type", "LORA") == "LORA", "peft_type", "must be 'LORA'")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    require(isinstance(r, int) and not isinstance(r, bool) and r >= 1, "r", "must be an integer >= 1")
    require(r <= cfg.max_lora_rank, "r", f"exceeds the engine's max_lora_rank={cfg.max_lora_rank}")
    require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool), "lora_alpha", "must be a number")
    require(isinstance(conf.get("use_rslora", False), bool), "use_rslora", "must be true or false")
    require(not conf.get("use_dora"), "use_dora", "is not supported (DoRA)")
    require(conf.get("bias", "none") == "none", "bias", "is not supported: only 'none'")
    require(not conf.get("rank_pattern"), "rank_pattern", "is not supported (one rank for every module)")
    require(not conf.get("alpha_pattern"), "alpha_pattern", "is not supported (one lora_alpha for every module)")
    require(not conf.get("modules_to_save"), "modules_to_save", "is not supported (whole trained modules)")
    require(not conf.get("fan_in_fan_out"), "fan_in_fan_out", "is not supported")
    require(not conf.get("lora_bias"), "lora_bias", "is not supported (a bias in B)")
    require(not conf.get("target_parameters"), "target_parameters", "is not supported (LoRA on raw parameters)")
    require(not conf.get("layer_replication"), "layer_replication", "is not supported")
    require(not conf.get("trainable_token_indices"), "trainable_token_indices", "is not supported (embeddings)")
    targets = conf.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    refused = [n for n in names if n.split(".")[-1] in REFUSED_MODULES]
    require(not refused, "target_modules", f"adapts {refused}: the embedding and the LM head take no LoRA here")
    if isinstance(targets, list):
        known = {name.split(".")[-1] for name in lora_targets(cfg)} | set(lora_targets(cfg))
        unknown = [n for n in names if n not in known]
        require(not unknown, "target_modules", f"names {unknown}, not projections of this {cfg.model_type} model "
                f"(it has {sorted({n.split('.')[-1] for n in lora_targets(cfg)})})")
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return r, float(scaling)


def _read_tensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return {name: np.asarray(f.get_tensor(name), np.float32) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _layout(file: Path, tensors: dict[str, np.ndarray], rank: int, scaling: float, cfg: ModelConfig) -> dict:
    """The adapter's tensors as the slots' stacked A and scaled B of each adapted Linear."""
    targets, max_rank, num_layers = lora_targets(cfg), cfg.max_lora_rank, cfg.num_layers
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name)
        module = match.group(2) if match else name
        if match is None or module not in targets:
            what = "the embedding or LM head" if any(m in name for m in REFUSED_MODULES) else "a projection"
            raise ValueError(f"{file}: tensor {name!r} is not a LoRA weight of {what} this {cfg.model_type} model "
                             f"adapts (its modules: {sorted(targets)})")
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"{file}: tensor {name!r}: layer {layer}, but the model has {num_layers} layers")
        pairs.setdefault((layer, module), {})[match.group(3)] = tensor
    weights: dict[tuple, np.ndarray] = {}
    for (layer, module), ab in sorted(pairs.items()):
        t = targets[module]
        in_flat = math.prod(t.in_shape)
        want = {"A": (rank, in_flat), "B": (t.part_sizes[t.part], rank)}
        for kind, shape in want.items():
            got = ab.get(kind)
            if got is None or got.shape != shape:
                raise ValueError(f"{file}: tensor {_name(layer, module, kind)!r} has shape "
                                 f"{None if got is None else got.shape}, the base model needs {shape} (r={rank})")
        width = len(t.part_sizes) * max_rank
        a = weights.setdefault((*t.path, "lora_a"), np.zeros((num_layers, *t.in_shape, width), np.float32))
        b = weights.setdefault((*t.path, "lora_b"), np.zeros((num_layers, width, *t.out_shape), np.float32))
        lo = t.part * max_rank
        a[layer, ..., lo:lo + rank] = ab["A"].T.reshape(*t.in_shape, rank)
        b[layer, lo:lo + rank] = _output_rows(t, ab["B"] * scaling)
    return weights


def _output_rows(t: Target, b: np.ndarray) -> np.ndarray:
    """B [out_part, r] of part t.part as rows [r, *out] of the fused Linear: the architecture's transform of the
    parts' [out, in] kernels, given B as the first r input columns of its part (the others zero); kernels keep the
    checkpoint's input order, so those columns are the first r input rows of the result."""
    in_flat, r = math.prod(t.in_shape), b.shape[1]
    if r > in_flat:
        raise ValueError(f"LoRA rank {r} exceeds the projection's input width {in_flat}")
    parts = [np.zeros((size, in_flat), np.float32) for size in t.part_sizes]
    parts[t.part][:, :r] = b
    kernel = np.asarray(t.transform(*parts))
    return kernel.reshape(in_flat, *t.out_shape)[:r]


def _name(layer: int, module: str, kind: str) -> str:
    return f"base_model.model.model.layers.{layer}.{module}.lora_{kind}.weight"


def _at(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree
