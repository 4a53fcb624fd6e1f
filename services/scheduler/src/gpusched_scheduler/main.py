"""Scheduler service: wires the engine to Kafka, metrics and telemetry."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.contracts import PRIORITY_CLASSES, Message
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes
from gpusched_scheduler import handlers
from gpusched_scheduler.engine import SERVICE, SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings


def create_app(settings: SchedulerSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    placements = Counter("gpusched_scheduler_decisions_total", "Placements and rejections.",
                         registry=registry)
    cycle_seconds = Histogram("gpusched_scheduler_cycle_seconds", "Time of one cycle.",
                              registry=registry)
    depth = Gauge("gpusched_scheduler_queue_depth", "Pending requests.", ["priority_class"],
                  registry=registry)

    async def publish(message: Message, topic: str, key: str) -> None:
        await broker.publish(message.to_bytes(), topic, key=key.encode(),
                             headers={"content-type": "application/json"})

    def on_cycle(decided: int, seconds: float) -> None:
        placements.inc(decided)
        cycle_seconds.observe(seconds)

    engine = SchedulingEngine(
        load_models(settings.config_dir), load_tenants(settings.config_dir), publish, clock,
        provider.get_tracer(SERVICE), epoch=settings.scheduler_epoch,
        cycle_window_ms=settings.cycle_window_ms,
        node_timeout_ms=int(settings.node_timeout_s * 1000), on_cycle=on_cycle)
    for cls in PRIORITY_CLASSES:
        depth.labels(cls).set_function(lambda c=cls: engine.queue.depth()[c])
    handlers.register(broker, engine, settings)
    started = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal started
        await topics.ensure_topics(settings.kafka.bootstrap)
        await broker.start()
        loop_task = asyncio.create_task(engine.run(), name="scheduling-cycle")
        started = True
        try:
            yield
        finally:
            started = False
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
            await broker.stop()
            provider.shutdown()

    app = FastAPI(title="gpusched scheduler", version="0.1.0", lifespan=lifespan)
    add_ops_routes(app, registry, lambda: started)

    @app.get("/v1/cluster")
    async def cluster() -> dict:
        now = clock()
        return {
            "nodes": [s.model_dump() | {"last_seen_ms": engine.view.last_seen_ms.get(n)}
                      for n, s in sorted(engine.view.nodes.items())],
            "reservations": len(engine.view.reservations),
            "pending": engine.queue.depth(),
            "schedulable_gpus": len(engine.view.schedulable_gpus(
                now, int(settings.node_timeout_s * 1000))),
        }

    app.state.engine = engine
    return app
