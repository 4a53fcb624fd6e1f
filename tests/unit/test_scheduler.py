"""Scheduler: cluster view, placement policy, and the engine's handlers on an in-memory
broker (TestKafkaBroker): valid requests are placed, bad records are dead-lettered."""

import asyncio
import json
from pathlib import Path

import pytest
from faststream.kafka import KafkaBroker, TestKafkaBroker
from opentelemetry.trace import NoOpTracer

from gpusched_common import topics
from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.contracts import (
    DEAD_LETTER,
    PLACEMENT,
    RESULT_EVENT,
    GpuState,
    NodeState,
    Rejection,
)
from gpusched_scheduler import handlers
from gpusched_scheduler.domain.cluster import ClusterView, Reservation
from gpusched_scheduler.domain.placement import Placed, Unschedulable, place_one
from gpusched_scheduler.engine import SchedulingEngine
from gpusched_scheduler.settings import SchedulerSettings

CONFIG = Path(__file__).resolve().parents[2] / "config"
CATALOG = load_models(CONFIG)
SMALL = CATALOG.get("qwen2.5-1.5b")


def node(node_id: str, free: list[int], models: tuple[str, ...] = (), seq: int = 1,
         active: tuple[str, ...] = ()) -> NodeState:
    return NodeState(node_id=node_id, seq=seq, started_at_ms=0, reported_at_ms=0,
                     active_placement_ids=active,
                     gpus=tuple(GpuState(index=i, uuid=f"{node_id}-{i}", gpu_type="H100-80GB",
                                         memory_total_mib=81559, memory_free_mib=f,
                                         loaded_models=models) for i, f in enumerate(free)))


def test_best_fit_prefers_loaded_model_then_tightest_gpu() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [80000, 40000]), 0)
    view.apply_node_state(node("b", [9000], models=(SMALL.name,)), 0)
    placed = place_one(100, SMALL, view.schedulable_gpus(0, 10_000))
    assert isinstance(placed, Placed) and placed.node_id == "b"
    assert placed.memory_mib == placed.kv_cache_mib  # no weights to load there
    view2 = ClusterView()
    view2.apply_node_state(node("a", [80000, 40000]), 0)
    placed = place_one(100, SMALL, view2.schedulable_gpus(0, 10_000))
    assert isinstance(placed, Placed) and placed.gpu_index == 1


def test_reservations_count_until_the_agent_reports_the_placement() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [10000]), 0)
    view.reserve(Reservation("p1", "a", 0, 6000, SMALL.name))
    assert view.schedulable_gpus(0, 10_000)[0].free_mib == 4000
    # the agent now counts p1 in its own free memory
    view.apply_node_state(node("a", [4000], seq=2, active=("p1",)), 0)
    assert view.schedulable_gpus(0, 10_000)[0].free_mib == 4000


def test_stale_node_state_is_ignored_and_silent_nodes_get_no_work() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [10000], seq=5), 0)
    assert not view.apply_node_state(node("a", [1], seq=4), 0)
    assert view.schedulable_gpus(now_ms=20_000, node_timeout_ms=10_000) == []


def test_a_model_bigger_than_every_gpu_is_permanently_unschedulable() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [81559]), 0)
    out = place_one(100, CATALOG.get("llama-3.1-70b"), view.schedulable_gpus(0, 10_000))
    assert isinstance(out, Unschedulable) and out.permanent and "MiB" in out.reason


def test_no_room_now_means_wait() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [100]), 0)
    out = place_one(100, SMALL, view.schedulable_gpus(0, 10_000))
    assert isinstance(out, Unschedulable) and not out.permanent


@pytest.fixture
def wired() -> tuple[KafkaBroker, SchedulingEngine, dict[str, list[bytes]]]:
    broker = KafkaBroker()
    sent: dict[str, list[bytes]] = {}

    async def publish(message, topic: str, key: str) -> None:
        sent.setdefault(topic, []).append(message.to_bytes())

    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), publish, lambda: 1000, NoOpTracer(),
                              epoch=3, cycle_window_ms=0, node_timeout_ms=10**12)
    handlers.register(broker, engine, SchedulerSettings())
    return broker, engine, sent


async def test_handler_places_a_request_and_dead_letters_garbage(wired) -> None:
    broker, engine, sent = wired
    loop_task = asyncio.create_task(engine.run())
    try:
        async with TestKafkaBroker(broker) as br:
            await br.publish(node("n1", [80000]).to_bytes(), topics.NODE_STATE.name, key=b"n1")
            await br.publish(b"{not json", topics.REQUESTS["standard"].name)
            await br.publish(json.dumps({"tenant": "acme", "model": SMALL.name, "prompt": "hi",
                                         "max_tokens": 4}).encode(),
                             topics.REQUESTS["standard"].name)
    finally:
        loop_task.cancel()
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "not valid JSON" in dead.reason and dead.source_topic.endswith("standard")
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.node_id == "n1" and placement.scheduler_epoch == 3
    assert placement.request.request_id.startswith("kafka-gpusched.requests.standard-")
    assert placement.request.priority_class == "standard"


async def test_unknown_model_from_kafka_gets_a_rejection_with_names(wired) -> None:
    broker, engine, sent = wired
    async with TestKafkaBroker(broker) as br:
        await br.publish(json.dumps({"request_id": "r9", "tenant": "acme", "model": "gpt-9",
                                     "prompt": "x"}).encode(), topics.REQUESTS["batch"].name)
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert isinstance(rejection, Rejection) and rejection.status_code == 404
    assert SMALL.name in rejection.reason
    assert len(sent[topics.DEAD_LETTERS.name]) == 1


async def test_interactive_is_placed_before_batch_that_arrived_earlier(wired) -> None:
    _, engine, sent = wired
    from gpusched_common.contracts import InferenceRequest
    from gpusched_scheduler.domain.queue import Pending

    for rid, cls in (("b1", "batch"), ("i1", "interactive")):
        req = InferenceRequest(request_id=rid, tenant="acme", priority_class=cls,
                               model=SMALL.name, prompt="x", max_tokens=8, created_at_ms=0)
        engine.queue.push(Pending(req, {}, 0, asyncio.get_running_loop().create_future()))
    # room for exactly one: weights + one KV cache
    engine.view.apply_node_state(node("n1", [SMALL.weight_memory_mib + 1]), 0)
    assert await engine.cycle() == 1
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.request.request_id == "i1"
    assert engine.queue.depth()["batch"] == 1
