"""GPU agent service: discovers GPUs, wires the runtime to Kafka, Redis and telemetry."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge
from redis.asyncio import Redis

from gpusched_agent import handlers
from gpusched_agent.adapters import nvml
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.inventory import GpuInfo, parse_simulated
from gpusched_agent.domain.node import NodeModel
from gpusched_agent.runtime import AgentRuntime
from gpusched_agent.settings import AgentSettings
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models
from gpusched_common.contracts import Message
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes

SERVICE = "gpu-agent"


def discover_inventory(settings: AgentSettings) -> list[GpuInfo]:
    """The simulated inventory when one is configured, else NVML's GPUs; a clear error when
    neither gives any."""
    if settings.simulate:
        return parse_simulated(settings.simulate, settings.node_id)
    found = nvml.discover()
    if not found:
        raise ValueError("no GPU found through NVML; set GPUSCHED_SIMULATE (e.g. 8xH100-80GB) "
                         "to run with a simulated inventory")
    return found


def create_app(settings: AgentSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    inventory = discover_inventory(settings)
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = Redis.from_url(settings.redis.url)

    async def publish(message: Message, topic: str, key: str, wait: bool = True) -> None:
        await broker.publish(message.to_bytes(), topic, key=key.encode(),
                             headers={"content-type": "application/json"}, no_confirm=not wait)

    runtime = AgentRuntime(
        settings.node_id, NodeModel.from_inventory(inventory), load_models(settings.config_dir),
        SimulatedExecutor(settings.time_scale, settings.seed), publish, redis, clock,
        chunk_tokens=settings.chunk_tokens, heartbeat_s=settings.heartbeat_s,
        time_scale=settings.time_scale)
    handlers.register(broker, runtime)
    Gauge("gpusched_agent_requests_in_flight", "Placements running.", registry=registry
          ).set_function(lambda: runtime.in_flight)
    started = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal started
        await topics.ensure_topics(settings.kafka.bootstrap)
        await broker.start()
        reporter = asyncio.create_task(runtime.report_forever(), name="node-state")
        started = True
        try:
            yield
        finally:
            started = False
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
            await runtime.drain(timeout_s=20)
            await broker.stop()
            await redis.aclose()
            provider.shutdown()

    app = FastAPI(title="gpusched gpu-agent", version="0.1.0", lifespan=lifespan)
    add_ops_routes(app, registry, lambda: started)

    @app.get("/v1/node")
    async def node() -> dict:
        return runtime.node.state(settings.node_id, 0, 0, clock(), runtime.status).model_dump()

    app.state.runtime = runtime
    return app
