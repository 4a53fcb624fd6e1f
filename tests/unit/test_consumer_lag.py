"""The consumer lag gauge (gpusched_common.consumer_lag) and the consumers that serve it:
accounting's usage consumer (usage not billed yet), the scheduler leader's request
consumers (requests unread beyond those it holds), each agent's placements consumer
(commands not acted on) and the router's status groups (outcomes and requests not stored
yet). Kafka's answers come from a stand-in consumer with aiokafka's calls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import TopicPartition
from fastapi import FastAPI
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from gpusched_accounting import handlers as accounting_handlers
from gpusched_accounting.domain import budgets
from gpusched_accounting.domain.usage import load_prices
from gpusched_agent import handlers as agent_handlers
from gpusched_agent import main as agent_main
from gpusched_agent.settings import AgentSettings
from gpusched_common import consumer_lag, topics, web
from gpusched_common.broker import make_broker
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.settings import (
    REPO_CONFIG_DIR,
    KafkaSettings,
    RedisSettings,
    TelemetrySettings,
)
from gpusched_router import main as router_main
from gpusched_router.settings import RouterSettings
from gpusched_scheduler.adapters import requests as request_adapter
from gpusched_scheduler.adapters.requests import RequestConsumer

LAG = "gpusched_consumer_lag_records"


class Consumer:
    """An aiokafka consumer as the lag measure sees it: its assigned partitions, its
    position on each, and each one's end offset; `fails` makes Kafka unreachable, and while
    `answer` is set, positions wait for it (never set: Kafka never answers)."""

    def __init__(self, positions: dict[TopicPartition, int],
                 ends: dict[TopicPartition, int]) -> None:
        self.positions, self.ends = positions, ends
        self.fails = False
        self.answer: asyncio.Event | None = None

    def assignment(self) -> set[TopicPartition]:
        return set(self.positions)

    async def position(self, tp: TopicPartition) -> int:
        if self.answer is not None:
            await self.answer.wait()
        return self.positions[tp]

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        if self.fails:
            raise KafkaConnectionError("no broker")
        return {tp: self.ends[tp] for tp in partitions}


def served(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    """(service, group, topic) -> records, of every lag series served."""
    return {(s.labels["service"], s.labels["group"], s.labels["topic"]): s.value
            for family in registry.collect() if family.name == LAG for s in family.samples}


def usage_consumer(position: int, end: int) -> Consumer:
    tp = TopicPartition(topics.USAGE.name, 0)
    return Consumer({tp: position}, {tp: end})


async def test_lag_is_each_topics_end_less_position_summed_over_the_partitions_assigned() -> None:
    registry = CollectorRegistry()
    lag = ConsumerLag("svc", registry)
    a0, a1, b0 = TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 2)
    consumer = Consumer({a0: 10, a1: 5, b0: 7}, {a0: 40, a1: 5, b0: 7})
    lag.watch("g", lambda: consumer)
    await lag.measure()
    assert served(registry) == {("svc", "g", "a"): 30, ("svc", "g", "b"): 0}

    # a rebalance took topic b's partition away, and a record came on a1
    del consumer.positions[b0]
    consumer.ends[a1] = 6
    await lag.measure()
    assert served(registry) == {("svc", "g", "a"): 31}


async def test_a_consumer_that_does_not_run_or_is_forgotten_serves_no_series() -> None:
    """Not started, stopped, or a scheduler that stepped down: a lag left behind would add
    to the consumer that reads those partitions now."""
    registry = CollectorRegistry()
    lag = ConsumerLag("svc", registry)
    running: list[Consumer] = []
    lag.watch("g", lambda: running[0] if running else None)
    await lag.measure()
    assert served(registry) == {}

    running.append(usage_consumer(3, 10))
    await lag.measure()
    assert served(registry) == {("svc", "g", topics.USAGE.name): 7}
    running.clear()
    await lag.measure()
    assert served(registry) == {}

    running.append(usage_consumer(3, 10))
    await lag.measure()
    lag.forget("g")
    assert served(registry) == {}
    await lag.measure()
    assert served(registry) == {}


async def test_a_measure_that_fails_or_hangs_keeps_the_last_and_the_others_are_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kafka away must not stop the other groups' measures, nor the loop."""
    monkeypatch.setattr(consumer_lag, "MEASURE_TIMEOUT_S", 0.05)
    registry = CollectorRegistry()
    lag = ConsumerLag("svc", registry)
    stalled, fine = usage_consumer(0, 100), usage_consumer(0, 5)
    lag.watch("stalled", lambda: stalled)
    lag.watch("fine", lambda: fine)
    await lag.measure()
    stalled.fails = True
    stalled.ends = {tp: 200 for tp in stalled.ends}
    fine.positions = {tp: 5 for tp in fine.positions}
    await lag.measure()
    assert served(registry) == {("svc", "stalled", topics.USAGE.name): 100,
                                ("svc", "fine", topics.USAGE.name): 0}

    stalled.fails, stalled.answer = False, asyncio.Event()
    await lag.measure()
    assert served(registry)[("svc", "stalled", topics.USAGE.name)] == 100
    stalled.answer = None
    await lag.measure()
    assert served(registry)[("svc", "stalled", topics.USAGE.name)] == 200


