"""Kafka subscribers of the scheduler: thin adapters from records to the engine."""

from __future__ import annotations

from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from gpusched_common import topics
from gpusched_scheduler.engine import SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings

CONSUMER_GROUP = "gpusched-scheduler"


def register(broker: KafkaBroker, engine: SchedulingEngine, settings: SchedulerSettings) -> None:
    # Requests: committed only after their placements are published (NACK_ON_ERROR seeks
    # back and redelivers when publishing failed).
    for spec in topics.REQUESTS.values():
        @broker.subscriber(spec.name, batch=True, group_id=CONSUMER_GROUP,
                           auto_offset_reset="earliest", ack_policy=AckPolicy.NACK_ON_ERROR,
                           max_records=settings.fetch_max_records, batch_timeout_ms=5)
        async def on_requests(msg: KafkaMessage) -> None:
            await engine.admit(list(msg.raw_message))

    # Node state: the compacted topic is read from the start by every scheduler (no group).
    @broker.subscriber(topics.NODE_STATE.name, batch=True, group_id=None,
                       auto_offset_reset="earliest", batch_timeout_ms=5)
    async def on_node_state(msg: KafkaMessage) -> None:
        engine.node_states(list(msg.raw_message))

    # Final usage records free the memory a placement reserved.
    @broker.subscriber(topics.USAGE.name, batch=True, group_id=None,
                       auto_offset_reset="latest", batch_timeout_ms=5)
    async def on_usage(msg: KafkaMessage) -> None:
        engine.usage(list(msg.raw_message))
