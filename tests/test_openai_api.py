"""The OpenAI-compatible HTTP API (serving/openai_api.py), end to end: a real `jaxpage serve` subprocess called
with the official `openai` package (sync and async clients, streaming and not) and with plain httpx.

- completions and chat completions give the offline engine's greedy text, token ids and token counts;
  n=3 with a seed gives the offline engine's samples; logprobs agree with the text and with the offline engine;
  stop strings and echo; echo with logprobs (the prompt's, as transformers'), max_tokens 0; 32 concurrent
  streams;
- a batch of prompts (strings, token ids; n=2; streamed) gives each prompt's own completions, indexed as OpenAI's,
  and a cancelled batch frees every block; logit_bias bans and forces tokens as the unbiased distribution says;
  /tokenize and /detokenize agree with the tokenizer;
- every bad request is OpenAI's error object with the right status (400 naming the field, 404 unknown model,
  unknown paths and 405 wrong methods), and the server keeps serving with every KV block back (read from
  /metrics on the same port);
- the Responses API (POST /v1/responses) gives the chat completion of the same messages, streamed in the
  documented events; text.format and forced function calls are valid for their schemas; bad fields are 400s;
- a client that disconnects (streaming or not) gets its blocks freed within a second;
- SIGTERM lets the HTTP and gRPC streams in flight finish, then the server exits 0.
A stand-in engine (test_grpc_service's, no model) shows 429 for a full queue (10,000 requests at once each answered,
200 or 429), and 503 for the calls in flight when the engine dies, while the server makes a fresh engine (then 200
again).
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import numpy as np
import openai
import pytest

from jaxpage.testing.launch import wait_serving
from jaxpage import SamplingParams
from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.servers import ENGINE_FLAGS, STAND_IN_SERVER, START_TIMEOUT, TEMPLATE, start_http

NAMES = ["smollm2-test", "another-name"]  # --served-model-name
CHAT_FLAGS = ["--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--reasoning-parser", "qwen3"]
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
LONG = [100 + i for i in range(200)]  # 13 blocks of 16 tokens


@pytest.fixture(scope="module")
def server_started(tmp_path_factory):
    server = start_http(["-m", "serving.cli", "serve", *ENGINE_FLAGS, "--num-kv-blocks", "160", "--grace-seconds", "60",
                    "--served-model-name", *NAMES, *CHAT_FLAGS], tmp_path_factory.mktemp("http") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(server_started, smollm2):  # the offline engine loads here while the server warms up
    wait_serving(server_started.target, server_started.proc, START_TIMEOUT, server_started.log)
    return server_started


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


async def collect(stream) -> dict:
    """A streamed completion or chat completion, per choice index: text, token ids, finish reasons; and usage."""
    got = {"text": {}, "token_ids": {}, "finish": {}, "usage": None, "ids": set()}
    async for chunk in stream:
        got["ids"].add(chunk.id)
        if chunk.usage is not None:
            got["usage"] = chunk.usage
        for c in chunk.choices:
            text = c.text if hasattr(c, "text") else c.delta.content or ""
            got["text"][c.index] = got["text"].get(c.index, "") + text
            got["token_ids"][c.index] = got["token_ids"].get(c.index, []) + (c.model_extra.get("token_ids") or [])
            if c.finish_reason:
                assert c.index not in got["finish"], "a second finish"
                got["finish"][c.index] = c.finish_reason
    return got


# --- the real server -------------------------------------------------------------------------------------
def test_completions_match_the_offline_engine(server, smollm2):
    want = smollm2.generate(PROMPTS, greedy(12))
    client = server.client()
    for prompt, w in zip(PROMPTS, want):
        r = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=12, **GREEDY)
        [c] = r.choices
        assert (c.text, c.model_extra["token_ids"], c.finish_reason) == (w.outputs[0].text, w.outputs[0].token_ids,
                                                                         "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(w.prompt_token_ids), 12, len(w.prompt_token_ids) + 12)
        assert r.model == NAMES[0] and r.id.startswith("cmpl-") and r.object == "text_completion"

    kw = dict(model=NAMES[1], max_tokens=12, stream_options={"include_usage": True}, **GREEDY)
    for got, w in zip(asyncio.run(stream_all(server, [w.prompt_token_ids for w in want], kw)), want):
        assert got["text"] == {0: w.outputs[0].text} and got["token_ids"] == {0: w.outputs[0].token_ids}
        assert got["finish"] == {0: "length"} and len(got["ids"]) == 1
        assert (got["usage"].prompt_tokens, got["usage"].completion_tokens) == (len(w.prompt_token_ids), 12)


def test_chat_completions_match_the_offline_engine(server, smollm2):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    prompt = smollm2.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    [w] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    r = server.client().chat.completions.create(model=NAMES[0], messages=messages, max_completion_tokens=16,
                                                temperature=0)
    [c] = r.choices
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", w.outputs[0].text,
                                                                    w.outputs[0].finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(w.prompt_token_ids),
                                                                  len(w.outputs[0].token_ids))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    async def streamed():
        return await collect(await server.async_client().chat.completions.create(
            model=NAMES[0], messages=messages, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}))

    got = asyncio.run(streamed())
    assert got["text"] == {0: w.outputs[0].text} and got["finish"] == {0: w.outputs[0].finish_reason}
    assert got["usage"].completion_tokens == len(w.outputs[0].token_ids)


def test_n3_with_a_seed_gives_the_offline_engine_samples(server, smollm2):
    [w] = smollm2.generate("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=8,
                                                               ignore_eos=True))
    want = [c.text for c in w.outputs]
    assert len(set(want)) > 1, "three samples, not three copies"
    kw = dict(model=NAMES[0], prompt="Once upon a time", n=3, temperature=0.8, seed=1234, max_tokens=8,
              extra_body={"ignore_eos": True})
    for _ in range(2):
        r = server.client().completions.create(**kw)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        assert r.usage.completion_tokens == 24
    got = asyncio.run(_stream_completion(server, kw))
    assert [got["text"][i] for i in range(3)] == want and got["finish"] == {0: "length", 1: "length", 2: "length"}


async def _stream_completion(server, kw) -> dict:
    return await collect(await server.async_client().completions.create(**kw, stream=True))


async def stream_all(server, prompts: list, kw: dict) -> list[dict]:
    """Streams a completion of every prompt at once (one async client)."""
    client = server.async_client()

    async def one(prompt):
        return await collect(await client.completions.create(prompt=prompt, **kw, stream=True))

    return await asyncio.gather(*(one(p) for p in prompts))


def test_logprobs_agree_with_the_text_and_the_offline_engine(server, smollm2):
    [w] = smollm2.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))
    want = w.outputs[0]
    r = server.client().completions.create(model=NAMES[0], prompt=PROMPTS[0], max_tokens=8, logprobs=3, **GREEDY)
    [c] = r.choices
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text == want.text and len(lp.tokens) == r.usage.completion_tokens == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for i, (token, entry) in enumerate(zip(want.token_ids, want.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[token], abs=1e-3)
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])  # greedy: the most likely

    chat = server.client().chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode() == t.token


def test_stop_strings_and_echo(server, smollm2):
    [full] = smollm2.generate(PROMPTS[1], greedy(16))
    text = full.outputs[0].text
    stop = " ".join(text.split()[2:4])  # two words from the middle
    assert stop and text.find(stop) > 0
    [w] = smollm2.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
    kw = dict(model=NAMES[0], prompt=PROMPTS[1], max_tokens=16, stop=[stop, "never-appears"], **GREEDY)
    r = server.client().completions.create(**kw)
    [c] = r.choices
    assert c.text == w.outputs[0].text == text[:text.find(stop)]
    assert (c.finish_reason, c.model_extra["stop_reason"]) == ("stop", stop)
    assert r.usage.completion_tokens == len(w.outputs[0].token_ids) < 16
    got = asyncio.run(_stream_completion(server, kw))
    assert got["text"] == {0: c.text} and got["finish"] == {0: "stop"}

    echo = server.client().completions.create(model=NAMES[0], prompt=PROMPTS[1], max_tokens=16, echo=True,
                                              **GREEDY)
    assert echo.choices[0].text == PROMPTS[1] + text


def test_echo_with_logprobs_scores_the_prompt_as_transformers(server, smollm2, hf_smollm2):
    """An evaluation harness's loglikelihood call: echo and logprobs over a token-id prompt longer than a step's
    64 tokens, max_tokens 0 (the prompt alone) or 1, unary and streamed: the prompt tokens' log-probabilities are
    transformers' float32 log-softmax within 1e-4 (the first None), the top one its argmax; vLLM's
    prompt_logprobs field the same; every block back."""
    import torch

    ids = smollm2.get_tokenizer()(" ".join(PROMPTS) * 8)["input_ids"][:90]
    assert len(ids) > 64  # two steps' chunks
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2[0](torch.tensor([ids])).logits[0].float(), -1).numpy()
    top3 = np.sort(ref, axis=-1)[:, -3:]
    clear = (top3[:, 2] - top3[:, 1] > 1e-3) & (top3[:, 1] - top3[:, 0] > 1e-3)  # no near-tie in the top 2
    decode = smollm2.get_tokenizer().decode

    def check(lp, n: int) -> None:
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.tokens[:len(ids)] == [decode([t]) for t in ids]
        got = np.array(lp.token_logprobs[1:len(ids)])
        np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-4)
        for i, top in enumerate(lp.top_logprobs[1:len(ids)]):
            [(token, value)] = top.items()
            assert abs(value - ref[i].max()) <= 1e-4
            assert token == decode([int(ref[i].argmax())]) or not clear[i]
        assert lp.text_offset == sorted(lp.text_offset)

    kw = dict(model=NAMES[0], prompt=ids, echo=True, logprobs=1, temperature=0)
    alone = server.client().completions.create(**kw, max_tokens=0)
    [c] = alone.choices
    assert c.text == decode(ids) and alone.usage.completion_tokens == 0
    check(c.logprobs, len(ids))
    one = server.client().completions.create(**kw, max_tokens=1, extra_body={"prompt_logprobs": 2})
    [c] = one.choices
    assert one.usage.completion_tokens == 1
    check(c.logprobs, len(ids) + 1)
    field = c.model_extra["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    for i, entry in enumerate(field[1:]):
        assert abs(entry[str(ids[i + 1])]["logprob"] - ref[i, ids[i + 1]]) <= 1e-4
        ranked = {int(t): e for t, e in entry.items() if e["rank"] is not None}
        assert sorted(ranked, key=lambda t: ranked[t]["rank"]) == np.argsort(-ref[i])[:2].tolist() or not clear[i]

    async def streamed():
        chunks = [chunk async for chunk in await server.async_client().completions.create(**kw, max_tokens=3,
                                                                                          stream=True)]
        return [chunk.choices[0] for chunk in chunks if chunk.choices]
    first, *rest = asyncio.run(streamed())
    assert first.text.startswith(decode(ids)) and sum(len(c.logprobs.tokens) for c in [first, *rest]) == len(ids) + 3
    check(first.logprobs, len(first.logprobs.tokens))
    assert server.all_blocks_free()


def test_grpc_prompt_logprobs_as_transformers(server, smollm2, hf_smollm2):
    """sampling.prompt_logprobs over gRPC: GenerateResponse.prompt_logprobs (unary; streaming: the first response
    only) holds each prompt token's log-probability, transformers' within 1e-4, the first position empty."""
    import torch

    ids = smollm2.get_tokenizer()("Scoring a prompt over gRPC, one position at a time.")["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2[0](torch.tensor([ids])).logits[0].float(), -1).numpy()
    request = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(temperature=0, max_tokens=3,
                                                                                  prompt_logprobs=1))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        unary, streamed = stub.Generate(request, timeout=60), list(stub.GenerateStream(request, timeout=60))
    for positions in (unary.prompt_logprobs, streamed[0].prompt_logprobs):
        assert len(positions) == len(ids) and not positions[0].top
        for i, position in enumerate(positions[1:]):
            own = {t.token_id: t.logprob for t in position.top}
            assert len(own) in (1, 2) and abs(own[ids[i + 1]] - ref[i, ids[i + 1]]) <= 1e-4
    assert len(streamed) > 1 and not any(r.prompt_logprobs for r in streamed[1:])


def test_32_concurrent_streams_complete_correctly(server, smollm2):
    prompts = [f"Fact {i}: the most interesting thing about the number {i * 7} is" for i in range(32)]
    want = smollm2.generate(prompts, greedy(12))

    kw = dict(model=NAMES[0], max_tokens=12, stream_options={"include_usage": True}, **GREEDY)
    got = asyncio.run(stream_all(server, prompts, kw))
    assert len({i for g in got for i in g["ids"]}) == 32
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["token_ids"] == {0: w.outputs[0].token_ids}, f"prompt {i}"
        assert g["text"] == {0: w.outputs[0].text} and g["finish"] == {0: "length"}, f"prompt {i}"
        assert g["usage"].completion_tokens == 12 and g["usage"].prompt_tokens == len(w.prompt_token_ids)
    assert server.all_blocks_free()


def test_models_health_version_and_metrics_on_one_port(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == NAMES and models.data[0].model_extra["max_model_len"] == 512
    assert models.data[0].model_extra["quantization"] is None
    with httpx.Client(base_url=server.base, timeout=10) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "jaxpage:kv_blocks_free" in metrics.text


BAD = [
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "seed": -3}, 400, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "n": 40}, 400, "n"),  # over --max-seqs-per-request (16: half of 32)
    ("completions", {"prompt": [1] * 600}, 400, "prompt"),
    ("completions", {"prompt": [10**6]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ["hi", ""]}, 400, "prompt"),  # one bad prompt of a batch: all refused
    ("completions", {"prompt": [[1, 2], [10**6]]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"1": 100.5}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1.0}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(129)}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}}, 400,
     "logit_bias"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(server, stream):
    with httpx.Client(base_url=server.base + "/v1", timeout=30) as http:
        for endpoint, body, status, param in BAD:
            r = http.post("/" + endpoint, json={"model": NAMES[0], **body, "stream": stream} if "model" not in body
                          else {**body, "stream": stream})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
            assert error["message"] and error["type"] == "invalid_request_error"
        r = http.post("/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model=NAMES[0], prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        server.client().chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert server.all_blocks_free() and server.metrics()["jaxpage:num_requests_in_flight"] == 0
    assert len(server.client().completions.create(model=NAMES[0], prompt="hi", max_tokens=3,
                                                  **GREEDY).choices[0].model_extra["token_ids"]) == 3


CALLS = [  # (method, path, body, status, the error's param or a word of its message)
    ("GET", "/v1/nothing", None, 404, "/v1/nothing"), ("POST", "/tokenizer_info", {}, 404, "/tokenizer_info"),
    ("GET", "/v1/completions", None, 405, "POST"), ("PUT", "/tokenize", {}, 405, "/tokenize"),
    ("POST", "/tokenize", {}, 400, "prompt"), ("POST", "/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("POST", "/tokenize", {"messages": []}, 400, "messages"),
    ("POST", "/detokenize", {"tokens": [10**6]}, 400, "tokens"), ("POST", "/detokenize", {"tokens": [-1]}, 400,
                                                                   "tokens.0"),
]


def test_unknown_paths_wrong_methods_and_bad_tokenize_calls_are_openai_errors(server):
    with httpx.Client(base_url=server.base, timeout=30) as http:
        for method, path, body, status, named in CALLS:
            r = http.request(method, path, json=body)
            assert r.status_code == status, (method, path, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == named or named in error["message"], (method, path, error)
        assert http.get("/v1/completions").headers["allow"] == "POST"
    with pytest.raises(openai.BadRequestError, match="needs a pooling model"):  # a generating model's server
        server.client().embeddings.create(model=NAMES[0], input="hi")


def test_tokenize_and_detokenize_agree_with_the_tokenizer(server, smollm2):
    tokenizer = smollm2.get_tokenizer()
    text = "The capital of France is Paris. Ünïcode: 東京"
    messages = [{"role": "user", "content": "Name a colour."}]
    with httpx.Client(base_url=server.base, timeout=30) as http:
        r = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        want = tokenizer(text)["input_ids"]
        assert (r["tokens"], r["count"], r["max_model_len"]) == (want, len(want), 512)
        assert r["token_strs"] == tokenizer.convert_ids_to_tokens(want)
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tokenizer.decode(want)}
        assert tokenizer.decode(want, skip_special_tokens=True) == text
        for add_generation_prompt in (True, False):
            r = http.post("/tokenize", json={"model": NAMES[1], "messages": messages,
                                             "add_generation_prompt": add_generation_prompt}).json()
            rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert r["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
            assert "token_strs" not in r or r["token_strs"] is None
            assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == rendered


def test_a_batch_of_prompts_gives_each_prompts_completions(server, smollm2):
    """A list of prompts is one request with len(prompt) x n choices, prompt i's at i * n + j: the offline
    engine's completions of each prompt alone (greedy strings; seeded samples of token ids), streamed too."""
    ids = [smollm2.get_tokenizer()(p)["input_ids"] for p in PROMPTS]
    seeded = dict(n=2, temperature=0.8, seed=77, max_tokens=6, ignore_eos=True)
    cases = [(PROMPTS, smollm2.generate(PROMPTS, greedy(6)), dict(n=1, max_tokens=6, **GREEDY)),
             (ids, smollm2.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(**seeded)),
              dict(n=2, temperature=0.8, seed=77, max_tokens=6,
                   extra_body={"ignore_eos": True, "return_token_ids": True}))]
    for prompts, want, kw in cases:
        n = kw["n"]
        want_tokens = {i * n + j: c.token_ids for i, w in enumerate(want) for j, c in enumerate(w.outputs)}
        assert len(set(map(tuple, want_tokens.values()))) > n, "the prompts' completions differ"
        r = server.client().completions.create(model=NAMES[0], prompt=prompts, **kw)
        assert {c.index: c.model_extra["token_ids"] for c in r.choices} == want_tokens
        assert {c.index: c.text for c in r.choices} == {i * n + j: c.text for i, w in enumerate(want)
                                                        for j, c in enumerate(w.outputs)}
        assert [c.model_extra["prompt_token_ids"] for c in sorted(r.choices, key=lambda c: c.index)] == [
            w.prompt_token_ids for w in want for _ in range(n)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(len(w.prompt_token_ids) for w in want),
                                                                      6 * n * len(want))
        got = asyncio.run(_stream_completion(server, dict(model=NAMES[0], prompt=prompts,
                                                          stream_options={"include_usage": True}, **kw)))
        assert got["token_ids"] == want_tokens and len(got["ids"]) == 1
        assert got["finish"] == {i: "length" for i in want_tokens}
        assert got["usage"].prompt_tokens == r.usage.prompt_tokens
    assert server.all_blocks_free()


