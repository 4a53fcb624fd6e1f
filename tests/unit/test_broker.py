"""The shared broker (gpusched_common.broker): what a producer's odd headers do to a
consumer, and which trace a consumed batch's spans land in, on FastStream's in-memory
broker."""

from __future__ import annotations

import pytest
from aiokafka.structs import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import KafkaMessage, TestKafkaBroker
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpusched_common.broker import RAW_BATCH, make_broker
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
