"""The shared broker's parsing (gpusched_common.broker): what a producer's odd headers do to
a consumer, on FastStream's in-memory broker."""

from __future__ import annotations

import pytest
from aiokafka.structs import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import KafkaMessage, TestKafkaBroker

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
