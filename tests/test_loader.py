"""The model loader's weights cache: a second load restores the converted weights."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from jaxpage.models import config_from_hf, params_from_hf_state


def test_second_load_restores_converted_weights_instead_of_converting(tmp_path, monkeypatch):
    import numpy as np
    torch = pytest.importorskip("torch")  # the newest-JAX lane has no torch
    from transformers import LlamaForCausalLM

    from jaxpage.models import loader as model_loader

    torch.manual_seed(np.random.SeedSequence().entropy % 2**31)
    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     tie_word_embeddings=False)
    LlamaForCausalLM(hf).save_pretrained(tmp_path / "model")
    first = model_loader.load_model(tmp_path / "model", tmp_path / "cache")
    monkeypatch.setattr(model_loader, "_convert_into", lambda *a: pytest.fail("converted a cached model again"))
    second = model_loader.load_model(tmp_path / "model", tmp_path / "cache")
    state = LlamaForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    expected = params_from_hf_state(config_from_hf(hf), {k: v.numpy() for k, v in state.items()})
    for loaded in (first, second):
        np.testing.assert_array_equal(loaded.params["layers"]["attn"]["qkv"]["kernel"],
                                      expected["layers"]["attn"]["qkv"]["kernel"])
        np.testing.assert_array_equal(loaded.params["lm_head"]["kernel"], expected["lm_head"]["kernel"])
