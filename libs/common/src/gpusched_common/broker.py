"""The FastStream Kafka broker every service uses, with tracing and metrics middlewares, and
a producer that is replaced once Kafka refuses it for good."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import OutOfOrderSequenceNumber, ProducerClosed
from aiokafka.structs import ConsumerRecord
from faststream.kafka import KafkaBroker
from faststream.kafka.opentelemetry.provider import (
    KafkaTelemetrySettingsProvider,
    telemetry_attributes_provider_factory,
)
from faststream.kafka.prometheus import KafkaPrometheusMiddleware
from faststream.kafka.response import KafkaPublishCommand
from faststream.opentelemetry import TelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from gpusched_common.settings import KafkaSettings

log = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 5.0
"""How long a replaced producer may take to deliver what it still holds for the partitions
that work, before it is closed anyway."""

CONSUMER_LOG = "gpusched.consumers"
"""The logger FastStream tells through that a handler raised (its records are read again)
or that a fetch failed, at ERROR; each message once per REPEAT_EVERY_S while it repeats.
Its INFO and DEBUG lines (a line per record handled, each rebalance, each consume task's
end) are not logged. Given no logger, it said nothing at all, and a handler failing on
every record (Redis away, a bug) left the service's log silent."""
REPEAT_EVERY_S = 30.0
"""How often the same consumer error is logged again while it goes on (a record read again
after a failure fails again at once, many times a second)."""


class OncePerInterval(logging.Filter):
    """Passes a warning or error the first time, then once per `every_s` while it repeats,
    saying how many like it were dropped meanwhile; passes lower levels as they are. A
    message FastStream gives a record's context for (a handler's failure) names its topic
    and group, and is told apart from others by them, its level and its text."""

    MAX_KEPT = 1000
    """Distinct messages remembered; past it, all are forgotten (each is logged again)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._every_s = every_s
        self._clock = clock
        self._last: dict[tuple[int, str], tuple[float, int]] = {}
        """(level, text) -> (when it was last passed, how many dropped since)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            said = record.getMessage()
        except Exception:  # noqa: BLE001 - the handler's formatting reports it, as without us
            return True
        if topic := getattr(record, "topic", None):
            said += f" (topic {topic}, group {getattr(record, 'group_id', None) or '-'})"
        key = (record.levelno, said)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._every_s:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if len(self._last) >= self.MAX_KEPT:
            self._last.clear()
        self._last[key] = (now, 0)
        if last is not None and last[1]:
            said += f" ({last[1]} more like it in the last {now - last[0]:.0f} s)"
        record.msg, record.args = said, ()
        return True


def consumer_logger() -> logging.Logger:
    """The CONSUMER_LOG logger: warnings and errors, repeats thinned by OncePerInterval."""
    logger = logging.getLogger(CONSUMER_LOG)
    logger.setLevel(logging.WARNING)
    if not any(isinstance(f, OncePerInterval) for f in logger.filters):
        logger.addFilter(OncePerInterval(REPEAT_EVERY_S))
    return logger