async def test_a_group_that_cannot_be_measured_for_a_while_serves_no_series(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept for good, the last measure of a consumer cut off from its partitions after it
    had caught up said 0 behind while it read nothing, and the billing alert, reading lag
    against what accounting applies (0/0), never fired. After STALE_AFTER_FAILURES failed
    measures in a row it serves nothing, which an alert on the series' absence sees; a
    measure that works serves it again."""
    registry = CollectorRegistry()
    lag = ConsumerLag("svc", registry)
    cut_off = usage_consumer(100, 100)
    lag.watch("usage", lambda: cut_off)
    await lag.measure()
    cut_off.fails = True
    for _ in range(consumer_lag.STALE_AFTER_FAILURES - 1):
        await lag.measure()
        assert served(registry) == {("svc", "usage", topics.USAGE.name): 0}
    await lag.measure()
    assert served(registry) == {}
    cut_off.fails = False
    await lag.measure()
    assert served(registry) == {("svc", "usage", topics.USAGE.name): 0}


async def test_a_group_forgotten_while_measured_is_not_served_again() -> None:
    """The scheduler steps down (its consumers stop) while a measure waits on Kafka."""
    registry = CollectorRegistry()
    lag = ConsumerLag("svc", registry)
    consumer = usage_consumer(0, 9)
    consumer.answer = answer = asyncio.Event()
    lag.watch("g", lambda: consumer)
    measuring = asyncio.create_task(lag.measure())
    await asyncio.sleep(0.01)
    lag.forget("g")
    answer.set()
    await asyncio.wait_for(measuring, 1)
    assert served(registry) == {}


async def test_accountings_usage_consumer_is_measured_while_it_runs() -> None:
    """Usage waiting on Kafka while accounting applies none (its Redis away) was exported by
    nothing: billing and budgets stopped without a sign."""
    registry = CollectorRegistry()
    lag = ConsumerLag("accounting", registry)
    broker = make_broker(KafkaSettings(), "accounting", None, None)
    accounting_handlers.register(broker, object(), load_prices(REPO_CONFIG_DIR),  # type: ignore[arg-type]
                                 budgets.BudgetTable(), lambda: 0, "gpusched-accounting", 100,
                                 100, trace.get_tracer("test"), registry, lag)
    [usage] = [s for s in broker.subscribers if s.topic_names == [topics.USAGE.name]]
    await lag.measure()
    assert served(registry) == {}  # not started
    usage.consumer = usage_consumer(40, 1040)
    await lag.measure()
    assert served(registry) == {("accounting", "gpusched-accounting", topics.USAGE.name): 1000}


class RequestTopicConsumer(Consumer):
    """A request consumer of one class as RequestConsumer runs it: one partition, behind by
    what `BEHIND` says of its topic."""

    BEHIND = {spec.name: n for n, spec in enumerate(topics.REQUESTS.values(), start=1)}

    def __init__(self, topic: str, **options: object) -> None:
        tp = TopicPartition(topic, 0)
        super().__init__({tp: 10}, {tp: 10 + self.BEHIND[topic]})
        self.group = options["group_id"]

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def getmany(self, timeout_ms: int, max_records: int) -> dict:
        await asyncio.sleep(timeout_ms / 1000)
        return {}


async def test_the_scheduler_serves_its_request_lag_while_it_leads_and_none_once_it_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's request consumers read nothing more while a class holds its pending
    bound: the requests beyond it waited on Kafka, counted nowhere. A standby serves none,
    so that the sum over instances is the leader's."""
    monkeypatch.setattr(request_adapter, "AIOKafkaConsumer", RequestTopicConsumer)

    async def admit(records, commit) -> None:  # noqa: ANN001
        raise AssertionError("nothing is read")

    registry = CollectorRegistry()
    lag = ConsumerLag("scheduler", registry)
    consumer = RequestConsumer("kafka:9092", "c", 256, admit, lambda _cls: None, lag)
    await consumer.start()
    try:
        await lag.measure()
        assert served(registry) == {
            ("scheduler", f"gpusched-scheduler-{cls}", spec.name):
                RequestTopicConsumer.BEHIND[spec.name]
            for cls, spec in topics.REQUESTS.items()}
    finally:
        await consumer.stop()
    assert served(registry) == {}
    await lag.measure()
    assert served(registry) == {}


async def test_an_agents_placements_consumer_is_measured_while_it_runs() -> None:
    """Placements waiting unread on an agent are work not started (and preempts, work not
    stopped): an agent stuck on its commands while its node kept reporting showed nothing,
    and each placement sent to it waited out the scheduler's untaken time-out."""
    registry = CollectorRegistry()
    lag = ConsumerLag("gpu-agent", registry)
    broker = make_broker(KafkaSettings(), "gpu-agent", None, None)
    commands = Counter("commands", "", ["command", "outcome"], registry=CollectorRegistry())
    placements = agent_handlers.register(broker, SimpleNamespace(node_id="node-1"),  # type: ignore[arg-type]
                                         commands, lag)
    await lag.measure()
    assert served(registry) == {}  # not started
    placements.consumer = placement_consumer("node-1", 5, 8)
    await lag.measure()
    assert served(registry) == {("gpu-agent", "gpusched-agent-node-1", topics.PLACEMENTS.name): 3}
    placements.consumer = None  # stopped
    await lag.measure()
    assert served(registry) == {}


class PlacementConsumer(Consumer):
    """An agent's placements consumer: its node's partition, a position committed there
    already (its first run is over)."""

    async def committed(self, tp: TopicPartition) -> int:
        return self.positions[tp]


def placement_consumer(node_id: str, position: int, end: int) -> PlacementConsumer:
    tp = TopicPartition(topics.PLACEMENTS.name,
                        topics.partition_for_key(node_id, topics.PLACEMENTS.partitions))
    return PlacementConsumer({tp: position}, {tp: end})


async def nothing(*args: object, **kwargs: object) -> None:
    return None


async def lag_served(app: FastAPI) -> dict[tuple[str, str, str], float]:
    """(service, group, topic) -> records, of every lag series `app`'s /metrics serves."""
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
        text = (await http.get("/metrics")).text
    return {(s.labels["service"], s.labels["group"], s.labels["topic"]): s.value
            for family in text_string_to_metric_families(text) if family.name == LAG
            for s in family.samples}


async def lag_served_once_measured(app: FastAPI) -> dict[tuple[str, str, str], float]:
    """What `lag_served` says once a first measure has served a series (or after 2 s)."""
    for _ in range(200):
        if lag := await lag_served(app):
            return lag
        await asyncio.sleep(0.01)
    return {}


def lag_measures() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "consumer-lag"]


