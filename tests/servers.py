"""The servers the tests start: a `jaxpage serve` subprocess (of the real model, or of the stand-in engine of
tests/fake_engine.py, which starts in seconds) and its handle, and certificates to serve over TLS."""
from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from jaxpage.testing.launch import free_port, spawn
from serving import generation_pb2 as pb

ENGINE_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "64",
                "--dtype", "float32"]
START_TIMEOUT = 180
# SmolLM2's own template has no tools: served with a copy that has (and renders chats without tools as SmolLM2's)
TEMPLATE = Path(__file__).parent / "data" / "tool_chat_template_hermes.jinja"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Server:
    proc: subprocess.Popen
    target: str
    metrics_url: str
    log: Path

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels summed over)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
        return values

    def wait_metric(self, name: str, want, timeout: float = 5.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics()[name]
            if want(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def assert_freed(self, free: float, before: dict, max_tokens: int, within: float) -> None:
        """A request that ended early: its blocks are back within ``within`` s, and it did not run to the end."""
        ended = time.monotonic()
        assert self.wait_metric("jaxpage:kv_blocks_free", lambda v: v == free) == free
        assert time.monotonic() - ended < within
        after = self.metrics()
        assert after["jaxpage:num_requests_running"] == 0 and after["jaxpage:num_requests_in_flight"] == 0
        assert after["jaxpage:generation_tokens_total"] - before.get("jaxpage:generation_tokens_total", 0) < max_tokens

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(argv: list[str], log: Path) -> Server:
    port, metrics_port = free_port(), free_port()
    proc = spawn([*argv, "--port", str(port), "--metrics-port", str(metrics_port), "--http-port", "0"], log)
    return Server(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)


class HttpServer(Server):
    @property
    def base(self) -> str:
        return self.metrics_url.removesuffix("/metrics")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def all_blocks_free(self) -> bool:
        total = self.metrics()["jaxpage:kv_blocks_total"]
        return self.wait_metric("jaxpage:kv_blocks_free", lambda v: v == total) == total


def start_http(argv: list[str], log) -> HttpServer:
    """A server with the OpenAI HTTP API beside gRPC, on free ports."""
    port, http_port = free_port(), free_port()
    proc = spawn([*argv, "--port", str(port), "--metrics-port", "0", "--http-port", str(http_port)], log)
    return HttpServer(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}/metrics", log)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


# A stand-in engine's server: argv[1] is its fail flag (tests/fake_engine.py), then `serve`'s flags.
STAND_IN_SERVER = r'''
import sys
from jaxpage.engine.async_engine import AsyncEngine
from serving.cli import build_parser
from serving.server import run
from tests.fake_engine import stand_in_engine

fail_flag = sys.argv[1]
ns = build_parser().parse_args(["serve", *sys.argv[2:]])
sys.exit(run(ns, lambda: AsyncEngine(stand_in_engine(step_seconds=0.02, fail_flag=fail_flag,
                                                  max_seqs_per_request=ns.max_seqs_per_request))))
'''


# --- TLS -----------------------------------------------------------------------------------------------------
KEY = "s3cret-token"


def _certificate(subject: str, issuer_key, issuer_name, key, *, ca: bool, san: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256()), name


def make_certificates(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as PEM files."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys = {name: ec.generate_private_key(ec.SECP256R1()) for name in ("ca", "server", "client")}
    ca, ca_name = _certificate("jaxpage test CA", None, None, keys["ca"], ca=True)
    server, _ = _certificate("localhost", keys["ca"], ca_name, keys["server"], ca=False, san=True)
    client, _ = _certificate("client", keys["ca"], ca_name, keys["client"], ca=False)
    paths = {}
    for name, cert in (("ca", ca), ("server", server), ("client", client)):
        paths[f"{name}.pem"] = tmp / f"{name}.pem"
        paths[f"{name}.pem"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}.key"] = tmp / f"{name}.key"
        paths[f"{name}.key"].write_bytes(keys[name].private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


def start_server(tmp: Path, *flags: str) -> Server:
    """The stand-in server with flags; ``http_base`` is its HTTP API's address (https)."""
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    proc = spawn(["-c", STAND_IN_SERVER, str(tmp / "no-fail"), "--port", str(port), "--metrics-port",
                  str(metrics_port), "--http-port", str(http_port), "--grace-seconds", "1", *flags],
                 tmp / "server.log")
    server = Server(proc, f"127.0.0.1:{port}", f"https://127.0.0.1:{metrics_port}/metrics", tmp / "server.log")
    server.http_base = f"https://127.0.0.1:{http_port}"
    return server


def secure_health(server: Server, creds) -> int:
    with grpc.secure_channel(server.target, creds) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def wait_tls(server: Server, creds) -> None:
    """wait_serving, over TLS (launch.wait_serving speaks plaintext)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(server.log.read_text()[-3000:])
        try:
            if secure_health(server, creds) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise TimeoutError(server.log.read_text()[-3000:])


def start_tls_server(tmp: Path, creds, *flags: str, attempts: int = 3) -> Server:
    """start_server, then wait_tls with these client credentials. free_port's port is free when picked, not when
    the server binds it (another test process can take it in between): a server that exits because its address
    is in use is started again on new ports."""
    for attempt in range(attempts):
        server = start_server(tmp, *flags)
        try:
            wait_tls(server, creds)
            return server
        except RuntimeError as e:
            server.stop()
            if "address already in use" not in str(e).lower() or attempt == attempts - 1:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def start_tls_only(tmp: Path, certs) -> Server:
    """Server-side TLS alone (no client certificates), the token from $JAXPAGE_API_KEY; started and SERVING."""
    os.environ["JAXPAGE_API_KEY"] = KEY
    try:
        return start_tls_server(tmp, grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes()), "--tls-cert",
                                str(certs["server.pem"]), "--tls-key", str(certs["server.key"]))
    finally:
        del os.environ["JAXPAGE_API_KEY"]