class Broker(KafkaBroker):
    """A KafkaBroker whose idempotent producer is replaced when Kafka refuses it as out of order.

    aiokafka numbers each partition's batches as it takes them from its queue. A batch taken
    and then dropped unwritten (one that waited past the 40 s request time-out while Kafka was
    away, and met a partition whose leader Kafka, just back, had not named yet) leaves a gap
    in the numbers, and from then on Kafka refuses every record of that partition as out of
    order (aio-libs/aiokafka#1017): the service could not publish there until restarted.
    A refused record was not written, so `publish` starts a fresh producer (a new producer
    id, numbering from zero), sends the record once more through it, and closes the old one.
    A concurrent publish that meets the old producer closed sends its record again too
    (a closed producer takes nothing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._renewing = asyncio.Lock()
        self._traced_keys: dict[str, set[bytes]] = {}
        """Topic -> the keys whose records are spans (`trace_only_keys`); all where absent."""

    def trace_only_keys(self, topic: str, *keys: bytes) -> None:
        """Make a span of a record of `topic` consumed alone only where it is keyless or
        keyed by one of `keys` (or of those given before): for a subscriber that reads
        records meant for others and skips them. An agent reads the placements partition its
        node id hashes to, every command of the nodes that share it (about 17 of 100 agents
        read each one), and each of them put a span of every such command in its request's
        trace. A keyless record is every reader's (each looks at it): its spans stay."""
        self._traced_keys.setdefault(topic, set()).update(keys)

    def _spans_for(self, msg: object) -> KafkaTelemetrySettingsProvider | None:
        """FastStream's Kafka telemetry for a record consumed alone and for a publish (`msg`
        None); none for a batch (a tuple of records, as many requests'), nor for a record
        meant for another reader (`trace_only_keys`). Its span of a batch went in the trace
        of the first record, whose headers the message carries (`lean_batch_parser`), with
        all the handler published; made from every record's headers, as FastStream would, it
        is a new trace per fetch, several a second per consumer, crowding requests' traces
        out of Jaeger. Batch handlers put what they do for one record in that record's
        trace (`telemetry.record_carrier`)."""
        if isinstance(msg, tuple):
            return None
        keys = self._traced_keys.get(msg.topic) if isinstance(msg, ConsumerRecord) else None
        if keys is not None and msg.key and msg.key not in keys:  # type: ignore[union-attr]
            return None
        return telemetry_attributes_provider_factory(msg)

    async def publish(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        used = self._current_producer()
        try:
            return await super().publish(*args, **kwargs)
        except OutOfOrderSequenceNumber:
            await self._renew_producer(used)
        except ProducerClosed:
            if used is None or self._current_producer() is used:
                raise  # closed, not replaced: the service is stopping
        return await super().publish(*args, **kwargs)

    def _current_producer(self) -> AIOKafkaProducer | None:
        # FastStream keeps the aiokafka producer in its producer wrapper's state; there is
        # none before start, and TestKafkaBroker's fake wrapper has no state
        state = getattr(self.config.producer, "_producer", None)
        return getattr(state, "producer", None)

    async def _renew_producer(self, used: AIOKafkaProducer | None) -> None:
        """Replace `used` with a fresh producer, unless a concurrent publish already did."""
        async with self._renewing:
            if used is None or self._current_producer() is not used:
                return
            log.warning("Kafka refused this service's producer as out of order (a batch was "
                        "lost in an outage); replacing the producer and sending again")
            wrapper = self.config.producer
            # the same options FastStream built the first producer with
            await wrapper.connect(AIOKafkaProducer(**self._connection_kwargs),
                                  wrapper.serializer, wrapper.codec)
        retire_producer(used)


_retiring: set[asyncio.Task[None]] = set()
"""Replaced producers being closed (a reference, so that the tasks run to their end)."""


def retire_producer(producer: AIOKafkaProducer) -> None:
    """Close a replaced producer in the background, letting it first deliver what it holds
    for the partitions Kafka still takes from it (at most RETIRE_TIMEOUT_S); the publish
    that replaced it does not wait for that."""
    async def close() -> None:
        try:
            async with asyncio.timeout(RETIRE_TIMEOUT_S):
                await producer.stop()
        except Exception:  # it was replaced because it failed: nothing more to do with it
            log.warning("closing a replaced Kafka producer failed", exc_info=True)

    task = asyncio.create_task(close(), name="retire-kafka-producer")
    _retiring.add(task)
    task.add_done_callback(_retiring.discard)


def make_broker(
    settings: KafkaSettings,
    service_name: str,
    tracer_provider: TracerProvider | None,
    registry: CollectorRegistry | None,
    **kwargs: object,
) -> Broker:
    """A broker whose every publish and every record consumed alone is a span (W3C context
    in Kafka headers), but for records meant for others (`Broker.trace_only_keys`), and
    every batch consumed none (`Broker._spans_for`); all counted in
    `registry`. Producer waits for the leader's ack (`acks=all` on one node)
    and is idempotent, so a retried send is not duplicated by the broker (see `Broker`).

    Handlers take one argument, the message itself (`msg: KafkaMessage`): no dependency
    injection per call (it resolved the message in a worker thread, about as costly as
    handling a batch), and each handler validates the raw bytes it reads once."""
    middlewares = []
    if registry is not None:
        middlewares.append(KafkaPrometheusMiddleware(registry=registry, app_name=service_name))
    broker = Broker(
        settings.bootstrap,
        client_id=f"gpusched-{service_name}",
        acks="all",
        enable_idempotence=True,
        linger_ms=1,
        middlewares=middlewares,
        apply_types=False,
        parser=readable_parser,
        decoder=_the_message,
        logger=consumer_logger(),
        log_level=logging.DEBUG,
        **kwargs,
    )
    if tracer_provider is not None:  # outermost, before the metrics, as if listed first
        broker.insert_middleware(TelemetryMiddleware[KafkaPublishCommand](
            settings_provider_factory=broker._spans_for, tracer_provider=tracer_provider,
            include_messages_counters=True))  # as FastStream's KafkaTelemetryMiddleware
    return broker


def _is_text(value: object) -> bool:
    if not isinstance(value, bytes):
        return False
    try:
        value.decode()
    except UnicodeDecodeError:
        return False
    return True


def _readable(record: ConsumerRecord) -> ConsumerRecord:
    """`record` without the headers FastStream cannot read: a value that is not UTF-8 text,
    or none. FastStream decodes every header of the record it makes the message of, and one
    it cannot fails the parse, and with it the message's ack or nack: the fetch was then
    neither handled nor read again, and the next one committed past it. gpusched's own
    headers are text; a producer's others are of no use to it."""
    if all(_is_text(value) for _, value in record.headers):
        return record
    return dataclasses.replace(record, headers=tuple(
        (key, value) for key, value in record.headers if _is_text(value)))


async def readable_parser(msg: Any, original: Any) -> Any:
    """FastStream's parsing of a record (or a batch of them) without the headers it cannot
    read (see `_readable`); every subscriber's, unless it has its own."""
    if isinstance(msg, ConsumerRecord):
        return await original(_readable(msg))
    return await original(tuple(_readable(record) for record in msg))


async def lean_batch_parser(records: Any, original: Any) -> Any:
    """FastStream's batch parsing without the per-record work its handlers here never read:
    decoding every record's headers into a dict, and its telemetry's per-record baggage
    (together about as costly as handling the record). The message is FastStream's own, made
    from the first record (its headers readable, see `_readable`) and then given the whole
    batch; no span is made of it (`Broker._spans_for`), so the first record's trace context
    goes nowhere, and batch handlers read each record's own (`telemetry.record_carrier`)."""
    msg = await original((_readable(records[0]),))
    first, last = records[0], records[-1]
    msg.raw_message = records
    msg.body = [r.value or b"" for r in records]
    msg.batch_headers = []
    msg.message_id = f"{first.offset}-{last.offset}-{first.timestamp}"
    return msg


async def _the_message(msg: Any, original: Any) -> Any:
    """What a handler is called with: the message, not its decoded body."""
    return msg


RAW_BATCH: dict[str, Any] = {"parser": lean_batch_parser}
"""Subscriber options for batch handlers that parse `msg.raw_message` themselves."""
