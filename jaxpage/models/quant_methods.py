"""The quant_methods of checkpoints published quantized (a transformers config's ``quantization_config``), each
read into one stored form (compressed-tensors' pack-quantized one: signed values, scales and zero points) and
served by the same quantized Linears; anything else is refused at load naming quant_method and what is served."""
from __future__ import annotations

import numpy as np

import jaxpage.models.awq as awq
import jaxpage.models.compressed_tensors as compressed_tensors
import jaxpage.models.fp8 as fp8
import jaxpage.models.gguf_quant as gguf_quant
import jaxpage.models.gptq as gptq
from jaxpage.config import require

METHODS = {m.METHOD: m for m in (compressed_tensors, gptq, awq, fp8, gguf_quant)}


def _as_dict(quantization_config) -> dict:
    return quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()


def quantized_weights(quantization_config) -> dict | None:
    """ModelConfig's fields of a checkpoint's quantization_config (quantization: its quant_method;
    quantized_weights, quantization_group_size, quantization_zero_point); None for a float checkpoint."""
    if quantization_config is None:
        return None
    qc = _as_dict(quantization_config)
    method = qc.get("quant_method")
    require(method in METHODS, "quantization_config.quant_method", method,
            "is not served (served: " + "; ".join(f"{name!r}: {m.SERVED}" for name, m in METHODS.items()) + ")")
    return {"quantization": method, **METHODS[method].quantized_weights(qc)}


def unpacked_state(quantization_config, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A quantized checkpoint's tensors in the stored form jaxpage.models.weights reads (``X.weight`` signed values
    as float32, ``X.weight_scale``, ``X.weight_zero_point``), whatever its quant_method."""
    qc = _as_dict(quantization_config)
    return METHODS[qc["quant_method"]].unpacked_state(state, qc)
