"""`gpusched reconcile`: recompute usage totals per tenant and day from the usage topic (every
record still retained, with the live apply's dedup, forgetting and request rules) and report
every difference from the live counters in Redis. A day with a record accounting has not yet
committed as applied is reported as still being billed, not compared. Exit status 0 when
they agree (or are still being billed), 1 when they differ, 2 when Kafka or Redis cannot be
reached, `--dedup-ttl-s` is shorter than accounting's own setting takes, `--tenant` names
no tenant (neither configured nor in any retained record: a misspelt name would pass as
agreeing), or `--consumer-group` names a group that committed nothing on the usage topic
while it holds records (every day would pass as still being billed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, NamedTuple
from urllib.parse import urlsplit, urlunsplit

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import collect_hosts
from aiokafka.errors import KafkaConnectionError, KafkaError
from pydantic import TypeAdapter, ValidationError
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gpusched_accounting.adapters.store import bucket_key
from gpusched_accounting.domain.usage import (
    COUNTERS_SIZE,
    TOTAL_FIELD,
    Totals,
    bucket_start_s,
    load_prices,
    recompute,
    row_for,
    unpack,
)
from gpusched_accounting.settings import (
    CONSUMER_GROUP,
    DEDUP_TTL_S,
    MIN_DEDUP_TTL_S,
    AccountingSettings,
)
from gpusched_common import topics
from gpusched_common.catalog import load_tenants
from gpusched_common.contracts import USAGE, UsageRecord
from gpusched_common.kafka_records import retained
from gpusched_common.settings import REPO_CONFIG_DIR


class Retained(NamedTuple):
    """A usage record and where the usage topic holds it."""

    partition: int
    offset: int
    usage: UsageRecord


async def read_usage(bootstrap: str, since: Mapping[int, int] | None = None,
                     topic: str = topics.USAGE.name) -> tuple[list[Retained], dict[int, int]]:
    """Every parseable usage record `topic` retains up to its end when called (of a partition
    `since` names, from that offset on), and the offset after the last record read of each
    partition, an unparseable one included: the `since` of a later read."""
    out, after = [], dict(since or {})
    async for record in retained(bootstrap, topic, since=since):
        after[record.partition] = record.offset + 1
        try:
            out.append(Retained(record.partition, record.offset,
                                USAGE.validate_json(record.value)))
        except ValidationError:
            continue  # the live consumer dead-letters these too
    return out, after


async def applied_offsets(bootstrap: str, group: str, topic: str = topics.USAGE.name
                          ) -> dict[int, int]:
    """The offset consumer group `group` (accounting's) has committed in each partition of
    `topic`. Accounting commits a fetch only once every record of it is applied in Redis
    (`handlers.on_usage`), so every record below it is applied (or dead-lettered) and stays
    so; one above it may be applied, in part or not at all. A partition missing here has
    nothing applied."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp.partition: done.offset for tp, done in committed.items() if tp.topic == topic}


TenantDay = tuple[str, int]
"""(tenant, start of the UTC day, epoch s): one day total compared."""


def day_of(usage: UsageRecord) -> TenantDay:
    return usage.tenant, bucket_start_s(usage.ended_at_ms, "day")


def _date(day_s: int) -> str:
    return datetime.fromtimestamp(day_s, UTC).strftime("%Y-%m-%d")


async def live_totals(redis: Redis, days: Sequence[TenantDay]) -> dict[TenantDay, Totals | str]:
    """Redis's live totals of those (tenant, day) buckets, read in one pipeline; a value
    that is no packed counter reads as what is wrong with it (a difference, where it raised
    out of the command: a traceback and exit 1 without a word of which day)."""
    async with redis.pipeline(transaction=False) as pipe:
        for t, day in days:
            pipe.hget(bucket_key(t, "day", day), TOTAL_FIELD)
        values = await pipe.execute()
    out: dict[TenantDay, Totals | str] = {}
    for k, v in zip(days, values):
        try:
            out[k] = unpack(v)
        except struct.error:
            out[k] = f"unreadable: {len(v)} bytes, not the {COUNTERS_SIZE} of a counter"
    return out


def shown(url: str) -> str:
    """`url` with its password hidden, for an error message (a terminal's, a CI log's)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.netloc.rpartition('@')[2]}"))


class NamesNothing(LookupError):
    """`--tenant` or `--consumer-group` names nothing there is: a misspelt one would pass as
    agreeing (nothing compared, exit 0)."""


async def run(args: argparse.Namespace) -> dict:
    """The report (as `--json` writes it). Only a (tenant, day) whose every record
    accounting has applied is compared; the others are still being billed. The cut is the
    offsets accounting's group has committed, read first: every record below them was
    applied before, so Redis holds it. A record above them may be applied in part or not at
    all: it is in the topic read, or it was produced while Redis was read and is in the
    `tail` read afterwards (one produced later cannot be in what Redis answered)."""
    prices = load_prices(args.config_dir)
    cut = await applied_offsets(args.kafka, args.consumer_group)
    records, after = await read_usage(args.kafka)
    if args.tenant is not None and all(r.usage.tenant != args.tenant for r in records):
        try:
            configured = load_tenants(args.config_dir).get(args.tenant) is not None
        except ValueError:  # no tenants.yaml there
            configured = False
        if not configured:
            raise NamesNothing(f"no tenant '{args.tenant}': it is not configured and no "
                                f"usage record of it is retained")
    if records and not cut:
        raise NamesNothing(f"consumer group '{args.consumer_group}' has committed nothing on "
                            f"{topics.USAGE.name}: it is not accounting's (--consumer-group, "
                            "GPUSCHED_CONSUMER_GROUP), or accounting has applied nothing yet")
    applied = [r.offset < cut.get(r.partition, 0) for r in records]
    billing = {day_of(r.usage) for r, done in zip(records, applied) if not done}
    # of the applied records alone, as Redis holds them: every (tenant, day) with one, those
    # whose every record was dropped included (once counted as checked but never compared)
    recomputed = recompute([row_for(r.usage, prices) for r, done in zip(records, applied)
                            if done], dedup_ttl_s=args.dedup_ttl_s)
    wanted = sorted(k for k in recomputed.keys() - billing if args.tenant in (None, k[0]))
    redis = Redis.from_url(args.redis)
    try:
        live = await live_totals(redis, wanted)
    finally:
        await redis.aclose()
    tail, _ = await read_usage(args.kafka, since=after)
    billing.update(day_of(r.usage) for r in tail)
    checked = [k for k in wanted if k not in billing]
    return {"records": len(records) + len(tail), "tenant_days_checked": len(checked),
            "differences": [{"tenant": t, "day": _date(day),
                             "recomputed": recomputed[(t, day)].public(),
                             "live": _public(live[(t, day)])}
                            for t, day in checked if live[(t, day)] != recomputed[(t, day)]],
            "still_being_billed": [{"tenant": t, "day": _date(day)} for t, day in sorted(
                billing) if args.tenant in (None, t)],
            "recomputed_total": sum((recomputed[k] for k in checked), Totals()).public()}


def _public(totals: Totals | str) -> dict | str:
    return totals if isinstance(totals, str) else totals.public()


def dedup_window_s(text: str) -> int:
    """`--dedup-ttl-s` as accounting's own setting reads it (AccountingSettings'
    `dedup_ttl_s`, the one rule: at least MIN_DEDUP_TTL_S). A window of 0 or less forgot
    every id at once, so each redelivery was recomputed as billed again and reported as a
    difference."""
    try:
        return DEDUP_WINDOW.validate_python(text)
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no dedup window accounting takes: give the one it runs with "
            f"(GPUSCHED_DEDUP_TTL_S), whole seconds, at least {MIN_DEDUP_TTL_S}") from None


DEDUP_WINDOW = TypeAdapter(Annotated[int, AccountingSettings.model_fields["dedup_ttl_s"]])


def kafka_bootstrap(text: str) -> str:
    """`--kafka` as the consumer reads it; what it cannot read was an error about an int(),
    naming no option."""
    try:
        collect_hosts(text, randomize=False)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes host:port[,host:port], not {text!r}") from None
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpusched reconcile", description=__doc__)
    parser.add_argument("--kafka", type=kafka_bootstrap,
                        default=os.environ.get("GPUSCHED_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
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
    parser.add_argument("--consumer-group", default=os.environ.get("GPUSCHED_CONSUMER_GROUP",
                                                                   CONSUMER_GROUP),
                        help="Accounting's consumer group, whose committed offsets say which "
                        "records it has applied (default: $GPUSCHED_CONSUMER_GROUP, else "
                        "accounting's default).")
    parser.add_argument("--config-dir", type=Path,
                        default=os.environ.get("GPUSCHED_CONFIG_DIR", REPO_CONFIG_DIR),
                        help="The config folder accounting bills with: prices.yaml, whose "
                        "prices costs are recomputed at, and models.yaml, which names its "
                        "models (tenants.yaml too for --tenant) (default: "
                        "$GPUSCHED_CONFIG_DIR, else the checkout's config/).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    args = parser.parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except KafkaConnectionError:
        print(f"error: Kafka not reachable at {args.kafka}; is the stack up?", file=sys.stderr)
        return 2
    except KafkaError as exc:  # no group coordinator yet: not a difference found (exit 1)
        print(f"error: Kafka at {args.kafka} answered with an error: {exc!r}", file=sys.stderr)
        return 2
    except RedisAuthenticationError as exc:  # a ConnectionError to redis-py
        print(f"error: Redis at {shown(args.redis)} refused the credentials: {exc}",
              file=sys.stderr)
        return 2
    except RedisConnectionError:
        print(f"error: Redis not reachable at {shown(args.redis)}; is the stack up?",
              file=sys.stderr)
        return 2
    except RedisError as exc:  # a time-out, NOAUTH: not a difference found (exit 1)
        print(f"error: Redis at {shown(args.redis)} answered with an error: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except (NamesNothing, ValueError) as exc:  # ValueError: a URL that is none
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        try:
            args.json.write_text(json.dumps(report, indent=2))
        except OSError as exc:
            print(f"error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 2
    differ, billing = report["differences"], report["still_being_billed"]
    print(f"{report['records']} usage records read, {report['tenant_days_checked']} "
          f"(tenant, day) totals checked, {len(differ)} differ, {len(billing)} not checked: "
          "still being billed")
    for d in differ[:50]:
        print(f"  {d['tenant']} {d['day']}: live {d['live']} != recomputed {d['recomputed']}")
    for d in billing[:50]:
        print(f"  {d['tenant']} {d['day']}: not checked: still being billed")
    if differ:
        print("differences can come from days partly past the topic's retention, records "
              "dead-lettered as older than the dedup window or as ending over a day ahead of "
              "accounting's clock, a price table changed since, or offsets of the consumer "
              "group (--consumer-group) past records accounting never applied: another "
              "group's, or moved by hand", file=sys.stderr)
    if billing:
        print("a day is still being billed while accounting has not committed one of its "
              "records as applied (it is behind, or the record came while reconcile ran): "
              "its live total may lack it, so it is not compared; run reconcile again once "
              "accounting has caught up, or once the day is over for today's",
              file=sys.stderr)
    return 1 if differ else 0
