"""Checkpoint tensors to the model's weights: transformers-named tensors (from safetensors, or from a GGUF file
renamed through the architecture's llama.cpp name map) into the pure-dict layout of jaxpage.models.causal_lm."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import jaxpage.models.gguf_quant as gguf_quant
from jaxpage.config import ModelConfig
from jaxpage.models.quant import SCALE, STORED, ZERO, pack_int4, quantize_int8
from jaxpage.models.registry import architecture


def params_from_hf_state(cfg: ModelConfig, state: dict[str, np.ndarray]) -> dict:
    """transformers-named tensors ([out, in] matrices) to jaxpage's stacked, head-explicit weights. A weight
    map's name may be a tuple of names (one per expert): its transform then takes all of them."""
    arch = architecture(cfg.model_type)
    params: dict = {}
    for path, (name, fn) in arch.top_weights(cfg).items():
        _put(params, path, fn(_take(state, name)))
    for path, (name, fn) in arch.layer_weights(cfg).items():
        stacked = np.stack([_layer_weight(state, f"model.layers.{i}.", name, fn) for i in range(cfg.num_layers)])
        _put(params, ("layers", *path), stacked)
    return params


def quantize_params(cfg: ModelConfig, params: dict) -> dict:
    """Float weights (``params_from_hf_state``'s layout) to ``cfg.quantization``'s: every Linear's kernel int8
    with its per-output-channel scale; a tied LM head becomes a Linear of its own, from the embedding."""
    from flax import nnx

    from jaxpage.models.causal_lm import _abstract_model
    from jaxpage.models.layers import Linear

    if cfg.quantization != "int8":
        return params
    params = {**params}
    if cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": np.ascontiguousarray(params["embed"]["embedding"].T)}
    for path, module in nnx.iter_graph(_abstract_model(cfg)):
        if isinstance(module, Linear):
            linear = _get(params, path)
            linear["kernel"], linear[SCALE] = quantize_int8(linear["kernel"], module.in_axes(linear["kernel"].ndim))
    return params


def stored_quantized_params(cfg: ModelConfig, state: dict[str, np.ndarray], params: dict) -> dict:
    """A quantized checkpoint's weights as stored (jaxpage.models.compressed_tensors): ``params``
    (``params_from_hf_state`` of the stored values, read as floats) with every decoder Linear's kernel back in its
    stored dtype, its float32 ``scale`` per output channel or group, and its zero points where asymmetric. Each
    checkpoint scale [out, 1] or [out, groups], spread over its weight's inputs, goes through the weight's own
    transform, so fused and head-explicit kernels get theirs."""
    from flax import nnx

    from jaxpage.models.causal_lm import _abstract_model
    from jaxpage.models.layers import Linear

    linears = {tuple(path): m for path, m in nnx.iter_graph(_abstract_model(cfg)) if isinstance(m, Linear)}
    for path, (names, fn) in architecture(cfg.model_type).layer_weights(cfg).items():
        names = names if isinstance(names, tuple) else (names,)
        module = linears.get(("layers", *path[:-1]))
        if path[-1] != "kernel" or not names[0].endswith(".weight"):
            continue
        if module is None:  # e.g. a MoE layer's experts, which are not Linears
            raise ValueError(f"quantization_config: the quantized weights {names[0]!r} of a "
                             f"{cfg.model_type} model are not served quantized")
        linear = _get(params, ("layers", *path[:-1]))
        linear["kernel"] = (pack_int4(linear["kernel"], module.num_in) if module.kind == "int4"
                            else np.asarray(linear["kernel"]).astype(STORED[module.kind]))
        linear[SCALE] = _per_output(module, _planes(state, cfg, names, fn, "_scale"))
        if module.zero is not None:
            linear[ZERO] = _per_output(module, _planes(state, cfg, names, fn, "_zero_point"))
    return params


def _planes(state: dict, cfg: ModelConfig, names: tuple, fn, suffix: str) -> np.ndarray:
    """Each layer's ``weight + suffix`` tensors spread over their weights' shape, through the weights' transform:
    [layers, *in, *out], each element its own scale (zero point)."""
    return np.stack([fn(*[_spread(state, f"model.layers.{i}.{name}", suffix) for name in names])
                     for i in range(cfg.num_layers)])


