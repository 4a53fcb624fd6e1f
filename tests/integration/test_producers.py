"""Producers on the real Kafka after it refused them as out of order (aio-libs/aiokafka#1017):
the services' broker and the scheduler's decision producer replace their producer, so a
service publishes again without a restart, and no record is lost or written twice."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import OutOfOrderSequenceNumber
from aiokafka.structs import TopicPartition
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from stack_helpers import read_topic

from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.contracts import DeadLetter
from gpusched_common.settings import KafkaSettings
from gpusched_scheduler.adapters.decisions import DecisionProducer, Outgoing


async def _one_partition_topic(bootstrap: str) -> str:
    name = f"gpusched.test.producer-{uuid.uuid4().hex[:8]}"
    await topics.ensure_topics(bootstrap, (topics.TopicSpec(name, key="none", partitions=1),))
    return name


def _lose_a_batch(producer: AIOKafkaProducer, topic: str) -> None:
    """What a batch that expired unwritten in an outage leaves behind: the producer counted
    its records, Kafka never saw them, so Kafka refuses the next batch as out of order."""
    producer._txn_manager.increment_sequence_number(TopicPartition(topic, 0), 3)


async def test_the_broker_replaces_a_refused_producer_and_sends_the_record_once(stack) -> None:
    bootstrap = stack.endpoints.kafka_bootstrap
    topic = await _one_partition_topic(bootstrap)
    broker = make_broker(KafkaSettings(bootstrap=bootstrap), "test", None, None)
    await broker.start()
    concurrent = [f"concurrent {i}".encode() for i in range(50)]
    try:
        await broker.publish(b"before", topic, partition=0)
        _lose_a_batch(broker._current_producer(), topic)
        await broker.publish(b"refused, then sent again", topic, partition=0)
        _lose_a_batch(broker._current_producer(), topic)
        # refused together, or meeting the old producer closed: each is sent once
        await asyncio.gather(*(broker.publish(value, topic, partition=0)
                               for value in concurrent))
        await broker.publish(b"after", topic, partition=0)
    finally:
        await broker.stop()
    values = [value for _, value in await read_topic(bootstrap, topic, lambda _k, _v: True)]
    assert values[:2] == [b"before", b"refused, then sent again"] and values[-1] == b"after"
    assert sorted(values[2:-1]) == sorted(concurrent)


async def test_the_decision_producer_is_replaced_and_its_refused_cycle_fails(stack) -> None:
    """The cycle whose records Kafka refused fails (the engine plans it again); the next one
    goes out through a fresh producer."""
    bootstrap = stack.endpoints.kafka_bootstrap
    topic = await _one_partition_topic(bootstrap)
    decisions = DecisionProducer(bootstrap, "test", trace.get_tracer("test"),
                                 CollectorRegistry())

    def cycle(text: str) -> list[Outgoing]:
        letter = DeadLetter(source_topic=topic, partition=0, offset=0, payload=text,
                            reason="test", service="test", at_ms=0)
        return [Outgoing(letter, topic, "k", {})]

    await decisions.start()
    try:
        await (await decisions.send(cycle("first")))
        _lose_a_batch(decisions._producer, topic)
        with pytest.raises(OutOfOrderSequenceNumber):
            await (await decisions.send(cycle("refused")))
        await (await decisions.send(cycle("planned again")))
    finally:
        await decisions.stop()
    records = await read_topic(bootstrap, topic, lambda _k, _v: True)
    payloads = [DeadLetter.model_validate_json(value).payload for _, value in records]
    assert payloads == ["first", "planned again"]
