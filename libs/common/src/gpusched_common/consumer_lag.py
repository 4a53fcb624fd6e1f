"""How far a service's Kafka consumers are behind their topics: the gauge
`gpusched_consumer_lag_records{service, group, topic}`, measured every LAG_EVERY_S."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer
from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)

LAG_EVERY_S = 15.0
"""How often each consumer's lag is measured: one offsets request to its partitions' leaders
per consumer and measure, however many records flow."""
MEASURE_TIMEOUT_S = 10.0
"""Longest one consumer's measure may take (Kafka away, its partitions' leader unreachable);
the measure then fails."""
STALE_AFTER_FAILURES = 4
"""Measures in a row that may fail (a minute at LAG_EVERY_S) before a group's series are
taken away: its last values stay until then. Kept for good, a consumer cut off from its
partitions after it had caught up served 0 behind while it read nothing, and an alert on
the lag could not see it; taken away, an alert on the series' absence does."""

ConsumerOf = Callable[[], AIOKafkaConsumer | None]
"""The consumer of a group as it is now: None while it does not run (not started yet, or
stopped)."""


async def lag_by_topic(consumer: AIOKafkaConsumer) -> dict[str, int]:
    """Per topic, the records of the partitions assigned to `consumer` that it has not handed
    out yet: each partition's end offset (its high watermark) less the consumer's position
    there (the next record it hands out), summed. Records it has fetched and holds in its
    buffer count as not read; records handed to a handler still at work do not. Positions
    are read first, so a record that arrives meanwhile counts as waiting, never below 0."""
    assigned = sorted(consumer.assignment())
    if not assigned:
        return {}
    positions = {tp: await consumer.position(tp) for tp in assigned}
    ends = await consumer.end_offsets(assigned)
    lag: dict[str, int] = {}
    for tp in assigned:
        lag[tp.topic] = lag.get(tp.topic, 0) + max(0, ends[tp] - positions[tp])
    return lag


class ConsumerLag:
    """The lag of every consumer a service `watch`es, one series per group and topic.

    A service's instances each serve the lag of the partitions assigned to their own
    consumer (their `instance` label tells them apart), so the sum over instances is the
    group's. A consumer that does not run (not started, stopped, a standby scheduler's)
    serves no series; nor does a group `forget` was called for. One whose measure fails or
    takes longer than MEASURE_TIMEOUT_S keeps its last values for STALE_AFTER_FAILURES
    measures, then serves no series until a measure works.
    Measured by `run`, not per record: the hot paths pay nothing for it."""

    def __init__(self, service: str, registry: CollectorRegistry | None) -> None:
        self._service = service
        self._gauge = Gauge(
            "gpusched_consumer_lag_records", "Records of the topic that this instance's "
            "consumer of the group has not read yet (end offset less its position, summed over "
            f"the partitions assigned to it), measured every {LAG_EVERY_S:g} s.",
            ["service", "group", "topic"], registry=registry)
        self._watched: dict[str, ConsumerOf] = {}
        self._served: dict[str, set[str]] = {}
        """The topics each group serves a series of."""
        self._failing: dict[str, int] = {}
        """Groups whose last measures failed: how many in a row (logged once, until one
        works)."""

    def watch(self, group: str, consumer: ConsumerOf) -> None:
        """Measure the consumer of `group` from the next measure on (replacing the one
        watched under that group, if any)."""
        self._watched[group] = consumer

    def forget(self, group: str) -> None:
        """Stop measuring `group` and take its series away now (a scheduler stepping down
        must not leave its last lag beside the next leader's)."""
        self._watched.pop(group, None)
        self._failing.pop(group, None)
        self._serve(group, {})

    async def measure(self) -> None:
        """Measure every watched consumer once, one after the other."""
        for group, consumer_of in list(self._watched.items()):
            consumer = consumer_of()
            if consumer is None:
                self._serve(group, {})
                continue
            try:
                async with asyncio.timeout(MEASURE_TIMEOUT_S):
                    lag = await lag_by_topic(consumer)
            except Exception:  # Kafka away or a rebalance: the next measure tries again
                failures = self._failing.get(group, 0) + 1
                self._failing[group] = failures
                if failures == 1:
                    log.warning("measuring the lag of consumer group %s failed; its last "
                                "measure stays for %d measures", group, STALE_AFTER_FAILURES,
                                exc_info=True)
                if failures >= STALE_AFTER_FAILURES and self._watched.get(group) is consumer_of:
                    self._serve(group, {})  # unknown now: no series, rather than a stale one
                continue
            if self._watched.get(group) is not consumer_of:
                continue  # forgotten (or replaced) while it was measured
            if group in self._failing:
                del self._failing[group]
                log.info("measuring the lag of consumer group %s works again", group)
            self._serve(group, lag)

    async def run(self, every_s: float = LAG_EVERY_S) -> None:
        """`measure` now and every `every_s`, until cancelled."""
        while True:
            await self.measure()
            await asyncio.sleep(every_s)

    def _serve(self, group: str, lag: dict[str, int]) -> None:
        for topic in self._served.get(group, set()) - lag.keys():
            self._gauge.remove(self._service, group, topic)
        for topic, records in lag.items():
            self._gauge.labels(self._service, group, topic).set(records)
        if lag:
            self._served[group] = set(lag)
        else:
            self._served.pop(group, None)
