"""TLS, mutual TLS, the bearer token, --no-reflection and the metrics endpoint, with real grpcio clients and
certificates made here (cryptography), against a stand-in-engine server (no model: it starts in seconds).

- over TLS a client that trusts the CA and sends the token is served; a plaintext client, a client without the
  token or with a wrong one (UNAUTHENTICATED, counted in request_errors_total), and, with mutual TLS, a client
  without a certificate are refused; health answers without the token;
- reflection is off with --no-reflection;
- the metrics endpoint answers /metrics only (404 elsewhere), over HTTPS, and only with the token.
"""
from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from serving import generation_pb2 as pb
from serving import generation_pb2_grpc as pb_grpc
from tests.servers import KEY, Server, secure_health, start_tls_only, start_tls_server


def _generate(server: Server, creds, metadata=()) -> list[int]:
    with grpc.secure_channel(server.target, creds) as channel:
        reply = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)),
            timeout=10, metadata=metadata)
        return list(reply.completions[0].token_ids)


def _https(url: str, certs, token: str | None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    context.load_cert_chain(certs["client.pem"], certs["client.key"])
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, certs):
    tmp = tmp_path_factory.mktemp("mtls")
    creds = grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes(), certs["client.key"].read_bytes(),
                                         certs["client.pem"].read_bytes())
    server = start_tls_server(tmp, creds, "--tls-cert", str(certs["server.pem"]), "--tls-key",
                              str(certs["server.key"]), "--tls-client-ca", str(certs["ca.pem"]), "--api-key", KEY,
                              "--no-reflection")
    server.creds = creds
    yield server
    server.stop()


def test_a_client_with_certificate_and_token_is_served(mtls_server):
    assert _generate(mtls_server, mtls_server.creds, [("authorization", f"Bearer {KEY}")]) == [7, 7, 7]


@pytest.mark.parametrize("metadata", [(), [("authorization", "Bearer wrong")], [("authorization", KEY)]],
                         ids=["none", "wrong", "no-bearer-prefix"])
def test_a_call_without_the_right_token_is_unauthenticated(mtls_server, metadata):
    with pytest.raises(grpc.RpcError) as e:
        _generate(mtls_server, mtls_server.creds, metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_answers_without_the_token(mtls_server):
    assert secure_health(mtls_server, mtls_server.creds) == health_pb2.HealthCheckResponse.SERVING


def test_a_client_without_a_certificate_or_without_tls_is_refused(mtls_server, certs):
    no_cert = grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes())
    with pytest.raises(grpc.RpcError) as e:
        _generate(mtls_server, no_cert, [("authorization", f"Bearer {KEY}")])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(mtls_server.target) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=[1]), timeout=5,
                                                 metadata=[("authorization", f"Bearer {KEY}")])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_reflection_is_off(mtls_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.secure_channel(mtls_server.target, mtls_server.creds) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5, metadata=[("authorization", f"Bearer {KEY}")])
        with pytest.raises(grpc.RpcError) as e:
            list(responses)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_metrics_need_the_token_and_serve_only_metrics(mtls_server, certs):
    status, text = _https(mtls_server.metrics_url, certs, KEY)
    assert status == 200 and 'jaxpage:request_errors_total{code="UNAUTHENTICATED"' in text
    assert _https(mtls_server.metrics_url, certs, None)[0] == 401
    assert _https(mtls_server.metrics_url, certs, "wrong")[0] == 401
    base = mtls_server.metrics_url.rsplit("/", 1)[0]
    for path in ("/", "/metricsx", "/debug", "/metrics/../x"):
        assert _https(base + path, certs, KEY)[0] == 404, path


def test_tls_without_client_certificates(tmp_path, certs):
    """Server-side TLS alone: any client trusting the CA is served; the token comes from $JAXPAGE_API_KEY."""
    server = start_tls_only(tmp_path, certs)
    try:
        creds = grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes())
        assert _generate(server, creds, [("authorization", f"Bearer {KEY}")]) == [7, 7, 7]
        with pytest.raises(grpc.RpcError) as e:
            _generate(server, creds)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_the_cli_client_speaks_mutual_tls_with_the_token(mtls_server, certs):
    import subprocess
    import sys

    from jaxpage.testing.launch import ROOT

    argv = [sys.executable, "-m", "serving.cli", "client", "--target", mtls_server.target, "--info",
            "--tls-ca", str(certs["ca.pem"]), "--tls-cert", str(certs["client.pem"]),
            "--tls-key", str(certs["client.key"])]
    ok = subprocess.run([*argv, "--api-key", KEY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and 'model_name: "stand-in"' in ok.stdout, ok.stderr
    refused = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
