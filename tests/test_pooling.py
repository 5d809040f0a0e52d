"""Pooling models (runner "pooling": LLM.embed / LLM.encode, jaxpage/worker/pooler.py and jaxpage/core/pooling.py)
against references, in float32:

- every architecture, saved as transformers saves a base model (its *Model class: no LM head, no "model." prefix;
  the runner "auto" then pools), pooled LAST, MEAN and CLS over prompts longer than the step's token budget
  (chunked): within 1e-5 of transformers' last_hidden_state pooled the same way (cosine within 1e-6);
- a sentence-transformers directory (Pooling + Normalize modules) embeds as sentence-transformers' encode() does,
  its pooler read from the modules;
- SmolLM2 (the GGUF file) with runner "pooling": MEAN-pooled prompts as transformers' hidden states;
- a *ForSequenceClassification head: transformers' logits (encode) and softmax (classify); a one-label head as a
  cross-encoder: LLM.score is the sigmoid of transformers' logit on each pair; an embedding model's score is the
  cosine of its embeddings;
- a prefix-cache hit (LAST) and a pool too small for the prompts at once give the vectors of a roomy run; every
  block comes back; dimensions and normalize; bad requests are errors naming the field.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from jaxpage import LLM, PoolingParams, SamplingParams
from tests.factories import ARCHITECTURES, SEED, engine_options, save_word_tokenizer, tiny_llama
from tests.reference import save_random_model

POOLING_TYPES = ("LAST", "MEAN", "CLS")
PROMPT_LENS = (1, 5, 17, 40, 70)  # over the 32-token budget: chunked
OPTIONS = engine_options(num_kv_blocks=40, max_num_batched_tokens=32, max_model_len=128)


def save_base_model(hf_config, path, seed: int) -> torch.nn.Module:
    """transformers' base model (AutoModel: LlamaModel, Qwen3Model, ...) of random weights, saved as it saves one."""
    return save_random_model(hf_config, path, seed, "AutoModel")


def reference(model: torch.nn.Module, prompt: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        h = model(torch.tensor([prompt])).last_hidden_state[0].double().numpy()
    return {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]


def assert_close(got, want: np.ndarray, context) -> None:
    got = np.asarray(got, np.float64)
    cosine = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
    assert abs(cosine - 1) < 1e-6 and np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max()), context


CONFIGS = {"llama": (tiny_llama, {})} | {
    name.removesuffix("Config").lower(): (lambda name=name, **kw: getattr(__import__("transformers"), name)(**kw),
                                          kwargs) for name, (kwargs, _) in ARCHITECTURES.items()}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_architecture_pools_as_transformers_hidden_states(arch, tmp_path):
    """Llama with each pooling type, the other architectures with one each (in turn): every prompt's vector
    (not normalized) is transformers' last_hidden_state pooled the same way; all blocks come back."""
    make, kwargs = CONFIGS[arch]
    index = list(CONFIGS).index(arch)
    model = save_base_model(make(**kwargs), tmp_path / "model", (SEED + index) % 2**31)
    rng = np.random.default_rng(SEED + index)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in PROMPT_LENS]
    for pooling in POOLING_TYPES if arch == "llama" else [POOLING_TYPES[index % 3]]:
        llm = LLM(str(tmp_path / "model"), cache_dir=str(tmp_path / "cache"), **OPTIONS,
                  pooler_config={"pooling_type": pooling, "normalize": False})
        assert llm.engine.config.runner == "pooling"  # runner "auto" on a base model's checkpoint
        outs = llm.encode([{"prompt_token_ids": p} for p in prompts])
        for prompt, out in zip(prompts, outs):
            assert out.finished and out.prompt_token_ids == prompt
            assert_close(out.outputs.data, reference(model, prompt, pooling), (arch, pooling, len(prompt)))
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        del llm