def test_a_cancelled_batch_frees_every_block(server):
    before = server.metrics()
    free = before["jaxpage:kv_blocks_free"]
    body = {"model": NAMES[0], "prompt": [[3, *LONG], [4, *LONG[:100]]], "n": 2, "max_tokens": 300,
            "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base + "/v1", timeout=120) as http:
        with http.stream("POST", "/completions", json=body) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            chunks = [json.loads(next(events).removeprefix("data: ")) for _ in range(12)]
            indexes = {c["index"] for chunk in chunks for c in chunk["choices"]}
            assert indexes == {0, 1, 2, 3}  # both prompts' two samples decoding
            assert server.metrics()["jaxpage:num_requests_running"] == 4
    server.assert_freed(free, before, 4 * 300, within=1.0)


def test_logit_bias_bans_and_forces_tokens(server, smollm2):
    """-100 on the greedy first token: the next likeliest (by the unbiased log-probabilities, which logprobs
    reports) comes instead; +100 on a token: it comes every step; on completions, chat and LLM.generate."""
    client = server.client()
    plain = client.completions.create(model=NAMES[0], prompt=PROMPTS[0], max_tokens=4, logprobs=2, **GREEDY)
    first = plain.choices[0].model_extra["token_ids"][0]
    runner_up = sorted(plain.choices[0].logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[1][0]
    banned = client.completions.create(model=NAMES[0], prompt=PROMPTS[0], max_tokens=4, logprobs=2,
                                       logit_bias={str(first): -100}, **GREEDY)
    tokens = banned.choices[0].model_extra["token_ids"]
    assert first not in tokens and banned.choices[0].logprobs.tokens[0] == runner_up
    assert banned.choices[0].logprobs.top_logprobs[0] == pytest.approx(  # logprobs are the model's: unbiased
        plain.choices[0].logprobs.top_logprobs[0], abs=1e-4)
    [offline] = smollm2.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                            logit_bias={first: -100}))
    assert offline.outputs[0].token_ids == tokens

    forced = 1000 if first != 1000 else 1001
    r = client.completions.create(model=NAMES[0], prompt=PROMPTS, max_tokens=3, logit_bias={str(forced): 100},
                                  **GREEDY)
    assert [c.model_extra["token_ids"] for c in r.choices] == [[forced] * 3] * len(PROMPTS)
    chat = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=3, logit_bias={str(forced): 100}, **GREEDY)
    assert chat.choices[0].model_extra["token_ids"] == [forced] * 3
    [offline] = smollm2.generate(PROMPTS[1], SamplingParams(temperature=0.9, seed=5, max_tokens=3,
                                                            logit_bias={forced: 100}))
    assert offline.outputs[0].token_ids == [forced] * 3
    assert server.all_blocks_free()



