"""Helpers for raw Kafka records: dead letters with a reason, wall-clock stamps, and reading
what a topic retains (for `gpusched reconcile` and `gpusched dead-letters`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from gpusched_common.contracts import DEAD_LETTER_PAYLOAD_CHARS, DeadLetter

WallClockMs = Callable[[], int]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch; services take a `WallClockMs` so tests can drive time."""
    return int(time.time() * 1000)


def dead_letter(record: ConsumerRecord, reason: str, service: str, now_ms: int) -> DeadLetter:
    """A dead-letter record for `record`, keeping where it came from and why it was refused."""
    raw = record.value or b""
    key = record.key.decode(errors="replace") if isinstance(record.key, bytes) else record.key
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=key,
        payload=raw.decode(errors="replace")[:DEAD_LETTER_PAYLOAD_CHARS],
        reason=reason[:2000],
        service=service,
        at_ms=now_ms,
    )


async def retained(bootstrap: str, topic: str, last: int | None = None
                   ) -> AsyncIterator[ConsumerRecord]:
    """The records `topic` holds when called, partition by partition interleaved as Kafka
    returns them: all it retains, or the `last` of each partition. Reads without a consumer
    group, so it commits nothing. Raises aiokafka's `KafkaConnectionError` when Kafka cannot
    be reached; a topic that does not exist yields nothing."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        await consumer.start()
        if not consumer.partitions_for_topic(topic):  # metadata not fetched for it yet
            await consumer._client.force_metadata_update()  # noqa: SLF001
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not parts:
            return
        consumer.assign(parts)
        starts = await consumer.beginning_offsets(parts)
        ends = await consumer.end_offsets(parts)
        for tp in parts:
            consumer.seek(tp, starts[tp] if last is None else max(starts[tp], ends[tp] - last))
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for records in (await consumer.getmany(timeout_ms=500, max_records=10_000)).values():
                for record in records:
                    if record.offset < ends[TopicPartition(record.topic, record.partition)]:
                        yield record
    finally:
        await consumer.stop()
