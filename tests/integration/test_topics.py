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