def test_grpc_logit_bias_bans_and_forces_tokens(server):
    """sampling.logit_bias over gRPC: -100 on the unbiased greedy first token gives the runner-up (by the unbiased
    log-probabilities), +100 on a token forces it every step; bad ids and biases are INVALID_ARGUMENT naming it."""
    def generate(stub, **sampling):
        request = pb.GenerateRequest(prompt=PROMPTS[0], sampling=pb.SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, **sampling))
        return stub.Generate(request, timeout=60).completions[0]

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        plain = generate(stub)
        first = plain.token_ids[0]
        runner_up = sorted(plain.logprobs[0].top, key=lambda t: -t.logprob)[1].token_id
        banned = generate(stub, logit_bias={first: -100})
        assert banned.token_ids[0] == runner_up and first not in banned.token_ids
        forced = 1000 if first != 1000 else 1001
        assert list(generate(stub, logit_bias={forced: 100}).token_ids) == [forced] * 3
        for bias in ({-1: 1.0}, {1: 100.5}, {10**6: 1.0}):
            with pytest.raises(grpc.RpcError) as e:
                generate(stub, logit_bias=bias)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logit_bias" in e.value.details()
    assert server.all_blocks_free()

# --- tools and reasoning (the server's --chat-template, --tool-call-parser hermes, --reasoning-parser qwen3) ------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Sets an alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "label": {"type": "string", "maxLength": 12}, "loud": {"type": "boolean"}},
        "required": ["hour", "label"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris? And wake me up at 7."}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def _message(choice) -> dict:
    """A chat choice as _stream_chat puts a streamed one back together."""
    m = choice.message
    return {"reasoning": getattr(m, "reasoning_content", None) or "", "content": m.content or "",
            "calls": [[c.function.name, c.function.arguments] for c in m.tool_calls or []],
            "finish": choice.finish_reason}


async def _stream_chat(server, kw: dict) -> dict[int, dict]:
    """A streamed chat completion put back together per choice: a tool call's first delta has its id, type and
    name, the later ones fragments of its arguments."""
    got: dict[int, dict] = {}
    async for chunk in await server.async_client().chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            g = got.setdefault(c.index, {"reasoning": "", "content": "", "calls": [], "finish": None})
            g["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            g["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                if call.index == len(g["calls"]):
                    assert call.id and call.type == "function" and call.function.name
                    g["calls"].append([call.function.name, call.function.arguments or ""])
                else:
                    assert call.id is None and call.function.name is None
                    g["calls"][call.index][1] += call.function.arguments or ""
            if c.finish_reason:
                g["finish"] = c.finish_reason
    return got


async def _unary_and_streamed(server, kw: dict, *variants: dict):
    """The chat completion of kw unary and streamed (put back together), and of kw with each variant's changes,
    all at once (one batch in the engine)."""
    client = server.async_client()
    return await asyncio.gather(client.chat.completions.create(**kw), _stream_chat(server, kw),
                                *(client.chat.completions.create(**{**kw, **v}) for v in variants))


@pytest.mark.parametrize("tool_choice, finish", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "set_alarm"}}, "stop")],
    ids=["required", "named"])
