"""Every Kafka topic of gpusched: name, key, partitions and cleanup policy, in one place.

Services create them idempotently at start-up with `ensure_topics`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from aiokafka.partitioner import murmur2

from gpusched_common.contracts import PRIORITY_CLASSES, PriorityClass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    """What the record key is; records with one key stay in order on one partition."""
    partitions: int
    cleanup_policy: Literal["delete", "compact"] = "delete"
    retention_ms: int = 7 * 24 * 3600 * 1000


REQUESTS: dict[PriorityClass, TopicSpec] = {
    cls: TopicSpec(f"gpusched.requests.{cls}", key="request_id", partitions=3)
    for cls in PRIORITY_CLASSES
}
NODE_STATE = TopicSpec("gpusched.node-state", key="node_id", partitions=3, cleanup_policy="compact")
PLACEMENTS = TopicSpec("gpusched.placements", key="node_id", partitions=6)
RESULTS = TopicSpec("gpusched.results", key="request_id", partitions=6)
USAGE = TopicSpec("gpusched.usage", key="tenant", partitions=6, retention_ms=30 * 24 * 3600 * 1000)
CONTROL = TopicSpec("gpusched.control", key="request_id", partitions=3)
"""Cancels; every agent reads every partition (no group) and acts on what it runs."""
EVENTS = TopicSpec("gpusched.events", key="tenant or model", partitions=3)
"""Budget and scaling events for operators and autoscalers."""
DEAD_LETTERS = TopicSpec("gpusched.dead-letters", key="source topic", partitions=1)

ALL_TOPICS: tuple[TopicSpec, ...] = (
    *REQUESTS.values(),
    NODE_STATE,
    PLACEMENTS,
    RESULTS,
    USAGE,
    CONTROL,
    EVENTS,
    DEAD_LETTERS,
)


def partition_for_key(key: str, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as in the Java client) picks."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


async def ensure_topics(bootstrap: str, specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> None:
    """Create any missing topic; existing topics are left as they are (idempotent)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(
                name=s.name,
                num_partitions=s.partitions,
                replication_factor=1,
                topic_configs={
                    "cleanup.policy": s.cleanup_policy,
                    "retention.ms": str(s.retention_ms),
                },
            )
            for s in specs
            if s.name not in existing
        ]
        if missing:
            try:
                await admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass  # another service created it first
            log.info("created topics %s", [t.name for t in missing])
    finally:
        await admin.close()
