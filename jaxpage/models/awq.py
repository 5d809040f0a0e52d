"""AWQ checkpoints (quant_method "awq", AutoAWQ's GEMM layout, what most published *-AWQ models hold), read into
the stored form of jaxpage.models.compressed_tensors' pack-quantized weights, so they are served by the same
grouped int4 Linears.

The format, per quantized Linear X: ``X.qweight`` int32 [in, out / 8] and ``X.qzeros`` int32 [groups, out / 8],
both packed along the outputs, word w's value j (bits [4j, 4j + 4)) being column 8w + ORDER[j]; ``X.scales``
[groups, out]. A weight is (q - zero) * scale, q and zero unsigned 4-bit."""
from __future__ import annotations

import numpy as np

from jaxpage.config import require
from jaxpage.models.compressed_tensors import unpack_words

METHOD = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SERVED = "4-bit weights with zero points in groups of group_size input columns, version gemm"


def quantized_weights(qc: dict) -> dict:
    """ModelConfig's fields of an AWQ quantization_config; a ValueError naming the field for what is not served."""
    bits = qc.get("bits", qc.get("w_bit"))
    require(bits == 4, "quantization_config.bits", bits, f"is not served ({SERVED})")
    version = str(qc.get("version", "gemm")).lower()
    require(version == "gemm", "quantization_config.version", qc.get("version"), f"is not served ({SERVED})")
    require(qc.get("zero_point", True) is True, "quantization_config.zero_point", qc.get("zero_point"),
            f"must be true ({SERVED})")
    size = qc.get("group_size", qc.get("q_group_size"))
    require(isinstance(size, int) and size > 0, "quantization_config.group_size", size, "must be a positive integer")
    return {"quantized_weights": "int4", "quantization_group_size": size, "quantization_zero_point": True}


def unpacked_state(state: dict[str, np.ndarray], qc: dict) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with every AWQ Linear X read into ``X.weight`` (signed values [out, in], float32,
    exact), ``X.weight_scale`` and ``X.weight_zero_point`` [out, groups] (signed: minus 8)."""
    state = dict(state)
    for name in [n for n in state if n.endswith(".qweight")]:
        base = name[:-len(".qweight")]
        q = _in_column_order(unpack_words(state.pop(name), 4, axis=1))  # [in, out]
        zero = _in_column_order(unpack_words(state.pop(base + ".qzeros"), 4, axis=1))  # [groups, out]
        state[base + ".weight"] = (q.T - 8).astype(np.float32)
        state[base + ".weight_scale"] = np.asarray(state.pop(base + ".scales"), np.float32).T
        state[base + ".weight_zero_point"] = (zero.T - 8).astype(np.float32)
    return state


def _in_column_order(values: np.ndarray) -> np.ndarray:
    """Unpacked [rows, out] values in AWQ's word order put back in column order."""
    where = np.argsort(ORDER)  # column k of each eight sits at word position where[k]
    columns = (np.arange(values.shape[1]).reshape(-1, 8)[:, where]).reshape(-1)
    return values[:, columns]
