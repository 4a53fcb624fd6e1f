"""`gpusched reconcile`: recompute usage totals per tenant and day from the usage topic (every
record still retained, with the live apply's dedup, forgetting and request rules) and report
every difference from the live counters in Redis. Exit status 0 when they agree, 1 when they
differ, 2 when Kafka or Redis cannot be reached, `--dedup-ttl-s` is shorter than
accounting's own setting takes, or `--tenant` names no tenant (neither configured nor in any
retained record: a misspelt name would pass as agreeing)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from aiokafka.errors import KafkaConnectionError
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gpusched_accounting.adapters.store import bucket_key
from gpusched_accounting.domain.usage import (
    TOTAL_FIELD,
    Totals,
    load_prices,
    recompute,
    row_for,
    unpack,
)
from gpusched_accounting.settings import DEDUP_TTL_S, MIN_DEDUP_TTL_S
from gpusched_common import topics
from gpusched_common.catalog import load_tenants
from gpusched_common.contracts import USAGE
from gpusched_common.kafka_records import retained
from gpusched_common.settings import REPO_CONFIG_DIR


async def read_usage(bootstrap: str, topic: str = topics.USAGE.name) -> list:
    """Every parseable usage record `topic` retains, up to its end when called."""
    out = []
    async for record in retained(bootstrap, topic):
        try:
            out.append(USAGE.validate_json(record.value))
        except ValidationError:
            continue  # the live consumer dead-letters these too
    return out


async def differences(redis: Redis, want: dict[tuple[str, int], Totals]) -> list[dict]:
    """The (tenant, day start) buckets of `want` (recomputed totals) whose live totals
    differ."""
    keys = sorted(want)
    async with redis.pipeline(transaction=False) as pipe:
        for t, day in keys:
            pipe.hget(bucket_key(t, "day", day), TOTAL_FIELD)
        live = [unpack(v) for v in await pipe.execute()]
    out = []
    for (t, day), live_totals in zip(keys, live):
        if live_totals != want[(t, day)]:
            out.append({"tenant": t,
                        "day": datetime.fromtimestamp(day, UTC).strftime("%Y-%m-%d"),
                        "recomputed": want[(t, day)].public(), "live": live_totals.public()})
    return out


class UnknownTenant(LookupError):
    pass


async def run(args: argparse.Namespace) -> dict:
    prices = load_prices(args.config_dir)
    records = await read_usage(args.kafka)
    rows = [row_for(r, prices) for r in records]
    if args.tenant is not None and all(r.tenant != args.tenant for r in rows):
        try:
            configured = load_tenants(args.config_dir).get(args.tenant) is not None
        except ValueError:  # no tenants.yaml there
            configured = False
        if not configured:
            raise UnknownTenant(f"no tenant '{args.tenant}': it is not configured and no "
                                f"usage record of it is retained")
    recomputed = recompute(rows, dedup_ttl_s=args.dedup_ttl_s)
    # every (tenant, day) with a record, those whose every record was dropped included: it
    # was counted as checked and never compared
    want = {k: v for k, v in recomputed.items() if args.tenant in (None, k[0])}
    redis = Redis.from_url(args.redis)
    try:
        diffs = await differences(redis, want)
    finally:
        await redis.aclose()
    total = sum(want.values(), Totals())
    return {"records": len(records), "tenant_days_checked": len(want),
            "differences": diffs, "recomputed_total": total.public()}


def dedup_window_s(text: str) -> int:
    """`--dedup-ttl-s` as accounting's own setting takes it: whole seconds, at least
    MIN_DEDUP_TTL_S. A window of 0 or less forgot every id at once, so each redelivery was
    recomputed as billed again and reported as a difference."""
    try:
        seconds = int(text)
    except ValueError:
        seconds = None
    if seconds is None or seconds < MIN_DEDUP_TTL_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no dedup window accounting takes: give the one it runs with "
            f"(GPUSCHED_DEDUP_TTL_S), whole seconds, at least {MIN_DEDUP_TTL_S}")
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpusched reconcile", description=__doc__)
    parser.add_argument("--kafka", default=os.environ.get("GPUSCHED_KAFKA_BOOTSTRAP",
                                                          "127.0.0.1:9092"),
                        help="Kafka bootstrap (default: $GPUSCHED_KAFKA_BOOTSTRAP, else the "
                        "local stack's).")
    parser.add_argument("--redis", default=os.environ.get("GPUSCHED_REDIS_URL",
                                                          "redis://127.0.0.1:6379/0"),
                        help="Redis URL (default: $GPUSCHED_REDIS_URL, else the local "
                        "stack's).")
    parser.add_argument("--tenant", default=None, help="Only this tenant.")
    parser.add_argument("--dedup-ttl-s", type=dedup_window_s,  # a text default too
                        default=os.environ.get("GPUSCHED_DEDUP_TTL_S", str(DEDUP_TTL_S)),
                        help="Accounting's dedup window, at least its minimum of "
                        f"{MIN_DEDUP_TTL_S} s (default: $GPUSCHED_DEDUP_TTL_S, else its "
                        "default, 7 days): a request id used again after it is a new request, "
                        "as live.")
    parser.add_argument("--config-dir", type=Path,
                        default=os.environ.get("GPUSCHED_CONFIG_DIR", REPO_CONFIG_DIR),
                        help="Folder with prices.yaml, whose prices costs are recomputed at "
                        "(default: $GPUSCHED_CONFIG_DIR, which accounting bills with, else "
                        "the checkout's config/).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    args = parser.parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except KafkaConnectionError:
        print(f"error: Kafka not reachable at {args.kafka}; is the stack up?", file=sys.stderr)
        return 2
    except RedisConnectionError:
        print(f"error: Redis not reachable at {args.redis}; is the stack up?", file=sys.stderr)
        return 2
    except RedisError as exc:  # a time-out, NOAUTH: not a difference found (exit 1)
        print(f"error: Redis at {args.redis} answered with an error: {exc!r}", file=sys.stderr)
        return 2
    except (UnknownTenant, ValueError) as exc:  # ValueError: a URL that is none
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        try:
            args.json.write_text(json.dumps(report, indent=2))
        except OSError as exc:
            print(f"error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    print(f"{report['records']} usage records read, {report['tenant_days_checked']} "
          f"(tenant, day) totals checked, {len(report['differences'])} differ")
    for d in report["differences"][:50]:
        print(f"  {d['tenant']} {d['day']}: live {d['live']} != recomputed {d['recomputed']}")
    if report["differences"]:
        print("differences can come from days partly past the topic's retention, records "
              "dead-lettered as older than the dedup window or as ending over a day ahead of "
              "accounting's clock, or a price table changed since", file=sys.stderr)
    return 1 if report["differences"] else 0