async def test_the_agent_measures_its_placements_lag_while_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The measure starts with the agent's lifespan and ends with it. Kafka, Redis and the
    runtime's reporting are stubbed out; the placements consumer is a stand-in."""
    registered = []
    register = agent_handlers.register

    def registering(broker, *args):  # noqa: ANN001, ANN202
        registered.append((broker, placements := register(broker, *args)))
        return placements

    monkeypatch.setattr(agent_handlers, "register", registering)
    monkeypatch.setattr(topics, "ensure_topics", nothing)
    app = agent_main.create_app(AgentSettings(
        telemetry=TelemetrySettings(otlp_endpoint=""), simulate="1xH100-80GB", node_id="n",
        redis=RedisSettings(url="redis://127.0.0.1:1/0")))
    [(broker, placements)] = registered
    monkeypatch.setattr(broker, "start", nothing)
    monkeypatch.setattr(broker, "stop", nothing)
    monkeypatch.setattr(app.state.runtime, "recover", nothing)
    monkeypatch.setattr(app.state.runtime, "start_reporting", lambda: None)
    monkeypatch.setattr(app.state.runtime, "drain", nothing)
    placements.consumer = placement_consumer("n", 40, 42)
    assert await lag_served(app) == {}
    async with app.router.lifespan_context(app):
        assert await lag_served_once_measured(app) == {
            ("gpu-agent", "gpusched-agent-n", topics.PLACEMENTS.name): 2}
    assert lag_measures() == []


async def test_the_router_measures_its_status_groups_while_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Outcomes the routers have not stored (GET and Idempotency-Key retries see them late)
    and requests produced straight to Kafka not known yet: each group per topic, measured
    from the router's start to its stop. Kafka is stubbed out; the consumers are
    stand-ins."""
    monkeypatch.setattr(web, "ensure_topics", nothing)
    app = router_main.create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                                redis=RedisSettings(url="redis://127.0.0.1:1/0")))
    broker = app.state.broker
    monkeypatch.setattr(broker, "start", nothing)
    monkeypatch.setattr(broker, "stop", nothing)
    groups = {s.group_id: s for s in broker.subscribers}
    results = TopicPartition(topics.RESULTS.name, 0)
    groups[router_main.STATUS_GROUP].consumer = Consumer({results: 7}, {results: 10})
    requests = {TopicPartition(spec.name, 0): RequestTopicConsumer.BEHIND[spec.name]
                for spec in topics.REQUESTS.values()}
    groups[router_main.SEEN_GROUP].consumer = Consumer(
        dict.fromkeys(requests, 0), requests)
    assert await lag_served(app) == {}
    async with app.router.lifespan_context(app):
        assert await lag_served_once_measured(app) == {
            ("router", router_main.STATUS_GROUP, topics.RESULTS.name): 3,
            **{("router", router_main.SEEN_GROUP, tp.topic): behind
               for tp, behind in requests.items()}}
    assert lag_measures() == []
