"""Speculative decoding's eagle3 method (issue 61): an EAGLE-3 head (one decoder layer over the target's auxiliary
hidden states) proposes k tokens a step from its own pool (the target's block ids), each drawn with the
distribution q it came from, which the target's step verifies by rejection sampling.

Over a tiny random 4-layer Llama target with random heads of both checkpoint layouts (the speculators library's
and the original release's): the target step's auxiliary hidden states are transformers' hidden states of those
layers (every layer driver); greedy tokens and log-probabilities equal a run without speculation, through
preemptions; each proposal is the head's own greedy continuation computed by a float32 torch reference of the
head (transformers' rotary embedding, the layer as both releases write it); a drafted token's q is a distribution
over the draft vocabulary only, the token among its support; random workloads (hypothesis: prefix caching,
aborts, preemptions, n > 1, beams, penalties) keep the block accounting and return every block. Where the
speculators library imports, the reference is checked against its own Eagle3DraftModel."""
from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from jaxpage.config import SpeculativeConfig
from jaxpage.models import forward_hidden_aux, stack_layers, unstack_layers
from jaxpage.models.batch import TokenBatch
from jaxpage.models.eagle3 import load_head
from jaxpage.sampling_params import SamplingParams
from tests.eagle3_heads import (
    LAYOUTS,
    eagle3_config,
    head_layer_config,
    reference_drafts,
    reference_pass,
    save_random_head,
)
from tests.factories import engine_options, tiny_llama

AUX = (1, 2, 3)  # of the target's 4 layers
DRAFT_VOCAB = 96
K = 3


def test_bad_eagle3_config_is_refused_naming_the_field():
    for options in ({"method": "eagle3", "num_speculative_tokens": 2},
                    {"method": "eagle3", "model": "", "num_speculative_tokens": 2}):
        with pytest.raises(ValueError, match="speculative_config.model"):
            SpeculativeConfig.from_dict(options)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target's path, its torch model, {layout: (head path, head tensors)}, cache directory)."""
    from tests.reference import save_random_model

    seed = random.randrange(2**31)
    target = tmp_path_factory.mktemp("target")
    torch_model = save_random_model(tiny_llama(num_hidden_layers=4), target, seed=seed)
    heads = {}
    for i, layout in enumerate(LAYOUTS):
        path = tmp_path_factory.mktemp(f"head-{layout}")
        heads[layout] = path, save_random_head(path, tiny_llama(num_hidden_layers=4), AUX, DRAFT_VOCAB, layout,
                                               seed=seed + 1 + i, own_embedding=layout == "original")
    return target, torch_model, heads, str(tmp_path_factory.mktemp("cache"))


def test_bad_heads_are_refused_naming_the_field(models, tmp_path):
    from jaxpage.models.hf_config import common_fields
    from jaxpage.config import ModelConfig
    import json

    target_cfg = ModelConfig(**common_fields(tiny_llama(num_hidden_layers=4)))
    embedding = np.zeros((256, 64), np.float32)
    _, _, heads, _ = models
    good = heads["speculators"][0]
    with pytest.raises(ValueError, match="speculative_config.model"):
        load_head(str(tmp_path / "missing"), target_cfg, embedding)
    for change, field in (({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, "eagle_aux_hidden_state_layer_ids"),
                          ({"speculators_model_type": "dflash"}, "speculators_model_type"),
                          ({"fc_norm": True}, "fc_norm")):
        bad = tmp_path / field
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        config = {**json.loads((good / "config.json").read_text()), **change}
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=field):
            load_head(str(bad), target_cfg, embedding)


OPTIONS = engine_options(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=40)


@pytest.fixture(scope="module")
def llms(models):
    """Engines over the target: without speculation; with each layout's head; the speculators head again over a
    pool small enough to preempt."""
    from jaxpage import LLM

    target, _, heads, cache = models
    plain = LLM(str(target), cache_dir=cache, **OPTIONS)
    spec = {layout: LLM(str(target), cache_dir=cache, speculative_config=eagle3_config(path, K), **OPTIONS)
            for layout, (path, _) in heads.items()}
    small = LLM(str(target), cache_dir=cache, speculative_config=eagle3_config(heads["speculators"][0], K),
                **{**OPTIONS, "num_kv_blocks": 14})
    return plain, spec, small


def _prompts(n: int = 6, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(0, 256, 5 + 7 * i)]} for i in range(n)]


