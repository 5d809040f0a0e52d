"""The model loader: a second load restores the converted weights; a damaged checkpoint is one error naming the
model path; an unwritable cache_dir still serves."""
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


def _tiny_checkpoint(path):
    torch = pytest.importorskip("torch")  # the newest-JAX lane has no torch
    from transformers import LlamaForCausalLM

    from tests.factories import tiny_llama

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama()).save_pretrained(path)
    return path


def test_a_truncated_checkpoint_is_one_error_naming_the_model_path(tmp_path):
    """A checkpoint cut short (a copy that died half way) is a ValueError naming the model path and what the
    reader said, not the reader's own exception."""
    from jaxpage.models import loader as model_loader

    path = _tiny_checkpoint(tmp_path / "model")
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"model path .*model.*: its checkpoint could not be read .*truncated"):
        model_loader.load_model(path, tmp_path / "cache")


def test_an_unwritable_cache_dir_still_serves(tmp_path):
    """cache_dir where no folder can be made (under a regular file: root ignores permissions): the engine still
    starts, without the persistent compile cache and converting into a folder of its own, and gives the greedy
    tokens of an engine whose cache_dir is writable."""
    from jaxpage import LLM, SamplingParams
    from tests.factories import engine_options

    path = _tiny_checkpoint(tmp_path / "model")
    (tmp_path / "file").write_text("not a folder")
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}, {"prompt_token_ids": [2, 7, 1, 8]}]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [[o.outputs[0].token_ids for o in LLM(str(path), cache_dir=str(cache), **engine_options()).generate(
        prompts, greedy)] for cache in (tmp_path / "file" / "cache", tmp_path / "cache")]
    assert got[0] == got[1] and all(len(t) == 8 for t in got[0])
