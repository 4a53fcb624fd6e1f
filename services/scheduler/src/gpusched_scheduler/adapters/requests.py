"""The request topics, read straight with aiokafka while this instance leads: the hot path
of every placement, so no framework middleware per batch and no poll interval. Each class
has its own consumer group, so one class's consumer joins or leaves without rebalancing
the others."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from gpusched_common import topics
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.tasks import cancelled
from gpusched_scheduler.adapters.offsets import Commit

log = logging.getLogger(__name__)

CONSUMER_GROUP = "gpusched-scheduler-{}"
"""One group per class (`gpusched-scheduler-interactive`, ...)."""

Admit = Callable[[list[ConsumerRecord], Commit], Awaitable[None]]
"""Queues a batch of one class and returns; waits first while that class is full."""
Stopped = Callable[[str], None]
"""Told the class whose consumer stopped on an error (logged already): nothing more of
that class is read until the consumers start again."""


class RequestConsumer:
    """One consumer per class. A batch goes to `admit` as soon as Kafka returns it
    (`getmany` wakes on arrival); while `admit` waits for room nothing more is fetched for
    that class beyond aiokafka's one prefetched response per partition (backpressure).
    Offsets are committed by whoever `admit` hands `Commit` to, never here; a batch whose
    admission failed is read again (the consumer seeks back to it). A consumer that fails
    itself (its fetch or seek raised) stops reading, and `stopped` is told its class. Each
    class's consumer is measured in `lag` while it runs: the requests waiting in Kafka,
    unread, beyond what the class holds in memory."""

    def __init__(self, bootstrap: str, client_id: str, max_records: int, admit: Admit,
                 stopped: Stopped, lag: ConsumerLag) -> None:
        self._options = {"bootstrap_servers": bootstrap, "client_id": client_id,
                         "enable_auto_commit": False, "auto_offset_reset": "earliest",
                         "max_poll_interval_ms": 3_600_000}
        self._max_records = max_records
        self._admit = admit
        self._stopped = stopped
        self._lag = lag
        self._consumers: list[AIOKafkaConsumer] = []
        self._loops: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Join every class's group; returns once each consumer is connected."""
        for cls, spec in topics.REQUESTS.items():
            group = CONSUMER_GROUP.format(cls)
            consumer = AIOKafkaConsumer(spec.name, group_id=group, **self._options)
            self._consumers.append(consumer)  # before starting: stop() closes it either way
            await consumer.start()
            self._lag.watch(group, lambda consumer=consumer: consumer)
            self._loops.append(asyncio.create_task(self._consume(cls, consumer),
                                                   name=f"requests-{cls}"))

    async def stop(self) -> None:
        """Leave the groups without committing anything more (the next leader reads on from
        the last commit)."""
        for cls in topics.REQUESTS:
            self._lag.forget(CONSUMER_GROUP.format(cls))  # a standby serves no lag
        await cancelled(*self._loops)
        for consumer in self._consumers:
            await consumer.stop()
        self._loops.clear()
        self._consumers.clear()

    async def _consume(self, priority_class: str, consumer: AIOKafkaConsumer) -> None:
        """Read `priority_class`'s requests until cancelled. A fault of the consumer itself
        ends the loop, logged, and `stopped` is told (the task ended unseen before: the
        instance led on, renewing its lease, and read no more of that class)."""
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=1000,
                                                 max_records=self._max_records)
                records = [r for part in batches.values() for r in part]
                if not records:
                    continue
                try:
                    await self._admit(records, consumer.commit)
                except Exception:
                    log.exception("admitting %d request records failed; reading them again",
                                  len(records))
                    for tp, part in batches.items():
                        consumer.seek(tp, part[0].offset)
                    await asyncio.sleep(1.0)
        except Exception:
            log.exception("reading the %s requests failed: their consumer stops",
                          priority_class)
            self._stopped(priority_class)