def test_target_step_returns_the_layers_hidden_states(llms, models):
    """The auxiliary hidden states of the target's step (scanned and unrolled layers alike) are transformers'
    hidden_states at the head's layers (the input of each)."""
    _, torch_model, _, _ = models
    engine = llms[1]["speculators"].engine
    cfg = engine.config.step_model
    tokens = _prompts(3)[2]["prompt_token_ids"]
    n, bs = len(tokens), engine.config.cache.block_size
    table = np.arange(1, 1 + -(-n // bs), dtype=np.int32)
    tables = np.zeros((1, engine.config.max_blocks_per_seq), np.int32)
    tables[0, :len(table)] = table
    pos = np.arange(n, dtype=np.int32)
    batch = TokenBatch(np.asarray(tokens, np.int32), pos, table[pos // bs] * bs + pos % bs, np.zeros(n, np.int32),
                       tables, np.zeros(1, np.int32))
    with torch.no_grad():
        states = torch_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = np.concatenate([states[i][0].numpy() for i in AUX], -1)
    params = engine.runner.params
    for layers in (stack_layers(params), unstack_layers(params)):
        _, _, aux = jax.jit(forward_hidden_aux, static_argnums=(0, 4, 5))(
            cfg, layers, jnp.zeros_like(engine.runner.kv_pool), batch, "xla", AUX)
        np.testing.assert_allclose(np.asarray(aux), expected, rtol=1e-4, atol=1e-4)


def _counts(llm) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_greedy_tokens_equal_those_without_speculation(llms):
    """Both layouts, and the small pool that preempts: the greedy tokens and log-probabilities of the run without
    speculation; drafts were made; every block is back."""
    plain, spec, small = llms
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = plain.generate(_prompts(), greedy)
    for llm in (*spec.values(), small):
        before = _counts(llm)
        got = llm.generate(_prompts(), greedy)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        for e, g in zip(expected, got):
            assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-3)
        drafted, _ = (a - b for a, b in zip(_counts(llm), before))
        assert drafted > 0
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_blocks"]
    assert small.stats()["num_preemptions"] > 0


def _recording(llm, seen: list):
    drafter = llm.engine.drafter
    propose = drafter.propose

    def recording(scheduled):
        scheduled = propose(scheduled)
        seen.extend((list(s.seq.token_ids), list(s.spec_token_ids), s.draft_probs) for s in scheduled
                    if s.spec_token_ids)
        return scheduled
    drafter.propose = recording
    return drafter


@pytest.mark.parametrize("layout", LAYOUTS)
def test_proposals_are_the_heads_own_greedy_continuation(llms, models, layout):
    """Greedy, with drafts often rejected (a random head): each proposal is the head's greedy continuation of the
    sequence as it stood, from the float32 torch reference over transformers' hidden states of the target, so
    the head's K/V held exactly the accepted tokens' at every step. Prompts no earlier test ran: a prefix-cache
    hit gives the head K/V that an earlier sequence's head wrote, which may differ (see eagle3_runner)."""
    _, torch_model, heads, _ = models
    llm, seen = llms[1][layout], []
    drafter = _recording(llm, seen)
    try:
        llm.generate(_prompts(4, seed=4 + LAYOUTS.index(layout)),
                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        del drafter.propose
    assert len(seen) > 8
    layer = head_layer_config(tiny_llama(num_hidden_layers=4))
    tensors = heads[layout][1]
    for tokens, drafts, _ in seen[::3]:
        assert drafts == reference_drafts(torch_model, tensors, layer, AUX, tokens, len(drafts)), tokens


def test_sampled_drafts_carry_their_distribution(llms, models):
    """Sampled requests (temperature 0.8, seeded): each draft's q sums to 1, is 0 off the draft vocabulary, and
    holds its token; the same seeds give the same tokens again; every block is back. Which steps carry drafts
    decides which of the law's realizations a seed gives, and a prefix-cache hit changes that (a shorter prefill
    leaves the step's token budget room for drafts): both runs start with the prompts cached."""
    _, _, heads, _ = models
    llm, seen = llms[1]["speculators"], []
    d2t = heads["speculators"][1]["d2t"].numpy()
    vocab = np.arange(DRAFT_VOCAB) + d2t
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=1))
    drafter = _recording(llm, seen)
    try:
        first = llm.generate(_prompts(4), params)
    finally:
        del drafter.propose
    assert seen
    for _, drafts, q in seen:
        np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.delete(q, vocab, axis=1) == 0)
        assert all(q[j, t] > 0 for j, t in enumerate(drafts))
    again = llm.generate(_prompts(4), params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_blocks"]


def test_the_reference_is_the_speculators_librarys_head(models):
    """The torch reference's pass equals speculators' own Eagle3DraftModel loaded from the head's directory
    (its first draft of every position, ttt_steps=1), where the library imports (it pins an older transformers
    than the test environment's, so it is not a test dependency)."""
    core = pytest.importorskip("speculators.models.eagle3.core")
    import json

    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    _, torch_model, heads, _ = models
    path, tensors = heads["speculators"]
    config = Eagle3SpeculatorConfig(**json.loads((path / "config.json").read_text()))
    config.transformer_layer_config._attn_implementation = "eager"
    model = core.Eagle3DraftModel(config)
    state = {**load_file(str(path / "model.safetensors")),
             "embed_tokens.weight": torch_model.get_input_embeddings().weight.detach()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) == {"verifier_lm_head.weight", "verifier_norm.weight"} and not unexpected  # training only
    tokens = _prompts(3)[2]["prompt_token_ids"]
    with torch.no_grad():
        states = torch_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in AUX], -1)[:-1]
        (drafts,) = model(aux[None], torch.tensor([tokens[1:]]), torch.zeros(1, len(tokens) - 1, dtype=torch.long),
                          ttt_steps=1)
        embeds = torch_model.get_input_embeddings().weight[torch.tensor(tokens[1:])]
        normed, _ = reference_pass(tensors, head_layer_config(tiny_llama(num_hidden_layers=4)), embeds,
                                   aux @ tensors["fc.weight"].T)
    assert drafts[0].tolist() == (normed @ tensors["lm_head.weight"].T).argmax(-1).tolist()


