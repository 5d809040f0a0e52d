"""A GGUF file's transformers config and tokenizer, without PyTorch.

transformers reads both from a GGUF file's metadata, but only with torch installed: its metadata reader's module
(``transformers.integrations.gguf.reader``) imports torch at the top, and for Llama-family files
``AutoConfig.from_pretrained(..., gguf_file=...)`` goes through ``load_gguf_checkpoint``, which refuses to run
without torch. jaxpage runs without torch (a test dependency only), so:

- ``gguf_config`` builds the config from the metadata with transformers' own GGUF key mapping
  (``GGUF_CONFIG_MAPPING``) and config classes, for the architectures jaxpage runs;
- ``use_without_torch`` puts ``read_gguf_metadata`` (the same results, read with the ``gguf`` package) in the
  reader module's place where torch is missing, so that a tokenizer class's ``from_pretrained(...,
  gguf_file=...)`` works (the rest of that path needs no torch; AutoTokenizer's does, to pick the class).
"""
from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Container

READER_MODULE = "transformers.integrations.gguf.reader"


def read_gguf_metadata(gguf_path: str, string_arrays: Container[str] = ()) -> tuple[dict, tuple[str, ...]]:
    """``(metadata, tensor names)`` as transformers' reader gives them: scalars and numeric arrays as Python
    values; arrays of strings as their length, except the keys in ``string_arrays``, given whole."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the header (version, counts): the gguf package lists it as fields
            continue
        is_string_array = field.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
        metadata[name] = field.contents() if not is_string_array or name in string_arrays else len(field.data)
    if "general.architecture" not in metadata:
        raise ValueError(f"{gguf_path} has no `general.architecture` in its metadata.")
    return metadata, tuple(t.name for t in reader.tensors)


_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_weights_dtype(gguf_path: str) -> str | None:
    """The dtype of a GGUF file's matrices where they are all of one float type (F32, F16, BF16), as a
    transformers config names it; None for quantized (or mixed) ones."""
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(gguf_path).tensors if len(t.shape) >= 2}
    return _FLOAT_TYPES.get(types.pop()) if len(types) == 1 else None


_TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
              "padding_token_id": "pad_token_id"}


# GGUF architecture -> (transformers model_type, metadata keys transformers' GGUF_CONFIG_MAPPING lacks). llama.cpp
# writes Mixtral as "llama" with an expert count; Qwen3's head_dim and Qwen3-MoE's expert width need their keys.
_ARCHITECTURES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"attention.key_length": "head_dim"}),
    "qwen3moe": ("qwen3_moe", {"expert_feed_forward_length": "moe_intermediate_size"}),
    "gemma2": ("gemma2", {}),  # Gemma's further fields: its module's gguf_fields
    "gemma3": ("gemma3_text", {}),
}
_MIXTRAL = ("mixtral", {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"})


def gguf_config(gguf_path: str):
    """The transformers config of a GGUF file of the architectures jaxpage runs (llama, which llama.cpp also
    writes for Mistral and Mixtral models, qwen2, qwen3, qwen3moe, gemma2 and gemma3), as
    ``AutoConfig.from_pretrained(..., gguf_file=...)`` makes it with torch (plus the keys it skips, see
    ``_ARCHITECTURES``, and what the architecture module's optional ``gguf_fields(metadata)`` reads)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    from jaxpage.models.registry import architecture

    metadata, tensor_names = read_gguf_metadata(gguf_path)
    arch = metadata["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {arch!r} in {gguf_path}; jaxpage reads GGUF files of "
                         f"the {', '.join(_ARCHITECTURES)} architectures")
    model_type, extra = _MIXTRAL if metadata.get(f"{arch}.expert_count") and arch == "llama" else _ARCHITECTURES[arch]
    kwargs = {**GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}),
              "tie_word_embeddings": "output.weight" not in tensor_names,
              "vocab_size": metadata.get(f"{arch}.vocab_size", metadata.get("tokenizer.ggml.tokens"))}
    mapping = {**GGUF_CONFIG_MAPPING[model_type if model_type in GGUF_CONFIG_MAPPING else arch], **extra}
    for key, name in mapping.items():
        if name is not None and f"{arch}.{key}" in metadata:
            kwargs[name] = metadata[f"{arch}.{key}"]
    for key, name in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in metadata:
            kwargs[name] = metadata[f"tokenizer.ggml.{key}"]
    kwargs.update(getattr(architecture(model_type), "gguf_fields", lambda _: {})(metadata))
    dtype = gguf_weights_dtype(gguf_path)  # a float32 file's dtype "auto" stays float32 (ModelConfig)
    if dtype:
        kwargs["dtype"] = dtype
    config = AutoConfig.for_model(model_type, **kwargs)
    if "blk.0.attn_q.bias" in tensor_names and hasattr(config, "attention_bias"):  # not in the metadata
        config.attention_bias = True
    return config


def _torch_importable() -> bool:
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None  # None: imports of torch are blocked
    return importlib.util.find_spec("torch") is not None


def use_without_torch() -> None:
    """Where torch cannot be imported, lets transformers read GGUF metadata with ``read_gguf_metadata``."""
    if READER_MODULE in sys.modules or _torch_importable():
        return
    module = types.ModuleType(READER_MODULE, __doc__)
    module.read_gguf_metadata = read_gguf_metadata
    sys.modules[READER_MODULE] = module
