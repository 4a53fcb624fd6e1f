"""Topic creation at start-up on the real Kafka: idempotent, and a topic Kafka refuses stops
the service with Kafka's reason instead of letting it run against a topic that is missing."""

from __future__ import annotations

import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from gpusched_common import topics


async def test_topics_are_created_once_and_a_refused_one_says_why(stack) -> None:
    bootstrap = stack.endpoints.kafka_bootstrap
    spec = topics.TopicSpec(f"gpusched.test.topics-{uuid.uuid4().hex[:8]}", key="none",
                            partitions=2)
    with pytest.raises(topics.TopicsNotCreated) as refused:
        await topics.ensure_topics(bootstrap, (spec,), replication_factor=3)  # one broker
    assert "replication factor of 3 cannot be reached" in str(refused.value)
    assert "GPUSCHED_KAFKA_REPLICATION_FACTOR is 3" in str(refused.value)
    await topics.ensure_topics(bootstrap, (spec,))
    await topics.ensure_topics(bootstrap, (spec,))  # again: nothing to do, no error
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [described] = await admin.describe_topics([spec.name])
        assert len(described["partitions"]) == 2
        await admin.delete_topics([spec.name])
    finally:
        await admin.close()


async def test_an_existing_topic_whose_partition_count_agents_rely_on_must_match(
        stack) -> None:
    """Agents pick the placements partition they read (and read every control partition) by
    the count in `topics`: a topic an operator created with another count silently starved
    some nodes of their placements, or agents of some cancels. It now stops the service."""
    bootstrap = stack.endpoints.kafka_bootstrap
    name = f"gpusched.test.fixed-{uuid.uuid4().hex[:8]}"
    await topics.ensure_topics(bootstrap, (topics.TopicSpec(name, key="node_id", partitions=2),))
    try:
        with pytest.raises(topics.TopicsMismatch) as wrong:
            await topics.ensure_topics(bootstrap, (topics.TopicSpec(
                name, key="node_id", partitions=3, partitions_fixed=True),))
        assert f"{name} has 2 partitions, gpusched needs exactly 3" in str(wrong.value)
        # a count nothing relies on is left as it is
        await topics.ensure_topics(bootstrap, (topics.TopicSpec(name, key="x", partitions=3),))
        await topics.ensure_topics(bootstrap, (topics.TopicSpec(
            name, key="node_id", partitions=2, partitions_fixed=True),))
    finally:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([name])
        finally:
            await admin.close()
