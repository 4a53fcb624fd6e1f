"""Helpers for raw Kafka records: dead letters with a reason, wall-clock stamps, a request
record's fields, and reading what a topic retains (for `gpusched reconcile` and `gpusched
dead-letters`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from gpusched_common.contracts import (
    DEAD_LETTER_KEY_CHARS,
    DEAD_LETTER_PAYLOAD_CHARS,
    DeadLetter,
    decode_json_object,
)
from gpusched_common.topics import request_topic_class

WallClockMs = Callable[[], int]


def wall_clock_ms() -> int:
    """Milliseconds since the epoch; services take a `WallClockMs` so tests can drive time."""
    return int(time.time() * 1000)


def dead_letter(record: ConsumerRecord, reason: str, service: str, now_ms: int) -> DeadLetter:
    """A dead-letter record for `record`, keeping where it came from and why it was refused;
    its key and value cut short (`DEAD_LETTER_KEY_CHARS`)."""
    raw = record.value or b""
    key = record.key.decode(errors="replace") if isinstance(record.key, bytes) else record.key
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=None if key is None else key[:DEAD_LETTER_KEY_CHARS],
        payload=raw.decode(errors="replace")[:DEAD_LETTER_PAYLOAD_CHARS],
        reason=reason,
        service=service,
        at_ms=now_ms,
    )


def request_payload(record: ConsumerRecord) -> dict[str, Any]:
    """The fields of a request topic's record, with what a producer may leave out filled in
    as every reader does: `request_id` `kafka-<topic>-<partition>-<offset>` (the same on
    every redelivery), `created_at_ms` the record's timestamp, `priority_class` the topic's.
    Raises ValueError (with the reason) when the value is no JSON object Python can read
    (`decode_json`), however malformed: readers skip or dead-letter it on that."""
    payload = decode_json_object(record.value or b"")
    payload.setdefault("request_id", f"kafka-{record.topic}-{record.partition}-{record.offset}")
    payload.setdefault("created_at_ms", record.timestamp)
    payload.setdefault("priority_class", request_topic_class(record.topic))
    return payload


async def retained(bootstrap: str, topic: str, last: int | None = None,
                   since: Mapping[int, int] | None = None) -> AsyncIterator[ConsumerRecord]:
    """The records `topic` holds when called, partition by partition interleaved as Kafka
    returns them: all it retains, or the `last` of each partition; of a partition `since`
    names (partition -> offset), only those from that offset on. Reads without a consumer
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
            first = starts[tp] if last is None else max(starts[tp], ends[tp] - last)
            consumer.seek(tp, max(first, (since or {}).get(tp.partition, first)))
        while any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for records in (await consumer.getmany(timeout_ms=500, max_records=10_000)).values():
                for record in records:
                    if record.offset < ends[TopicPartition(record.topic, record.partition)]:
                        yield record
    finally:
        await consumer.stop()
