"""Who may call the server: TLS (optionally mutual), a bearer token, and the metrics endpoint behind both.

The token is checked by a gRPC server interceptor on every method but the standard health check (load
balancers and Kubernetes probes call it without credentials; it tells nothing about the model), and by the
HTTP API's guard (serving/http_guard.py) on every path but ``/health``. The metrics endpoint serves
``/metrics`` only (404 elsewhere) and asks for the same token when one is set. The same certificate, key and
client CA serve gRPC, the HTTP API and the metrics endpoint.
"""
from __future__ import annotations

import hmac
import os
import ssl
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import make_wsgi_app

API_KEY_ENV = "JAXPAGE_API_KEY"
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def api_key(flag: str | None) -> str | None:
    """The bearer token: --api-key, else $JAXPAGE_API_KEY, else none (no check)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    return key or None


def authorized(header: str | None, key: str) -> bool:
    """True when an Authorization header (or metadata) value is exactly ``Bearer <key>``."""
    return is_key(header, f"Bearer {key}")


def is_key(value: str | None, key: str) -> bool:
    """True when a header's value is exactly key (compared in constant time)."""
    return value is not None and hmac.compare_digest(value.encode(), key.encode())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call's ``authorization`` metadata is ``Bearer <key>``."""

    def __init__(self, key: str, on_reject: Callable[[grpc.StatusCode], None] = lambda code: None):
        self.key = key
        self.on_reject = on_reject

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token "
                                "(metadata 'authorization: Bearer <key>')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        if authorized(header, self.key):
            return await continuation(details)
        self.on_reject(grpc.StatusCode.UNAUTHENTICATED)
        return self._deny


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with the server's certificate chain; with a client CA, clients must present a certificate it signed."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(),
                                       require_client_auth=True)


def uvicorn_tls(cert: str | None, key: str | None, client_ca: str | None) -> dict:
    """uvicorn.Config's TLS options for the same certificate (and client CA) as gRPC's; none without one."""
    if cert is None:
        return {}
    options = {"ssl_certfile": cert, "ssl_keyfile": key}
    if client_ca is not None:
        options.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


# --- the metrics endpoint ------------------------------------------------------------------------------
class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def metrics_app(registry, key: str | None):
    """``/metrics`` (with the bearer token when one is set); 404 for any other path."""
    exposition = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        if key is not None and not authorized(environ.get("HTTP_AUTHORIZATION"), key):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong bearer token\n"]
        return exposition(environ, start_response)
    return app


def serve_metrics(registry, host: str, port: int, key: str | None = None, cert: str | None = None,
                  cert_key: str | None = None, client_ca: str | None = None):
    """Starts the metrics endpoint (HTTPS when a certificate is given) in a daemon thread; returns the server."""
    httpd = make_server(host, port, metrics_app(registry, key), _Server, handler_class=_QuietHandler)
    if cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, cert_key)
        if client_ca is not None:
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, name="jaxpage-metrics", daemon=True).start()
    return httpd
