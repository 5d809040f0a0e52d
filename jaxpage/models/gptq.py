"""GPTQ checkpoints (quant_method "gptq": what AutoGPTQ and GPTQModel publish), read into the stored form of
jaxpage.models.compressed_tensors' pack-quantized weights (signed values, scales and zero points per group of
input columns), so they are served by the same grouped int4 / int8 Linears.

The format, per quantized Linear X: ``X.qweight`` int32 [in / per, out] packed along the inputs (per = 32 / bits
values a word, value i in bits [i * bits, ...)), ``X.qzeros`` int32 [groups, out / per] packed along the outputs,
``X.scales`` [groups, out], ``X.g_idx`` [in] (each input's group). A weight is (q - zero) * scale with q and zero
unsigned; checkpoint_format "gptq" (the original, and the default) stores each zero minus one, "gptq_v2" the zero.
Served: 4 or 8 bits, groups in input order (desc_act false) or one per channel (group_size -1, symmetric only)."""
from __future__ import annotations

import numpy as np

from jaxpage.config import require
from jaxpage.models.compressed_tensors import PACKED_KINDS, unpack_words

METHOD = "gptq"
SERVED = ("4- or 8-bit weights (bits 4 or 8) in groups of group_size input columns in their order (desc_act "
          "false), or one group per output channel (group_size -1) when symmetric; checkpoint_format gptq or "
          "gptq_v2; the decoder Linears quantized and the LM head float")


def quantized_weights(qc: dict) -> dict:
    """ModelConfig's fields of a GPTQ quantization_config; a ValueError naming the field for what is not served."""
    require(qc.get("bits") in PACKED_KINDS, "quantization_config.bits", qc.get("bits"), f"is not served ({SERVED})")
    require(not qc.get("desc_act"), "quantization_config.desc_act", qc.get("desc_act"),
            f"must be false: activation-ordered groups are not served ({SERVED})")
    size = qc.get("group_size")
    require(size == -1 or (isinstance(size, int) and size > 0), "quantization_config.group_size", size,
            "must be -1 or a positive integer")
    asymmetric = qc.get("sym", True) is False
    require(size != -1 or not asymmetric, "quantization_config.sym", qc.get("sym"),
            "must be true with group_size -1 (one zero point per channel is not served)")
    fmt = qc.get("checkpoint_format", "gptq")
    require(fmt in ("gptq", "gptq_v2"), "quantization_config.checkpoint_format", fmt, "must be 'gptq' or 'gptq_v2'")
    require(not qc.get("lm_head"), "quantization_config.lm_head", qc.get("lm_head"),
            "must be false (a quantized LM head is not served)")
    require(not qc.get("dynamic"), "quantization_config.dynamic", qc.get("dynamic"),
            "must be empty (per-module overrides are not served)")
    return {"quantized_weights": PACKED_KINDS[qc["bits"]], "quantization_group_size": size,  # -1: weight-only
            "quantization_zero_point": asymmetric}


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with every GPTQ Linear X read into ``X.weight`` (signed values [out, in], float32,
    exact), ``X.weight_scale`` [out, groups] and, where asymmetric, ``X.weight_zero_point`` [out, groups]
    (signed: zero minus 2**(bits - 1))."""
    bits, offset = qc["bits"], 1 << (qc["bits"] - 1)
    state = dict(state)
    for name in [n for n in state if n.endswith(".qweight")]:
        base = name[:-len(".qweight")]
        q = unpack_words(state.pop(name), bits, axis=0)  # [in, out]
        scale = np.asarray(state.pop(base + ".scales"), np.float32)  # [groups, out]
        zero = unpack_words(state.pop(base + ".qzeros"), bits, axis=1)[:, :q.shape[1]]
        zero = zero + 1 if qc.get("checkpoint_format", "gptq") == "gptq" else zero
        _require_input_order(state.pop(base + ".g_idx", None), q.shape[0], scale.shape[0], base)
        state[base + ".weight"] = (q.T - offset).astype(np.float32)
        state[base + ".weight_scale"] = scale.T
        if qc.get("sym", True) is False:
            state[base + ".weight_zero_point"] = (zero.T - offset).astype(np.float32)
        elif np.any(zero != offset):
            raise ValueError(f"quantization_config.sym=True but {base}.qzeros holds zero points other than "
                             f"{offset}: the checkpoint is asymmetric")
    return state


def _require_input_order(g_idx, num_in: int, num_groups: int, base: str) -> None:
    if g_idx is None:
        return
    want = np.arange(num_in) // (num_in // num_groups)
    if not np.array_equal(np.asarray(g_idx), want):
        raise ValueError(f"{base}.g_idx assigns inputs to groups out of their order (activation order): "
                         f"not served ({SERVED})")
