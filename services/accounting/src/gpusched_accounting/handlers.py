"""Kafka subscriber of accounting: usage records applied in Redis before their offsets
commit, then the budgets of the tenants in the batch checked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from aiokafka import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from gpusched_accounting.adapters.store import APPLIED, PendingApply, UsageStore
from gpusched_accounting.domain import budgets as budget_rules
from gpusched_accounting.domain.budgets import BudgetTable
from gpusched_accounting.domain.usage import (
    CONFLICT,
    DUPLICATE,
    MAX_END_AHEAD_MS,
    STALE,
    PriceTable,
    UsageRow,
    row_for,
)
from gpusched_common import topics
from gpusched_common.broker import RAW_BATCH
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.contracts import USAGE, BudgetExhausted, Message, invalid_fields
from gpusched_common.kafka_records import WallClockMs, dead_letter
from gpusched_common.telemetry import context_from, in_trace, record_carrier

log = logging.getLogger(__name__)
SERVICE = "accounting"
Publish = Callable[[Message, str, str], Awaitable[None]]
_PARTITION_FETCH_BYTES = 4 * 2**20
"""Per partition and fetch (Kafka's default is 1 MiB): a backlog then arrives in fetches of
tens of thousands of records, so the chunks of one fetch keep Redis and the parser busy
together for longer (the first parse and the last apply of a fetch cannot overlap)."""


async def enforce_budgets(store: UsageStore, table: BudgetTable, tenants: set[str],
                          now_ms: int, publish: Publish) -> None:
    """Flag each given tenant whose budget for the period of `now_ms` is spent (the router
    then answers 429) until the end of the latest such period, and publish one
    `budget_exhausted` event when the flag is new, names another period or its event has not
    gone out; clear the flag of a tenant no longer over (its budget was raised). A flag of a
    period starting after `now_ms` (another instance's check, later or by a clock ahead),
    or set from a later reading than this check's, stays as it is, and no event goes out for
    it. Idempotent: it only reads the totals, so running it again after a redelivery changes
    nothing."""
    for tenant in tenants:
        budgets = table.of(tenant)
        if not budgets:
            continue
        exhausted, read = [], {}
        for budget in budgets:
            window = budget_rules.period_of(now_ms, budget.period)
            spending = await store.spending(tenant, window.day_starts_s)
            read[(window.label, budget.unit)] = budget_rules.spent(spending, budget.unit)
            if budget_rules.is_exhausted(budget, spending):
                exhausted.append((budget, window, spending))
        if not exhausted:
            await store.clear_exhausted(tenant, now_ms, read)
            continue
        # the spent budget whose period ends last names the reason and how long it holds:
        # a spent month outlasts a spent day
        budget, window, spending = max(exhausted, key=lambda spent: spent[1].end_ms)
        spent = budget_rules.spent(spending, budget.unit)
        flag = {"period": window.label, "period_start_ms": window.start_ms,
                "limit": budget.limit, "spent": spent, "unit": budget.unit,
                "reason": budget_rules.reason(budget, window, spending)}
        if await store.set_exhausted(tenant, flag, window.end_ms, now_ms, read):
            log.warning("budget exhausted: %s", flag["reason"])
            # published before the flag says so: a refused publish is tried again with the
            # batch's redelivery (a crash between the two publishes it twice, never zero)
            await publish(BudgetExhausted(tenant=tenant, period=window.label,
                                          limit=budget.limit, spent=spent, unit=budget.unit,
                                          at_ms=now_ms), topics.EVENTS.name, tenant)
            await store.announced(tenant, flag, window.end_ms)


async def recheck_budgets(store: UsageStore, table: BudgetTable, now_ms: int,
                          publish: Publish) -> None:
    """At start, against `budgets.yaml` as it is now (it may have changed since the flags
    were set): a flagged tenant without a budget is cleared, and every tenant with one is
    flagged or cleared. Otherwise a budget raised or removed would keep its tenant at 429
    until the period's end (a blocked tenant sends no usage that would check it again)."""
    budgeted = {b.tenant for b in table.budgets}
    for tenant in await store.exhausted_tenants() - budgeted:
        await store.clear_exhausted(tenant, now_ms)
    await enforce_budgets(store, table, budgeted, now_ms, publish)


def register(broker: KafkaBroker, store: UsageStore, prices: PriceTable, budgets: BudgetTable,
             clock: WallClockMs, consumer_group: str, max_records: int, chunk_records: int,
             tracer: trace.Tracer, registry: CollectorRegistry | None = None,
             lag: ConsumerLag | None = None) -> Callable[[], Awaitable[None]]:
    """Subscribe the usage consumer (its lag measured in `lag`: usage not billed yet);
    returns `recheck_budgets` bound to this service, to run once the broker has started
    (`recheck_forever`)."""
    checking_budgets = asyncio.Lock()
    """One budget check at a time in this instance: the consumer's and the recheck's, run
    together, both found a new flag and published its event twice."""
    outcomes = Counter("gpusched_accounting_usage_records_total",
                       "Usage records by outcome (applied, duplicate, stale, conflict, "
                       "invalid).", ["outcome"], registry=registry)
    for outcome in ("applied", "duplicate", "stale", "conflict", "invalid"):
        outcomes.labels(outcome)  # at 0: a series first seen at 1 is no increase() to alert on

    async def publish(message: Message, topic: str, key: str) -> None:
        await broker.publish(message.to_bytes(), topic, key=key.encode(),
                             headers={"content-type": "application/json"})

    async def refuse(record: ConsumerRecord, reason: str, now_ms: int) -> None:
        """Dead-letter `record` in the trace of the request it bills (a batch has none of
        its own: `Broker._spans_for` in gpusched_common.broker)."""
        with in_trace(record_carrier(record.headers)):
            await publish(dead_letter(record, reason, SERVICE, now_ms), topics.DEAD_LETTERS.name,
                          record.topic)

    async def parse(records: Sequence[ConsumerRecord], now_ms: int
                    ) -> tuple[list[UsageRow], list[ConsumerRecord]]:
        """Rows of the valid records (and those records); invalid ones are dead-lettered."""
        rows, sources = [], []
        for record in records:
            try:
                row = row_for(USAGE.validate_json(record.value), prices)
            except Exception as exc:  # noqa: BLE001 - one record must never stop its partition
                reason = (f"invalid usage record: {invalid_fields(exc)}"
                          if isinstance(exc, ValidationError)
                          else f"unreadable usage record: {exc!r}")
            else:
                if (ahead_ms := row.ended_at_ms - now_ms) <= MAX_END_AHEAD_MS:
                    rows.append(row)
                    sources.append(record)
                    continue
                reason = (f"unusable usage record: it ended at {row.ended_at_ms}, "
                          f"{ahead_ms // 60_000} minutes after accounting's clock ({now_ms}): "
                          "its agent's clock is off by more than a day; fix it, then produce "
                          "this record again")
            outcomes.labels("invalid").inc()
            await refuse(record, reason, now_ms)
        return rows, sources

    async def settle(rows: list[UsageRow], sources: list[ConsumerRecord], statuses: list[int],
                     now_ms: int) -> None:
        """Count outcomes, dead-letter stale and conflicting rows, and end a span per traced
        record."""
        for status, name in ((APPLIED, "applied"), (DUPLICATE, "duplicate"), (STALE, "stale"),
                             (CONFLICT, "conflict")):
            if n := statuses.count(status):
                outcomes.labels(name).inc(n)
        for row, record, status in zip(rows, sources, statuses):
            if status == STALE:
                await refuse(
                    record, f"usage record ended at {row.ended_at_ms}, before the dedup window "
                    f"({store.dedup_ttl_s} s): not applied, since it cannot be told apart from a "
                    "duplicate; check it with `gpusched reconcile`", now_ms)
            elif status == CONFLICT:
                await refuse(
                    record, f"event id {row.event_id} reused with other content: not billed. "
                    "A record with this id and another tenant, model, node, count or end, or "
                    "one of this request id with another tenant or model, was applied within "
                    f"the dedup window ({store.dedup_ttl_s} s); request ids must be unique, so "
                    f"was request id {row.request_id} used again? GET "
                    f"/v1/usage/requests/{row.request_id} shows what was billed under it",
                    now_ms)
            # one span per traced record, in the trace of the request it bills
            carrier = record_carrier(record.headers)
            if carrier:
                tracer.start_span("bill usage", context=context_from(carrier), attributes={
                    "gpusched.request_id": row.request_id, "gpusched.event_id": row.event_id,
                    "gpusched.applied": status == APPLIED}).end()

    # At-least-once delivery + idempotent apply = exactly-once effect: every chunk of a batch
    # is applied in Redis (one atomic script each) before the handler returns and the batch's
    # offsets commit; on error the batch is redelivered and the already-applied event ids
    # change nothing. While Redis applies one chunk, the next one is parsed here.
    usage = broker.subscriber(topics.USAGE.name, batch=True, group_id=consumer_group,
                              auto_offset_reset="earliest", ack_policy=AckPolicy.NACK_ON_ERROR,
                              max_records=max_records, batch_timeout_ms=20,
                              max_partition_fetch_bytes=_PARTITION_FETCH_BYTES, **RAW_BATCH)
    if lag is not None:
        lag.watch(consumer_group, lambda: usage.consumer)

    @usage
    async def on_usage(msg: KafkaMessage) -> None:
        now_ms = clock()
        records = msg.raw_message
        tenants: set[str] = set()
        sent: tuple[PendingApply, list[UsageRow], list[ConsumerRecord]] | None = None

        async def settle_sent() -> None:
            nonlocal sent
            if sent is not None:
                pending, rows, sources = sent
                sent = None  # result() hands its connection back, whatever happens
                await settle(rows, sources, await pending.result(), now_ms)

        try:
            for start in range(0, len(records), chunk_records):
                rows, sources = await parse(records[start:start + chunk_records], now_ms)
                tenants.update(r.tenant for r in rows)
                await settle_sent()
                if rows:
                    sent = (await store.send_apply(rows, now_ms), rows, sources)
            await settle_sent()
        finally:
            if sent is not None:  # sent but never read: a parse or publish failed
                await sent[0].abandon()
        if budgets.budgets:
            async with checking_budgets:
                # judged as of now, not of when the batch began: one begun before midnight
                # and applied after it (a backlog's fetch takes a while) judged a day over
                await enforce_budgets(store, budgets, tenants, clock(), publish)

    async def recheck() -> None:
        async with checking_budgets:
            await recheck_budgets(store, budgets, clock(), publish)

    return recheck


RECHECK_RETRY_S = 5.0
RECHECK_LOGGED_S = 300.0
"""While the recheck keeps failing (Redis away), its error is logged with the traceback once
and then once per this many seconds, not at every try."""


async def recheck_forever(recheck: Callable[[], Awaitable[None]], every_s: float) -> None:
    """`recheck` the budget flags now and every `every_s`; one that fails (Redis or Kafka
    away) is tried again within RECHECK_RETRY_S. Checked once, at start, a flag whose check
    failed then stayed until its period ended, the raised budget notwithstanding."""
    logged_at: float | None = None
    while True:
        try:
            await recheck()
            pause_s, logged_at = every_s, None
        except Exception:  # the service goes on, serving 503s while Redis is away
            now = time.monotonic()
            if logged_at is None or now - logged_at >= RECHECK_LOGGED_S:
                log.exception("re-checking the budget flags failed; trying again every %g s",
                              RECHECK_RETRY_S)
                logged_at = now
            pause_s = min(every_s, RECHECK_RETRY_S)
        await asyncio.sleep(pause_s)
