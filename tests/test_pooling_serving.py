"""The pooling endpoints end to end: `jaxpage serve` of SmolLM2 with --runner pooling (MEAN pooling), called with
the official `openai` package and httpx.

- /v1/embeddings (the openai client asks for base64; floats with httpx): each input's vector is transformers'
  hidden states of the same tokens, mean-pooled and normalized; token-id inputs and a batch; dimensions keeps the
  first n normalized; usage counts the prompt tokens;
- vLLM's /pooling gives the pooled vector as it is (not normalized); /score and /rerank on this embedding model are
  the cosines of transformers' vectors, ranked;
- a cross-encoder (a random one-label LlamaForSequenceClassification with a word tokenizer): /rerank's scores
  are the sigmoid of transformers' logit on each (query, document) pair, ordered, top_n of them; /score alike;
- gRPC's Embed and Score give the HTTP endpoints' vectors and scores; a bad input is INVALID_ARGUMENT naming it;
- bad requests are 400s naming the field (an empty input, dimensions over the hidden size, an input over
  max_model_len, a completion asked of the pooling model); the server keeps serving with every block back.
"""
from __future__ import annotations

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch

from jaxpage.testing.launch import wait_serving
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.servers import START_TIMEOUT, start_http

MODEL = "smollm2-embed"
TEXTS = ["The capital of France is Paris.", "Paged attention keeps the KV cache in blocks. " * 6, "Hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, hf_smollm2):  # transformers loads while the server warms up
    server = start_http(["-m", "serving.cli", "serve", "--max-model-len", "256", "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "64", "--dtype", "float32", "--num-kv-blocks", "64",
                         "--served-model-name", MODEL, "--runner", "pooling",
                         "--pooler-config", '{"pooling_type": "MEAN"}'],
                        tmp_path_factory.mktemp("pooling") / "server.log")
    try:
        wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
        yield server
    finally:
        server.stop()


def mean_hidden(hf_smollm2, ids: list[int]) -> np.ndarray:
    model, _ = hf_smollm2
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy().mean(0)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_embeddings_are_transformers_mean_pooled_hidden_states(server, hf_smollm2):
    tokenizer = hf_smollm2[1]
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids):
        want = unit(mean_hidden(hf_smollm2, i))
        np.testing.assert_allclose(d.embedding, want, atol=1e-4)
    with httpx.Client(base_url=server.base, timeout=60) as http:
        floats = http.post("/v1/embeddings", json={"model": MODEL, "input": ids[1], "encoding_format": "float"}).json()
        np.testing.assert_allclose(floats["data"][0]["embedding"], r.data[1].embedding, atol=1e-6)
        cut = http.post("/v1/embeddings", json={"input": [ids[0]], "dimensions": 32}).json()["data"][0]["embedding"]
        np.testing.assert_allclose(cut, unit(mean_hidden(hf_smollm2, ids[0])[:32]), atol=1e-4)
        raw = http.post("/pooling", json={"model": MODEL, "input": TEXTS[0]}).json()
        assert raw["object"] == "list" and raw["data"][0]["object"] == "pooling"
        np.testing.assert_allclose(raw["data"][0]["data"], mean_hidden(hf_smollm2, ids[0]), rtol=1e-4, atol=1e-4)


def test_score_and_rerank_are_the_cosines_of_transformers_vectors(server, hf_smollm2):
    tokenizer = hf_smollm2[1]
    query, documents = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "France's capital."]
    vector = {t: unit(mean_hidden(hf_smollm2, tokenizer(t)["input_ids"])) for t in [query, *documents]}
    want = [float(vector[query] @ vector[d]) for d in documents]
    with httpx.Client(base_url=server.base, timeout=60) as http:
        scored = http.post("/score", json={"model": MODEL, "text_1": query, "text_2": documents}).json()
        ranked = http.post("/v1/rerank", json={"model": MODEL, "query": query, "documents": documents,
                                               "top_n": 2}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], want, atol=1e-4)
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(want)[::-1][:2])
    assert [r["document"]["text"] for r in ranked["results"]] == [documents[i] for i in np.argsort(want)[::-1][:2]]


