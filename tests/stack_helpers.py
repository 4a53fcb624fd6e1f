"""Helpers for tests against the real stack: Kafka reads and polling with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T | None]], timeout_s: float = 20,
                     interval_s: float = 0.2, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


async def end_offsets(bootstrap: str, topic_names: list[str]) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topic_names
                 for p in (consumer.partitions_for_topic(t) or await _partitions(consumer, t))]
        return await consumer.end_offsets(parts)
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()  # noqa: SLF001 - no public equivalent
    return consumer.partitions_for_topic(topic) or set()


async def read_topic(bootstrap: str, topic: str, match: Callable[[bytes | None, bytes], bool],
                     timeout_s: float = 20) -> list[tuple[bytes | None, bytes]]:
    """Every record of `topic` (from the beginning) for which match(key, value) holds, read
    until at least one matches or timeout_s passes."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest")
    await consumer.start()
    found: list[tuple[bytes | None, bytes]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                found += [(r.key, r.value) for r in records if match(r.key, r.value)]
            if found and not batch:
                break
        return found
    finally:
        await consumer.stop()
