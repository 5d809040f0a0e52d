"""Issue 17's protections on the OpenAI-compatible HTTP API, against a stand-in-engine server (no model) with the
`openai` package and httpx over TLS, certificates made by the `certs` fixture (conftest.py):

- mutual TLS: a client with a certificate and the API key is served; without the key (or with a wrong one) it
  gets 401 with OpenAI's error object, counted in request_errors_total; /health answers without the key, every
  other path (/metrics and /v1/models included) needs it; Anthropic's x-api-key header carries it as well (the
  `anthropic` SDK's 401 is its AuthenticationError, in Anthropic's error object); a client without a certificate, or speaking plain
  HTTP, is refused; server-side TLS alone serves any client trusting the CA, the key from $JAXPAGE_API_KEY;
- --max-prompt-bytes refuses prompts and chat messages with a 400 naming the field; a body over
  --max-message-bytes is 413 (declared or chunked); n or best_of over the per-request cap is a 400 naming it;
  after every refusal the server keeps serving with every KV block back.
"""
from __future__ import annotations

import ssl

import anthropic
import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import KEY, start_tls_only, start_tls_server

MAX_PROMPT_BYTES, MAX_MESSAGE_BYTES = 1000, 20_000
SEQS_CAP = 4  # --max-seqs-per-request (the stand-in engine holds 8 sequences)
AUTH = {"Authorization": f"Bearer {KEY}"}


