"""Accounting service: usage consumer plus the usage query API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, HTTPException, Query
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gpusched_accounting import handlers
from gpusched_accounting.adapters.store import UsageStore
from gpusched_accounting.handlers import SERVICE
from gpusched_accounting.settings import AccountingSettings
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_tenants
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes


def create_app(settings: AccountingSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    tenants = load_tenants(settings.config_dir)
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = Redis.from_url(settings.redis.url)
    store = UsageStore(redis, settings.dedup_ttl_s)
    handlers.register(broker, store, clock, settings.fetch_max_records,
                      provider.get_tracer(SERVICE))
    started = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal started
        await topics.ensure_topics(settings.kafka.bootstrap)
        await broker.start()
        started = True
        try:
            yield
        finally:
            started = False
            await broker.stop()
            await redis.aclose()
            provider.shutdown()

    app = FastAPI(title="gpusched accounting", version="0.1.0", lifespan=lifespan)
    add_ops_routes(app, registry, lambda: started)

    def caller(authorization: str | None) -> str | None:
        """The tenant a key belongs to; None for an admin key; 401 otherwise."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'")
        if key in tenants.admin_api_keys:
            return None
        tenant = tenants.by_api_key(key)
        if tenant is None:
            raise HTTPException(401, "unknown API key")
        return tenant.name

    @app.get("/v1/usage")
    async def usage(
        tenant: str | None = Query(default=None, description="Tenant; default: the caller's."),
        group_by: str | None = Query(default=None, pattern="^model$",
                                     description="'model' adds a row per model."),
        authorization: str | None = Header(default=None),
    ) -> dict:
        """Token and GPU-second totals. A tenant's key reads only that tenant; an admin key
        reads any tenant, or all of them when `tenant` is omitted."""
        who = caller(authorization)
        if who is not None and tenant not in (None, who):
            raise HTTPException(403, f"this API key belongs to tenant '{who}' and cannot read "
                                f"'{tenant}'")
        wanted = [tenant or who] if (tenant or who) else await store.tenants()
        return {"tenants": [await store.tenant_totals(t, group_by == "model") for t in wanted]}

    app.state.store = store
    return app
