"""An ASGI app served over HTTP by uvicorn inside the test's own event loop: an inference
engine (or any server) a test stands in for, which it can inspect and switch as it runs."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class ServedApp:
    """Serves `app` on 127.0.0.1:`port` (0: a free port) between `async with` and its end."""

    def __init__(self, app, port: int = 0, log_level: str = "warning") -> None:  # noqa: ANN001
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))

    async def __aenter__(self):  # noqa: ANN204 - the subclass
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
