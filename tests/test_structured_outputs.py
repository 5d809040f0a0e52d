"""Structured outputs (issue 15): constrained samples parse and validate; greedy equals transformers under the same
llguidance mask; constrained rows mixed with others, n > 1, beams and preemptions stay valid and free their blocks."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
import pydantic
import pytest
import torch

from jaxpage import SamplingParams, StructuredOutputsParams

NESTED = {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
        "city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}}}}
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["scores", "passed"], "properties": {
    "scores": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 100}},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1}, "passed": {"type": "boolean"}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["size", "quantity", "toppings"], "properties": {
    "size": {"enum": ["small", "medium", "large"]}, "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
    "toppings": {"type": "array", "maxItems": 3, "items": {"enum": ["cheese", "ham", "olives"]}}}}
SCHEMAS = {"nested": (NESTED, "A person and their address, as JSON:"),
           "arrays": (ARRAYS, "Test scores, as JSON:"),
           "enums": (ENUMS, "A pizza order, as JSON:")}
SAMPLES = 100
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _texts(llm, prompt: str, samples: int, **params) -> list[str]:
    """``samples`` completions at temperature 1.0, n=8 a request, seeded."""
    requests = -(-samples // 8)
    outs = llm.generate([prompt] * requests, [SamplingParams(n=8, temperature=1.0, seed=i, **params)
                                              for i in range(requests)])
    return [c.text for o in outs for c in o.outputs][:samples]


def _assert_all_freed(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_pool.num_free == engine.config.cache.num_kv_blocks - 1


# --- parameters ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("json", {"type": "objekt"}), ("json", "{not json"), ("json", ["a list"]), ("regex", "[a-z"),
    ("choice", []), ("choice", ["ok", 3]), ("grammar", "start: ( \"x\""), ("grammar", "root ::= ( \"x\"")])
def test_a_bad_constraint_is_a_value_error_naming_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(structured_outputs=StructuredOutputsParams(**{field: value}))


def test_exactly_one_constraint_and_the_accepted_forms():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    from_model = SamplingParams(structured_outputs={"json": Point}).structured_outputs
    assert from_model.key == StructuredOutputsParams(json=json.dumps(Point.model_json_schema())).key
    assert StructuredOutputsParams(grammar='root ::= "a" | "b"').kind == "grammar"  # GBNF is taken too


# --- the real model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def json_samples():
    """Each schema's SAMPLES constrained texts and 8 unconstrained ones, all in one generate call on a SmolLM2
    engine 32 sequences wide (four times the shared engine's: the samples take a quarter of the steps)."""
    from jaxpage import LLM
    from tests.factories import SMOLLM2_OPTIONS

    llm = LLM(**{**SMOLLM2_OPTIONS, "max_num_seqs": 32})
    prompts, params, spans = [], [], {}
    for name, (schema, prompt) in SCHEMAS.items():
        for count, so in ((SAMPLES, StructuredOutputsParams(json=schema)), (8, None)):
            requests = -(-count // 8)
            spans[name, so is None] = (len(prompts), count)
            prompts += [prompt] * requests
            params += [SamplingParams(n=8, temperature=1.0, seed=i, max_tokens=64, structured_outputs=so)
                       for i in range(requests)]
    outs = llm.generate(prompts, params)
    _assert_all_freed(llm)
    return {key: [c.text for o in outs[start:start + -(-count // 8)] for c in o.outputs][:count]
            for key, (start, count) in spans.items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_validates_and_unconstrained_does_not(json_samples, name):
    schema = SCHEMAS[name][0]
    texts = json_samples[name, False]
    assert len(texts) == SAMPLES
    invalid = [t for t in texts if not _valid(t, schema)]
    assert not invalid, f"{len(invalid)} of {SAMPLES} invalid, e.g. {invalid[:3]}"
    free = json_samples[name, True]
    assert not all(_valid(t, schema) for t in free), "unconstrained output validates too: the test cannot fail"


def test_regex_and_choice_outputs_match(smollm2):
    prompt = "Call me at"
    phones = _texts(smollm2, prompt, 16, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=PHONE))
    assert all(re.fullmatch(PHONE, t) for t in phones), phones
    assert not all(re.fullmatch(PHONE, t) for t in _texts(smollm2, prompt, 8, max_tokens=20))
    prompt = "Review: 'great food, slow service'. Sentiment:"
    picks = _texts(smollm2, prompt, 16, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    assert all(t in CHOICES for t in picks), picks
    assert not all(t in CHOICES for t in _texts(smollm2, prompt, 8, max_tokens=8))


@torch.no_grad()
def _hf_constrained_greedy(model, tokenizer, prompt_ids: list[int], grammar: str, eos: list[int],
                           max_new: int) -> list[int]:
    """transformers' logits, the same llguidance mask applied at each step, argmax; stops after EOS."""
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos), grammar)
    mask = llnp.allocate_token_bitmask(1, vocab)
    ids, new, past = list(prompt_ids), list(prompt_ids), None
    for _ in range(max_new):
        out = model(torch.tensor([new]), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1].float().numpy(), out.past_key_values
        llnp.fill_next_token_bitmask(matcher, mask, 0)
        allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        ids.append(token)
        new = [token]
        assert matcher.consume_token(token)
        if token in eos:
            break
    return ids[len(prompt_ids):]


def test_greedy_constrained_equals_transformers_with_the_same_mask(smollm2, hf_smollm2):
    model, tokenizer = hf_smollm2
    eos = sorted(smollm2.engine.eos_token_ids)
    cases = [StructuredOutputsParams(json=NESTED), StructuredOutputsParams(json=ENUMS),
             StructuredOutputsParams(regex=PHONE)]
    prompts = [SCHEMAS["nested"][1], SCHEMAS["enums"][1], "Call me at"]
    outs = smollm2.generate(prompts, [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
                                      for so in cases])
    for prompt, so, out in zip(prompts, cases, outs):
        ref = _hf_constrained_greedy(model, tokenizer, tokenizer(prompt)["input_ids"], so.grammar_text, eos, 48)
        assert out.outputs[0].token_ids == ref, (prompt, out.outputs[0].text, tokenizer.decode(ref))
        assert out.outputs[0].finish_reason == "stop"


def test_mixed_batch_with_n_beams_preemptions_and_abort(smollm2):
    engine = smollm2.engine
    json_so, choice_so = StructuredOutputsParams(json=ENUMS), StructuredOutputsParams(choice=CHOICES)
    requests = {
        "json-n3": ("A pizza order, as JSON:", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=64,
                                                             structured_outputs=json_so)),
        "json-best-of": ("A pizza order, as JSON:", SamplingParams(n=1, best_of=2, temperature=1.0, seed=6,
                                                                  max_tokens=64, structured_outputs=json_so)),
        "beams": ("Call me at", SamplingParams(n=2, use_beam_search=True, max_tokens=20,
                                               structured_outputs=StructuredOutputsParams(regex=PHONE))),
        "choice": ("Sentiment of 'meh':", SamplingParams(temperature=1.0, seed=7, max_tokens=8,
                                                         structured_outputs=choice_so)),
        "free": ("The capital of France is", SamplingParams(temperature=1.0, seed=8, max_tokens=24)),
        "aborted": ("A pizza order, as JSON:", SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=64,
                                                             structured_outputs=json_so)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        if step % 4 == 0 and engine.scheduler.running:  # forced recompute preemption of the newest group
            engine.scheduler.preempt(max(engine.scheduler.running, key=lambda g: g.arrival))
        if step == 6:
            engine.abort_request("aborted")
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                finished[out.request_id] = out
    assert engine.scheduler.num_preemptions >= 3
    texts = {k: [c.text for c in out.outputs] for k, out in finished.items()}
    assert len(texts["json-n3"]) == 3 and all(_valid(t, ENUMS) for t in texts["json-n3"] + texts["json-best-of"])
    assert len(texts["beams"]) == 2 and all(re.fullmatch(PHONE, t) for t in texts["beams"]), texts["beams"]
    assert texts["choice"][0] in CHOICES and texts["free"][0]
    _assert_all_freed(smollm2)


def test_speculative_decoding_under_a_grammar_equals_it_without(smollm2, smollm2_ngram):
    """n-gram speculation with constrained rows (issue 26): each draft position is masked by the grammar's state
    after the drafts before it, so greedy constrained tokens equal the shared engine's without speculation,
    drafts are accepted (the prompts hold examples the output repeats), and seeded samples still validate."""
    spec = smollm2_ngram
    example = '{"name": "Ann", "address": {"city": "Oslo", "zip": 12345}}'
    cases = [(f"A person and their address, as JSON: {example}. Another one: ", StructuredOutputsParams(json=NESTED)),
             ("A pizza order, as JSON: {\"size\": \"small\", \"quantity\": 2, \"toppings\": [\"ham\"]}. Another:",
              StructuredOutputsParams(json=ENUMS)),
             ("Call me at (555) 123-4567 or at", StructuredOutputsParams(regex=PHONE))]
    prompts = [p for p, _ in cases]
    greedy = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so) for _, so in cases]
    before = spec.engine.stats()["spec_decode_num_accepted_tokens"]
    ours, ref = spec.generate(prompts, greedy), smollm2.generate(prompts, greedy)
    for a, b in zip(ours, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].text, b.outputs[0].text)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > before
    sampled = spec.generate([cases[0][0]] * 2, [SamplingParams(n=4, temperature=1.0, seed=s, max_tokens=64,
                                                               structured_outputs=cases[0][1]) for s in (1, 2)])
    texts = [c.text for o in sampled for c in o.outputs]
    assert all(_valid(t, NESTED) for t in texts), texts
    _assert_all_freed(spec)
