"""Kafka subscriber of the agent: this node's share of the placements topic."""

from __future__ import annotations

import logging

from faststream import AckPolicy
from faststream.kafka import KafkaBroker, TopicPartition
from faststream.kafka.annotations import KafkaMessage
from pydantic import ValidationError

from gpusched_agent.runtime import AgentRuntime
from gpusched_common import topics
from gpusched_common.contracts import PLACEMENT

log = logging.getLogger(__name__)


def register(broker: KafkaBroker, runtime: AgentRuntime) -> None:
    # Placements are keyed by node id: this agent reads only the partition its id hashes
    # to, committing offsets in its own group so a restart resumes where it stopped.
    partition = topics.partition_for_key(runtime.node_id, topics.PLACEMENTS.partitions)

    @broker.subscriber(partitions=[TopicPartition(topics.PLACEMENTS.name, partition)],
                       group_id=f"gpusched-agent-{runtime.node_id}",
                       auto_offset_reset="latest", ack_policy=AckPolicy.NACK_ON_ERROR)
    async def on_placement(msg: KafkaMessage) -> None:
        record = msg.raw_message
        if record.key is not None and record.key.decode(errors="replace") != runtime.node_id:
            return  # another node's placement sharing this partition
        try:
            placement = PLACEMENT.validate_json(record.value)
        except ValidationError:
            log.error("invalid placement at offset %s skipped", record.offset)
            return
        await runtime.accept(placement)
