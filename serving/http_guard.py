"""Issue 17's protections in front of the HTTP API, checked before the app reads anything of the body: the API
key on every path but the open ones (401; ``Authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>``),
then the body's size (413). A Content-Length over the
limit is refused unread; a body without one (chunked) is read only up to the limit."""
from __future__ import annotations

from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.security import authorized, is_key

Reject = Callable[[int, str, str, str], Response]  # (status, message, code, path): the error response, counted


class HttpGuard:
    def __init__(self, app: ASGIApp, *, reject: Reject, key: str | None = None,
                 max_body_bytes: int | None = None, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.reject, self.key = app, reject, key
        self.max_body_bytes, self.open_paths = max_body_bytes, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        path = scope["path"]
        if self.key is not None and path not in self.open_paths and not (
                authorized(headers.get("authorization"), self.key) or is_key(headers.get("x-api-key"), self.key)):
            response = self.reject(401, "missing or wrong API key (header 'Authorization: Bearer <key>' or "
                                        "'x-api-key: <key>')", "invalid_api_key", path)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        if self.max_body_bytes is not None:
            first = await self._body(headers, receive)
            if first is None:
                response = self.reject(413, f"the request body is over {self.max_body_bytes} bytes "
                                            "(--max-message-bytes)", "request_too_large", path)
                return await response(scope, receive, send)
            receive = _replay(first, receive)
        await self.app(scope, receive, send)

    async def _body(self, headers: Headers, receive: Receive) -> Message | None:
        """The whole body as one message (or the client's disconnect); None once it is over the limit."""
        declared = headers.get("content-length")
        if declared is not None and int(declared) > self.max_body_bytes:
            return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return {"type": "http.request", "body": bytes(body), "more_body": False}


def _replay(first: Message, receive: Receive) -> Receive:
    """receive, with first as its first message (later ones, a disconnect, come from the client)."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()
    return replayed
