"""Helpers for raw Kafka records: dead letters with a reason, and wall-clock stamps."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiokafka.structs import ConsumerRecord

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
