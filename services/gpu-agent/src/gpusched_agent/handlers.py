"""Kafka subscribers of the agent: this node's share of the placements topic (placements and
preempts), and every partition of the control topic (cancels)."""

from __future__ import annotations

import logging

from aiokafka.structs import ConsumerRecord
from faststream import AckPolicy
from faststream.kafka import TopicPartition
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.subscriber.usecase import LogicSubscriber
from prometheus_client import Counter
from pydantic import ValidationError

from gpusched_agent.runtime import AgentRuntime, Reused, Stale
from gpusched_common import topics
from gpusched_common.broker import Broker
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.contracts import CANCEL, PLACEMENT_COMMAND, invalid_fields
from gpusched_common.kafka_records import dead_letter

log = logging.getLogger(__name__)
SERVICE = "gpu-agent"


def register(broker: Broker, runtime: AgentRuntime, commands: Counter,
             lag: ConsumerLag | None = None) -> LogicSubscriber:
    """`commands` counts commands by type and outcome (started, stale, invalid, ...); the
    placements consumer is measured in `lag` (commands waiting unread: work not started, and
    work not stopped). Returns the placements subscriber, for `hold_command_position` once
    the broker runs."""
    # Placements are keyed by node id: this agent reads only the partition its id hashes
    # to, committing offsets in its own group so a restart resumes where it stopped. The
    # other nodes' commands there are skipped, and make no span in their requests' traces.
    partition = topics.partition_for_key(runtime.node_id, topics.PLACEMENTS.partitions)
    ours = runtime.node_id.encode()
    broker.trace_only_keys(topics.PLACEMENTS.name, ours)

    async def reject(record: ConsumerRecord, reason: str) -> None:
        await broker.publish(dead_letter(record, reason, SERVICE, runtime.now_ms()).to_bytes(),
                             topics.DEAD_LETTERS.name, key=record.topic.encode())

    async def ours_to_report(record: ConsumerRecord) -> bool:
        """Whether this agent dead-letters `record`, which others may read too: the first of
        them to claim it does, once."""
        return await runtime.first_to_report(f"{record.topic}:{record.partition}:"
                                             f"{record.offset}")

    group = f"gpusched-agent-{runtime.node_id}"
    placements = broker.subscriber(
        partitions=[TopicPartition(topics.PLACEMENTS.name, partition)],
        group_id=group, auto_offset_reset="latest", ack_policy=AckPolicy.NACK_ON_ERROR)
    if lag is not None:
        lag.watch(group, lambda: placements.consumer)

    @placements
    async def on_placement(msg: KafkaMessage) -> None:
        record = msg.raw_message
        if record.key and record.key != ours:
            return  # another node's command sharing this partition
        try:
            command = PLACEMENT_COMMAND.validate_json(record.value)
        except ValidationError as exc:
            commands.labels("unknown", "invalid").inc()
            if not record.key and not await ours_to_report(record):
                return  # keyless: every agent sharing the partition read it
            reason = f"not a placement or preempt: {invalid_fields(exc)}"
            log.error("command at offset %s dead-lettered: %s", record.offset, reason)
            await reject(record, reason)
            return
        outcome = await runtime.command(command)
        commands.labels(command.type, type(outcome).__name__.lower()).inc()
        if isinstance(outcome, Stale | Reused):
            log.warning("rejected %s %s: %s", command.type, getattr(command, "placement_id", ""),
                        outcome.reason)
            await reject(record, outcome.reason)

    @broker.subscriber(partitions=[TopicPartition(topics.CONTROL.name, p)
                                   for p in range(topics.CONTROL.partitions)],
                       group_id=None, auto_offset_reset="latest")
    async def on_control(msg: KafkaMessage) -> None:
        record = msg.raw_message
        try:
            cancel = CANCEL.validate_json(record.value or b"")
        except ValidationError as exc:
            commands.labels("unknown", "invalid").inc()
            # every agent reads it: the first to claim it dead-letters it, once
            if await ours_to_report(record):
                reason = f"not a cancel: {invalid_fields(exc)}"
                log.error("control record at %s:%s dead-lettered: %s", record.partition,
                          record.offset, reason)
                await reject(record, reason)
            return
        outcome = runtime.cancel(cancel)
        commands.labels("cancel", type(outcome).__name__.lower()).inc()

    return placements


async def hold_command_position(placements: LogicSubscriber) -> None:
    """On this node's first run, commit where its commands start, before the agent reports
    itself. `latest` is otherwise resolved a fetch round-trip after start, so a placement the
    scheduler sends as soon as it sees the node could land before that position and be
    skipped; and a run that ends before committing anything would leave the next run to
    skip whatever was sent meanwhile. Reading a command twice is harmless (the ledger claims
    each placement once)."""
    consumer = placements.consumer
    (tp,) = consumer.assignment()
    if await consumer.committed(tp) is None:
        await consumer.commit({tp: await consumer.position(tp)})
