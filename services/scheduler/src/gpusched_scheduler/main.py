"""Scheduler service: the engine, its leader lease, Kafka, metrics and telemetry.

Every instance keeps the cluster view warm; only the leader consumes requests (its request
consumers start on taking the lease and stop on losing it) and publishes decisions,
stamped with its fencing token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Query
from prometheus_client import CollectorRegistry, Gauge

from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.contracts import MAX_QUEUE_LIST
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.redis_client import make_redis
from gpusched_common.tasks import cancelled
from gpusched_common.telemetry import make_tracer_provider
from gpusched_common.web import add_ops_routes, get_and_head
from gpusched_scheduler import handlers
from gpusched_scheduler.adapters.decisions import DecisionProducer
from gpusched_scheduler.adapters.redis_state import LeaderLease, RunningStore
from gpusched_scheduler.adapters.requests import RequestConsumer
from gpusched_scheduler.domain.planner import warm_up
from gpusched_scheduler.domain.solver import POLICIES
from gpusched_scheduler.engine import SERVICE, EngineConfig, SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings

log = logging.getLogger(__name__)


def create_app(settings: SchedulerSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    if settings.placement_policy not in POLICIES:
        raise ValueError(f"GPUSCHED_PLACEMENT_POLICY '{settings.placement_policy}' is not one "
                         f"of {', '.join(POLICIES)}")
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = make_redis(settings.redis)
    lease = LeaderLease(redis, settings.instance_id, settings.lease_ttl_ms)
    store = RunningStore(redis)

    decisions = DecisionProducer(settings.kafka.bootstrap, f"gpusched-{SERVICE}",
                                 provider.get_tracer(SERVICE), registry)

    config = EngineConfig(
        policy=settings.placement_policy, cycle_window_ms=settings.cycle_window_ms,
        node_timeout_ms=int(settings.node_timeout_s * 1000),
        untaken_timeout_ms=int(settings.untaken_timeout_s * 1000),
        fleet_known_after_ms=int(settings.node_timeout_s * 1000),
        stopped_grace_ms=int(settings.stopped_node_grace_s * 1000),
        class_target_ms=(("interactive", settings.interactive_target_ms),
                         ("standard", settings.standard_target_ms),
                         ("batch", settings.batch_target_ms)),
        class_max_queue_ms=settings.class_max_queue_ms(),
        aging_factor=settings.aging_factor, fair_half_life_s=settings.fair_half_life_s,
        max_pending_per_class=settings.fetch_max_records)
    engine = SchedulingEngine(load_models(settings.config_dir), load_tenants(settings.config_dir),
                              decisions.send, clock, provider.get_tracer(SERVICE), config, store,
                              registry)
    handlers.register_cluster(broker, engine)
    stepping_down: set[asyncio.Task[None]] = set()

    def consumer_stopped(priority_class: str) -> None:
        """A request consumer stopped on an error: this instance steps down, as when its
        consumers fail to start, and the next renewal of the lease it still holds leads
        again with new consumers. Leading on, it read no more of that class. Shutting down,
        it stays the leader until the lifespan steps down and releases the lease (stepped
        down here, the renewals led again while it stopped, or nothing released the lease)."""
        if stopping:
            return
        task = asyncio.create_task(follow(None), name="step-down")
        stepping_down.add(task)
        task.add_done_callback(stepping_down.discard)

    lag = ConsumerLag(SERVICE, registry)
    requests = RequestConsumer(settings.kafka.bootstrap, f"gpusched-{SERVICE}-requests",
                               settings.fetch_max_records, engine.admit, consumer_stopped, lag)
    leader = Gauge("gpusched_scheduler_leader", "1 while this instance leads.",
                   registry=registry)
    started = stopping = False

    transitions = asyncio.Lock()

    async def follow(epoch: int | None) -> None:
        """Lead with `epoch`, or stop leading when None; one transition at a time."""
        async with transitions:
            if engine.epoch == epoch:
                return
            if engine.epoch is not None:
                log.warning("stepping down as leader (token %s)", engine.epoch)
                await _step_down()
            if epoch is not None:
                log.info("leading with fencing token %d", epoch)
                try:
                    running = await store.load()
                    engine.lead(epoch, running, await store.claims(running),
                                await store.over_quota())
                    leader.set(1)
                    await requests.start()
                except Exception:
                    # all or nothing: a leader whose consumers did not start read no request
                    # and, renewing its lease, kept every standby out for good; standing
                    # down, the next renewal tries again
                    log.exception("taking the lead with token %d failed; trying again at "
                                  "the next renewal", epoch)
                    if engine.epoch is not None:
                        await _step_down()

    async def keep_lease() -> None:
        """Renew (or try to take) the lease three times per TTL; shutting down, only renew
        the lease held, while the cycles sent settle under its token. A free lease taken
        then (a new token) refused their saves, and the instance led again, its consumers
        started, while it stopped. Transitions run beside the renewals (joining the consumer
        groups takes a while) so a leader never lets its own lease lapse while it starts
        consuming."""
        period_s = settings.lease_ttl_ms / 3000
        pending: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    epoch = await (lease.renew() if stopping else lease.acquire_or_renew())
                except Exception:  # Redis unreachable: a leader cannot prove it still leads
                    log.exception("leader lease check failed")
                    epoch = None
                if stopping and epoch is not None and engine.epoch is None:
                    pass  # stepped down while stopping (a consumer failed): never lead again
                elif epoch != engine.epoch and (pending is None or pending.done()):
                    pending = asyncio.create_task(follow(epoch), name="leadership")
                await asyncio.sleep(period_s)
        finally:  # shutting down: no transition may start consumers after this
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending

    async def _step_down() -> None:
        engine.step_down()
        leader.set(0)
        await requests.stop()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal started, stopping
        await topics.ensure_topics(settings.kafka.bootstrap,
                                   replication_factor=settings.kafka.replication_factor)
        warm_up(settings.placement_policy)
        await decisions.start()
        await broker.start()
        tasks = [asyncio.create_task(engine.run(), name="scheduling-cycle"),
                 asyncio.create_task(keep_lease(), name="leader-lease")]
        measuring = asyncio.create_task(lag.run(), name="consumer-lag")
        started = True
        try:
            yield
        finally:
            started, stopping = False, True
            cycling, leasing = tasks
            # the cycle under way ends (cut short as the producer took its records, those went
            # out with no settle) and the cycles sent settle, the lease still renewed: an
            # agent may run a placement Kafka has not answered yet, and unsaved, a next
            # leader placed its request again, maybe elsewhere
            engine.stop()
            await asyncio.wait([cycling], timeout=settings.settle_on_shutdown_s)
            await cancelled(cycling, leasing, measuring)
            async with transitions:
                led = engine.epoch is not None
                await _step_down()  # also stops consumers that a cut-short transition started
            if led:
                await lease.release()  # a standby takes over without waiting for the TTL
            await broker.stop()
            await decisions.stop()
            await redis.aclose()
            provider.shutdown()

    app = FastAPI(title="gpusched scheduler", version="0.1.0", lifespan=lifespan)
    add_ops_routes(app, registry, lambda: started)

    @get_and_head(app, "/v1/cluster")
    async def cluster() -> dict:
        now = clock()
        live = engine.view.live_nodes(now, config.node_timeout_ms)
        return {
            "leader": engine.epoch is not None, "epoch": engine.epoch,
            "instance_id": settings.instance_id,
            "nodes": [s.model_dump() | {"last_seen_ms": engine.view.last_seen_ms.get(n),
                                        "live": n in live}
                      for n, s in sorted(engine.view.nodes.items())],
            "reservations": len(engine.view.reservations),
            "running": len(engine.running),
            "pending": engine.queue.depth(),
        }

    @get_and_head(app, "/v1/placements")
    async def placements() -> dict:
        """Placements in flight (leader's view): where each request runs, and whether it is
        borrowed now (beyond its tenant's guarantee; work being stopped is not judged)."""
        borrowed = engine.borrowed()
        return {"placements": [
            {"placement_id": r.placement_id, "request_id": r.request.request_id,
             "tenant": r.tenant, "priority_class": r.request.priority_class,
             "node_id": r.node_id, "gpu_indices": list(r.gpu_indices),
             "borrowed": r.placement_id in borrowed, "placed_at_ms": r.placed_at_ms}
            for r in engine.running.values()]}

    @get_and_head(app, "/v1/queue")
    async def queue(limit: int = Query(100, ge=1, le=MAX_QUEUE_LIST)) -> dict:
        """Work waiting for a GPU (leader's view), in the order the next cycle considers it:
        requests whose preemption is under way, aged work, then interactive, standard,
        batch, tenants by fair share inside each."""
        now = clock()
        return {"leader": engine.epoch is not None, "pending": engine.queue.depth(),
                "requests": [
                    {"position": i, "request_id": p.request.request_id,
                     "tenant": p.request.tenant, "priority_class": p.request.priority_class,
                     "chunk": chunk, "model": p.request.model, "num_gpus": p.request.num_gpus,
                     "attempt": p.request.attempt, "requeued": p.request.requeued,
                     "waited_ms": max(0, now - p.request.created_at_ms),
                     "max_queue_ms": engine.queue_limit(p.request)[0]}
                    for i, (chunk, p) in enumerate(engine.in_line(now)[:limit], 1)]}

    app.state.engine = engine
    return app

