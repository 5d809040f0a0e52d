"""Checkpoints published in compressed-tensors' format (llm-compressor's output, vLLM's quant_method
"compressed-tensors"): the schemes served as they are stored, read off a transformers config's
``quantization_config``, and their stored weights put into the model's quantized Linears unchanged.

Served: int8 weights with a scale per output channel, symmetric ("int-quantized": W8A8 int8, or W8A16), and float8
e4m3 weights with a scale per output channel ("float-quantized": FP8 dynamic), in every decoder Linear, the LM head
left float. Anything else is refused at load, naming the field and what is served."""
from __future__ import annotations

import re

from jaxpage.config import require

METHOD = "compressed-tensors"
FORMATS = {"int-quantized": ("int", "int8"), "float-quantized": ("float", "fp8")}  # format -> (type, stored kind)
SERVED = ("int8 or float8 weights of 8 bits, symmetric, one scale per output channel (format int-quantized or "
          "float-quantized: W8A8 int8, W8A16, FP8 dynamic), targets ['Linear'], the LM head alone ignored")


def quantized_weights(quantization_config) -> str | None:
    """The decoder Linears' stored kind ("int8" or "fp8") of a checkpoint's quantization_config (None: a float
    checkpoint); a ValueError naming the field for anything not served."""
    if quantization_config is None:
        return None
    qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = qc.get("quant_method")
    require(method == METHOD, "quantization_config.quant_method", method,
            f"is not served (jaxpage serves {METHOD!r} checkpoints: {SERVED})")
    fmt = qc.get("format")
    require(fmt in FORMATS, "quantization_config.format", fmt, f"is not served (served: {SERVED})")
    groups = list((qc.get("config_groups") or {}).values())
    require(len(groups) == 1, "quantization_config.config_groups", len(groups), f"must be one group ({SERVED})")
    group = groups[0]
    require(group.get("targets") == ["Linear"], "quantization_config.config_groups.targets", group.get("targets"),
            "must be ['Linear']")
    weights, kind = group.get("weights") or {}, FORMATS[fmt]
    for key, want in (("num_bits", 8), ("type", kind[0]), ("symmetric", True), ("strategy", "channel"),
                      ("dynamic", False)):
        require(weights.get(key) == want, f"quantization_config.config_groups.weights.{key}", weights.get(key),
                f"must be {want!r} ({SERVED})")
    acts = group.get("input_activations")
    require(acts is None or acts.get("dynamic") is True, "quantization_config.config_groups.input_activations",
            acts, "must be dynamic (or absent): static activation scales are not served")
    ignore = [name for name in qc.get("ignore") or [] if not _is_lm_head(name)]
    require(not ignore, "quantization_config.ignore", ignore, "must name the LM head alone")
    return kind[1]


def _is_lm_head(name: str) -> bool:
    return name == "lm_head" or name.startswith("re:") and re.fullmatch(name[3:], "lm_head") is not None