def tls_context(certs, client_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    if client_certificate:
        context.load_cert_chain(certs["client.pem"], certs["client.key"])
    return context


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics on the HTTP port, by sample name and labels."""
    r = http.get("/metrics", headers=AUTH)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def errors(http: httpx.Client, code: str) -> float:
    return sum(v for (name, labels), v in metrics(http).items()
               if name == "jaxpage:request_errors_total" and ("code", code) in labels)


def assert_still_serving(http: httpx.Client) -> None:
    """A request succeeds, nothing is in flight and every KV block is free."""
    r = http.post("/v1/completions", headers=AUTH, json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True,
                                                         "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 7, 7]
    value: dict[str, float] = {}
    for (name, _), v in metrics(http).items():
        value[name] = value.get(name, 0.0) + v
    assert value["jaxpage:num_requests_in_flight"] == 0
    assert value["jaxpage:kv_blocks_free"] == value["jaxpage:kv_blocks_total"] > 0


@pytest.fixture(scope="module")
def server(tmp_path_factory, certs):
    creds = grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes(), certs["client.key"].read_bytes(),
                                         certs["client.pem"].read_bytes())
    server = start_tls_server(tmp_path_factory.mktemp("http_mtls"), creds, "--tls-cert", str(certs["server.pem"]),
                              "--tls-key", str(certs["server.key"]), "--tls-client-ca", str(certs["ca.pem"]),
                              "--api-key", KEY, "--max-prompt-bytes", str(MAX_PROMPT_BYTES),
                              "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-seqs-per-request", str(SEQS_CAP))
    yield server
    server.stop()


@pytest.fixture
def http(server, certs):
    with httpx.Client(base_url=server.http_base, verify=tls_context(certs), timeout=30) as client:
        yield client


def openai_client(server, certs, api_key: str, **tls) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_base + "/v1", api_key=api_key, max_retries=0,
                         http_client=httpx.Client(verify=tls_context(certs, **tls), timeout=30))


# --- TLS and the API key ---------------------------------------------------------------------------------
def test_the_openai_client_with_certificate_and_key_is_served(server, certs):
    client = openai_client(server, certs, KEY)
    r = client.completions.create(model="stand-in", prompt=[1, 2], max_tokens=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [7, 7, 7]
    assert [m.id for m in client.models.list()] == ["stand-in"]


def test_a_wrong_or_missing_key_is_401_and_counted(server, certs, http):
    before = errors(http, "UNAUTHENTICATED")
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(server, certs, "wrong").completions.create(model="stand-in", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert e.value.body["type"] == "invalid_request_error" and "Bearer" in e.value.body["message"]
    missing = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert errors(http, "UNAUTHENTICATED") == before + 2


def test_anthropics_client_and_the_x_api_key_header(server, certs, http):
    """Anthropic's SDK with a wrong key gets its AuthenticationError, in Anthropic's error object; the key in
    Anthropic's x-api-key header is taken as the bearer token is (the stand-in has no chat template: the message
    gets past the key to a 400 naming messages)."""
    before = errors(http, "UNAUTHENTICATED")
    wrong = anthropic.Anthropic(base_url=server.http_base, api_key="wrong", max_retries=0,
                                http_client=anthropic.DefaultHttpxClient(verify=tls_context(certs), timeout=30))
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="stand-in", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": (
        "missing or wrong API key (header 'Authorization: Bearer <key>' or 'x-api-key: <key>')")}}
    body = {"model": "stand-in", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": "messages: this model has no chat template"}
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert errors(http, "UNAUTHENTICATED") == before + 2


def test_only_health_is_open(http):
    assert http.get("/health").status_code == 200
    for path in ("/metrics", "/v1/models", "/version"):
        r = http.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert http.get(path, headers={"Authorization": KEY}).status_code == 401, path  # no "Bearer "
        assert http.get(path, headers=AUTH).status_code == 200, path


def test_no_certificate_or_plain_http_is_refused(server, certs):
    with pytest.raises(httpx.TransportError):
        httpx.get(server.http_base + "/health", verify=tls_context(certs, client_certificate=False), timeout=10)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.http_base.replace("https:", "http:") + "/health", timeout=10)


def test_tls_without_client_certificates_and_the_key_from_the_environment(tmp_path, certs):
    server = start_tls_only(tmp_path, certs)
    try:
        r = openai_client(server, certs, KEY, client_certificate=False).completions.create(
            model="stand-in", prompt=[3], max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, certs, "wrong", client_certificate=False).models.list()
    finally:
        server.stop()


# --- limits ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x" * (MAX_PROMPT_BYTES + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["é" * (MAX_PROMPT_BYTES // 2 + 1)]}, "prompt"),  # UTF-8 bytes, not chars
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_BYTES // 2)}] * 2},
     "messages"),
    ("/v1/responses", {"instructions": "x" * (MAX_PROMPT_BYTES // 2), "input": "x" * (MAX_PROMPT_BYTES // 2)}, "input"),
], ids=["text", "utf-8-in-a-list", "chat-messages-summed", "responses-instructions-and-input-summed"])
def test_a_prompt_over_max_prompt_bytes_is_400_naming_the_field(http, path, body, param):
    r = http.post(path, headers=AUTH, json={**body, "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and "--max-prompt-bytes" in error["message"]
    assert error["message"].startswith(f"{param} is ")
    assert_still_serving(http)


def test_a_body_over_max_message_bytes_is_413(http):
    big = {"prompt": [1] * (MAX_MESSAGE_BYTES // 2), "max_tokens": 2}  # token ids: not a text prompt
    before = errors(http, "RESOURCE_EXHAUSTED")
    declared = http.post("/v1/completions", headers=AUTH, json=big)
    chunked = http.post("/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                        content=iter([b"{", b" " * MAX_MESSAGE_BYTES, b"}"]))
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert f"over {MAX_MESSAGE_BYTES} bytes (--max-message-bytes)" in r.json()["error"]["message"]
    assert "content-length" not in chunked.request.headers
    assert errors(http, "RESOURCE_EXHAUSTED") == before + 2
    assert_still_serving(http)


@pytest.mark.parametrize("fields, param", [({"n": SEQS_CAP + 1}, "n"), ({"n": 1, "best_of": SEQS_CAP + 2}, "best_of")],
                         ids=["n", "best_of"])
def test_n_or_best_of_over_the_per_request_cap_is_400_naming_it(http, fields, param):
    r = http.post("/v1/completions", headers=AUTH, json={"prompt": [1, 2], "max_tokens": 2, **fields})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and f"max_seqs_per_request={SEQS_CAP}" in error["message"]
    ok = http.post("/v1/completions", headers=AUTH, json={"prompt": [1, 2], "max_tokens": 2, "n": SEQS_CAP})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == SEQS_CAP
    assert_still_serving(http)
