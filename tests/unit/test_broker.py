"""The shared broker (gpusched_common.broker): what a producer's odd headers do to a
consumer, and which trace a consumed batch's spans land in, on FastStream's in-memory
broker."""

from __future__ import annotations

import contextlib
import logging

import pytest
from aiokafka.structs import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import KafkaMessage, TestKafkaBroker
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpusched_common.broker import CONSUMER_LOG, RAW_BATCH, OncePerInterval, make_broker
from gpusched_common.settings import KafkaSettings

TOPIC = "gpusched.test"


class Consumer:
    """What a message's ack and nack call on its consumer."""

    def __init__(self) -> None:
        self.calls: list[object] = []

    async def commit(self) -> None:
        self.calls.append("commit")

    def seek(self, partition, offset: int) -> None:  # noqa: ANN001
        self.calls.append(("seek", offset))


def record(offset: int, headers: list) -> ConsumerRecord:
    value = b'{"n": %d}' % offset
    return ConsumerRecord(topic=TOPIC, partition=0, offset=offset, timestamp=0,
                          timestamp_type=0, key=b"k", value=value, checksum=None,
                          serialized_key_size=1, serialized_value_size=len(value),
                          headers=headers)


def traceparent(trace_id: int) -> tuple[str, bytes]:
    """The W3C trace header of a record sent in trace `trace_id` (sampled)."""
    return "traceparent", f"00-{trace_id:032x}-{trace_id:016x}-01".encode()


ODD_HEADERS = pytest.mark.parametrize("headers", [
    [("x-bin", b"\xff\xfe")], [("x-null", None)],
    [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01"), ("x-bin", b"\xc3")]],
    ids=["not-utf-8", "null", "beside-a-trace"])


@ODD_HEADERS
async def test_a_batch_whose_first_record_has_an_odd_header_is_handled_and_committed(
        headers: list) -> None:
    """The first record of a fetch had a header value FastStream could not decode: the
    parse failed, and so did the nack that parses it again, so the fetch was neither handled
    nor read again, and the next fetch's commit went past it (a usage batch lost unbilled)."""
    broker = make_broker(KafkaSettings(), "test", None, None)
    handled: list[int] = []

    subscriber = broker.subscriber(TOPIC, batch=True, group_id="g",
                                   ack_policy=AckPolicy.NACK_ON_ERROR, **RAW_BATCH)

    @subscriber
    async def on_batch(msg: KafkaMessage) -> None:
        handled.extend(r.offset for r in msg.raw_message)

    consumer = Consumer()
    async with TestKafkaBroker(broker):
        subscriber.parser._setup(consumer)
        await subscriber.consume((record(10, headers), record(11, []), record(12, [])))
    assert handled == [10, 11, 12] and consumer.calls == ["commit"]


@ODD_HEADERS
async def test_a_record_with_an_odd_header_reaches_its_handler(headers: list) -> None:
    """The same for a subscriber of one record at a time (an agent's placements): its
    command was dropped unread."""
    broker = make_broker(KafkaSettings(), "test", None, None)
    handled: list[int] = []

    subscriber = broker.subscriber(TOPIC, group_id="g", ack_policy=AckPolicy.NACK_ON_ERROR)

    @subscriber
    async def on_record(msg: KafkaMessage) -> None:
        handled.append(msg.raw_message.offset)

    consumer = Consumer()
    async with TestKafkaBroker(broker):
        subscriber.parser._setup(consumer)
        await subscriber.consume(record(10, headers))
    assert handled == [10] and consumer.calls == ["commit"]


async def test_a_batch_makes_no_span_in_its_first_records_trace(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """FastStream made a batch's span from its message's headers, the first record's: one
    fetch of three requests' records (the router's results, the scheduler's usage) showed
    up as a span in the first request's trace alone, with whatever its handler published
    under it. A batch now makes no span (what a handler does for one record goes in that
    record's trace); a record consumed alone still continues its trace."""
    broker = make_broker(KafkaSettings(), "test", tracer_provider, None)
    batches = broker.subscriber(TOPIC, batch=True, group_id="g", **RAW_BATCH)
    alone = broker.subscriber(f"{TOPIC}.alone", group_id="g")

    @batches
    async def on_batch(msg: KafkaMessage) -> None:
        await broker.publish(b"{}", f"{TOPIC}.out")

    @alone
    async def on_record(msg: KafkaMessage) -> None:
        pass

    async with TestKafkaBroker(broker):
        batches.parser._setup(Consumer())
        alone.parser._setup(Consumer())
        await batches.consume(tuple(record(n, [traceparent(n)]) for n in (1, 2, 3)))
        await alone.consume(record(4, [traceparent(4)]))
    traced = {s.context.trace_id for s in span_exporter.get_finished_spans()}
    assert not traced & {1, 2, 3} and 4 in traced


async def test_a_handler_that_raises_is_logged_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """The broker was made without a logger: FastStream then said nothing of a handler that
    raised (its records read again, NACK_ON_ERROR), so a usage consumer failing on every
    batch left accounting's log silent. Now it is an ERROR with the traceback, the same one
    repeated at most once per REPEAT_EVERY_S, and no line per record handled."""
    broker = make_broker(KafkaSettings(), "test", None, None)

    @broker.subscriber(TOPIC, group_id="g", ack_policy=AckPolicy.NACK_ON_ERROR)
    async def handle(msg: KafkaMessage) -> None:
        if msg.raw_message.value == b"bad":
            raise RuntimeError("Redis away")

    caplog.set_level(logging.INFO)
    broker._setup_logger()  # noqa: SLF001 - what the broker logs through once it starts
    logs_through = broker.config.logger.logger
    async with TestKafkaBroker(broker) as test_broker:
        broker.config.logger.logger = logs_through  # the test broker puts a mock there
        await test_broker.publish(b"good", TOPIC)
        for _ in range(3):
            with contextlib.suppress(RuntimeError):
                await test_broker.publish(b"bad", TOPIC)
    said = [r for r in caplog.records if r.name == CONSUMER_LOG]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.ERROR, f"RuntimeError: Redis away (topic {TOPIC}, group g)")]
    assert said[0].exc_info is not None


def test_a_repeated_message_passes_once_per_interval_with_how_many_were_dropped() -> None:
    """Told apart by level, text, topic and group: the router's two groups failing on the
    same Redis outage were one message, logged under the first group only."""
    now = [0.0]
    thin = OncePerInterval(30.0, clock=lambda: now[0])

    def passes(text: str, level: int = logging.ERROR, **context: str) -> str | None:
        record = logging.LogRecord("x", level, __file__, 1, text, (), None)
        record.__dict__.update(context)
        return record.getMessage() if thin.filter(record) else None

    assert passes("Kafka error occurred") == "Kafka error occurred"
    now[0] = 10.0
    assert passes("Kafka error occurred") is None
    assert passes("Kafka error occurred", logging.WARNING) == "Kafka error occurred"
    assert passes("Redis away", topic="a", group_id="ga") == "Redis away (topic a, group ga)"
    assert passes("Redis away", topic="b", group_id="gb") == "Redis away (topic b, group gb)"
    assert passes("Redis away", topic="a", group_id="ga") is None
    assert passes("Received", logging.DEBUG) == passes("Received", logging.DEBUG) == "Received"
    now[0] = 31.0
    assert passes("Kafka error occurred") == ("Kafka error occurred (1 more like it in the "
                                              "last 31 s)")
    now[0] = 62.0
    assert passes("Kafka error occurred") == "Kafka error occurred"
