"""uvicorn in the gRPC server's event loop: started and drained by `serving.server.Server`, which owns the signals
(uvicorn's ``serve()`` would install its own SIGTERM/SIGINT handlers, so its steps are run here one by one)."""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn


class HttpServer:
    def __init__(self, app, host: str, port: int, grace_seconds: float, tls: dict | None = None):
        """tls: uvicorn's ssl_* options (serving.security.uvicorn_tls); none: plain HTTP."""
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning",
                                timeout_graceful_shutdown=grace_seconds, access_log=False, **(tls or {}))
        self.server = uvicorn.Server(config)
        self._ticks: asyncio.Task | None = None

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def start(self) -> None:
        config = self.server.config
        if not config.loaded:
            config.load()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup()
        if not self.server.started:
            raise OSError(f"cannot listen on {config.host}:{config.port} (HTTP)")
        self._ticks = asyncio.ensure_future(self.server.main_loop())  # the Date header, once a second

    async def stop(self) -> None:
        """Stops accepting connections and lets the responses in flight finish (up to the grace period)."""
        self.server.should_exit = True
        if self._ticks is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticks
        await self.server.shutdown()

    def force_stop(self) -> None:
        """A second signal: stop waiting for the responses in flight."""
        self.server.force_exit = True
