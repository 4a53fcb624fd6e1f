"""`gpusched bench accounting`: usage events/s applied by one accounting instance through real
Kafka and Redis (totals checked exactly at the end), next to a baseline of one Lua call per
event; then Redis memory and p99 query latency over a day of minute buckets for 100 tenants
and 5 models. Starts its own Kafka and Redis (own ports and run folder) unless given some."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
from aiokafka import AIOKafkaProducer
from redis.asyncio import Redis

from gpusched_accounting.adapters.store import Retention, UsageStore
from gpusched_accounting.domain.usage import (
    PriceTable,
    Totals,
    UsageRow,
    cover,
    load_prices,
    recompute,
    row_for,
)
from gpusched_accounting.settings import DEDUP_TTL_S
from gpusched_common import topics
from gpusched_common.bench_options import Count, option, port_base
from gpusched_common.contracts import UsageRecord
from gpusched_common.settings import REPO_CONFIG_DIR

DAY_MS = 86_400_000
RETENTION = Retention(2 * 86_400, 35 * 86_400, 400 * 86_400)
GPU_TYPES = ("H100-80GB", "A100-40GB")
CLASSES = ("interactive", "standard", "batch")
MODELS = ("llama-3.1-8b", "qwen2.5-1.5b", "mistral-7b", "llama-3.1-70b", "model-e")


PORTS_FROM_BASE = 10
"""The bench's own Kafka, Redis and Jaeger take --port-base to +5, its instance +10."""


SPREAD_MS = 120_000
"""Records arrive seconds after their request ends, so a live batch spans the last minutes."""