def _spread(state: dict, weight: str, suffix: str) -> np.ndarray:
    """A weight's [out, 1] or [out, groups] tensor repeated over the group's columns: the weight's [out, in]."""
    values = state.get(weight + suffix)
    if values is None:
        raise ValueError(f"the checkpoint has no tensor {weight + suffix!r} (its weights are not compressed)")
    values = np.asarray(values, np.float32).reshape(state[weight].shape[0], -1)
    return np.repeat(values, state[weight].shape[1] // values.shape[1], axis=1)


def _per_output(module, planes: np.ndarray) -> np.ndarray:
    """A Linear's scale (zero points) out of their spread planes: one per output channel, or per group of the
    flattened inputs [layers, groups, *out] (the inputs' order is the checkpoint's, so its groups stay whole)."""
    if not module.num_groups:
        return planes.max(axis=module.in_axes(planes.ndim)).astype(np.float32)
    out = planes.shape[1 + module.num_in:]  # planes [layers, *in, *out]
    return planes.reshape(planes.shape[0], module.num_groups, -1, *out)[:, :, 0].astype(np.float32)


def pack_params(cfg: ModelConfig, params: dict) -> dict:
    """Float weights (``params_from_hf_state``'s layout) with every packed Linear's kernel in bfloat16, packed
    for oneDNN (jaxpage.models.weight_packing); unchanged unless ``cfg.onednn_packed_weights``."""
    from flax import nnx

    from jaxpage.models.causal_lm import _abstract_model
    from jaxpage.models.layers import Linear
    from jaxpage.models.weight_packing import pack_kernel, unties_lm_head

    if not cfg.onednn_packed_weights:
        return params
    params = {**params}
    if unties_lm_head(cfg):
        params["lm_head"] = {"kernel": np.ascontiguousarray(np.asarray(params["embed"]["embedding"]).T)}
    for path, module in nnx.iter_graph(_abstract_model(cfg)):
        if isinstance(module, Linear) and module.packed:
            linear = _get(params, path)
            linear["kernel"] = pack_kernel(linear["kernel"], module.num_in, module.num_out)
    return params


def _get(tree: dict, path: tuple) -> dict:
    """The sub-dict at ``path``, copied along the way so the caller's tree stays unchanged."""
    for key in path:
        tree[key] = {**tree[key]}
        tree = tree[key]
    return tree


def _layer_weight(state: dict, prefix: str, name: str | tuple, fn) -> np.ndarray:
    if isinstance(name, tuple):
        return fn(*[_take(state, prefix + n) for n in name])
    return fn(_take(state, prefix + name))


def _take(state: dict, name: str) -> np.ndarray:
    if name not in state:
        raise ValueError(f"the checkpoint has no tensor {name!r}")
    return state[name]


def _put(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_state_from_gguf(path: Path, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Dequantizes every tensor and renames it to transformers' names, undoing llama.cpp's q/k row permutation
    where its converter applied one. A merged experts' tensor ([E, ...], named with ``{}`` for the expert in the
    architecture's GGUF_LAYER_NAMES) becomes one tensor per expert. Kept quantized (``cfg.quantization`` "gguf"),
    the decoder Linears' weights are read as stored instead (jaxpage.models.gguf_quant: ``X.weight`` signed values,
    ``X.weight_scale``, ``X.weight_zero_point``)."""
    import gguf

    arch = architecture(cfg.model_type)
    permuted = arch.gguf_permuted(cfg)
    reader = gguf.GGUFReader(path)
    state = {}
    for t in tqdm(reader.tensors, desc="reading GGUF", leave=False):
        name = gguf_to_hf_name(t.name, arch.GGUF_LAYER_NAMES)
        shape = tuple(int(d) for d in reversed(t.shape))
        if cfg.quantization == gguf_quant.METHOD and is_decoder_linear(name):
            parts = gguf_quant.stored_values(t.data, t.tensor_type.name, shape)
        else:
            parts = {"": gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)}
        for suffix, array in parts.items():
            if permuted and ".q_proj." in name:
                array = _unpermute_rope_rows(array, cfg.num_heads)
            elif permuted and ".k_proj." in name:
                array = _unpermute_rope_rows(array, cfg.num_kv_heads)
            if hasattr(arch, "from_gguf"):
                array = arch.from_gguf(name, array)
            if "{}" in name:
                state.update((name.format(e) + suffix, a) for e, a in enumerate(array))
            else:
                state[name + suffix] = array
    return state


def is_decoder_linear(hf_name: str) -> bool:
    """A decoder layer's projection weight (what a quantized checkpoint quantizes), not an expert's."""
    return hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight") and "{}" not in hf_name


def gguf_linear_types(path: Path, cfg: ModelConfig) -> dict[str, str]:
    """Each decoder Linear weight's ggml type name in the GGUF file at ``path`` (transformers' names)."""
    import gguf

    names = architecture(cfg.model_type).GGUF_LAYER_NAMES
    types = {gguf_to_hf_name(t.name, names): t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    return {name: kind for name, kind in types.items() if is_decoder_linear(name)}


def gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> str:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")  # llama.cpp's older per-expert tensors (blk.N.ffn_gate.E.weight) have five
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    _, index, part, kind = parts
    return f"model.layers.{index}.{layer_names[part]}.{kind}"


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; transformers keeps them as two halves."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
