"""Every Kafka topic of gpusched: name, key, partitions and cleanup policy, in one place.

Services create them idempotently at start-up with `ensure_topics`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import InvalidReplicationFactorError, TopicAlreadyExistsError
from aiokafka.partitioner import murmur2

from gpusched_common.contracts import PRIORITY_CLASSES, PriorityClass

log = logging.getLogger(__name__)
DESCRIBE_TRIES = 20
DESCRIBE_RETRY_S = 0.25


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    """What the record key is; records with one key stay in order on one partition."""
    partitions: int
    cleanup_policy: Literal["delete", "compact"] = "delete"
    retention_ms: int = 7 * 24 * 3600 * 1000
    partitions_fixed: bool = False
    """The partition count is part of the contract: agents pick the partitions they read by
    it, so a topic that exists already must have exactly that many (`ensure_topics`)."""


REQUESTS: dict[PriorityClass, TopicSpec] = {
    cls: TopicSpec(f"gpusched.requests.{cls}", key="request_id", partitions=3)
    for cls in PRIORITY_CLASSES
}
NODE_STATE = TopicSpec("gpusched.node-state", key="node_id", partitions=3, cleanup_policy="compact")
PLACEMENTS = TopicSpec("gpusched.placements", key="node_id", partitions=6, partitions_fixed=True)
"""Each agent reads the one partition its node id hashes to, out of `partitions`."""
RESULTS = TopicSpec("gpusched.results", key="request_id", partitions=6)
USAGE = TopicSpec("gpusched.usage", key="tenant", partitions=6, retention_ms=30 * 24 * 3600 * 1000)
CONTROL = TopicSpec("gpusched.control", key="request_id", partitions=3, partitions_fixed=True)
"""Cancels; every agent reads every partition (no group) and acts on what it runs."""
EVENTS = TopicSpec("gpusched.events", key="tenant or model", partitions=3)
"""Budget and scaling events for operators and autoscalers."""
DEAD_LETTERS = TopicSpec("gpusched.dead-letters", key="source topic", partitions=1)


def request_topic_class(topic: str) -> str:
    """The priority class a request topic carries (`gpusched.requests.<class>`)."""
    return topic.rsplit(".", 1)[-1]


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


def new_topic(spec: TopicSpec, replication_factor: int) -> NewTopic:
    """How `spec` is created. With more than one copy, a write is acknowledged (acks=all)
    once two copies have it (min.insync.replicas 2): a broker lost right after cannot take
    an acknowledged request or usage record with it. Kafka's default, 1, would."""
    return NewTopic(
        name=spec.name,
        num_partitions=spec.partitions,
        replication_factor=replication_factor,
        topic_configs={
            "cleanup.policy": spec.cleanup_policy,
            "retention.ms": str(spec.retention_ms),
            "min.insync.replicas": str(min(2, replication_factor)),
        },
    )


async def ensure_topics(bootstrap: str, specs: tuple[TopicSpec, ...] = ALL_TOPICS,
                        replication_factor: int = 1) -> None:
    """Create any missing topic with `replication_factor` copies of each partition; existing
    topics are left as they are (idempotent). Raises `TopicsNotCreated` with Kafka's reason
    when the cluster refuses one (Kafka answers with errors; it does not raise them), and
    `TopicsMismatch` when one that exists has another partition count than its spec fixes
    (`partitions_fixed`): agents then never saw the placements of some nodes, or the cancels
    on the partitions past the count, and nothing said why."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [new_topic(s, replication_factor) for s in specs if s.name not in existing]
        made: set[str] = set()
        if missing:
            response = await admin.create_topics(missing)
            refused = [(error[0], error[1], error[2] if len(error) > 2 else None)
                       for error in response.topic_errors
                       if error[1] not in (0, TopicAlreadyExistsError.errno)]
            if refused:
                raise TopicsNotCreated(refused, replication_factor)
            made = {error[0] for error in response.topic_errors if error[1] == 0}
            log.info("created topics %s", sorted(made))
        # those made here have their counts; one made meanwhile by someone else (Kafka's
        # auto-create, an operator) answered "already exists" and is looked at too
        fixed = {s.name: s.partitions for s in specs if s.partitions_fixed and s.name not in made}
        if fixed:
            found = await _partition_counts(admin, list(fixed))
            wrong = {name: (n, found[name]) for name, n in fixed.items() if found[name] != n}
            if wrong:
                raise TopicsMismatch(wrong)
    finally:
        await admin.close()


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]
                            ) -> dict[str, int | None]:
    """Each topic's partition count, None for one Kafka still does not describe after a few
    seconds (a topic made a moment ago is not known to every broker at once)."""
    found: dict[str, int | None] = dict.fromkeys(names)
    for _ in range(DESCRIBE_TRIES):
        for t in await admin.describe_topics([n for n in names if found[n] is None]):
            if t.get("error_code", 0) == 0:
                found[t["topic"]] = len(t["partitions"])
        if all(n is not None for n in found.values()):
            break
        await asyncio.sleep(DESCRIBE_RETRY_S)
    return found


class TopicsMismatch(RuntimeError):
    """Topics that exist with another partition count than gpusched needs."""

    def __init__(self, wrong: dict[str, tuple[int, int | None]]) -> None:
        super().__init__("; ".join(
            (f"{name} has {has} partitions, gpusched needs exactly {needs}" if has is not None
             else f"Kafka did not describe {name} (it needs exactly {needs} partitions)")
            for name, (needs, has) in sorted(wrong.items()))
            + " (agents pick the partitions they read by that count): delete the topic and "
            "let gpusched create it, or create it with that many")


class TopicsNotCreated(RuntimeError):
    """Kafka refused to create topics; the message has its reason for each."""

    def __init__(self, refused: list[tuple[str, int, str | None]],
                 replication_factor: int) -> None:
        reasons = "; ".join(f"{topic}: {message or f'error code {code}'}"
                            for topic, code, message in refused)
        hint = (f" (GPUSCHED_KAFKA_REPLICATION_FACTOR is {replication_factor}: at most the "
                "number of brokers)" if any(code == InvalidReplicationFactorError.errno
                                            for _, code, _ in refused) else "")
        super().__init__(f"Kafka did not create the topics: {reasons}{hint}")
