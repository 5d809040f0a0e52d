"""Reading the fields every architecture shares off a transformers config."""
from __future__ import annotations

from jaxpage.models.rope import read_rope_parameters, sliding_rope_parameters


def common_fields(hf_config, **overrides) -> dict:
    """ModelConfig keyword arguments common to the decoder-only architectures; ``overrides`` win."""
    num_heads = hf_config.num_attention_heads
    rope = dict(read_rope_parameters(hf_config))
    fields = dict(
        model_type=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(rope.pop("rope_theta")),
        rope_parameters=tuple(sorted(rope.items())),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        hidden_act=getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", "silu"),
        checkpoint_dtype=checkpoint_dtype(hf_config),
    )
    fields.update(attention_layout(hf_config))
    fields.update(overrides)
    return fields


def checkpoint_dtype(hf_config) -> str | None:
    """The dtype a transformers config names for its weights ("float32", "bfloat16", ...), or None (a quantized
    GGUF file's config names none: jaxpage.models.gguf_metadata)."""
    dtype = getattr(hf_config, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype else None


def attention_layout(hf_config) -> dict:
    """layer_types, sliding_window and the sliding layers' RoPE settings. A window at least as long as the
    model's context is no window."""
    window = getattr(hf_config, "sliding_window", None)
    n = hf_config.num_hidden_layers
    types = list(getattr(hf_config, "layer_types", None) or [])
    if not types:  # configs without layer_types (Mistral, Mixtral): every layer slides when a window is set
        uses = getattr(hf_config, "use_sliding_window", True) is not False
        types = ["sliding_attention" if window and uses else "full_attention"] * n
    if not window or window >= hf_config.max_position_embeddings:
        types, window = ["full_attention"] * n, None
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: full_attention, sliding_attention")
    local = sliding_rope_parameters(hf_config)
    full = read_rope_parameters(hf_config)
    return dict(layer_types=tuple(types), sliding_window=window,
                local_rope_parameters=tuple(sorted(local.items())) if local != full else ())