def test_forced_tool_calls_are_valid_for_the_schema_on_every_sample(server, tool_choice, finish):
    """tool_choice required (one call: parallel_tool_calls off) and a named function, four samples at temperature
    1: every call is one of the tools (the named one) with arguments valid for its schema; streamed, the same
    seed's deltas put back together are the same calls."""
    kw = dict(model=NAMES[0], messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              temperature=1.0, seed=11, n=4, max_tokens=120)
    r, streamed = asyncio.run(_unary_and_streamed(server, kw))
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == finish and c.message.content is None and len(c.message.tool_calls) == 1, c
        [call] = c.message.tool_calls
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert isinstance(tool_choice, str) or call.function.name == "set_alarm"
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1, "four samples, not copies"
    assert streamed == {c.index: _message(c) for c in r.choices}


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_come_back_as_calls_when_max_tokens_cuts_the_array(server, parallel):
    """tool_choice required at temperature 1 with max_tokens 80, seeds 0-5 (the array of calls may run on past the
    limit): every response carries at least one call valid for its tool's schema (exactly one without parallel tool
    calls), none leaves the array as content; the cut ones end with "length", and a stream gives the same calls."""
    kw = dict(model=NAMES[0], messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
              temperature=1.0, max_tokens=80)
    client = server.async_client()

    async def run():
        return await asyncio.gather(*(client.chat.completions.create(**kw, seed=seed) for seed in range(6)),
                                    _stream_chat(server, {**kw, "seed": 0}))
    *responses, streamed = asyncio.run(run())
    for r in responses:
        (c,) = r.choices
        calls = c.message.tool_calls or []
        assert calls and c.message.content is None, c
        assert len(calls) == 1 or parallel
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert c.finish_reason in ("tool_calls", "length"), c
    assert streamed == {0: _message(responses[0].choices[0])}


