"""The HTTP face every service shares."""

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gpusched_common.web import Server, add_ops_routes


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


async def test_every_service_answers_head_of_its_health_and_metrics() -> None:
    """Load balancers and uptime probes send HEAD: /healthz and /metrics answered 405."""
    app = FastAPI()
    add_ops_routes(app, CollectorRegistry(), lambda: True)
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
        for path in ("/healthz", "/metrics"):
            got, head = await client.get(path), await client.head(path)
            assert (got.status_code, head.status_code, head.content) == (200, 200, b"")
            assert head.headers == got.headers
        assert (await client.post("/healthz")).headers["allow"] == "GET"
        assert (await client.get("/openapi.json")).json()["paths"] == {}


async def test_a_task_that_swallows_a_cancel_is_still_stopped() -> None:
    """asyncio.wait_for on Python 3.11 (redis-py writes commands under it) may swallow a
    cancel that comes as its write is done; the loop around it went on, and a shutdown that
    cancelled it once waited for good."""
    import asyncio

    from gpusched_common.tasks import cancelled

    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if swallowed < 2:  # as wait_for does when the write is done
                    swallowed += 1
                    continue
                raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancelled(task), timeout=2)
    assert task.cancelled() and swallowed == 2
