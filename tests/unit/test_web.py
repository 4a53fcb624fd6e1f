"""The HTTP face every service shares."""

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from gpusched_common.web import Server


async def test_what_start_up_created_is_frozen_out_of_the_collector() -> None:
    made: dict[str, list[object]] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        made["clients"] = [object()]  # a container: the collector tracks it
        yield

    server = Server(uvicorn.Config(FastAPI(lifespan=lifespan), host="127.0.0.1", port=0,
                                   lifespan="on", log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        assert not any(o is made["clients"] for o in gc.get_objects())
    finally:
        server.should_exit = True
        await serving
        gc.unfreeze()
