"""Helpers for tests against the real stack: Kafka reads and polling with a deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from gpusched_ops.services import ServicePorts
from gpusched_ops.testing import TEST_PORTS

T = TypeVar("T")

ADMIN = {"Authorization": "Bearer sk-admin-demo"}
"""The demo admin key's header (config/tenants.yaml): reads every tenant's usage."""

PORT_OFFSET = int(os.environ.get("GPUSCHED_TEST_PORT_OFFSET", "0"))
"""Shifts every test port, so several test sessions can run side by side on one machine."""
TEST_SERVICE_PORTS = ServicePorts(router=28080 + PORT_OFFSET, scheduler=28081 + PORT_OFFSET,
                                  accounting=28082 + PORT_OFFSET, first_agent=28090 + PORT_OFFSET)
INFRA_PORTS = dataclasses.replace(
    TEST_PORTS, **{f.name: getattr(TEST_PORTS, f.name) + PORT_OFFSET
                   for f in dataclasses.fields(TEST_PORTS)})
SERVICE_TEST_ENV = {
    "GPUSCHED_TIME_SCALE": "0.1",   # simulated GPUs run ten times faster than the model says
    "GPUSCHED_HEARTBEAT_S": "1",
    "GPUSCHED_NODE_TIMEOUT_S": "4",
    "GPUSCHED_UNTAKEN_TIMEOUT_S": "10",
    "GPUSCHED_LEASE_TTL_MS": "2000",
    "GPUSCHED_USAGE_INTERVAL_S": "1",  # partial usage records, as in production, but sooner
    # budget flags are checked at start only: a test sets one by hand for a tenant with no
    # budget, which a periodic check would clear under it
    "GPUSCHED_BUDGET_RECHECK_S": "86400",
}



def needs_local_infra(stack) -> None:  # noqa: ANN001 - conftest's RunningStack
    """Skip the calling test where Kafka, Redis and Jaeger run in containers: it stops,
    restarts or pauses one of them, which only the process stack can."""
    if stack.infra_in_containers:
        pytest.skip("stops, restarts or pauses Kafka or Redis, which only the process stack "
                    "can (GPUSCHED_TEST_CONTAINERS is set)")


async def eventually(probe: Callable[[], Awaitable[T | None]], timeout_s: float = 20,
                     interval_s: float = 0.2, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


async def end_offsets(bootstrap: str, topic_names: list[str]) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t in topic_names
                 for p in (consumer.partitions_for_topic(t) or await _partitions(consumer, t))]
        return await consumer.end_offsets(parts)
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()  # noqa: SLF001 - no public equivalent
    return consumer.partitions_for_topic(topic) or set()


READ_CAP_S = 60.0
"""Longest `read_topic` takes to read what a topic held, however short its wait for more."""


async def read_topic(bootstrap: str, topic: str, match: Callable[[bytes | None, bytes], bool],
                     timeout_s: float = 20) -> list[tuple[bytes | None, bytes]]:
    """Every record of `topic` (from the beginning) for which match(key, value) holds. Reads
    all the topic held when called and, with none matching, waits up to timeout_s for one;
    once one matches, reads on to the end each partition had then (so a copy already
    written is seen). An empty fetch was taken for the end: "exactly one" could pass with a
    partition unread, and "none" with the topic unread. Fails past timeout_s or READ_CAP_S,
    whichever is longer, with what the topic held not read."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest")
    found: list[tuple[bytes | None, bytes]] = []
    try:
        async with asyncio.timeout(max(timeout_s, READ_CAP_S)):
            await consumer.start()
            assigned = sorted(consumer.assignment())
            assert assigned, f"{topic}: no partition assigned to the reader"
            ends = await consumer.end_offsets(assigned)
            matched_at_ends = False
            deadline = time.monotonic() + timeout_s
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    found += [(r.key, r.value) for r in records if match(r.key, r.value)]
                if found and not matched_at_ends:
                    ends = await consumer.end_offsets(assigned)
                    matched_at_ends = True
                positions = [(tp, await consumer.position(tp)) for tp in assigned]
                if all(position >= ends[tp] for tp, position in positions) and (
                        found or time.monotonic() >= deadline):
                    return found
    except TimeoutError:
        raise AssertionError(f"{topic} was not read to its end in "
                             f"{max(timeout_s, READ_CAP_S):g} s") from None
    finally:
        await consumer.stop()


class TopicWatch:
    """Records of a topic from the moment the watch started (positions fixed up front, so
    nothing produced after `start()` is missed)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                          enable_auto_commit=False)
        self._topic = topic
        self.records: list[tuple[bytes | None, bytes, int]] = []
        """(key, value, timestamp ms) in arrival order."""

    async def start(self) -> TopicWatch:
        await self._consumer.start()
        parts = [TopicPartition(self._topic, p)
                 for p in (await _partitions(self._consumer, self._topic))]
        self._consumer.assign(parts)
        for tp, offset in (await self._consumer.end_offsets(parts)).items():
            self._consumer.seek(tp, offset)
        return self

    async def poll(self) -> None:
        batch = await self._consumer.getmany(timeout_ms=200)
        for records in batch.values():
            self.records += [(r.key, r.value, r.timestamp) for r in records]

    async def drain(self, quiet_s: float = 1.0) -> None:
        """Read until nothing new arrived for `quiet_s`."""
        deadline = time.monotonic() + quiet_s
        while time.monotonic() < deadline:
            before = len(self.records)
            await self.poll()
            if len(self.records) > before:
                deadline = time.monotonic() + quiet_s

    async def until(self, done: Callable[[list[tuple[bytes | None, bytes, int]]], bool],
                    timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self.records):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            await self.poll()

    async def stop(self) -> None:
        await self._consumer.stop()
