"""The HTTP face every service shares, and how each one starts."""

import asyncio
import gc
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gpusched_common.web import Server, add_ops_routes, run_service
from gpusched_router.settings import RouterSettings

CONFIG = Path(__file__).resolve().parents[2] / "config"


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


@pytest.mark.parametrize("service", ["router", "scheduler", "gpu-agent", "accounting"])
def test_a_service_with_a_wrong_config_file_stops_with_one_line_naming_it(
        tmp_path, service) -> None:
    """It printed pydantic's traceback, which never named models.yaml; now every service
    (the four `python -m` entry points share `run_service`) says what is wrong in one line
    and exits with status 1."""
    for name in ("tenants.yaml", "prices.yaml"):
        shutil.copy(CONFIG / name, tmp_path)
    models = yaml.safe_load((CONFIG / "models.yaml").read_text())
    models["models"].append(models["models"][0])
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    module = "gpusched_" + service.replace("gpu-", "")
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                          env={**os.environ, "GPUSCHED_CONFIG_DIR": str(tmp_path),
                               "GPUSCHED_SIMULATE": "1xH100-80GB"},
                          timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr == (f"{service}: {tmp_path / 'models.yaml'} is invalid: value: Value "
                           f"error, model(s) listed twice: {models['models'][0]['name']}\n")


def test_a_wrong_setting_stops_a_service_with_one_line_naming_it(monkeypatch) -> None:
    monkeypatch.setenv("GPUSCHED_HTTP_PORT", "eighty")
    with pytest.raises(SystemExit) as stopped:
        run_service("router", RouterSettings, lambda settings: FastAPI())
    assert stopped.value.code == ("router: a GPUSCHED_* setting in the environment is "
                                  "invalid: http_port: Input should be a valid integer, "
                                  "unable to parse string as an integer")


async def test_a_consumer_service_stops_what_reads_its_consumers_before_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lag measure was stopped with Redis, after the broker: a measure under way as the
    consumers stopped met a closing client and logged a traceback at every shutdown."""
    from gpusched_common import web
    from gpusched_common.settings import KafkaSettings

    said: list[str] = []

    async def no_topics(*args: object, **kwargs: object) -> None:
        return None

    class Broker:
        async def start(self) -> None:
            said.append("broker started")

        async def stop(self) -> None:
            said.append("broker stopped")

    class Provider:
        def shutdown(self) -> None:
            said.append("spans flushed")

    def hook(what: str):  # noqa: ANN202
        async def run() -> None:
            said.append(what)
        return run

    monkeypatch.setattr(web, "ensure_topics", no_topics)
    lifespan, ready = web.broker_lifespan(KafkaSettings(), Broker(), Provider(),
                                          [hook("redis closed")], starting=[hook("measuring")],
                                          stopping=[hook("measure stopped")])
    async with lifespan(FastAPI()):
        assert ready()
    assert not ready()
    assert said == ["broker started", "measuring", "measure stopped", "broker stopped",
                    "redis closed", "spans flushed"]