FIXED = ('Ok.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>')


def test_auto_tool_choice_reads_the_hermes_calls_of_the_output(server):
    """The model's output fixed (a structured-output choice of one string): with tool_choice auto the hermes
    parser gives the text before the calls as content and both calls, finish "tool_calls", streamed alike;
    without parallel tool calls only the first call; with tool_choice none it is all content."""
    kw = dict(model=NAMES[0], messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"choice": [FIXED]}})
    r, streamed, one, none = asyncio.run(_unary_and_streamed(server, kw, {"parallel_tool_calls": False},
                                                             {"tool_choice": "none"}))
    want = {"reasoning": "", "content": "Ok.\n", "finish": "tool_calls",
            "calls": [["get_weather", '{"city": "Paris"}'], ["set_alarm", '{"hour": 7}']]}
    assert _message(r.choices[0]) == want and len({call.id for call in r.choices[0].message.tool_calls}) == 2
    assert streamed == {0: want}
    assert _message(one.choices[0]) == {**want, "calls": want["calls"][:1]}
    assert _message(none.choices[0]) == {"reasoning": "", "content": FIXED, "calls": [], "finish": "stop"}


def test_tool_calls_and_results_in_the_chat_go_through_the_template(server, smollm2):
    """An assistant's tool call and the tool's result in the history, and the tools: the prompt is what
    transformers' apply_chat_template makes of them with the server's template."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, result]
    as_transformers = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}, result]
    prompt = smollm2.get_tokenizer().apply_chat_template(as_transformers, tools=TOOLS, tokenize=False,
                                                         chat_template=TEMPLATE.read_text(), add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt and '"name": "set_alarm"' in prompt
    [w] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    r = server.client().chat.completions.create(model=NAMES[0], messages=history, tools=TOOLS, tool_choice="none",
                                                temperature=0, max_tokens=8, extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == w.prompt_token_ids
    assert r.choices[0].message.content == w.outputs[0].text


def test_tokenize_and_grpc_chats_go_through_the_servers_chat_template(server, smollm2):
    """/tokenize with messages and gRPC's messages use --chat-template (here it renders an assistant's tool call
    and a tool's result, which SmolLM2's own template renders otherwise), as the chat endpoint does."""
    tokenizer = smollm2.get_tokenizer()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    as_transformers = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, history[2]]

    def tokens(messages, template=None) -> list[int]:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    want = tokens(as_transformers, TEMPLATE.read_text())
    assert want != tokens(as_transformers)
    with httpx.Client(base_url=server.base, timeout=30) as http:
        assert http.post("/tokenize", json={"messages": history}).json()["tokens"] == want
    plain = [ASK[0], {"role": "tool", "content": "21"}]  # gRPC's messages: role and content
    want = tokens(plain, TEMPLATE.read_text())
    assert len(want) != len(tokens(plain))
    with grpc.insecure_channel(server.target) as channel:
        r = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in plain], sampling=pb.SamplingParams(max_tokens=1)), timeout=60)
    assert r.usage.prompt_tokens == len(want)


def test_reasoning_content_apart_from_content_unary_and_streamed(server, smollm2):
    """--reasoning-parser qwen3 on an output that thinks (forced by a regex): the text in <think>...</think> is
    reasoning_content, the rest content, in the message and in the stream's deltas."""
    kw = dict(model=NAMES[0], messages=[{"role": "user", "content": "Think, then say hello."}], temperature=0,
              max_tokens=80, extra_body={"structured_outputs": {"regex": "<think>[a-z ]{3,20}</think>[A-Za-z ]{3,20}"},
                                         "return_token_ids": True})
    r, streamed = asyncio.run(_unary_and_streamed(server, kw))
    [c] = r.choices
    text = smollm2.get_tokenizer().decode(c.model_extra["token_ids"], skip_special_tokens=True)
    assert text.startswith("<think>") and "</think>" in text
    reasoning, _, content = text.removeprefix("<think>").partition("</think>")
    assert _message(c) == {"reasoning": reasoning, "content": content, "calls": [], "finish": "stop"}
    assert streamed == {0: _message(c)}