def usage_events(n: int, tenants: list[str], now_ms: int, seed: int,
                 spread_ms: int = SPREAD_MS) -> list[UsageRecord]:
    """n final usage records (one per request) that ended over the last `spread_ms`, each of
    a random tenant, model, class, node and GPU type."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        rid = f"req-bench-{seed}-{i}"
        ended = now_ms - rnd.randrange(0, spread_ms)
        out.append(UsageRecord(
            event_id=f"{rid}#0:final", request_id=rid, placement_id=f"{rid}#0",
            tenant=rnd.choice(tenants), model=rnd.choice(MODELS),
            priority_class=rnd.choice(CLASSES), node_id=f"node-{rnd.randrange(8)}",
            gpu_type=rnd.choice(GPU_TYPES), prompt_tokens=rnd.randrange(1, 2000),
            completion_tokens=rnd.randrange(0, 500), gpu_seconds=rnd.randrange(1, 10**7) / 1e6,
            final=True, started_at_ms=ended - 1000, ended_at_ms=ended, prompt_from=0,
            completion_from=0))
    return out


async def produce(bootstrap: str, events: list[UsageRecord]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, acks="all",
                                max_batch_size=512 * 1024)
    await producer.start()
    try:
        for e in events:
            await producer.send(topics.USAGE.name, e.to_bytes(), key=e.tenant.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def applied_count(client: httpx.AsyncClient) -> int:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith('gpusched_accounting_usage_records_total{outcome="applied"}'):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def through_kafka(args: argparse.Namespace, stack, bootstrap: str, redis_url: str,
                        prices: PriceTable) -> dict:
    """Events/s of one instance (subprocess) draining pre-produced records; exact check."""
    from gpusched_ops.stack import ServiceSpec

    run = uuid.uuid4().hex[:6]
    tenants = [f"b{run}-{i}" for i in range(args.tenants)]
    now = int(time.time() * 1000)
    events = usage_events(args.events, tenants, now, seed=1)
    started = time.perf_counter()
    await produce(bootstrap, events)
    produce_s = time.perf_counter() - started
    port = args.http_port
    spec = ServiceSpec(name="accounting-bench", module="gpusched_accounting", env={
        "GPUSCHED_KAFKA_BOOTSTRAP": bootstrap, "GPUSCHED_REDIS_URL": redis_url,
        "GPUSCHED_OTLP_ENDPOINT": "", "GPUSCHED_HTTP_PORT": str(port),
        "GPUSCHED_CONSUMER_GROUP": f"bench-{run}", "GPUSCHED_LOG_LEVEL": "WARNING",
        "GPUSCHED_APPLY_CHUNK_RECORDS": str(args.batch)},
        health_url=f"http://127.0.0.1:{port}/healthz")
    stack.start_service(spec)
    instance = psutil.Process(next(s.pid for s in stack.status() if s.name == "accounting-bench"))
    redis = Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            t0 = first = None
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                n = await applied_count(client)
                if n and t0 is None:
                    t0, first = time.perf_counter(), n
                    cpu0 = _cpu_s(instance), await _redis_cpu_s(redis)
                if n >= len(events):
                    t1 = time.perf_counter()
                    cpu1 = _cpu_s(instance), await _redis_cpu_s(redis)
                    break
                await asyncio.sleep(0.1)  # polling /metrics costs the instance CPU
            else:
                raise RuntimeError("the accounting instance did not apply every event in 600 s")
    finally:
        stack.stop_service("accounting-bench")
    counted = len(events) - first
    if counted <= 0:
        raise RuntimeError(f"the instance applied all {len(events):,} events before the first "
                           "look at its metrics: too few to time; send more (--events)")
    rate = counted / (t1 - t0) if t1 > t0 else float("inf")
    store = UsageStore(redis, DEDUP_TTL_S, RETENTION)
    try:
        _, live = await store.window(None, cover(now - 2 * 3_600_000, now).buckets, "u:")
    finally:
        await redis.aclose()
    want: dict[str, Totals] = {}
    rows = (row_for(e, prices) for e in events)
    for (tenant, _), t in recompute(rows, dedup_ttl_s=DEDUP_TTL_S).items():
        want[tenant] = want.get(tenant, Totals()) + t
    exact = all(live.get(t) == want[t] for t in want)
    return {"events": len(events), "events_per_s": round(rate), "exact": exact,
            "produce_s": round(produce_s, 2), "batch_records": args.batch,
            "instance_cpu_us_per_event": round((cpu1[0] - cpu0[0]) / counted * 1e6, 1),
            "redis_cpu_us_per_event": round((cpu1[1] - cpu0[1]) / counted * 1e6, 1)}


def _cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _redis_cpu_s(redis: Redis) -> float:
    info = await redis.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def in_database(redis_url: str, db: int) -> str:
    """`redis_url` naming database `db`, whatever database it named (or none), its host,
    credentials and options kept."""
    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}"))


async def in_process(redis_url: str, rows: list[UsageRow], batch: int) -> float:
    redis = Redis.from_url(redis_url)
    await redis.flushdb()
    store = UsageStore(redis, DEDUP_TTL_S, RETENTION)
    now = int(time.time() * 1000)
    started = time.perf_counter()
    try:
        for i in range(0, len(rows), batch):
            await store.apply(rows[i:i + batch], now)
    finally:
        await redis.flushdb()
        await redis.aclose()
    return len(rows) / (time.perf_counter() - started)


async def day_of_buckets(redis_url: str, prices: PriceTable, tenants: int, queries: int
                         ) -> dict:
    """Fill a day of minute buckets (every tenant uses every model every minute: one 5-minute
    request per tenant, model and 5 minutes, billed by a record each minute), then time
    queries of a tenant's last 24 h grouped by model, as GET /v1/usage runs them."""
    redis = Redis.from_url(redis_url)
    await redis.flushdb()
    base = (await redis.info("memory"))["used_memory"]
    store = UsageStore(redis, DEDUP_TTL_S, RETENTION)
    now = int(time.time() * 1000) // 60_000 * 60_000
    start = now - DAY_MS
    rows, applied = [], 0
    started = time.perf_counter()
    for minute in range(1440):
        at = start + minute * 60_000 + 30_000
        for t in range(tenants):
            for m, model in enumerate(MODELS):
                rid = f"req-{t}-{m}-{minute // 5}"
                final = minute % 5 == 4
                rows.append(row_for(UsageRecord(
                    event_id=f"{rid}#0:{'final' if final else minute % 5}", request_id=rid,
                    placement_id=f"{rid}#0", tenant=f"tenant-{t:03d}", model=model,
                    priority_class=CLASSES[t % 3], node_id=f"node-{(t + m) % 8}",
                    gpu_type=GPU_TYPES[m % 2], prompt_tokens=100 if final else 0,
                    completion_tokens=50, gpu_seconds=1.5, final=final,
                    started_at_ms=at - 1000, ended_at_ms=at, prompt_from=0,
                    completion_from=minute % 5 * 50), prices))
        if len(rows) >= 5000 or minute == 1439:
            applied += sum(await store.apply(rows, now + 60_000))
            rows = []
    fill_s = time.perf_counter() - started
    used = (await redis.info("memory"))["used_memory"] - base
    await redis.config_resetstat()
    lat = []
    rnd = random.Random(3)
    for _ in range(queries):
        t0 = time.perf_counter()
        plan = cover(now - DAY_MS + rnd.randrange(1, 60_000), now)
        await store.window(f"tenant-{rnd.randrange(tenants):03d}", plan.buckets, "m:")
        lat.append((time.perf_counter() - t0) * 1000)
    lat.sort()
    stats = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    await redis.aclose()
    return {"events": applied, "fill_events_per_s": round(applied / fill_s),
            "redis_mib": round(used / 2**20, 1),
            "query_p50_ms": round(lat[len(lat) // 2], 2),
            "query_p99_ms": round(lat[int(len(lat) * 0.99) - 1], 2),
            "query_redis_ms_per_call": round(stats.get("usec_per_call", 0) / 1000, 2)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpusched bench accounting", description=__doc__)
    parser.add_argument("--events", type=option(Count), default=200_000,
                        help="Events through Kafka.")
    parser.add_argument("--tenants", type=option(Count), default=100)
    parser.add_argument("--batch", type=option(Count), default=5000,
                        help="Records per Lua call (the service's default chunk).")
    parser.add_argument("--baseline-events", type=option(Count), default=5000)
    parser.add_argument("--queries", type=option(Count), default=1000)
    parser.add_argument("--quick", action="store_true", help="20k events, 10 tenants.")
    parser.add_argument("--kafka", default=None, help="Use this running Kafka (and --redis).")
    parser.add_argument("--redis", default=None, help="Redis URL of a running stack; the "
                        "bench uses its databases 14 and 15 and flushes them.")
    parser.add_argument("--port-base", type=option(port_base(PORTS_FROM_BASE)), default=31000,
                        help="Ports of the bench's own Kafka/Redis/instance start here (below "
                        "Linux's ephemeral range, which client sockets draw from).")
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    args = parser.parse_args(argv)
    if args.quick:
        args.events, args.tenants, args.queries = 20_000, 10, 200
    from gpusched_ops.stack import LocalStack, StackPorts, default_cache_dir

    b = args.port_base
    args.http_port = b + PORTS_FROM_BASE
    run_dir = default_cache_dir() / "bench-accounting"
    own = args.kafka is None
    if own:
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh topic and Redis every run
    stack = LocalStack(run_dir, StackPorts(kafka=b, kafka_controller=b + 1, redis=b + 2,
                                           jaeger_otlp_grpc=b + 3, jaeger_otlp_http=b + 4,
                                           jaeger_query=b + 5))
    prices = load_prices(REPO_CONFIG_DIR)
    try:
        if own:
            print("starting Kafka and Redis for the benchmark ...", flush=True)
            stack.install()
            stack.start_component("kafka")
            stack.start_component("redis")
        bootstrap = args.kafka or stack.endpoints().kafka_bootstrap
        redis_url = args.redis or stack.endpoints().redis_url
        asyncio.run(topics.ensure_topics(bootstrap))
        try:
            kafka = asyncio.run(through_kafka(args, stack, bootstrap, in_database(redis_url, 14),
                                              prices))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        rows = [row_for(e, prices) for e in usage_events(
            args.baseline_events, [f"t{i}" for i in range(args.tenants)],
            int(time.time() * 1000), seed=2)]
        naive = asyncio.run(in_process(in_database(redis_url, 15), rows, 1))
        batched = asyncio.run(in_process(in_database(redis_url, 15), rows, args.batch))
        day = asyncio.run(day_of_buckets(in_database(redis_url, 15), prices, args.tenants,
                                         args.queries))
    finally:
        if own:
            stack.stop()
    result = {"events_per_s": kafka["events_per_s"], "exact": kafka["exact"],
              "query_p99_ms": day["query_p99_ms"], "redis_mib": day["redis_mib"],
              "through_kafka": kafka, "baseline_one_call_per_event_per_s": round(naive),
              "batched_in_process_per_s": round(batched), "day_of_minute_buckets": day,
              "tenants": args.tenants, "models": len(MODELS)}
    print(f"{'':44}{'events/s':>12}")
    print(f"{'baseline: one Lua call per event (no Kafka)':44}{round(naive):>12,}")
    print(f"{'batched Lua apply (no Kafka)':44}{round(batched):>12,}")
    print(f"{'one instance through Kafka + Redis':44}{kafka['events_per_s']:>12,}"
          f"   exact totals: {kafka['exact']}  (target >= 20,000/s)")
    print(f"  CPU per event: instance {kafka['instance_cpu_us_per_event']} us, Redis "
          f"{kafka['redis_cpu_us_per_event']} us (each has its own core on a quiet machine)")
    print(f"day of minute buckets, {args.tenants} tenants x {len(MODELS)} models: "
          f"{day['events']:,} records, Redis {day['redis_mib']} MiB (target < 200), query "
          f"p50 {day['query_p50_ms']} ms, p99 {day['query_p99_ms']} ms (target < 10; "
          f"{day['query_redis_ms_per_call']} ms of it inside Redis on average)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if kafka["exact"] else 1
