"""The scheduler benchmark's request producer hands batches to real Kafka at once: the
latency it reports starts when a request is produced, so a producer linger would be counted
as the scheduler's."""

from __future__ import annotations

import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from gpusched_common import topics
from gpusched_scheduler.bench.scheduler import send_batch_now

TOPIC = topics.TopicSpec("gpusched.test.bench-producer", key="none", partitions=1,
                         retention_ms=3600_000)
LINGER_MS = 1000


async def _delivery_s(bootstrap: str, close: bool) -> float:
    """Seconds from handing three records to a producer that lingers 1 s until a consumer
    holds them, sent as closed (`send_batch_now`) or as open batches."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=LINGER_MS)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        tp = TopicPartition(TOPIC.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        records = [(str(i).encode(), b"x" * 100) for i in range(3)]
        started = time.monotonic()
        if close:
            assert await send_batch_now(producer, TOPIC.name, 0, records) == 3
        else:
            batch = producer.create_batch()
            for key, value in records:
                batch.append(key=key, value=value, timestamp=None)
            await producer.send_batch(batch, TOPIC.name, partition=0)
        got = 0
        while got < 3:
            batches = await consumer.getmany(timeout_ms=5000)
            assert batches, "nothing arrived within 5 s"
            got += sum(len(part) for part in batches.values())
        return time.monotonic() - started
    finally:
        await consumer.stop()
        await producer.stop()


async def test_bench_requests_do_not_wait_for_the_producer_linger(stack) -> None:
    bootstrap = stack.endpoints.kafka_bootstrap
    await topics.ensure_topics(bootstrap, (TOPIC,))
    assert await _delivery_s(bootstrap, close=True) < LINGER_MS / 2000
    # what it guards against: an open batch waits out the linger before it is sent
    assert await _delivery_s(bootstrap, close=False) >= 0.9 * LINGER_MS / 1000