def test_a_sentence_transformers_directory_embeds_as_sentence_transformers(tmp_path):
    """A SentenceTransformer of a tiny Llama with last-token (then mean) pooling and a Normalize module, saved by
    sentence-transformers: jaxpage reads the pooler from its modules and LLM.embed gives encode()'s vectors."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    model_dir = tmp_path / "llama"
    save_base_model(tiny_llama(), model_dir, SEED % 2**31)
    save_word_tokenizer(model_dir, 256)
    rng = np.random.default_rng(SEED)
    texts = [" ".join(f"t{t}" for t in rng.integers(1, 256, n)) for n in PROMPT_LENS]
    for mode in ("lasttoken", "mean"):
        word = models.Transformer(str(model_dir))
        word.tokenizer.pad_token = "t0"
        st = SentenceTransformer(modules=[word, models.Pooling(64, mode), models.Normalize()], device="cpu")
        st.save(str(tmp_path / mode))
        want = st.encode(texts, convert_to_numpy=True, batch_size=2).astype(np.float64)
        llm = LLM(str(tmp_path / mode), cache_dir=str(tmp_path / "cache"), **OPTIONS)
        pooler = llm.engine.config.pooler_config
        assert (pooler.pooling_type, pooler.normalize) == ({"lasttoken": "LAST", "mean": "MEAN"}[mode], True)
        got = np.array([o.outputs.embedding for o in llm.embed(texts)])
        for g, w, text in zip(got, want, texts):
            assert abs(np.linalg.norm(g) - 1) < 1e-5
            assert 1 - g @ w < 1e-3 and np.abs(g - w).max() < 1e-4, (mode, text)
        del llm


def test_smollm2_mean_pooled_as_transformers(hf_smollm2):
    """The real model (its GGUF file) with runner "pooling": MEAN-pooled, normalized vectors of text prompts, one
    longer than the token budget, are transformers' hidden states of the same tokens pooled and normalized."""
    model, tokenizer = hf_smollm2
    llm = LLM(runner="pooling", pooler_config={"pooling_type": "MEAN"},
              **engine_options(num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=512))
    texts = ["The capital of France is Paris.", "Paged attention keeps the KV cache in fixed-size blocks. " * 8]
    for text, out in zip(texts, llm.embed(texts)):
        ids = tokenizer(text)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        want = h.mean(0) / np.linalg.norm(h.mean(0))
        got = np.array(out.outputs.embedding)
        assert 1 - got @ want < 1e-5 and np.abs(got - want).max() < 1e-4, text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-base")
    return path, save_base_model(tiny_llama(), path, (SEED + 1) % 2**31)