TOOL_BAD = [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
]


def test_bad_tool_requests_are_400s_naming_the_field(server):
    with httpx.Client(base_url=server.base + "/v1", timeout=30) as http:
        for body, param in TOOL_BAD:
            r = http.post("/chat/completions", json={"model": NAMES[0], "messages": ASK, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert server.all_blocks_free()


# --- the Responses API (POST /v1/responses: serving/responses_api.py, on the chat path) ----------------------------
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses shape
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


async def _stream_response(server, kw: dict) -> list:
    return [event async for event in await server.async_client().responses.create(**kw, stream=True)]


def test_responses_give_the_chat_completion_of_the_same_messages(server):
    """client.responses.create, greedy: a text input, a list of message items (input_text and an assistant's
    output_text parts) and instructions (a system message first) give the chat completion of the same messages,
    with its token counts; streamed, the events come in the documented order, numbered, and put together are the
    unstreamed text."""
    colour = "Name a colour."
    cases = [  # (Responses fields, the chat's messages)
        ({"input": colour}, [{"role": "user", "content": colour}]),
        ({"input": colour, "instructions": "You are terse."},
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": colour}]),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                    {"role": "user", "content": colour}]},
         [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
          {"role": "user", "content": colour}]),
    ]
    kw = dict(model=NAMES[0], temperature=0)

    async def run():
        client = server.async_client()
        return await asyncio.gather(
            *(client.responses.create(**kw, **fields, max_output_tokens=12) for fields, _ in cases),
            *(client.chat.completions.create(**kw, messages=messages, max_tokens=12) for _, messages in cases),
            _stream_response(server, {**kw, **cases[1][0], "max_output_tokens": 12}))

    *got, events = asyncio.run(run())
    for r, chat in zip(got[:len(cases)], got[len(cases):]):
        [c] = chat.choices
        assert r.output_text == c.message.content and r.object == "response" and r.id.startswith("resp_")
        assert [item.type for item in r.output] == ["message"] and r.model == NAMES[0]
        assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
        assert r.status == ("incomplete" if c.finish_reason == "length" else "completed")
    types = [e.type for e in events]
    assert [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]] == EVENT_ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == got[1].output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == got[1].usage.output_tokens
    assert events[0].response.status == "in_progress" and events[-1].response.status == got[1].status


def test_responses_text_format_and_forced_function_calls_are_valid(server):
    """text.format json_schema (and json_object) through the structured-output path: the text is JSON valid for
    the schema; function tools with tool_choice required and a named function: one function_call item whose
    arguments are valid for its tool's parameters, at temperature 1; streamed with the same seed, the argument
    deltas put together are the same call."""
    schema = SCHEMAS["get_weather"]
    ask = "What is the weather in Paris? And wake me up at 7."
    kw = dict(model=NAMES[0], input=ask, temperature=1.0, max_output_tokens=100, extra_body={"seed": 11})
    forced = dict(kw, tools=RESPONSES_TOOLS, parallel_tool_calls=False)

    async def run():
        client = server.async_client()
        return await asyncio.gather(
            client.responses.create(**kw, text={"format": {"type": "json_schema", "name": "weather", "schema": schema,
                                                           "strict": True}}),
            client.responses.create(**kw, text={"format": {"type": "json_object"}}),
            client.responses.create(**forced, tool_choice="required"),
            client.responses.create(**forced, tool_choice={"type": "function", "name": "set_alarm"}),
            _stream_response(server, {**forced, "tool_choice": "required"}))

    structured, as_object, required, named, events = asyncio.run(run())
    jsonschema.validate(json.loads(structured.output_text), schema)
    assert isinstance(json.loads(as_object.output_text), dict)
    for r, names in ((required, set(SCHEMAS)), (named, {"set_alarm"})):
        [call] = r.output
        assert call.type == "function_call" and call.call_id and call.name in names, r.output
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == required.output[0].arguments
    assert [item.name for item in events[-1].response.output] == [required.output[0].name]
    assert server.all_blocks_free()


def test_responses_function_calls_and_outputs_in_the_input_go_through_the_template(server, smollm2):
    """An earlier function_call item and its function_call_output, with the tools: the prompt is what
    transformers' apply_chat_template makes of the tool call and its result with the server's template."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}'}
    items = [*ASK, call, {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}]
    as_transformers = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    tokenizer = smollm2.get_tokenizer()
    prompt = tokenizer.apply_chat_template(as_transformers, tools=TOOLS, tokenize=False,
                                           chat_template=TEMPLATE.read_text(), add_generation_prompt=True)
    assert "<tool_response>" in prompt and "<tool_call>" in prompt
    [w] = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=6))
    r = server.client().responses.create(model=NAMES[0], input=items, tools=RESPONSES_TOOLS, tool_choice="none",
                                         temperature=0, max_output_tokens=6)
    assert r.usage.input_tokens == len(w.prompt_token_ids) and r.output_text == w.outputs[0].text


def test_a_responses_stream_that_fails_ends_with_an_error_event():
    """An engine failure under a streamed response (OpenAIServing._response_events, no server): the events so far,
    then OpenAI's error event (its code, message and the Responses field), counted as the other endpoints'."""
    from jaxpage.outputs import CompletionOutput, RequestOutput
    from serving.openai_api import OpenAIError, OpenAIServing
    from serving.responses_api import ResponseRendering
    from serving.responses_protocol import ResponsesRequest

    class Lifecycle:
        codes: list = []

        def count_error(self, code):
            self.codes.append(code)

    async def outputs():
        yield 0, RequestOutput("r", None, [1], [CompletionOutput(0, "Hel", [5])], False)
        raise OpenAIError(500, "the engine failed: boom", "messages", "engine_error")

    async def events():
        render = ResponseRendering("resp_1", "m", ResponsesRequest(input="hi", stream=True), None)
        return [json.loads(e.split("data: ", 1)[1]) async for e in OpenAIServing(Lifecycle())._response_events(
            outputs(), render)]

    got = asyncio.run(events())
    assert [e["type"] for e in got] == EVENT_ORDER[:5] + ["error"]
    assert got[4]["delta"] == "Hel" and [e["sequence_number"] for e in got] == list(range(6))
    assert {k: got[-1][k] for k in ("code", "message", "param")} == {"code": "engine_error", "param": "input",
                                                                     "message": "the engine failed: boom"}
    assert Lifecycle.codes == ["INTERNAL"]


RESPONSES_BAD = [  # (body, the error's param)
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": "word " * 800}, "input"),  # over --max-model-len: the engine's refusal, named as the client's field
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.message.content.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_responses_requests_are_400s_naming_the_field(server, stream):
    with httpx.Client(base_url=server.base + "/v1", timeout=30) as http:
        for body, param in RESPONSES_BAD:
            r = http.post("/responses", json={"model": NAMES[0], **body, "stream": stream})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        r = http.post("/responses", json={"model": "gpt-4", "input": "hi", "stream": stream})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        server.client().responses.create(model=NAMES[0], input="hi", previous_response_id="resp_1")
    assert server.all_blocks_free() and server.metrics()["jaxpage:num_requests_in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_client_that_disconnects_frees_its_blocks_within_a_second(server, stream):
    before = server.metrics()
    free = before["jaxpage:kv_blocks_free"]
    body = {"model": NAMES[0], "prompt": [1 + stream, *LONG], "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=server.base + "/v1", timeout=120) as http:
        if stream:
            with http.stream("POST", "/completions", json=body) as r:
                events = (line for line in r.iter_lines() if line.startswith("data: "))
                next(events), next(events)  # prefilled and decoding
                assert server.metrics()["jaxpage:kv_blocks_free"] <= free - 13
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/completions", json=body, timeout=httpx.Timeout(120, read=3.0))
    server.assert_freed(free, before, 300, within=1.0)


def test_sigterm_lets_http_and_grpc_streams_finish_then_exits_0(server):
    """Last on the real server: it stops it."""
    async def run():
        client = server.async_client()
        http_streams = [await client.completions.create(model=NAMES[0], prompt=f"Count to {i}:", max_tokens=30,
                                                        stream=True, **GREEDY) for i in range(3)]
        firsts = [await s.__anext__() for s in http_streams]  # admitted and streaming
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(pb.GenerateRequest(
                prompt="Count to 9:", sampling=pb.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
            await call.read()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as late:
                await client.completions.create(model=NAMES[0], prompt="late", max_tokens=2)
            assert not isinstance(late.value, openai.APIStatusError) or late.value.status_code == 503
            grpc_tokens, response = 0, await call.read()
            while response is not grpc.aio.EOF:
                grpc_tokens += sum(len(c.token_ids) for c in response.completions)
                response = await call.read()
        counts = []
        for first, stream in zip(firsts, http_streams):
            rest = await collect(stream)
            counts.append(len(first.choices[0].model_extra["token_ids"]) + len(rest["token_ids"][0]))
            assert rest["finish"] == {0: "length"}
        return counts, grpc_tokens

    counts, grpc_tokens = asyncio.run(run())
    assert counts == [30, 30, 30] and grpc_tokens >= 29  # the gRPC stream's first response was read above
    assert server.proc.wait(60) == 0
    assert "shutting down: 4 calls in flight" in server.log.read_text()


# --- a stand-in engine: a full queue, an engine failure ------------------------------------------------------
@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http_stand_in")
    server = start_http(["-c", STAND_IN_SERVER, str(tmp / "fail"), "--max-queue", "4", "--grace-seconds", "5"],
                   tmp / "server.log")
    wait_serving(server.target, server.proc, START_TIMEOUT, server.log)
    server.fail_flag = tmp / "fail"
    yield server
    server.stop()


def open_streams(http: httpx.Client, n: int) -> list:
    """n streams of 3000 tokens, each admitted and generating."""
    streams = []
    for i in range(n):
        cm = http.stream("POST", "/completions", json={"prompt": [1, 2, 3 + i], "max_tokens": 3000,
                                                       "ignore_eos": True, "stream": True})
        r = cm.__enter__()
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        streams.append((cm, lines))
    return streams


def test_a_full_queue_is_429_and_the_default_model_name(stand_in):
    with httpx.Client(base_url=stand_in.base + "/v1", timeout=30) as http:
        models = http.get("/models").json()["data"]
        assert [m["id"] for m in models] == ["stand-in"] and models[0]["kv_cache_dtype"] == "auto"
        streams = open_streams(http, 4)
        r = http.post("/completions", json={"model": "stand-in", "prompt": [1], "max_tokens": 2})
        assert r.status_code == 429 and "--max-queue 4" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "rate_limit_error"
        streams[0][0].__exit__(None, None, None)
        stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 3)
        r = http.post("/completions", json={"prompt": [1], "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 7]
        for cm, _ in streams[1:]:
            cm.__exit__(None, None, None)
    assert stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 0) == 0
    assert stand_in.all_blocks_free()


def test_ten_thousand_requests_at_once_each_get_an_answer_and_the_server_serves_on(stand_in):
    """A client opening 10,000 requests at once (its own connection each) against --max-queue 4: every one is
    answered, 200 with its tokens or 429 naming the limit (no 5xx, no dropped connection); then the server serves
    the next request, nothing is in flight and every KV block is back."""
    n = 10_000

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=stand_in.base + "/v1", limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client.post("/completions", json={
                "prompt": [1, 2, i % 50 + 3], "max_tokens": 2, "return_token_ids": True}) for i in range(n)))

    got = asyncio.run(burst())
    statuses = {r.status_code for r in got}
    assert statuses <= {200, 429}, statuses
    ok = [r for r in got if r.status_code == 200]
    assert ok and all(r.json()["choices"][0]["token_ids"] == [7, 7] for r in ok)
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in got if r.status_code == 429)
    with httpx.Client(base_url=stand_in.base + "/v1", timeout=30) as http:
        r = http.post("/completions", json={"prompt": [1], "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 7]
    assert stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 0) == 0
    assert stand_in.all_blocks_free()


def test_an_engine_failure_is_503_then_the_engine_restarts(stand_in):
    """The engine loop dies (a device error): the calls in flight get 503 (retry shortly, as gRPC's UNAVAILABLE),
    /health is 503 while the server makes a fresh engine, then 200, and requests are served again."""
    with httpx.Client(base_url=stand_in.base + "/v1", timeout=30) as http, ThreadPoolExecutor(1) as pool:
        streams = open_streams(http, 2)
        unary = pool.submit(httpx.post, stand_in.base + "/v1/completions", timeout=30,
                            json={"prompt": [5], "max_tokens": 3000, "ignore_eos": True})
        stand_in.wait_metric("jaxpage:num_requests_in_flight", lambda v: v == 3)
        stand_in.fail_flag.touch()
        error = unary.result().json()["error"]
        assert unary.result().status_code == 503 and error["code"] == "engine_restarting"
        assert "injected device error" in error["message"] and "retry shortly" in error["message"]
        for cm, lines in streams:
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "service_unavailable" and "injected device error" in error["message"]
            cm.__exit__(None, None, None)
        assert wait_health(http, stand_in.base, 503) == 503
        assert wait_health(http, stand_in.base, 200, timeout=60) == 200
        r = http.post("/completions", json={"prompt": [1], "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 7]
    assert stand_in.all_blocks_free()
    stand_in.proc.send_signal(signal.SIGTERM)
    assert stand_in.proc.wait(30) == 0


def wait_health(http: httpx.Client, base: str, status: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (got := http.get(base + "/health").status_code) != status and time.monotonic() < deadline:
        time.sleep(0.05)
    return got
