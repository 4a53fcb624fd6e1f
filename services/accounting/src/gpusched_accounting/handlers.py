"""Kafka subscriber of accounting: usage records, applied before their offsets commit."""

from __future__ import annotations

import logging

from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from opentelemetry import trace
from pydantic import ValidationError

from gpusched_accounting.adapters.store import UsageStore
from gpusched_accounting.domain.usage import increment_for
from gpusched_common import topics
from gpusched_common.contracts import USAGE, Message
from gpusched_common.kafka_records import WallClockMs, dead_letter
from gpusched_common.telemetry import context_from, record_carrier

log = logging.getLogger(__name__)
CONSUMER_GROUP = "gpusched-accounting"
SERVICE = "accounting"


def register(broker: KafkaBroker, store: UsageStore, clock: WallClockMs,
             max_records: int, tracer: trace.Tracer) -> None:
    async def publish(message: Message, topic: str, key: str) -> None:
        await broker.publish(message.to_bytes(), topic, key=key.encode(),
                             headers={"content-type": "application/json"})

    # At-least-once delivery + idempotent apply = exactly-once effect: a batch is applied
    # in Redis first; only then is its offset committed; on error it is redelivered.
    @broker.subscriber(topics.USAGE.name, batch=True, group_id=CONSUMER_GROUP,
                       auto_offset_reset="earliest", ack_policy=AckPolicy.NACK_ON_ERROR,
                       max_records=max_records, batch_timeout_ms=20)
    async def on_usage(msg: KafkaMessage) -> None:
        increments = []
        for record in msg.raw_message:
            try:
                usage = USAGE.validate_json(record.value)
            except ValidationError as exc:
                await publish(dead_letter(record, f"invalid usage record: {exc.errors()[0]}",
                                          SERVICE, clock()),
                              topics.DEAD_LETTERS.name, record.topic)
                continue
            increments.append((increment_for(usage), usage.model))
            # one span per record, in the trace of the request it bills
            tracer.start_span("bill usage", context=context_from(record_carrier(record.headers)),
                              attributes={"gpusched.request_id": usage.request_id,
                                          "gpusched.event_id": usage.event_id}).end()
        await store.apply(increments)