def test_prefix_hits_and_a_small_pool_give_the_roomy_runs_vectors(tiny, tmp_path):
    """LAST pooling keeps prefix caching: a prompt sharing 48 tokens with one embedded before takes them from the
    cache and gets the vector it gets alone. MEAN over a pool that holds a third of the prompts' blocks (the others
    wait for blocks): the vectors of a roomy pool, and every block back."""
    path, model = tiny
    rng = np.random.default_rng(SEED)
    head = rng.integers(0, 256, 48).tolist()
    prompts = [head + rng.integers(0, 256, n).tolist() for n in (3, 20)] + [rng.integers(0, 256, 60).tolist()
                                                                             for _ in range(4)]
    llm = LLM(str(path), cache_dir=str(tmp_path), **OPTIONS, pooler_config={"normalize": False})
    first = llm.encode({"prompt_token_ids": prompts[0]})[0]
    second = llm.encode({"prompt_token_ids": prompts[1]})[0]
    assert llm.stats()["prefix_cache_hits"] >= 48
    for prompt, out in zip(prompts[:2], (first, second)):
        assert_close(out.outputs.data, reference(model, prompt, "LAST"), len(prompt))
    del llm
    roomy = LLM(str(path), cache_dir=str(tmp_path), **OPTIONS, pooler_config={"pooling_type": "MEAN"})
    want = [o.outputs.embedding for o in roomy.embed([{"prompt_token_ids": p} for p in prompts])]
    del roomy
    tight = LLM(str(path), cache_dir=str(tmp_path), **{**OPTIONS, "num_kv_blocks": 9, "max_num_batched_tokens": 64},
                pooler_config={"pooling_type": "MEAN"})
    got = [o.outputs.embedding for o in tight.embed([{"prompt_token_ids": p} for p in prompts])]
    stats = tight.stats()
    assert sum(-(-len(p) // 16) for p in prompts) > 3 * stats["num_blocks"]  # the pool holds a third at most
    assert stats["num_free_blocks"] == stats["num_blocks"]
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_dimensions_normalize_and_bad_requests(tiny, tmp_path):
    """dimensions keeps the first n of the vector and normalizes them; normalize=False gives the raw pooled vector;
    a pooling engine refuses SamplingParams and a generating one PoolingParams, naming what to use."""
    path, model = tiny
    prompt = {"prompt_token_ids": list(range(1, 30))}
    llm = LLM(str(path), cache_dir=str(tmp_path), **OPTIONS)
    raw = reference(model, prompt["prompt_token_ids"], "LAST")
    [full, cut, plain] = llm.embed([prompt] * 3, [PoolingParams(), PoolingParams(dimensions=16),
                                                  PoolingParams(normalize=False)])
    assert_close(full.outputs.embedding, raw / np.linalg.norm(raw), "normalized")
    assert_close(cut.outputs.embedding, raw[:16] / np.linalg.norm(raw[:16]), "dimensions")
    assert_close(plain.outputs.embedding, raw, "raw")
    with pytest.raises(ValueError, match="PoolingParams.dimensions=65 exceeds the model's hidden size 64"):
        llm.embed(prompt, PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="pooling model .* give PoolingParams"):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="PoolingParams.dimensions=0 must be an integer >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooler_config=.* unknown fields"):
        LLM(str(path), cache_dir=str(tmp_path), **OPTIONS, pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="pooler_config.pooling_type='MAX' must be one of LAST, MEAN, CLS"):
        LLM(str(path), cache_dir=str(tmp_path), **OPTIONS, pooler_config={"pooling_type": "MAX"})
    generating = LLM(str(path), cache_dir=str(tmp_path), **OPTIONS, runner="generate")
    with pytest.raises(ValueError, match="this model generates"):
        generating.embed(prompt)
    assert len(generating.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def save_classifier(hf_config, path, seed: int) -> torch.nn.Module:
    """transformers' *ForSequenceClassification of random weights (its score head too), saved."""
    return save_random_model(hf_config, path, seed, "AutoModelForSequenceClassification")


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_classification_head_gives_transformers_logits_and_probabilities(arch, tmp_path):
    """A *ForSequenceClassification checkpoint of 3 labels (runner "auto" pools it, last token): encode gives
    transformers' logits within 1e-4, classify their softmax; embedding it is refused, naming the task."""
    make, kwargs = CONFIGS[arch]
    model = save_classifier(make(**kwargs, num_labels=3, pad_token_id=0), tmp_path / "model", SEED % 2**31)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(1, model.config.vocab_size, n).tolist() for n in PROMPT_LENS]
    llm = LLM(str(tmp_path / "model"), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    logits = llm.encode([{"prompt_token_ids": p} for p in prompts])
    probs = llm.classify([{"prompt_token_ids": p} for p in prompts])
    for prompt, raw, prob in zip(prompts, logits, probs):
        want = hf_logits(model, prompt)
        np.testing.assert_allclose(raw.outputs.data, want, rtol=1e-4, atol=1e-4)
        e = np.exp(want - want.max())
        np.testing.assert_allclose(prob.outputs.probs, e / e.sum(), atol=1e-5)
        assert prob.outputs.num_classes == 3
    with pytest.raises(ValueError, match="PoolingParams.task='embed': this model classifies"):
        llm.embed({"prompt_token_ids": prompts[0]})


def test_cross_encoder_scores_are_transformers_pair_logits(tmp_path):
    """A one-label classifier with a tokenizer (a cross-encoder): LLM.score(query, documents) is the sigmoid of
    transformers' logit on each pair's encoding (the tokenizer's text_pair), so the ranking is the reference's."""
    from transformers import AutoTokenizer

    model = save_classifier(tiny_llama(num_labels=1, pad_token_id=0), tmp_path / "model", SEED % 2**31)
    save_word_tokenizer(tmp_path / "model", 256)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    rng = np.random.default_rng(SEED)
    words = lambda n: " ".join(f"t{t}" for t in rng.integers(1, 256, n))  # noqa: E731
    query, documents = words(6), [words(n) for n in (3, 12, 30, 7)]
    llm = LLM(str(tmp_path / "model"), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    got = [o.outputs.score for o in llm.score(query, documents)]
    want = [1 / (1 + np.exp(-hf_logits(model, tokenizer(query, text_pair=d)["input_ids"])[0])) for d in documents]
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert list(np.argsort(got)) == list(np.argsort(want))
    with pytest.raises(ValueError, match="text_2: 4 texts for 2 text_1 texts"):
        llm.score([query, query], documents)


def test_an_embedding_models_score_is_the_cosine_of_its_embeddings(tiny, tmp_path):
    """LLM.score on an embedding model: the cosine of the two texts' vectors (transformers' last hidden states)."""
    path, model = tiny
    shutil.copytree(path, tmp_path / "model")
    save_word_tokenizer(tmp_path / "model", 256)
    pairs = [("t1 t2 t3", "t4 t5"), ("t1 t2 t3", "t9 t8 t7 t6")]
    llm = LLM(str(tmp_path / "model"), cache_dir=str(tmp_path / "cache"), **OPTIONS)
    got = [o.outputs.score for o in llm.score(pairs[0][0], [b for _, b in pairs])]
    for (a, b), score in zip(pairs, got):
        ea, eb = (reference(model, [int(w[1:]) for w in t.split()], "LAST") for t in (a, b))
        assert abs(score - ea @ eb / np.linalg.norm(ea) / np.linalg.norm(eb)) < 1e-5
