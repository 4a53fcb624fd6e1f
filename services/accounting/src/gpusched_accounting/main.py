"""Accounting service: the usage consumer (exactly-once apply, budgets) plus the usage query
API; `create_app(settings)` wires broker, Redis, config tables and routes."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gpusched_accounting import handlers
from gpusched_accounting.adapters.store import Retention, UsageStore
from gpusched_accounting.api import build_router
from gpusched_accounting.domain.budgets import load_budgets
from gpusched_accounting.domain.usage import load_prices
from gpusched_accounting.handlers import SERVICE
from gpusched_accounting.settings import AccountingSettings
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_tenants
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.redis_client import make_redis, warn_unless_durable
from gpusched_common.tasks import cancelled
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes, broker_lifespan, unavailable_without_redis


def create_app(settings: AccountingSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    tenants = load_tenants(settings.config_dir)
    prices = load_prices(settings.config_dir)
    budgets = load_budgets(settings.config_dir, {t.name for t in tenants.tenants})
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = make_redis(settings.redis)
    store = UsageStore(redis, settings.dedup_ttl_s, Retention(
        settings.minute_retention_s, settings.hour_retention_s, settings.day_retention_s))
    lag = ConsumerLag(SERVICE, registry)
    recheck_budgets = handlers.register(
        broker, store, prices, budgets, clock, settings.consumer_group,
        settings.fetch_max_records, settings.apply_chunk_records, provider.get_tracer(SERVICE),
        registry, lag)
    background: list[asyncio.Task[None]] = []
    """The budget recheck and the consumer's lag measure."""

    async def start_background() -> None:
        background.append(asyncio.create_task(handlers.recheck_forever(
            recheck_budgets, settings.budget_recheck_s), name="budget-recheck"))
        background.append(asyncio.create_task(lag.run(), name="consumer-lag"))

    async def stop_background() -> None:
        await cancelled(*background)

    lifespan, ready = broker_lifespan(settings.kafka, broker, provider, [redis.aclose],
                                      starting=[lambda: warn_unless_durable(redis),
                                                start_background],
                                      stopping=[stop_background])
    app = FastAPI(title="gpusched accounting", version="0.2.0", lifespan=lifespan,
                  description="Usage totals per tenant, model, node, GPU type and priority "
                  "class in minute, hour and day buckets; cost; per-request usage; CSV.")
    add_ops_routes(app, registry, ready)
    unavailable_without_redis(app, lambda request, reason: {"detail": reason})
    app.include_router(build_router(store, tenants, clock))
    app.state.store = store
    return app
