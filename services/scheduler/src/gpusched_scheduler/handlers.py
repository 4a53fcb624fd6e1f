"""Kafka subscribers of the scheduler: thin adapters from records to the engine."""

from __future__ import annotations

from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from gpusched_common import topics
from gpusched_common.broker import RAW_BATCH
from gpusched_scheduler.engine import SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings

CONSUMER_GROUP = "gpusched-scheduler-{}"
"""One group per class: a class's consumer joins or leaves without rebalancing the others."""


def register_requests(broker: KafkaBroker, engine: SchedulingEngine,
                      settings: SchedulerSettings) -> None:
    """Request topics, on the broker that runs only while this instance leads. A batch is
    committed only after all its decisions are published; while the fleet is full the
    handler waits, so no more is fetched (backpressure: at most `fetch_max_records` pending
    per class). NACK_ON_ERROR seeks back and redelivers when publishing failed."""
    for cls, spec in topics.REQUESTS.items():
        @broker.subscriber(spec.name, batch=True, group_id=CONSUMER_GROUP.format(cls),
                           auto_offset_reset="earliest", ack_policy=AckPolicy.NACK_ON_ERROR,
                           max_records=settings.fetch_max_records, batch_timeout_ms=5,
                           max_poll_interval_ms=3_600_000, **RAW_BATCH)
        async def on_requests(msg: KafkaMessage) -> None:
            await engine.admit(list(msg.raw_message))


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