@pytest.fixture(scope="module")
def accounting_llm(models):
    """The speculators head over the property test's geometry (tests/fake_engine.py: blocks of 8, 64 positions),
    a pool of 14 blocks that preempts, prefix caching on; one engine for every example."""
    from jaxpage import LLM

    target, _, heads, cache = models
    llm = LLM(str(target), cache_dir=cache, speculative_config=eagle3_config(heads["speculators"][0], K),
              **engine_options(block_size=8, max_model_len=64, num_kv_blocks=14, max_num_seqs=8,
                               max_num_batched_tokens=32, enable_prefix_caching=True))
    llm.engine.refuse_unfittable = False  # as the property test's engines: groups that never fit end 'abort'
    return llm


def _scenarios():
    from tests.fake_engine import scenarios

    return scenarios()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(_scenarios())
def test_block_accounting_under_random_workloads(accounting_llm, scenario):
    """The block-accounting property test's scenarios (tests/fake_engine.py: adds with shared prefixes, steps,
    aborts, preemptions; greedy, sampled n > 1, best_of, beams, penalties) on the real target with the head, over
    one engine: the accounting holds after every action, and every block is back at the end."""
    from tests.fake_engine import play

    _, actions = scenario
    actions = [a[:4] if a[0] == "add" else a for a in actions]  # no LoRA adapters on this engine
    engine = accounting_llm.engine
    try:
        play(engine, actions)
    finally:  # a failed example leaves no request behind for the next (hypothesis replays on this engine)
        engine.wait_for_step()
        for request_id in sorted(engine.requests):
            engine.abort_request(request_id)
        engine.step()


def test_a_lora_target_with_a_head_gives_its_greedy_tokens(models, tmp_path):
    """A LoRA adapter on the target (every projection, rank 8): the head drafts from the adapted target's hidden
    states (the head itself has no adapter, as in vLLM); greedy tokens equal the adapted engine's without
    speculation, for requests with and without the adapter in one batch."""
    from jaxpage import LLM
    from jaxpage.lora.request import LoRARequest
    from tests.reference import peft_adapter

    target, torch_model, heads, cache = models
    peft_adapter(torch_model, tmp_path / "adapter", rank=8, alpha=16,
                 targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    options = {**OPTIONS, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    plain = LLM(str(target), cache_dir=cache, **options)
    spec = LLM(str(target), cache_dir=cache, speculative_config=eagle3_config(heads["speculators"][0], K), **options)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts, requests = _prompts(4, seed=9), [lora, None, lora, None]
    expected = plain.generate(prompts, greedy, lora_request=requests)
    got = spec.generate(prompts, greedy, lora_request=requests)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_smollm2_with_a_random_head_gives_its_greedy_tokens(smollm2, tmp_path):
    """SmolLM2 (the real model, float32) with a random head of its shapes (2,048 draft tokens, vLLM's default
    layers 2, 15, 27): chat answers, a regex-constrained and a JSON-constrained answer, and a stop string give
    the engine's tokens without speculation; drafts were made and verified."""
    from transformers import LlamaConfig

    from jaxpage import LLM
    from jaxpage.structured_outputs import StructuredOutputsParams
    from tests.factories import SMOLLM2_OPTIONS

    shapes = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5)
    save_random_head(tmp_path / "head", shapes, (2, 15, 27), 2048, seed=3)
    spec = LLM(**SMOLLM2_OPTIONS, speculative_config=eagle3_config(tmp_path / "head", 3))
    tokenizer = smollm2.get_tokenizer()
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in ("What is the capital of France?", "Name three colors.", "Write a haiku about rain.")]
    params = [SamplingParams(temperature=0.0, max_tokens=24),
              SamplingParams(temperature=0.0, max_tokens=24, stop=["."]),
              SamplingParams(temperature=0.0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]+( [a-z]+){2,4}\.")),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
                  json={"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}))]
    prompts = [chat[0], chat[1], chat[2], chat[1]]
    expected, got = smollm2.generate(prompts, params), spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_one_token_prompts_speculate_from_their_first_step(llms):
    """A one-token prompt's first step may carry drafts before any position has its next token (found by the
    property test): the head is skipped (the drafts are the token itself, q one-hot), and greedy and seeded
    tokens are those without speculation; every block is back."""
    plain, spec, _ = llms
    prompts = [{"prompt_token_ids": [t]} for t in (5, 77, 200)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2, best_of=2)]
    expected = plain.generate(prompts, params)
    got = spec["speculators"].generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    s = spec["speculators"].stats()
    assert s["num_free_blocks"] == s["num_blocks"]

