"""Reading a Hugging Face config into a ModelConfig: architectures, windows, RoPE scaling, the checkpoint's
dtype."""
from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig

from jaxpage.models import config_from_hf


def test_unsupported_architecture_is_refused_and_windows_are_read():
    with pytest.raises(ValueError, match="'gpt2'"):
        config_from_hf(GPT2Config())
    windowed = config_from_hf(MistralConfig(sliding_window=16, max_position_embeddings=128, num_hidden_layers=3))
    assert windowed.layer_windows().tolist() == [16, 16, 16] and windowed.every_layer_windowed
    unwindowed = config_from_hf(MistralConfig(sliding_window=None))
    assert unwindowed.model_type == "mistral" and not unwindowed.layer_windows().any()


def test_llama3_rope_scaling_matches_transformers():
    import numpy as np
    torch = pytest.importorskip("torch")  # the newest-JAX lane has no torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(head_dim=64, num_attention_heads=4, hidden_size=256, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    from jaxpage.models.attention import rope_frequencies

    np.testing.assert_allclose(rope_frequencies(config_from_hf(hf))[0], ref.numpy(), rtol=1e-6)


def test_checkpoint_dtype_is_read_from_the_config(tmp_path):
    from transformers import AutoConfig

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, dtype="bfloat16")
    config.save_pretrained(tmp_path)
    assert config_from_hf(AutoConfig.from_pretrained(tmp_path)).checkpoint_dtype == "bfloat16"
    assert config_from_hf(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4)).checkpoint_dtype is None
