"""Kafka subscribers of the scheduler for the cluster view: thin adapters from records to
the engine. (The request topics, the hot path, are read by `adapters/requests.py`.)"""

from __future__ import annotations

from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from gpusched_common import topics
from gpusched_common.broker import RAW_BATCH
from gpusched_scheduler.engine import SchedulingEngine

USAGE_FETCH_MIN_BYTES = 64 * 1024


def register_cluster(broker: KafkaBroker, engine: SchedulingEngine) -> None:
    """Node state, usage and cancels: every instance, leader or standby, keeps its view
    warm."""

    # The compacted topic is read from the start by every scheduler (no group).
    @broker.subscriber(topics.NODE_STATE.name, batch=True, group_id=None,
                       auto_offset_reset="earliest", batch_timeout_ms=5, **RAW_BATCH)
    async def on_node_state(msg: KafkaMessage) -> None:
        await engine.node_states(list(msg.raw_message))

    # Usage: measured consumption for fair share; final records end placements. Batched
    # by the broker (up to 20 ms or 64 KiB per fetch): each batch costs a handler call and
    # its middlewares, and a reservation released 20 ms later changes little.
    @broker.subscriber(topics.USAGE.name, batch=True, group_id=None,
                       auto_offset_reset="latest", batch_timeout_ms=5,
                       fetch_min_bytes=USAGE_FETCH_MIN_BYTES, fetch_max_wait_ms=20, **RAW_BATCH)
    async def on_usage(msg: KafkaMessage) -> None:
        await engine.usage(list(msg.raw_message))

    # Cancels: a request still waiting ends unplaced; each is kept in Redis for agents that
    # were down. From the end, as the agents read them: a leader that missed one places the
    # request, and its agent ends it.
    @broker.subscriber(topics.CONTROL.name, batch=True, group_id=None,
                       auto_offset_reset="latest", batch_timeout_ms=5, **RAW_BATCH)
    async def on_control(msg: KafkaMessage) -> None:
        await engine.cancels(list(msg.raw_message))