def test_grpc_embed_and_score_are_the_http_endpoints(server):
    with httpx.Client(base_url=server.base, timeout=60) as http:
        embedded = http.post("/v1/embeddings", json={"input": TEXTS[:2], "dimensions": 48}).json()
        scored = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        r = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS[:2]], dimensions=48), timeout=60)
        np.testing.assert_allclose([list(e.values) for e in r.embeddings],
                                   [d["embedding"] for d in embedded["data"]], atol=1e-6)
        assert r.prompt_tokens == embedded["usage"]["prompt_tokens"] == sum(e.prompt_tokens for e in r.embeddings)
        s = stub.Score(pb.ScoreRequest(text_1=[TEXTS[0]], text_2=TEXTS[1:]), timeout=60)
        np.testing.assert_allclose(s.scores, [d["score"] for d in scored["data"]], atol=1e-6)
        for bad, field in [(pb.EmbedRequest(inputs=[pb.EmbedInput()]), "inputs[0]"),
                           (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], dimensions=4096), "dimensions"),
                           (pb.EmbedRequest(inputs=[pb.EmbedInput(text="a")], task="nope"), "task")]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Embed(bad, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
    assert server.all_blocks_free()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A server of a random one-label classifier with a word tokenizer, and the transformers model."""
    from tests.factories import save_word_tokenizer, tiny_llama
    from tests.reference import save_random_model

    path = tmp_path_factory.mktemp("cross-encoder")
    model = save_random_model(tiny_llama(num_labels=1, pad_token_id=0), path, 0, "AutoModelForSequenceClassification")
    save_word_tokenizer(path, 256)
    server = start_http(["-m", "serving.cli", "serve", "--model", str(path), "--max-model-len", "128",
                         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--dtype", "float32",
                         "--num-kv-blocks", "40"], path / "server.log")
    try:
        wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
        yield server, model
    finally:
        server.stop()


def test_a_cross_encoders_rerank_is_transformers_pair_logits_ordered(cross_encoder):
    server, model = cross_encoder
    query, documents = "t5 t9 t14", ["t1 t2", "t5 t9", "t200 t3 t77 t8", "t14"]
    pair_ids = [[int(w[1:]) for w in f"{query} {d}".split()] for d in documents]  # the word tokenizer's pair
    with torch.no_grad():
        logits = [float(model(torch.tensor([ids])).logits[0, 0]) for ids in pair_ids]
    want = 1 / (1 + np.exp(-np.array(logits)))
    with httpx.Client(base_url=server.base, timeout=60) as http:
        ranked = http.post("/rerank", json={"query": query, "documents": documents, "top_n": 3}).json()
        scored = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
        assert http.post("/v1/embeddings", json={"input": "t1"}).status_code == 400  # a classifier embeds nothing
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(-want)[:3])
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], np.sort(want)[::-1][:3], atol=1e-5)
    np.testing.assert_allclose([d["score"] for d in scored["data"]], want, atol=1e-5)
    assert ranked["usage"]["total_tokens"] == scored["usage"]["prompt_tokens"] == sum(map(len, pair_ids))
    with grpc.insecure_channel(server.target) as channel:
        r = pb_grpc.GenerationStub(channel).Score(pb.ScoreRequest(text_1=[query], text_2=documents), timeout=60)
    np.testing.assert_allclose(r.scores, want, atol=1e-5)
    assert server.all_blocks_free()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 1000}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": [1] * 300}, "input"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ("/pooling", {"input": [[]]}, "input"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "prompt"),
], ids=["empty-list", "empty-string", "dimensions-over", "dimensions-zero", "too-long", "format", "empty-ids",
        "score-lengths", "rerank-empty", "completion"])
def test_bad_requests_are_400s_naming_the_field(server, path, body, param):
    with httpx.Client(base_url=server.base, timeout=60) as http:
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200
    assert server.all_blocks_free() and server.metrics()["jaxpage:num_requests_in_flight"] == 0
