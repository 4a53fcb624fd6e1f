"""Publishes a cycle's decisions to Kafka in one pipelined batch: every record is handed to
the producer at once, and one future completes when Kafka acknowledged them all (the next
cycle need not wait for it).

This is the scheduler's hot path, so it talks to aiokafka directly (the broker's per-message
middlewares cost more than the decision itself); each record still carries the W3C
context of a `schedule` span opened in the request's own trace, which names the request,
placement and node it decides for, with status ERROR where the record ends the request in
failure (`telemetry.mark_failure`). Like the broker's, its producer is replaced once Kafka
refuses it as out of order (`gpusched_common.broker.Broker`);
the placements of the cycle whose records were refused are published again, unchanged,
and the rest of its work is decided again.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import OutOfOrderSequenceNumber
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as MetricCounter

from gpusched_common.broker import retire_producer
from gpusched_common.contracts import InferenceRequest, Message, Placement, Preempt
from gpusched_common.telemetry import carrier_of, mark_failure, request_attributes

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 1 << 20
"""Per partition and request; Kafka's default `max.message.bytes` is about 1 MiB."""

NAMED_FIELDS = ("request_id", "tenant", "priority_class", "model", "placement_id", "node_id")
"""The fields of a record's message its `schedule` span names, as `gpusched.<field>`."""


@dataclass(frozen=True)
class Outgoing:
    message: Message
    topic: str
    key: str
    trace_carrier: dict[str, str]
    """The request's trace context; empty for records that belong to no request, sent in
    the caller's context (`telemetry.untraced()` for those that should start no trace)."""
    preemptor: InferenceRequest | None = None
    """For a preempt, the request it makes room for, whose trace it goes in (the message
    names its victim)."""


def decision_attributes(out: Outgoing) -> dict[str, AttributeValue]:
    """What the `schedule` span of `out` says of its decision: the request it decides for
    (the one whose trace it is in), and the placement and node it names, under the names
    the router's spans use (`telemetry.request_attributes`); for a preempt, its victim's
    request and placement too (`gpusched.victim_*`). A field the message lacks is left
    out."""
    message = out.message
    attributes: dict[str, AttributeValue] = {
        "messaging.destination.name": out.topic,
        "gpusched.decision": message.type}  # type: ignore[attr-defined]
    if isinstance(message, Preempt):
        if out.preemptor is not None:
            attributes.update(request_attributes(out.preemptor))
        attributes.update({"gpusched.node_id": message.node_id,
                           "gpusched.victim_request_id": message.request_id,
                           "gpusched.victim_placement_id": message.placement_id})
        return attributes
    for source in (message.request, message) if isinstance(message, Placement) else (message,):
        fields = type(source).model_fields  # looked up: getattr's miss raised, ~2 us each
        for name in NAMED_FIELDS:
            if name in fields and isinstance(value := getattr(source, name), str):
                attributes[f"gpusched.{name}"] = value
    return attributes


class DecisionProducer:
    def __init__(self, bootstrap: str, client_id: str, tracer: trace.Tracer,
                 registry: CollectorRegistry) -> None:
        # A placement carries its request (prompt included), ~1-2 KiB: with aiokafka's
        # default 16 KiB batches a cycle's records filled a partition's batch every ~10
        # records and each further send waited for it to drain (35-77 ms per cycle at
        # 1,000 requests/s). One batch per partition holds a whole cycle.
        # No linger: a cycle hands over all its records before the sender task runs, so
        # waiting for more would only delay every placement by the linger.
        self._options = {"bootstrap_servers": bootstrap, "client_id": client_id, "acks": "all",
                         "enable_idempotence": True, "linger_ms": 0,
                         "max_batch_size": MAX_BATCH_BYTES}
        self._producer: AIOKafkaProducer | None = None
        self._renewing = asyncio.Lock()
        self._tracer = tracer
        self._published = MetricCounter("gpusched_scheduler_records_published_total",
                                  "Decision records published, by topic.", ["topic"],
                                  registry=registry)

    async def start(self) -> None:
        """Connect (aiokafka needs the running event loop, hence not in __init__)."""
        self._producer = AIOKafkaProducer(**self._options)
        await self._producer.start()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def send(self, batch: list[Outgoing]) -> asyncio.Future:
        """Hand all of `batch` to the producer, in order; the future returned completes once
        Kafka acknowledged every record, and fails if any failed."""
        assert self._producer is not None, "start() first"
        producer = self._producer
        pending = []
        for out in batch:
            span = self._tracer.start_span(
                "schedule", context=extract(out.trace_carrier) if out.trace_carrier else None,
                kind=trace.SpanKind.PRODUCER, attributes=decision_attributes(out))
            mark_failure(span, out.message)  # a rejection, a dead letter, a failed end
            carrier = carrier_of(span)
            span.end()
            headers = [("content-type", b"application/json")] + [
                (k, v.encode()) for k, v in carrier.items()]
            pending.append(await producer.send(
                out.topic, out.message.to_bytes(), key=out.key.encode(), headers=headers))
        for topic, count in Counter(out.topic for out in batch).items():
            self._published.labels(topic).inc(count)
        return asyncio.ensure_future(self._acknowledged(producer, pending))

    async def _acknowledged(self, producer: AIOKafkaProducer, pending: list) -> list:
        try:
            return await asyncio.gather(*pending)
        except OutOfOrderSequenceNumber:
            async with self._renewing:
                if self._producer is not producer:  # an earlier cycle's failure replaced it
                    raise
                log.warning("Kafka refused the decision producer as out of order (a batch "
                            "was lost in an outage); replacing it")
                fresh = AIOKafkaProducer(**self._options)
                await fresh.start()
                self._producer = fresh
            retire_producer(producer)
            raise
