"""Kafka subscribers of the scheduler: thin adapters from records to the engine."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from gpusched_common import topics
from gpusched_common.broker import RAW_BATCH
from gpusched_scheduler.adapters.offsets import Commit
from gpusched_scheduler.engine import SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings

CONSUMER_GROUP = "gpusched-scheduler-{}"
"""One group per class: a class's consumer joins or leaves without rebalancing the others."""


def register_requests(broker: KafkaBroker, engine: SchedulingEngine,
                      settings: SchedulerSettings) -> None:
    """Request topics, on the broker that runs only while this instance leads. The handler
    returns once a batch is queued; the engine commits each record's offset after its
    decision is published. While a class holds `fetch_max_records` pending, its handler
    waits, so no more is fetched (backpressure). A failed batch is read again (seek back)."""
    for cls, spec in topics.REQUESTS.items():
        @broker.subscriber(spec.name, batch=True, group_id=CONSUMER_GROUP.format(cls),
                           auto_offset_reset="earliest", ack_policy=AckPolicy.MANUAL,
                           max_records=settings.fetch_max_records, batch_timeout_ms=5,
                           max_poll_interval_ms=3_600_000, **RAW_BATCH)
        async def on_requests(msg: KafkaMessage) -> None:
            try:
                await engine.admit(list(msg.raw_message), _committer(msg))
            except Exception:
                await msg.nack()
                raise


def _committer(msg: KafkaMessage) -> Commit | None:
    """The consumer's partial commit; None with the in-memory test broker (no offsets)."""
    consumer = msg.consumer
    return consumer.commit if isinstance(consumer, AIOKafkaConsumer) else None


def register_cluster(broker: KafkaBroker, engine: SchedulingEngine) -> None:
    """Node state and usage: every instance, leader or standby, keeps its view warm."""

    # The compacted topic is read from the start by every scheduler (no group).
    @broker.subscriber(topics.NODE_STATE.name, batch=True, group_id=None,
                       auto_offset_reset="earliest", batch_timeout_ms=5, **RAW_BATCH)
    async def on_node_state(msg: KafkaMessage) -> None:
        engine.node_states(list(msg.raw_message))

    # Usage: measured consumption for fair share; final records end placements.
    @broker.subscriber(topics.USAGE.name, batch=True, group_id=None,
                       auto_offset_reset="latest", batch_timeout_ms=5, **RAW_BATCH)
    async def on_usage(msg: KafkaMessage) -> None:
        await engine.usage(list(msg.raw_message))
