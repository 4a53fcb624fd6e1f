"""Scheduler: cluster view, placement policy, and the engine's handlers on an in-memory
broker (TestKafkaBroker) for node state; request records go to the engine as the request
consumer hands them: valid requests are placed, bad records are dead-lettered."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord, TopicPartition
from faststream.kafka import KafkaBroker, TestKafkaBroker
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracer, StatusCode
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gpusched_agent.adapters.executor import PromptTokens
from gpusched_agent.adapters.ledger import Claim, MemoryLedger, RedisLedger, Taken
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.inventory import parse_simulated
from gpusched_agent.domain.node import NodeModel
from gpusched_agent.runtime import AgentRuntime
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import (
    Tenant,
    TenantDirectory,
    TenantQuota,
    load_models,
    load_tenants,
    weights_name,
)
from gpusched_common.contracts import (
    DEAD_LETTER,
    EVENT,
    PLACEMENT,
    RESULT_EVENT,
    Cancel,
    GpuState,
    InferenceRequest,
    LoadFailure,
    NodeState,
    Placement,
    Preempt,
    Rejection,
    RequestResult,
    Resume,
    TokenChunk,
    UsageRecord,
)
from gpusched_common.redis_client import make_redis
from gpusched_common.redis_keys import (
    BUDGET_EXHAUSTED_KEY,
    SCHEDULER_EPOCH_KEY,
    SCHEDULER_RUNNING_KEY,
)
from gpusched_common.settings import KafkaSettings, RedisSettings, TelemetrySettings
from gpusched_common.telemetry import carried_span, make_tracer_provider
from gpusched_scheduler import handlers
from gpusched_scheduler.adapters.decisions import DecisionProducer
from gpusched_scheduler.adapters.redis_state import (
    LEADER_KEY,
    TRACES_KEY,
    Filed,
    LeaderLease,
    RunningStore,
    SpentBudget,
)
from gpusched_scheduler.domain.cluster import ClusterView, Reservation
from gpusched_scheduler.domain.ordering import Chunk, FairShare, order_pending
from gpusched_scheduler.domain.planner import (
    NodeSpecCache,
    fleet_gpu_mib,
    memory_per_gpu,
    out_of_reach,
    plan_cycle,
    snapshot,
)
from gpusched_scheduler.domain.queue import Pending, PendingQueue
from gpusched_scheduler.domain.quotas import QuotaBook
from gpusched_scheduler.domain.running import RunningPlacement, RunningSet
from gpusched_scheduler.domain.solver import ClusterState
from gpusched_scheduler.engine import (
    RE_READ_SKEW_MS,
    EngineConfig,
    SchedulingEngine,
    parse_request_record,
)
from gpusched_scheduler.settings import SchedulerSettings

CONFIG = Path(__file__).resolve().parents[2] / "config"
CATALOG = load_models(CONFIG)
SMALL = CATALOG.get("qwen2.5-1.5b")
TARGETS = {"interactive": 1000, "standard": 10_000, "batch": 60_000}
STOPPED_GRACE_MS = EngineConfig().stopped_grace_ms
NODE_TIMEOUT_MS = 10_000


def node(node_id: str, free: list[int], models: tuple[str, ...] = (), seq: int = 1,
         active: tuple[str, ...] = (), idle: tuple[str, ...] = ()) -> NodeState:
    """H100s with `models` loaded on each, of which `idle` run nothing (single-GPU weights)."""
    idle_mib = sum(CATALOG.get(m).weight_memory_mib for m in idle)
    return NodeState(node_id=node_id, seq=seq, started_at_ms=0, reported_at_ms=0,
                     active_placement_ids=active,
                     gpus=tuple(GpuState(index=i, uuid=f"{node_id}-{i}", gpu_type="H100-80GB",
                                         memory_total_mib=81559, memory_free_mib=f,
                                         loaded_models=models, idle_models=idle or None,
                                         kv_cache_free_mib=f + idle_mib)
                                for i, f in enumerate(free)))


def fleet_of(view: ClusterView, now: int = 0) -> Callable[[], list]:
    """`plan_cycle`'s `fleet` as the engine reads it at `now`."""
    return lambda: fleet_gpu_mib(view, now, STOPPED_GRACE_MS)


def plan(view: ClusterView, requests: list[InferenceRequest], now: int = 0,
         running: list | None = None, may_preempt: dict | None = None,
         reclaiming: tuple[str, ...] = (), borrowed: tuple[str, ...] = ()):
    items = [Pending(r, {}, 0) for r in requests]
    chunks = order_pending(items, now, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    snap = snapshot(view, view.live_nodes(now, 10_000))
    return plan_cycle(snap, chunks, CATALOG, "gpusched", running or [], now, may_preempt or {},
                      fleet=fleet_of(view, now), reclaiming=reclaiming,
                      borrowed=borrowed)


def req(rid: str, cls: str = "standard", model: str = "qwen2.5-1.5b", tenant: str = "acme",
        max_tokens: int = 100, num_gpus: int = 1) -> InferenceRequest:
    return InferenceRequest(request_id=rid, tenant=tenant, priority_class=cls, model=model,
                            prompt="x", max_tokens=max_tokens, num_gpus=num_gpus,
                            created_at_ms=0)


def test_prefers_a_gpu_where_the_model_is_loaded() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [80000, 40000]), 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [9000], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    [placed] = plan(view, [req("r")]).placed
    assert placed.node_id == "b"
    assert placed.memory_mib_per_gpu == placed.kv_cache_mib  # no weights to load there


EIGHT_B = CATALOG.get("llama-3.1-8b")
SEVENTY_B = CATALOG.get("llama-3.1-70b")


def test_a_gang_in_the_cycle_leaves_a_request_where_its_model_is_loaded() -> None:
    """The solver holds the last node a workload's largest gang fits for it. Live requests
    share GPUs by memory (1 milli-GPU of share), so the gang still fits beside a request:
    the idle node with the 8B loaded stays the 8B's. Held as a node whose GPUs were all
    free, it sent the 8B to the busy node, which loaded its 16 GB of weights again."""
    busy = node("a", [60000, 80000])
    busy = busy.model_copy(update={"gpus": (
        busy.gpus[0].model_copy(update={"running_requests": 1}), *busy.gpus[1:])})
    free = 81559 - EIGHT_B.weight_memory_mib
    view = ClusterView()
    view.apply_node_state(busy, 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [free, free], models=(EIGHT_B.name,),
                               idle=(EIGHT_B.name,)), 0, NODE_TIMEOUT_MS)
    cycle = plan(view, [req("8b", "interactive", model=EIGHT_B.name),
                        req("tp2", "batch", num_gpus=2)])
    placed = {p.item.request.request_id: p for p in cycle.placed}
    assert placed["8b"].node_id == "b"
    assert placed["8b"].memory_mib_per_gpu == placed["8b"].kv_cache_mib  # weights loaded
    assert placed["tp2"].node_id == "a"


def test_work_that_fits_only_without_idle_models_is_placed_and_they_are_unloaded() -> None:
    """An idle 8B on each GPU leaves 66 GB free, less than a 70B gang needs on each of two
    H100s. Before, the 70B waited for memory no agent ever freed (idle models stay loaded),
    and every lower class waited behind it; now it goes where the agent will unload them."""
    view = ClusterView()
    free = 81559 - EIGHT_B.weight_memory_mib
    view.apply_node_state(node("a", [free, free], models=(EIGHT_B.name,),
                               idle=(EIGHT_B.name,)), 0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("tp2", "interactive", model=SEVENTY_B.name, num_gpus=2),
                            req("b", "batch", model=SMALL.name)])
    [gang] = [p for p in decisions.placed if p.item.request.request_id == "tp2"]
    assert gang.node_id == "a" and sorted(gang.gpu_indices) == [0, 1]
    assert gang.memory_mib_per_gpu == gang.kv_cache_mib + SEVENTY_B.weight_memory_mib // 2
    # the same GPUs while the 8B runs there: nothing to unload, so it waits
    view.apply_node_state(node("a", [free, free], models=(EIGHT_B.name,), seq=2),
                          0, NODE_TIMEOUT_MS)
    assert [p.request.request_id for p in plan(view, [req("tp2", model=SEVENTY_B.name,
                                                          num_gpus=2)]).waiting] == ["tp2"]


def test_a_gangs_shards_count_as_loaded_only_for_work_of_the_same_gang_size() -> None:
    """Two H100s hold halves of the 70B, as an agent reports them after a 2-GPU gang.
    A 1-GPU 70B request needs all 134 GiB on one GPU: refused, as on an empty fleet; a
    2-GPU one uses the shards and reserves only its KV cache. Before, a shard counted as
    the model loaded and the whole 70B was placed on one 80 GB GPU."""
    view = ClusterView()
    shard = weights_name(SEVENTY_B.name, 2)
    free = 81559 - SEVENTY_B.weight_memory_mib // 2
    view.apply_node_state(node("a", [free, free], models=(shard,)), 0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("one", "interactive", model=SEVENTY_B.name)])
    assert not decisions.placed
    [refused] = decisions.rejected
    assert f"weights {SEVENTY_B.weight_memory_mib} + KV" in refused.reason
    [gang] = plan(view, [req("tp2", model=SEVENTY_B.name, num_gpus=2)]).placed
    assert sorted(gang.gpu_indices) == [0, 1] and gang.memory_mib_per_gpu == gang.kv_cache_mib


def test_an_idle_model_stays_loaded_while_its_work_fits_without_unloading() -> None:
    """Unloading is the last resort: work of an idle model goes where it is loaded, and work
    that fits beside idle models does not unload them."""
    view = ClusterView()
    view.apply_node_state(node("a", [60000], models=(EIGHT_B.name,), idle=(EIGHT_B.name,)),
                          0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("8b", model=EIGHT_B.name), req("small", model=SMALL.name)])
    assert {p.item.request.request_id: p.memory_mib_per_gpu - p.kv_cache_mib
            for p in decisions.placed} == {"8b": 0, "small": SMALL.weight_memory_mib}


def test_memory_a_sent_placement_relies_on_is_not_offered_twice() -> None:
    view, cache = ClusterView(), NodeSpecCache()
    free = 81559 - EIGHT_B.weight_memory_mib
    view.apply_node_state(node("a", [free], models=(EIGHT_B.name,), idle=(EIGHT_B.name,)),
                          0, NODE_TIMEOUT_MS)

    def evictable() -> dict:
        cached = snapshot(view, {"a"}, cache).evictable
        assert cached == snapshot(view, {"a"}).evictable
        return cached

    assert evictable() == {"a": ((0, EIGHT_B.weight_memory_mib, frozenset({EIGHT_B.name})),)}
    # sent, not yet reported: 70,000 MiB, 3,757 of them from unloading the 8B
    view.reserve(Reservation("p1", "a", (0,), 70000, "some-model"))
    assert evictable()["a"][0][1] == 81559 - 70000
    # a placement that uses the idle 8B keeps it loaded: nothing to unload there
    view.reserve(Reservation("p2", "a", (0,), 100, EIGHT_B.name))
    assert evictable() == {}


def test_reservations_count_until_the_agent_reports_the_placement() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [10000]), 0, NODE_TIMEOUT_MS)
    view.reserve(Reservation("p1", "a", (0,), 6000, SMALL.name))
    assert view.node_reservations("a") == ({0: 6000}, {0: {SMALL.name}})
    # the agent now counts p1 in its own free memory
    view.apply_node_state(node("a", [4000], seq=2, active=("p1",)), 0, NODE_TIMEOUT_MS)
    assert view.node_reservations("a") == ({}, {})


def test_a_cached_snapshot_equals_a_fresh_one_as_nodes_and_reservations_change() -> None:
    view, cache = ClusterView(), NodeSpecCache()

    def both():
        args = (view, view.live_nodes(0, 10_000))
        cached, fresh = snapshot(*args, cache), snapshot(*args)
        return cached.node_index, fresh.node_index, cached.state, fresh.state

    view.apply_node_state(node("a", [80000, 40000]), 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [9000], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    steps = [lambda: None,
             lambda: view.reserve(Reservation("p1", "a", (1,), 6000, SMALL.name)),
             lambda: view.apply_node_state(node("b", [7000], seq=2), 0, NODE_TIMEOUT_MS),
             lambda: view.release("p1"),
             lambda: view.apply_node_state(node("a", [80000, 40000], seq=2),
                                           0, NODE_TIMEOUT_MS),  # same GPUs
             lambda: view.apply_node_state(node("b", [7000], models=("llama-3.1-8b",), seq=3),
                                           0, NODE_TIMEOUT_MS),
             lambda: view.reserve(Reservation("p2", "b", (0,), 500, SMALL.name)),
             # the agent reports p2 running: its memory is in the agent's numbers now
             lambda: view.apply_node_state(node("b", [6500], models=("llama-3.1-8b",), seq=4,
                                                active=("p2",)), 0, NODE_TIMEOUT_MS),
             lambda: view.apply_node_state(node("c", [1000, 2000]), 0, NODE_TIMEOUT_MS)]
    def decoded(state):
        """Every field, with type and model codes turned back into names (a reused snapshot
        may number them differently)."""
        coded = {"gpu_type", "gpu_models", "type_names", "model_names"}
        plain = {name: getattr(state, name).tolist() if isinstance(getattr(state, name),
                                                                    np.ndarray)
                 else getattr(state, name) for name in state.__dataclass_fields__
                 if name not in coded}
        return plain, [state.type_names[t] for t in state.gpu_type], \
            [{state.model_names[m] for m in row if m >= 0} for row in state.gpu_models]

    for step in steps:
        step()
        cached_index, fresh_index, cached, fresh = both()
        assert cached_index == fresh_index
        assert decoded(cached) == decoded(fresh)


def test_a_reservation_rewrites_only_its_gpu_in_the_cached_snapshot(monkeypatch) -> None:
    view, cache = ClusterView(), NodeSpecCache()
    view.apply_node_state(node("a", [80000, 40000]), 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [9000], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    before = snapshot(view, view.live_nodes(0, 10_000), cache).state
    rebuilt = []
    monkeypatch.setattr(ClusterState, "from_nodes",
                        classmethod(lambda cls, *a, **k: rebuilt.append(a) or None))
    view.reserve(Reservation("p1", "a", (1,), 6000, SMALL.name))
    after = snapshot(view, view.live_nodes(0, 10_000), cache).state
    assert rebuilt == []  # no fresh build
    assert after.gpu_mem_free_mib.tolist() == [80000, 34000, 9000]
    assert before.gpu_mem_free_mib.tolist() == [80000, 40000, 9000]  # left untouched
    view.release("p1")
    assert snapshot(view, view.live_nodes(0, 10_000), cache).state.gpu_mem_free_mib.tolist() \
        == [80000, 40000, 9000]
    assert rebuilt == []


def test_stale_node_state_is_ignored_and_silent_nodes_are_lost_once() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [10000], seq=5), 0, NODE_TIMEOUT_MS)
    assert not view.apply_node_state(node("a", [1], seq=4), 0, NODE_TIMEOUT_MS)
    assert view.live_nodes(now_ms=20_000, node_timeout_ms=10_000) == set()
    assert view.silent(20_000, 10_000) == ["a"]
    view.mark_lost(["a"])
    assert view.silent(21_000, 10_000) == []


def test_a_model_bigger_than_every_gpu_is_rejected_with_the_numbers() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [81559]), 0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("big", model="llama-3.1-70b")])
    [reject] = decisions.rejected
    assert "MiB" in reject.reason and "num_gpus" in reject.reason


def test_work_waits_while_the_fleet_is_silent_or_restarting_instead_of_failing() -> None:
    """Kafka restarting silences every agent past the node time-out, and an agent restarting
    drains its node: nothing fits now, but the GPUs still exist. Before, such requests were
    rejected with "no healthy GPU ... add nodes"."""
    view = ClusterView()
    view.apply_node_state(node("a", [81559]), 0, NODE_TIMEOUT_MS)
    silent = plan(view, [req("r")], now=20_000)  # "a" last heard 20 s ago (time-out 10 s)
    assert not silent.rejected and [p.request.request_id for p in silent.waiting] == ["r"]
    view.apply_node_state(node("a", [81559], seq=2).model_copy(update={"status": "draining"}),
                          20_000, NODE_TIMEOUT_MS)
    draining = plan(view, [req("r")], now=20_000)
    assert not draining.rejected and len(draining.waiting) == 1
    # what no GPU of the fleet can hold is still rejected at once
    [big] = plan(view, [req("big", model="llama-3.1-70b")], now=20_000).rejected
    assert "MiB" in big.reason
    view.apply_node_state(node("a", [81559], seq=3).model_copy(update={"status": "stopped"}),
                          20_000, NODE_TIMEOUT_MS)
    assert plan(view, [req("r")], now=20_000).waiting  # no fleet at all: wait for agents


def test_work_only_a_node_restarting_could_hold_waits_for_it_then_gets_its_422() -> None:
    """A graceful restart reports `stopped`: with another node in the fleet, the 70B work
    only the restarting node could hold got a 422 (the hand-back its drain promised would
    keep its client waiting too), where a crash made it wait. It waits now, for as long
    as an agent restarting takes (`stopped_grace_ms`); a node stopped for good counts no
    more after that."""
    view = ClusterView()
    l4 = node("l4", [22_000]).model_copy(update={"gpus": (node("l4", [22_000]).gpus[0]
                                                          .model_copy(update={
                                                              "gpu_type": "L4-24GB",
                                                              "memory_total_mib": 22_528}),)})
    view.apply_node_state(l4, 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("h", [81559, 81559], seq=2).model_copy(
        update={"status": "stopped"}), 1000, NODE_TIMEOUT_MS)
    seventy = req("r", model="llama-3.1-70b", num_gpus=2)
    waiting = plan(view, [seventy], now=1000 + STOPPED_GRACE_MS)
    assert not waiting.rejected and len(waiting.waiting) == 1
    [gone] = plan(view, [seventy], now=1001 + STOPPED_GRACE_MS).rejected
    assert "no node" in gone.reason


async def test_a_scheduler_started_cold_rejects_nothing_before_every_node_could_report(
) -> None:
    """Its first cycles had read the L4 node's report and not yet the H100 node's, and
    rejected for good (422) the 70B work only the H100 node could hold. For its node
    time-out (`fleet_known_after_ms`) after its first report, within which every live node
    reports, it waits; timed from that report, not from its start (a new pod compiles its
    solver for about 20 s first)."""
    now = [0]
    engine, sent = leading_engine(lambda: now[0], fleet_known_after_ms=10_000)
    l4 = node("l4", [22_000])
    l4 = l4.model_copy(update={"gpus": (l4.gpus[0].model_copy(update={
        "gpu_type": "L4-24GB", "memory_total_mib": 22_528}),)})
    await _cycle_at(engine, now, 20_000, [req("r", model="llama-3.1-70b", num_gpus=2)], l4)
    assert topics.RESULTS.name not in sent and len(engine.queue) == 1
    await _cycle_at(engine, now, 29_999, [])
    assert topics.RESULTS.name not in sent
    await _cycle_at(engine, now, 30_000, [])
    [rejected] = [json.loads(v) for v in sent[topics.RESULTS.name]]
    assert rejected["status_code"] == 422


def test_a_gang_gets_all_its_gpus_on_one_node() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [81559]), 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [81559, 81559]), 0, NODE_TIMEOUT_MS)
    [placed] = plan(view, [req("tp2", model="llama-3.1-70b", num_gpus=2)]).placed
    assert placed.node_id == "b" and sorted(placed.gpu_indices) == [0, 1]


def test_no_room_now_means_wait_and_lower_classes_wait_too() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [SMALL.weight_memory_mib + 50]), 0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("i", "interactive", max_tokens=30_000), req("b", "batch",
                                                                             max_tokens=10)])
    assert not decisions.placed and {p.request.request_id for p in decisions.waiting} == {"i", "b"}


def test_later_units_of_a_blocked_chunk_may_fit_but_later_chunks_wait() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [SMALL.weight_memory_mib + 2 * SMALL.kv_cache_mib(200)]),
                          0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("i-big", "interactive", max_tokens=30_000),
                            req("i-small", "interactive", max_tokens=100),
                            req("b", "batch", max_tokens=100)])
    assert [p.item.request.request_id for p in decisions.placed] == ["i-small"]
    assert [p.request.request_id for p in decisions.waiting] == ["i-big", "b"]


def test_aged_batch_work_goes_before_fresh_interactive_work() -> None:
    items = [Pending(req("b", "batch"), {}, 0),
             Pending(req("i", "interactive"), {}, 299_000)]
    chunks = order_pending(items, 300_001, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    assert [c.name for c in chunks] == ["aged", "interactive"]


@pytest.mark.parametrize("now_ms,chunk_name", [(0, "standard"), (100_000, "aged")])
def test_fair_share_interleaves_tenants_by_weighted_consumption(
        now_ms: int, chunk_name: str) -> None:
    """In a class, and among aged work too: aged work was taken oldest first across
    tenants, so a tenant flooding its class had all its work age first and took every
    placement, and an equal tenant's work waited behind it without bound (a probe: 227 s
    against 2 s with ageing off)."""
    fair = FairShare()
    fair.charge("heavy", 30.0, now_ms / 1000)
    items = [Pending(req(f"h{i}", tenant="heavy"), {}, i) for i in range(3)] + \
        [Pending(req(f"l{i}", tenant="light"), {}, 10 + i) for i in range(3)]
    [chunk] = order_pending(items, now_ms, fair, {"heavy": 3.0, "light": 1.0}, TARGETS, 5.0,
                            lambda p: 4.0)
    assert chunk.name == chunk_name
    # heavy consumed 30 at weight 3 (10 per weight); light starts at 0 and pays 4 per request
    assert [p.request.request_id for p in chunk.items] == ["l0", "l1", "l2", "h0", "h1", "h2"]


def _interactive_behind_two_batch_victims():
    """A cycle's decisions for an interactive request on a node full with two batch
    requests, placed at 0 and 9 s, at 10 s."""
    view = ClusterView()
    view.apply_node_state(node("a", [0], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    victims = [RunningPlacement(placement_id=f"v{i}", node_id="a", gpu_indices=(0,),
                                memory_mib_per_gpu=SMALL.kv_cache_mib(8100),
                                kv_cache_mib=SMALL.kv_cache_mib(8100),
                                estimate_gpu_s=1.0, placed_at_ms=at,
                                request=req(f"b{i}", "batch", max_tokens=8000))
               for i, at in enumerate((0, 9_000))]
    return plan(view, [req("i", "interactive", max_tokens=100)], now=10_000,
                running=victims, may_preempt={"i": 1})


def test_interactive_work_preempts_the_cheapest_batch_victim() -> None:
    full = SMALL.weight_memory_mib + 2 * SMALL.kv_cache_mib(8100)
    decisions = _interactive_behind_two_batch_victims()
    assert full > 0 and not decisions.placed
    [pre] = decisions.preemptions
    assert [v.placement_id for v in pre.victims] == ["v1"]  # the one that lost the least


@pytest.mark.parametrize("budget", [200_000, 0])
def test_a_preemption_plan_says_whether_its_search_finished(monkeypatch, budget) -> None:
    """The solver's search for the cheapest victims stops at its step budget with the best
    plan found so far; the plan carries that (gpusched_scheduler_preemption_plans_total
    counts the ones cut short), which nothing read before."""
    from gpusched_scheduler.domain.solver import preemption

    monkeypatch.setattr(preemption, "SEARCH_BUDGET", budget)
    [pre] = _interactive_behind_two_batch_victims().preemptions
    assert pre.proven_optimal == (budget > 0)


@pytest.mark.parametrize("preemptor,tenant,victim_class", [
    ("interactive", "acme", "batch"),  # class priority
    ("batch", "soylent", "batch"),  # a tenant reclaiming its guarantee from borrowed work
])
def test_preemption_prices_each_earlier_attempt_of_a_victims_request(
        preemptor: str, tenant: str, victim_class: str) -> None:
    """Cheapest by progress alone, a hand-back placed just now was the next victim again
    and again: a simulation saw a borrower's request stopped 79 times in 700 s by a tenant
    reclaiming its guarantee, each stop one of its 100 attempts. Each earlier attempt now
    counts EARLIER_ATTEMPT_GPU_S (30) GPU-seconds more, where the scheduler confirmed the
    retry (`RunningPlacement.retry`)."""
    view = ClusterView()
    view.apply_node_state(node("a", [0], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    victims = [RunningPlacement(placement_id=f"u{i}#{attempt}", node_id="a", gpu_indices=(0,),
                                memory_mib_per_gpu=SMALL.kv_cache_mib(8100),
                                kv_cache_mib=SMALL.kv_cache_mib(8100),
                                estimate_gpu_s=1.0, placed_at_ms=at, retry=bool(attempt) or None,
                                request=req(f"u{i}", victim_class, tenant="umbrella",
                                            max_tokens=8000).model_copy(
                                                update={"attempt": attempt, "requeued":
                                                        "preempted" if attempt else None}))
               for i, (attempt, at) in enumerate(((3, 9_900), (0, 1_000), (0, 5_000)))]

    def victims_of(running: list[RunningPlacement]) -> tuple[list[str], float]:
        decisions = plan(view, [req("p", preemptor, tenant=tenant, max_tokens=100)],
                         now=10_000, running=running, may_preempt={"p": 1 if preemptor ==
                                                                   "interactive" else 0},
                         reclaiming={"p"} if preemptor == "batch" else (),
                         borrowed=[v.placement_id for v in running])
        [pre] = decisions.preemptions
        return [v.placement_id for v in pre.victims], pre.gpu_seconds_lost

    assert victims_of(victims) == (["u2#0"], 5.0)  # not u0#3, placed 0.1 s ago
    # a later attempt the scheduler judged new work (its record only says it is a retry)
    # is priced as a first attempt: `"attempt": 99` made it the last victim of every plan
    judged_new = [victims[0].model_copy(update={"retry": None}), *victims[1:]]
    assert victims_of(judged_new) == (["u0#3"], pytest.approx(0.1))


def test_borrowed_work_is_no_victim_of_its_own_tenant() -> None:
    """A tenant's interactive request preempted the tenant's own borrowed interactive work,
    whose hand-back preempted a sibling in turn, every preemption time-out: the tenant
    gained nothing and a request never ran again. Another tenant may still take it back."""
    view = ClusterView()
    view.apply_node_state(node("a", [0], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    borrowed = [RunningPlacement(placement_id=f"v{i}", node_id="a", gpu_indices=(0,),
                                 memory_mib_per_gpu=SMALL.kv_cache_mib(8100),
                                 kv_cache_mib=SMALL.kv_cache_mib(8100),
                                 estimate_gpu_s=1.0, placed_at_ms=0,
                                 request=req(f"u{i}", "interactive", tenant="umbrella",
                                             max_tokens=8000)) for i in range(2)]
    ids = ("v0", "v1")
    own = plan(view, [req("p", "interactive", tenant="umbrella", max_tokens=100)],
               now=10_000, running=borrowed, may_preempt={"p": 1}, borrowed=ids)
    assert not own.preemptions and not own.placed
    other = plan(view, [req("p", "interactive", tenant="acme", max_tokens=100)],
                 now=10_000, running=borrowed, may_preempt={"p": 1}, borrowed=ids)
    assert len(other.preemptions) == 1


def test_quota_limits_tokens_per_minute_and_inflight() -> None:
    book = QuotaBook()
    quota = TenantQuota(tokens_per_minute=1000, max_inflight_requests=2)
    assert book.check("t", quota, 600, inflight=0, now_ms=0) is None
    book.admit("t", 600, 0)
    over = book.check("t", quota, 600, inflight=1, now_ms=1000)
    assert "tokens per minute" in over.reason and over.retry_after_s == 59
    assert book.check("t", quota, 600, inflight=1, now_ms=61_000) is None
    busy = book.check("t", quota, 1, inflight=2, now_ms=61_000)
    assert "in flight" in busy.reason and busy.retry_after_s is None


def test_a_tokens_per_minute_refusal_says_when_enough_admissions_have_left_the_window() -> None:
    """Before, it named the second the oldest admission left, though this request needed
    two of them gone: a client that waited that long was refused again."""
    book = QuotaBook()
    quota = TenantQuota(tokens_per_minute=1000)
    for at_ms in (0, 10_000, 20_000):
        book.admit("t", 300, at_ms)
    over = book.check("t", quota, 500, inflight=0, now_ms=30_000)
    assert over.retry_after_s == 40 and "retry in 40 s" in over.reason
    assert book.check("t", quota, 500, inflight=0, now_ms=69_999) is not None
    assert book.check("t", quota, 500, inflight=0, now_ms=70_000) is None


@pytest.mark.parametrize("step_back_ms", [30_000, 600_000, 2 * 3_600_000])
def test_a_clock_stepped_back_does_not_stretch_the_tokens_per_minute_window(
        step_back_ms: int) -> None:
    """The scheduler's wall clock is stepped back (NTP, a VM restored): the admissions of
    the minute before the step counted for the whole step, and the 429 said to retry in
    the step plus a minute (past an hour, more than a rejection may say). Now they leave
    the window: the next request fits, and none is ever told to wait more than a minute."""
    book = QuotaBook()
    quota = TenantQuota(tokens_per_minute=1000)
    book.admit("t", 900, 10_000_000)
    now_ms = 10_000_000 - step_back_ms
    assert book.tokens_last_minute("t", now_ms) == 0
    assert book.check("t", quota, 600, inflight=0, now_ms=now_ms) is None
    book.admit("t", 600, now_ms)
    over = book.check("t", quota, 600, inflight=0, now_ms=now_ms + 1000)
    assert over.retry_after_s == 59  # the admission after the step, not the one before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "requeue"]), st.integers(0, 7),
                          st.sampled_from(["acme", "globex", "initech"]),
                          st.integers(1, 4), st.integers(100, 9000), st.integers(0, 2)),
                max_size=40))
def test_each_tenants_running_and_waiting_share_stays_equal_to_a_recount(ops) -> None:
    """What each tenant holds, runs, waits for and has borrowed, kept as placements come
    and go, against a recount (borrowed: oldest first up to the guarantee are inside)."""
    running, queue = RunningSet(), PendingQueue()
    waiting: dict[int, Pending] = {}
    guarantees = {"acme": None, "globex": 9000, "initech": 0}
    for op, i, tenant, gpus, mib, placed_at_ms in ops:
        pid = f"p{i}"
        if op == "add":  # a new placement, or one replacing the same id
            running[pid] = RunningPlacement(
                placement_id=pid, node_id="n", gpu_indices=tuple(range(gpus)),
                memory_mib_per_gpu=mib, kv_cache_mib=mib, estimate_gpu_s=1.0,
                placed_at_ms=placed_at_ms, request=req(pid, tenant=tenant))
        elif op == "remove":
            running.pop(pid, None)
            if i in waiting:
                queue.remove(waiting.pop(i))
        elif queue.push(item := Pending(req(pid, tenant=tenant), {}, 0)):
            waiting[i] = item
        borrowed: set[str] = set()
        for t, guarantee in guarantees.items():
            assert running.memory_mib(t) == sum(r.memory_mib_per_gpu * len(r.gpu_indices)
                                                for r in running.values() if r.tenant == t)
            assert running.count(t) == sum(r.tenant == t for r in running.values())
            assert queue.by_tenant[t] == sum(p.request.tenant == t for p in queue.in_order())
            held = 0
            for r in sorted((r for r in running.values() if r.tenant == t),
                            key=lambda r: (r.placed_at_ms, r.placement_id)):
                held += r.memory_mib
                if guarantee is not None and held > guarantee:
                    borrowed.add(r.placement_id)
        assert running.borrowed(guarantees.get) == borrowed


def leading_engine(clock=lambda: 1000, registry: CollectorRegistry | None = None,
                   store=None, tenants: TenantDirectory | None = None,
                   tracer: trace.Tracer | None = None, **config  # noqa: ANN001
                   ) -> tuple[SchedulingEngine, dict[str, list[bytes]]]:
    """A leading engine whose publishes Kafka acknowledges at once, and what it sent per
    topic; `config` overrides EngineConfig (no micro-batch wait, nodes never time out);
    `tenants` are config/tenants.yaml's unless given; `tracer`, none unless given."""
    sent: dict[str, list[bytes]] = {}

    async def publish(batch):
        for out in batch:
            sent.setdefault(out.topic, []).append(out.message.to_bytes())
        return asyncio.gather()  # acknowledged at once

    engine = SchedulingEngine(CATALOG, tenants or load_tenants(CONFIG), publish, clock,
                              tracer or NoOpTracer(),
                              EngineConfig(**{"cycle_window_ms": 0, "node_timeout_ms": 10**12,
                                              **config}), store=store, registry=registry)
    engine.lead(3, [])
    return engine, sent


def recording_tracer(sample_ratio: float = 1.0) -> tuple[trace.Tracer, InMemorySpanExporter]:
    """The scheduler's tracer as its service makes it, and where its spans are kept."""
    spans = InMemorySpanExporter()
    provider = make_tracer_provider("scheduler", TelemetrySettings(
        otlp_endpoint="", trace_sample_ratio=sample_ratio))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider.get_tracer("scheduler"), spans


class KafkaTakesAll:
    """aiokafka's producer as DecisionProducer uses it: each record taken at once, and kept
    as (topic, value, key, headers)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes, dict[str, bytes]]] = []

    async def send(self, topic: str, value: bytes, key: bytes, headers: list) -> asyncio.Future:
        self.records.append((topic, value, key, dict(headers)))
        taken = asyncio.get_running_loop().create_future()
        taken.set_result(None)
        return taken


def traced_engine(clock=lambda: 1000, **config  # noqa: ANN001
                  ) -> tuple[SchedulingEngine, InMemorySpanExporter,
                             list[tuple[str, bytes, bytes, dict[str, bytes]]]]:
    """A leading engine with the scheduler's tracer, publishing through its DecisionProducer
    (whose Kafka keeps what it takes); its spans and the records it published."""
    tracer, spans = recording_tracer()
    decisions = DecisionProducer("127.0.0.1:1", "test", tracer, CollectorRegistry())
    decisions._producer = kafka = KafkaTakesAll()
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), decisions.send, clock,
                              tracer, EngineConfig(**{"cycle_window_ms": 0,
                                                      "node_timeout_ms": 10**12, **config}))
    engine.lead(3, [])
    return engine, spans, kafka.records


def traceparent(trace_id: int) -> dict[str, str]:
    """A W3C carrier that names trace `trace_id`, as the router sends it."""
    return {"traceparent": f"00-{trace_id:032x}-{trace_id:016x}-01"}


def traced_record(offset: int, request_id: str, trace_id: int | None = None,
                  header: bytes | None = None, model: str = SMALL.name) -> ConsumerRecord:
    """A standard request record, keyed by its id, whose `traceparent` names trace
    `trace_id` (as the router sends them), or is `header` as given; none with neither (one
    produced straight to Kafka)."""
    value = json.dumps({"request_id": request_id, "tenant": "acme", "model": model,
                        "prompt": "hi", "max_tokens": 4}).encode()
    if trace_id is not None:
        header = traceparent(trace_id)["traceparent"].encode()
    headers = () if header is None else (("traceparent", header),)
    return ConsumerRecord(topics.REQUESTS["standard"].name, 0, offset, 1000, 0,
                          request_id.encode(), value, None, 0, len(value), headers)


@pytest.fixture
def wired() -> tuple[KafkaBroker, SchedulingEngine, dict[str, list[bytes]]]:
    broker = make_broker(KafkaSettings(), "scheduler", None, None)
    engine, sent = leading_engine()
    handlers.register_cluster(broker, engine)
    return broker, engine, sent


def request_record(topic: str, offset: int, value: bytes) -> ConsumerRecord:
    """A record as the request consumer hands it to the engine."""
    return ConsumerRecord(topic, 0, offset, 1000, 0, None, value, None, 0, len(value), ())


def node_state_record(offset: int, key: bytes | None, value: bytes | None,
                      timestamp_ms: int = 1000) -> ConsumerRecord:
    """A node-state record (None: a tombstone) written at `timestamp_ms`, as the node-state
    subscriber hands it to the engine."""
    return ConsumerRecord(topics.NODE_STATE.name, 0, offset, timestamp_ms, 0, key, value, None,
                          0, len(value or b""), ())


async def test_a_cycle_span_links_every_request_it_decided() -> None:
    """A cycle decides up to 1,024 requests, and its `scheduling cycle` span is linked to
    each; it kept 128 links (the SDK's default limit) and dropped the rest, so most of a
    busy cycle's requests could not be found from it."""
    tracer, spans = recording_tracer()
    engine, _ = leading_engine(tracer=tracer, max_pending_per_class=1024)
    for n in range(8):
        engine.view.apply_node_state(node(f"n{n}", [80000] * 8), 1000, NODE_TIMEOUT_MS)
    await engine.admit([traced_record(i, f"r{i}", trace_id=i) for i in range(1, 301)])
    assert await engine.cycle() == 300
    [cycle] = [s for s in spans.get_finished_spans() if s.name == "scheduling cycle"]
    assert sorted(link.context.trace_id for link in cycle.links) == list(range(1, 301))


async def test_a_cycle_that_decides_nothing_records_no_span() -> None:
    """While work waited and nothing fit, every cycle (each node's report wakes one, at
    least one a second) recorded a `scheduling cycle` span with nothing placed, each a
    trace of its own, crowding requests' traces out of Jaeger's store. Only a cycle that
    sends something records one."""
    engine, spans, records = traced_engine()
    engine.view.apply_node_state(node("n1", [100]), 1000, NODE_TIMEOUT_MS)  # too small
    await engine.admit([traced_record(0, "r0", trace_id=5)])
    for _ in range(10):
        assert await engine.cycle() == 0
    assert len(engine.queue) == 1 and not records
    assert not [s for s in spans.get_finished_spans() if s.name == "scheduling cycle"]

    engine.view.apply_node_state(node("n1", [80000], seq=2), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    [cycle] = [s for s in spans.get_finished_spans() if s.name == "scheduling cycle"]
    assert cycle.attributes["gpusched.placed"] == 1
    assert [link.context.trace_id for link in cycle.links] == [5]


def trace_of(headers: dict[str, bytes]) -> int:
    """The trace id a record's traceparent names."""
    return int(headers["traceparent"].split(b"-")[1], 16)


async def test_a_request_produced_straight_to_kafka_has_a_trace_of_its_own() -> None:
    """Requests produced to Kafka with no traceparent (or a malformed one) were placed in
    the trace of the cycle that decided them: one trace held every such request of a cycle
    (and their agents' and accounting's spans), and none named its request. Each now has a
    trace of its own, begun by an `admit` span that names it, found in Jaeger by its
    request id; a request the router traced stays in the router's trace."""
    engine, spans, records = traced_engine()
    engine.view.apply_node_state(node("n1", [80000] * 4), 1000, NODE_TIMEOUT_MS)
    await engine.admit([traced_record(0, "r0"), traced_record(1, "r1"),
                        traced_record(2, "r2", header=b"garbage"),
                        traced_record(3, "routed", trace_id=5)])
    assert await engine.cycle() == 4
    trace_ids = {PLACEMENT.validate_json(value).request.request_id: trace_of(headers)
                 for topic, value, _, headers in records if topic == topics.PLACEMENTS.name}
    [cycle] = [s for s in spans.get_finished_spans() if s.name == "scheduling cycle"]
    assert trace_ids["routed"] == 5
    assert len(set(trace_ids.values())) == 4 and cycle.context.trace_id not in trace_ids.values()
    admitted = {s.attributes["gpusched.request_id"]: s for s in spans.get_finished_spans()
                if s.name == "admit"}
    assert sorted(admitted) == ["r0", "r1", "r2"]
    for request_id, span in admitted.items():
        assert span.parent is None and span.context.trace_id == trace_ids[request_id]
        assert span.attributes["gpusched.tenant"] == "acme"


async def test_a_rejection_goes_in_its_requests_trace() -> None:
    """An invalid record's rejection and dead letter were published in a new trace each,
    apart from the trace its traceparent named; now both go in that trace, or, with none,
    in one of their own that names the request."""
    engine, spans, records = traced_engine()
    await engine.admit([traced_record(0, "bad", trace_id=9, model="no-such-model"),
                        traced_record(1, "bad2", model="no-such-model")])
    by_id: dict[str, set[int]] = {}
    for topic, value, _, headers in records:
        message = RESULT_EVENT.validate_json(value) if topic == topics.RESULTS.name else \
            json.loads(DEAD_LETTER.validate_json(value).payload)
        request_id = message.request_id if topic == topics.RESULTS.name else message["request_id"]
        by_id.setdefault(request_id, set()).add(trace_of(headers))
    assert by_id["bad"] == {9}
    [admit] = [s for s in spans.get_finished_spans() if s.name == "admit"]
    assert admit.attributes["gpusched.request_id"] == "bad2"
    assert by_id["bad2"] == {admit.context.trace_id}


async def test_a_decision_that_refuses_its_request_is_a_span_with_status_error() -> None:
    """No span was ever marked as an error: in Jaeger a request rejected or dead-lettered
    looked like one placed. The `schedule` span of a rejection or a dead letter has status
    ERROR now, with its reason; a placement's stays unset (OpenTelemetry: never Ok)."""
    engine, spans, _ = traced_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([traced_record(0, "bad", trace_id=9, model="no-such-model"),
                        traced_record(1, "good", trace_id=5)])
    assert await engine.cycle() == 1
    decided = {s.attributes["gpusched.decision"]: s.status
               for s in spans.get_finished_spans() if s.name == "schedule"}
    assert {d: status.status_code for d, status in decided.items()} == {
        "dead_letter": StatusCode.ERROR, "rejection": StatusCode.ERROR,
        "placement": StatusCode.UNSET}
    assert "no-such-model" in decided["rejection"].description
    assert "no-such-model" in decided["dead_letter"].description


def gpusched_attributes(span) -> dict[str, object]:  # noqa: ANN001
    return {k: v for k, v in span.attributes.items() if k.startswith("gpusched.")}


async def test_a_schedule_span_names_what_it_decides() -> None:
    """A `schedule` span said only its topic and the kind of record: nothing named the
    request, placement or node it decided, so Jaeger found no request's scheduling by its
    id, nor showed where it went. They are named now, as on the router's spans; a preempt,
    in the trace of the request it makes room for, names its victim too."""
    engine, spans, _ = traced_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([traced_record(0, "r", trace_id=5)])
    assert await engine.cycle() == 1
    [placed] = [s for s in spans.get_finished_spans() if s.name == "schedule"]
    assert gpusched_attributes(placed) == {
        "gpusched.decision": "placement", "gpusched.request_id": "r",
        "gpusched.tenant": "acme", "gpusched.priority_class": "standard",
        "gpusched.model": SMALL.name, "gpusched.placement_id": "r#0", "gpusched.node_id": "n1"}

    engine, spans, _ = traced_engine()  # S runs on a's only GPU; interactive I preempts it
    batch = req("S", "batch", model=EIGHT_B.name, tenant="soylent", max_tokens=7990)
    kv, weights = memory_per_gpu(batch, EIGHT_B)
    engine.view.apply_node_state(node("a", [300], models=(EIGHT_B.name,), active=("S#0",)),
                                 1000, NODE_TIMEOUT_MS)
    engine.running["S#0"] = _victim("S#0", batch, (0,), kv + weights, kv)
    urgent = request_record(topics.REQUESTS["interactive"].name, 0, req(
        "I", "interactive", model=EIGHT_B.name, tenant="soylent", max_tokens=7990).to_bytes())
    await engine.admit([replace(urgent, headers=(
        ("traceparent", traceparent(7)["traceparent"].encode()),))])
    assert await engine.cycle() == 1
    [preempt] = [s for s in spans.get_finished_spans() if s.name == "schedule"]
    assert preempt.context.trace_id == 7
    assert gpusched_attributes(preempt) == {
        "gpusched.decision": "preempt", "gpusched.request_id": "I",
        "gpusched.tenant": "soylent", "gpusched.priority_class": "interactive",
        "gpusched.model": EIGHT_B.name, "gpusched.node_id": "a",
        "gpusched.victim_request_id": "S", "gpusched.victim_placement_id": "S#0"}


async def test_a_request_is_placed_and_garbage_dead_lettered(wired) -> None:
    broker, engine, sent = wired
    standard = topics.REQUESTS["standard"].name
    async with TestKafkaBroker(broker) as br:
        await br.publish(node("n1", [80000]).to_bytes(), topics.NODE_STATE.name, key=b"n1")
    await engine.admit([
        request_record(standard, 0, b"{not json"),
        request_record(standard, 1, json.dumps({"tenant": "acme", "model": SMALL.name,
                                                "prompt": "hi", "max_tokens": 4}).encode())])
    assert await engine.cycle() == 1  # admitting queued it; the cycle places it
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "not valid JSON" in dead.reason and dead.source_topic.endswith("standard")
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.node_id == "n1" and placement.scheduler_epoch == 3
    assert placement.request.request_id == "kafka-gpusched.requests.standard-0-1"
    assert placement.request.priority_class == "standard"


@pytest.mark.parametrize("extra,why", [
    ({"resume": {"tokens": ["a"], "streamed_tokens": 0, "next_seq": 0}},
     "resume is set only on a later attempt"),
    ({"attempt": 1}, "attempt 1 with requeued=None"),
    ({"requeued": "preempted"}, "attempt 0 with requeued='preempted'"),
    ({"refused": 1}, "refused 1 on attempt 0"),
    ({"attempt": 1, "requeued": "preempted",
      "resume": {"tokens": ["a"] * 10, "streamed_tokens": 50}}, "resume has 10 tokens, 50"),
])
async def test_a_client_record_that_claims_to_be_a_retry_is_refused(wired, extra, why) -> None:
    """`attempt`, `requeued` and `resume` are gpusched's own, for retries of placed work: a
    Kafka record that sets them against each other gets a 400 and a dead letter with the
    reason. Before, a made-up `resume` ran with its prompt unbilled (the first attempt
    bills it), and 10 resumed tokens came back, unbilled, for max_tokens 3."""
    _, engine, sent = wired
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, 0, json.dumps({
        "request_id": "forged", "tenant": "acme", "model": SMALL.name, "prompt": "hi",
        "max_tokens": 3, **extra}).encode())])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (rejection.request_id, rejection.status_code) == ("forged", 400)
    assert why in rejection.reason
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert dead.reason == rejection.reason and not len(engine.queue)


async def test_a_request_created_in_the_future_is_refused_beyond_five_minutes(wired) -> None:
    """A producer's clock may run a little ahead; a `created_at_ms` more than 5 minutes ahead
    of the scheduler's gets a 400 and a dead letter that says so. Before, 10**20 was taken:
    its result said ttft_ms -1e20, and its max_queue_ms could never run out."""
    _, engine, sent = wired  # the clock reads 1000
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, offset, json.dumps({
        "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
        "max_tokens": 3, "created_at_ms": created, "max_queue_ms": 1000}).encode())
        for offset, (request_id, created) in enumerate(
            [("skewed", 301_000), ("ahead", 301_001), ("far", 10**20)])])
    rejections = {r.request_id: r for r in map(RESULT_EVENT.validate_json,
                                               sent[topics.RESULTS.name])}
    assert set(rejections) == {"ahead", "far"}
    assert all(r.status_code == 400 for r in rejections.values())
    assert "created_at_ms 301001 is 300 s ahead of this scheduler's clock (1000), more " \
        "than 300 s" in rejections["ahead"].reason
    assert len(sent[topics.DEAD_LETTERS.name]) == 2
    assert [p.request.request_id for p in engine.queue.in_order()] == ["skewed"]


def test_a_rejection_quoting_a_records_field_names_fits_in_a_record() -> None:
    """pydantic names every unknown field, and the rejection's reason quoted them whole:
    a record of long field names got a rejection as large as itself, past what Kafka takes
    once JSON escapes its characters again, and its topic stalled behind it."""
    value = json.dumps({"request_id": "r1", "tenant": "acme", "model": "m", "prompt": "x",
                        "\x01" * 150_000: 1}).encode()
    record = ConsumerRecord(topics.REQUESTS["standard"].name, 0, 7, 1000, 0, None, value, None, 0,
                            len(value), ())
    refused = parse_request_record(record, CATALOG, load_tenants(CONFIG), 1000)
    assert refused.rejection is not None
    assert len(refused.rejection.to_bytes()) + len(refused.dead_letter.to_bytes()) < 200_000


async def test_another_request_under_a_taken_id_is_dead_lettered_not_dropped(wired) -> None:
    """A producer reuses an id: a record with another prompt or seed, or in another class, is
    dead-lettered with the reason, while it waits and once it is placed; no rejection goes
    out (it would end the first request). A redelivery, even with a new timestamp, is still
    skipped quietly. Before, the other record vanished without a trace, and the one in
    another class was queued beside the first and placed under the same placement id."""
    broker, engine, sent = wired

    def record(offset: int, cls: str = "standard", prompt: str = "hi",
               created: int = 1000, **extra) -> ConsumerRecord:
        return request_record(topics.REQUESTS[cls].name, offset, json.dumps({
            "request_id": "dup", "tenant": "acme", "model": SMALL.name, "prompt": prompt,
            "max_tokens": 3, "priority_class": cls, "created_at_ms": created,
            **extra}).encode())

    def dead() -> list[str]:
        return [DEAD_LETTER.validate_json(v).reason for v in sent.get(topics.DEAD_LETTERS.name,
                                                                      [])]

    await engine.admit([record(0), record(1, prompt="other"), record(2, created=900)])
    await engine.admit([record(0, "batch"), record(3, seed=7)])
    assert len(dead()) == 3 and all("request_id 'dup' is taken by another request" in d
                                    for d in dead())
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    await engine.admit([record(4, prompt="again"), record(5)])
    assert len(dead()) == 4 and topics.RESULTS.name not in sent
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.request.prompt == "hi" and not len(engine.queue)


async def test_a_retry_of_another_request_under_a_taken_id_is_dead_lettered() -> None:
    """A record of attempt 1 under the id of a request running as attempt 0, but asking for
    something else (another tenant and prompt), was placed as a second run of it: the
    client of the first could have read the other's result."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000, 80000]), 1000, NODE_TIMEOUT_MS)
    standard = topics.REQUESTS["standard"].name

    def record(offset: int, **extra) -> ConsumerRecord:
        return request_record(standard, offset, json.dumps({
            "request_id": "victim", "tenant": "acme", "model": SMALL.name, "prompt": "secret",
            "max_tokens": 3} | extra).encode())

    await engine.admit([record(0)])
    assert await engine.cycle() == 1
    retry = {"attempt": 1, "requeued": "handback"}
    await engine.admit([record(1, tenant="globex", prompt="other", **retry)])
    [letter] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "request_id 'victim' is taken by another request" in letter.reason
    await engine.admit([record(2, **retry)])  # the agent's own hand-back of it
    assert await engine.cycle() == 1
    placements = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert [(p.placement_id, p.request.tenant) for p in placements] == [
        ("victim#0", "acme"), ("victim#1", "acme")]


@pytest.mark.parametrize("placed", [False, True], ids=["waiting", "placed"])
@pytest.mark.parametrize("extra", [
    {"max_token": 5}, {"max_tokens": "5"}, {"tenant": "nobody"}, {"model": "gpt-9"},
    {"priority_class": "batch"}, {"attempt": 1}, {"max_tokens": 32768},
    {"created_at_ms": 1000 + 600_000}],
    ids=["typo", "string", "tenant", "model", "class", "attempt", "context", "ahead"])
async def test_an_invalid_record_under_a_taken_id_ends_no_request(extra: dict,
                                                                   placed: bool) -> None:
    """A record refused as invalid (unparsed, or parsed and refused) under the id of a
    request taken in sent a rejection under that id: the first request's client was told
    it failed, and its status at the router rewritten, while it ran on and was billed. A
    valid record under the id was dead-lettered only, as documented."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "dup", created_at_ms=1000)])
    if placed:
        assert await engine.cycle() == 1
    await engine.admit([_standard_record(1, "dup", **{"created_at_ms": 1000} | extra)])
    [letter] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "request_id 'dup' is taken by a request this scheduler has taken in" in letter.reason
    assert topics.RESULTS.name not in sent
    await engine.cycle()
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.request.prompt == "x"


async def test_a_record_corrected_after_its_rejection_does_not_run_under_the_id() -> None:
    """A producer's record was rejected (a typo), and the corrected one sent again under
    the same id ran: its client had been told it failed, and the router's status kept
    saying so while it ran and was billed (two terminal outcomes under one id). The
    rejection's tenant, where the record names a configured one, lets it read that status
    at the router."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "r-42", max_token=5)])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert rejection.status_code == 400 and rejection.tenant == "acme"
    await engine.admit([_standard_record(1, "r-42")])
    assert await engine.cycle() == 0 and topics.PLACEMENTS.name not in sent
    letters = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "request_id 'r-42' was refused before" in letters[-1].reason
    assert len(sent[topics.RESULTS.name]) == 1


@pytest.mark.parametrize("extra", [{"max_token": 5}, {"model": "gpt-9"}],
                         ids=["unparsed", "parsed"])
async def test_an_invalid_first_attempt_under_a_request_on_its_second_ends_nothing(
        extra: dict) -> None:
    """Only the record's own attempt and earlier ones were looked at: with the request
    running as attempt 1 (its attempt 0 inherited, or forgotten past the last decisions),
    a typo'd attempt-0 record under its id got a rejection that told its client it failed."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "live", attempt=1, requeued="node_lost",
                                         created_at_ms=1000)])
    assert await engine.cycle() == 1 and list(engine.running) == ["live#1"]
    await engine.admit([_standard_record(1, "live", **extra)])
    assert topics.RESULTS.name not in sent
    [letter] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "request_id 'live' is taken by a request this scheduler has taken in" \
        in letter.reason


async def test_a_record_read_while_a_rejection_under_its_id_is_on_its_way_does_not_run(
) -> None:
    """The rejection's id was noted only once Kafka took it: a record under that id read
    meanwhile on another class's topic (each has its own consumer) was queued and placed,
    so one id got a 400 and a run."""
    out: list = []
    engine, acks, kafka = _held_engine(sent=out)
    wrong = request_record(topics.REQUESTS["interactive"].name, 0, json.dumps(
        {"request_id": "r7", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4, "priority_class": "standard"}).encode())
    refusing = asyncio.create_task(engine.admit([wrong], kafka.commit))
    await asyncio.sleep(0)  # its rejection is with Kafka, which is slow to answer
    corrected = asyncio.create_task(engine.admit([_standard_record(0, "r7")], kafka.commit))
    await asyncio.sleep(0)
    for ack in acks:
        ack.set_result(None)
    await refusing
    await corrected
    assert not len(engine.queue)
    assert [type(o.message).__name__ for o in out] == ["DeadLetter", "Rejection", "DeadLetter"]
    assert "request_id 'r7' was refused before" in out[-1].message.reason


class CountsTheChatTemplate(SimulatedExecutor):
    """vLLM behind the agent: with its chat template the prompt is 1,000 tokens, where
    gpusched estimated 3. A first attempt generates until it is stopped; a resumed one ends
    its reply 3 tokens on (the model ends its text)."""

    def generate(self, job):  # noqa: ANN001, ANN202
        async def tokens():  # noqa: ANN202
            if job.prefix:
                for token in (" a", " b", " c"):
                    yield token
                return
            yield PromptTokens(1_000)
            while True:
                await asyncio.sleep(0.002)
                yield " x"
        return tokens()


async def test_a_request_preempted_after_its_engine_counted_a_longer_prompt_completes(
) -> None:
    """Scheduler and agent together: 3 prompt tokens by the estimate plus max_tokens 32,000
    fit qwen2.5-1.5b's 32,768; its engine counted 1,000, and it was preempted after a few
    tokens. The agent handed it back with max_tokens cut to 31,768, which the scheduler took
    for another request under its id: dead-lettered, nothing queued or answered (the
    client's stream stalled until its 504; its status said running for a day). Now it is
    queued, placed again and completes, telling the usage it was billed."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000, 80000]), 1000, NODE_TIMEOUT_MS)
    standard = topics.REQUESTS["standard"].name
    asked = InferenceRequest(request_id="long-1", tenant="acme", model=SMALL.name,
                             prompt="hello there", max_tokens=32_000, created_at_ms=1000)
    await engine.admit([request_record(standard, 0, asked.to_bytes())])
    assert await engine.cycle() == 1
    published: list = []

    async def publish(message, topic, key, wait=True) -> None:  # noqa: ANN001
        published.append(message)

    def of(kind: type) -> list:
        return [m for m in published if isinstance(m, kind)]

    async def settle() -> None:
        async with asyncio.timeout(10):
            while agent.in_flight:
                await asyncio.sleep(0.002)

    agent = AgentRuntime("n1", NodeModel.from_inventory(parse_simulated("2xH100-80GB", "n1")),
                         CATALOG, CountsTheChatTemplate(0.01, seed=7), publish,
                         MemoryLedger(None), lambda: 1_200, chunk_tokens=4, heartbeat_s=1.0)
    await agent.command(PLACEMENT.validate_json(sent[topics.PLACEMENTS.name][-1]))
    async with asyncio.timeout(10):
        while sum(c.token_count for c in of(TokenChunk)) < 5:
            await asyncio.sleep(0.002)
    await agent.command(Preempt(placement_id="long-1#0", request_id="long-1", node_id="n1",
                                scheduler_epoch=3, reason="interactive work"))
    await settle()
    [again] = of(InferenceRequest)

    await engine.admit([request_record(standard, 1, again.to_bytes())])
    assert topics.DEAD_LETTERS.name not in sent and len(engine.queue) == 1
    engine.view.apply_node_state(node("n1", [80000, 80000], seq=2), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    placed = PLACEMENT.validate_json(sent[topics.PLACEMENTS.name][-1])
    assert placed.placement_id == "long-1#1"  # its KV cache sized by its engine's count:
    assert placed.kv_cache_mib == SMALL.kv_cache_mib(32_768)  # 1,000 + the 31,768 left
    await agent.command(placed)
    await settle()
    [result] = of(RequestResult)
    assert (result.status, result.completion_tokens) == ("completed",
                                                         len(again.resume.tokens) + 3)
    billed = of(UsageRecord)
    assert sum(u.prompt_tokens for u in billed) == result.prompt_tokens == 1_000
    assert sum(u.completion_tokens for u in billed) == result.completion_tokens
    assert result.ttft_ms == 200.0  # created at 1,000 ms, its first token at 1,200


async def test_a_handback_that_does_not_parse_still_ends_its_request() -> None:
    """A retry of a placed request that this release cannot read (a newer agent's field)
    is the request's last word: its rejection goes out, or its client never hears."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "h")])
    assert await engine.cycle() == 1
    await engine.admit([_standard_record(1, "h", attempt=1, requeued="handback",
                                         speculative=True)])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (rejection.request_id, rejection.status_code) == ("h", 400)


async def test_a_rejected_record_sent_again_with_only_its_times_corrected_is_not_dropped(
) -> None:
    """Refused as created 10 minutes ahead and sent again under its id without
    created_at_ms, as the rejection advises: the noted identity leaves times out, so the
    corrected record passed as a redelivery and was committed with no answer at all."""
    engine, sent = leading_engine()
    await engine.admit([_standard_record(0, "r-43", created_at_ms=1000 + 600_000)])
    await engine.admit([_standard_record(1, "r-43")])
    assert not len(engine.queue) and len(sent[topics.RESULTS.name]) == 1
    letters = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "request_id 'r-43' was refused before" in letters[-1].reason


async def test_an_id_rejected_at_a_later_attempt_takes_no_corrected_first_attempt() -> None:
    """The rejected id was noted at the attempt its record claimed, and a corrected record
    was looked up at its own attempt and earlier ones: after a record claiming attempt 1
    was rejected, the corrected attempt 0 under its id ran."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "r9", attempt=1, requeued="handback",
                                         max_token=5)])
    await engine.admit([_standard_record(1, "r9")])
    assert await engine.cycle() == 0 and not engine.running
    assert len(sent[topics.RESULTS.name]) == 1


async def test_a_rejection_kafka_may_have_taken_keeps_its_id_taken_and_goes_out_again(
) -> None:
    """The refusal's publish failed (its dead letter refused, its rejection maybe taken):
    the note was dropped, so a corrected record read meanwhile ran beside the rejection.
    Kept, the corrected record is refused, and the refused record read again is rejected
    again (at least once)."""
    failing = [True]
    published: list = []

    async def send(batch):
        if failing[0] and any(isinstance(o.message, Rejection) for o in batch):
            failing[0] = False
            published.extend(batch)  # Kafka took the rejection, then failed the batch
            raise KafkaConnectionError("the dead-letters partition's leader is away")
        published.extend(batch)
        return asyncio.gather()
    engine, _, kafka = _held_engine(send=send)
    typo = _standard_record(0, "r7", max_token=5)
    with pytest.raises(KafkaConnectionError):
        await engine.admit([typo], kafka.commit)
    await engine.admit([_standard_record(1, "r7")], kafka.commit)
    await engine.admit([typo], kafka.commit)  # the batch read again
    assert await engine.cycle() == 0 and not engine.running
    rejections = [o.message for o in published if isinstance(o.message, Rejection)]
    assert [r.request_id for r in rejections] == ["r7", "r7"]


async def test_a_handback_too_large_to_place_is_still_rejected() -> None:
    """The refusal of a retry of the request that goes by its id is that request's end:
    its rejection goes out, though the id is taken (by its own first attempt)."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(0, "big", max_tokens=3)])
    assert await engine.cycle() == 1
    await engine.admit([_standard_record(1, "big", max_tokens=3, attempt=1,
                                         requeued="handback", created_at_ms=1000,
                                         tenant="nobody")])
    await engine.admit([_standard_record(2, "big", max_tokens=3, attempt=1,
                                         requeued="handback", created_at_ms=1000,
                                         model="gpt-9")])
    results = [RESULT_EVENT.validate_json(v) for v in sent.get(topics.RESULTS.name, [])]
    assert results == []  # another request posing as its retry ends nothing
    with patch("gpusched_scheduler.engine.MAX_HANDBACK_BYTES", 100):
        await engine.admit([_standard_record(3, "big", max_tokens=3, attempt=1,
                                             requeued="handback", created_at_ms=1000)])
    results = [RESULT_EVENT.validate_json(v) for v in sent.get(topics.RESULTS.name, [])]
    assert [(r.request_id, r.status_code) for r in results] == [("big", 413)]


async def test_a_record_without_num_gpus_runs_on_its_models_gang_size(wired) -> None:
    """The 70B's 132 GiB need two 80 GB GPUs: models.yaml gives it num_gpus 2, which a
    record without num_gpus gets; one that sets it keeps its own. Before, every record
    defaulted to one GPU, and a 70B request that did not know to ask for two was refused."""
    _, engine, sent = wired
    batch = topics.REQUESTS["batch"].name
    assert CATALOG.get("llama-3.1-70b").num_gpus == 2 and SMALL.num_gpus == 1
    engine.view.apply_node_state(node("n1", [81559] * 8), 1000, NODE_TIMEOUT_MS)
    await engine.admit([request_record(batch, offset, json.dumps({
        "request_id": request_id, "tenant": "acme", "model": model, "prompt": "hi",
        "max_tokens": 3, **extra}).encode()) for offset, (request_id, model, extra) in
        enumerate([("big", SEVENTY_B.name, {}), ("big4", SEVENTY_B.name, {"num_gpus": 4}),
                   ("small", SMALL.name, {})])])
    assert await engine.cycle() == 3
    placed = {p.request.request_id: p for p in map(PLACEMENT.validate_json,
                                                   sent[topics.PLACEMENTS.name])}
    assert {rid: len(p.gpu_indices) for rid, p in placed.items()} == {
        "big": 2, "big4": 4, "small": 1}


async def test_a_request_created_more_than_a_year_ago_is_refused_as_likely_seconds() -> None:
    """Epoch seconds in created_at_ms (a common slip) read as January 1970: a 400 and a dead
    letter say so. Before, it was taken, and its wait and TTFT were reported as 56 years."""
    now_ms = 1_764_840_000_000  # 2025-12-04
    engine, sent = leading_engine(lambda: now_ms)
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, offset, json.dumps({
        "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
        "max_tokens": 3, "created_at_ms": created}).encode())
        for offset, (request_id, created) in enumerate(
            [("seconds", now_ms // 1000), ("backlog", now_ms - 7 * 86_400_000)])])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (rejection.request_id, rejection.status_code) == ("seconds", 400)
    assert "days behind this scheduler's clock" in rejection.reason
    assert "if it is epoch seconds, send milliseconds" in rejection.reason
    assert [p.request.request_id for p in engine.queue.in_order()] == ["backlog"]


async def test_a_request_too_large_to_travel_on_is_refused_with_a_413() -> None:
    """Produced straight to Kafka under the broker's 1 MiB, it would be placed and, once
    preempted with its tokens, be too large a record to hand back."""
    engine, sent = leading_engine(lambda: 1000)
    standard = topics.REQUESTS["standard"].name
    retry = {"attempt": 1, "requeued": "handback"}  # a later one may be larger, to a point

    def chat(chars: int) -> dict:  # a conversation is not counted against the context
        return {"messages": [{"role": "user", "content": "\x01" * chars}]}

    await engine.admit([request_record(standard, offset, json.dumps({
        "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": prompt,
        "max_tokens": 3} | extra).encode()) for offset, (request_id, prompt, extra) in enumerate(
            [("huge", "\x01" * 120_000, {}), ("large", "\x01" * 100_000, {}),
             ("forged", "hi", retry | chat(170_000)), ("again", "hi", retry | chat(120_000))])])
    rejections = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert [(r.request_id, r.status_code, r.code) for r in rejections] == [
        ("huge", 413, "request_too_large"), ("forged", 413, "request_too_large")]
    assert "bytes as gpusched writes it, over the limit of 655360" in rejections[0].reason
    assert "over the limit of 995904" in rejections[1].reason
    assert len(sent[topics.DEAD_LETTERS.name]) == 2
    assert [p.request.request_id for p in engine.queue.in_order()] == ["large", "again"]


@pytest.mark.parametrize("gpus,reason", [
    ([{"memory_total_mib": 10**30, "memory_free_mib": 10**30}], "less than or equal to"),
    ([{"memory_free_mib": 100, "kv_cache_free_mib": 10**30, "loaded_models": ["x"],
       "idle_models": ["x"]}], "less than or equal to"),
    ([{"gpu_type": f"made-up-{i}"} for i in range(70)], "not in the catalog"),
    ([{"index": 3}, {"index": 7}], "GPU indices [3, 7] are not 0..1"),
    ([{"index": 0}, {"index": 0}], "GPU indices [0, 0] are not 0..1"),
    ([{"memory_total_mib": 1000, "memory_free_mib": 80000}],
     "GPU 0 reports 80000 MiB free of 1000 MiB total"),
], ids=["huge-memory", "huge-kv-cache", "70-made-up-types", "sparse-indices", "same-index",
        "more-free-than-total"])
async def test_a_node_state_the_solver_cannot_take_is_dead_lettered_and_others_still_run(
        gpus, reason) -> None:
    """Each was taken into the view: the first three then failed every cycle (an int64
    overflow, the solver's 62 GPU types), so nothing was placed anywhere, and the record
    outlived restarts in its compacted topic; the next two got placements on GPUs the node
    does not have, the last on memory it does not have. The dead letter is counted where
    GpuschedRecordsDeadLettered looks (it was not: no alert)."""
    registry = CollectorRegistry()
    engine, sent = leading_engine(registry=registry)
    good = node("good", [80000])
    bad = {"node_id": "bad", "seq": 1, "started_at_ms": 0, "reported_at_ms": 0, "gpus": [
        {"index": i, "uuid": f"u{i}", "gpu_type": "H100-80GB", "memory_total_mib": 81559,
         "memory_free_mib": 80000} | g for i, g in enumerate(gpus)]}
    await engine.node_states([node_state_record(0, b"good", good.to_bytes()),
                              node_state_record(1, b"bad", json.dumps(bad).encode())])
    [letter] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert letter.reason.startswith("invalid node state") and reason in letter.reason
    assert registry.get_sample_value("gpusched_scheduler_rejections_total",
                                     {"reason": "invalid"}) == 1
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 0, json.dumps({
        "request_id": "r", "tenant": "acme", "model": SMALL.name, "prompt": "hi",
        "max_tokens": 3}).encode())])
    assert await engine.cycle() == 1
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.node_id == "good"


@pytest.mark.parametrize("key,reason", [
    (b"rack7-host3", "keyed 'rack7-host3', not by its node_id 'big8'"),
    (None, "the record has no key: key it by its node_id ('big8')"),
    (b"", "the record has no key: key it by its node_id ('big8')"),
], ids=["another-key", "keyless", "empty-key"])
async def test_a_node_state_not_keyed_by_its_node_id_is_dead_lettered(key, reason) -> None:
    """Taken, it stayed in the compacted topic under its own key, where the node's tombstone
    (keyed by its id) does not reach: a scheduler started later brought the decommissioned
    node back, counted in the fleet for good, and work only it could hold waited forever
    instead of getting its 422. It is dead-lettered and counted as the other invalid node
    states are."""
    registry = CollectorRegistry()
    engine, sent = leading_engine(registry=registry)
    big = node("big8", [80000] * 8)
    await engine.node_states([node_state_record(0, key, big.to_bytes()),
                              node_state_record(1, b"small", node("small", [80000]).to_bytes())])
    [letter] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert letter.reason.startswith(f"invalid node state: {reason}")
    assert registry.get_sample_value("gpusched_scheduler_rejections_total",
                                     {"reason": "invalid"}) == 1
    assert set(engine.view.nodes) == {"small"}


@pytest.mark.parametrize("fleet", ["sick-gpu", "silent-node"])
async def test_work_no_live_node_could_hold_does_not_hold_back_the_classes_below(fleet
                                                                                 ) -> None:
    """An interactive gang for 2 GPUs of a node whose second GPU is sick, or for 8 GPUs of
    a node gone silent: it waits (the GPUs may come back), and the standard and batch work
    behind it, which fits now, used to wait with it for as long."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0], node_timeout_ms=10_000)
    if fleet == "sick-gpu":
        a = node("a", [80000, 80000])
        engine.view.apply_node_state(a.model_copy(update={"gpus": (a.gpus[0], a.gpus[1].model_copy(
            update={"healthy": False, "unhealthy_reason": "Xid 79"}))}), now[0], NODE_TIMEOUT_MS)
        gang = 2
    else:
        engine.view.apply_node_state(node("big", [80000] * 8), now[0], NODE_TIMEOUT_MS)
        now[0] = 100_000
        engine.view.apply_node_state(node("small", [80000]), now[0], NODE_TIMEOUT_MS)
        gang = 8

    def record(topic: str, offset: int, request_id: str, **extra) -> ConsumerRecord:
        return request_record(topics.REQUESTS[topic].name, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
            "max_tokens": 4, "created_at_ms": now[0]} | extra).encode())

    await engine.admit([record("interactive", 0, "gang", num_gpus=gang),
                        record("standard", 0, "s"), record("batch", 0, "b")])
    await engine.cycle()
    placed = [PLACEMENT.validate_json(v).request.request_id for v in sent[topics.PLACEMENTS.name]]
    assert sorted(placed) == ["b", "s"]
    assert [p.request.request_id for p in engine.queue.in_order()] == ["gang"]


def test_work_waiting_for_room_to_free_up_still_holds_back_the_classes_below() -> None:
    view = ClusterView()
    view.apply_node_state(node("a", [1000, 80000]), 0, NODE_TIMEOUT_MS)  # GPU 0 is busy, not away
    gang = InferenceRequest(request_id="gang", tenant="acme", model=SMALL.name, prompt="hi",
                            max_tokens=4, num_gpus=2, priority_class="interactive",
                            created_at_ms=0)
    small = InferenceRequest(request_id="s", tenant="acme", model=SMALL.name, prompt="hi",
                             max_tokens=4, created_at_ms=0)
    decisions = plan(view, [gang, small])
    assert not decisions.placed and len(decisions.waiting) == 2


@pytest.mark.parametrize("fleet", ["other-node", "only-node"])
async def test_a_model_whose_load_failed_on_a_node_goes_elsewhere_or_waits_its_cooldown(
        fleet) -> None:
    """A node that could not load a model (a corrupt file there) got its work again and
    again, as its report showed nothing: each attempt used up one of the request's
    refusals, and after the fifth it failed while other nodes served the model. While the
    node's cooldown lasts its work goes to another node; where none other serves the model
    it waits (no 422: the node serves it again soon), then goes to the node. The end is on
    the agent's clock, an hour ahead of the scheduler's here: it is judged by the time left
    of it when reported."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    agent_ms = 3_600_000 + now[0]
    a = node("a", [80000], models=(SMALL.name,))  # loaded there: preferred, but for the failure
    engine.view.apply_node_state(a.model_copy(update={
        "reported_at_ms": agent_ms,
        "load_failures": (LoadFailure(model=SMALL.name, until_ms=agent_ms + 60_000),)}),
        now[0], NODE_TIMEOUT_MS)
    if fleet == "other-node":
        engine.view.apply_node_state(node("b", [80000]), now[0], NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["interactive"].name, 0, json.dumps({
        "request_id": "r", "tenant": "acme", "model": SMALL.name, "prompt": "hi",
        "max_tokens": 4, "priority_class": "interactive", "created_at_ms": now[0]}).encode()),
        request_record(topics.REQUESTS["batch"].name, 0, json.dumps({
            "request_id": "m", "tenant": "acme", "model": "mistral-7b", "prompt": "hi",
            "max_tokens": 4, "priority_class": "batch", "created_at_ms": now[0]}).encode())])

    def placed() -> list[tuple[str, str]]:
        return sorted((p.request.request_id, p.node_id) for p in
                      map(PLACEMENT.validate_json, sent.get(topics.PLACEMENTS.name, [])))

    await engine.cycle()
    if fleet == "other-node":
        assert placed() == [("m", "a"), ("r", "b")]
        return
    # it waits, without holding back the class below (nothing it could take frees up)
    assert placed() == [("m", "a")] and topics.RESULTS.name not in sent
    assert [p.request.request_id for p in engine.queue.in_order()] == ["r"]
    now[0] += 59_999
    await engine.cycle()
    assert placed() == [("m", "a")] and topics.RESULTS.name not in sent
    now[0] += 1
    await engine.cycle()
    assert placed() == [("m", "a"), ("r", "a")]


def test_a_cooldown_crowds_no_node_out_and_one_of_a_model_not_served_changes_nothing(
) -> None:
    """A cooling node's GPUs are typed anew. With the solver's types all taken (62 kinds
    here), that new type left another node out of every placement for the cooldown; and a
    failure naming a model the node does not serve made a type of its own all the same.
    The cooldown is now dropped where it would crowd a node out, and a failure of a model
    not served is none."""
    import itertools

    from gpusched_scheduler.domain.solver import MAX_GPU_TYPES

    def state(node_id: str, models: tuple[str, ...] | None, gpu_type: str = "H100-80GB",
              failed: str | None = None) -> NodeState:
        return NodeState(node_id=node_id, seq=1, started_at_ms=0, reported_at_ms=0,
                         models=models, load_failures=None if failed is None else (
                             LoadFailure(model=failed, until_ms=60_000),),
                         gpus=(GpuState(index=0, uuid=node_id, gpu_type=gpu_type,
                                        memory_total_mib=81559, memory_free_mib=20_000),))

    names = sorted(CATALOG.names)
    kinds = [(gpu, models) for gpu in ("H200-141GB", "A100-80GB", "A100-40GB", "L4-24GB")
             for k in range(1, len(names) + 1) for models in itertools.combinations(names, k)
             ] + [("H100-80GB", (SMALL.name,))]
    assert len(kinds) == MAX_GPU_TYPES - 1  # with a and b's H100s: every kind taken
    for failed in (SMALL.name, "not-in-the-catalog"):  # cooling a would make a 63rd kind
        view = ClusterView()
        view.apply_node_state(state("a", None, failed=failed), 0, NODE_TIMEOUT_MS)
        view.apply_node_state(state("b", None), 0, NODE_TIMEOUT_MS)
        for i, (gpu, models) in enumerate(kinds):
            view.apply_node_state(state(f"m{i:02d}", models, gpu), 0, NODE_TIMEOUT_MS)
        snap = snapshot(view, set(view.nodes), NodeSpecCache(), now_ms=1, catalog=CATALOG)
        assert not snap.crowded and len(set(snap.state.type_names)) == MAX_GPU_TYPES
        assert snap.state.type_names[snap.state.gpu_type[0]] == "H100-80GB"  # as before


@pytest.mark.parametrize("declared_lost", [True, False], ids=["lost", "alive-in-redis"])
def test_a_node_that_started_again_with_its_clock_set_back_is_heard_once_silent(
        declared_lost) -> None:
    """Its new run reports an earlier start than the one that died: refused as stale, the
    node stayed silent to the scheduler forever (and so did a node whose record once said it
    started in the far future). Before, only a node declared lost was heard again, and one
    whose new run said in Redis that it was alive never was."""
    view = ClusterView()
    view.apply_node_state(node("a", [80000], seq=9).model_copy(update={"started_at_ms": 10**15}),
                          0, NODE_TIMEOUT_MS)
    again = node("a", [70000], seq=1)
    assert not view.apply_node_state(again, 1000, NODE_TIMEOUT_MS)  # an older run's, maybe
    assert not view.apply_node_state(again, NODE_TIMEOUT_MS, NODE_TIMEOUT_MS)
    if declared_lost:
        view.mark_lost(view.silent(60_000, NODE_TIMEOUT_MS))
    assert view.apply_node_state(again, 60_000, NODE_TIMEOUT_MS) and "a" not in view.lost
    assert view.nodes["a"].gpus[0].memory_free_mib == 70000
    assert view.apply_node_state(node("a", [60000], seq=2), 61_000, NODE_TIMEOUT_MS)
    assert not view.apply_node_state(again, 62_000, NODE_TIMEOUT_MS)  # its own older report


async def test_a_cancelled_request_still_waiting_ends_unplaced_whichever_came_first(
        wired) -> None:
    """A request waiting for room is cancelled: the next cycle ends it with a cancelled
    result and nothing is placed, then or once room appears. A request whose cancel came
    before it (the router's 503 when Kafka was slow) ends the same way. Before, both waited
    for room and were then placed, for their agents to end them."""
    broker, engine, sent = wired
    standard = topics.REQUESTS["standard"].name

    def body(request_id: str) -> bytes:
        return json.dumps({"request_id": request_id, "tenant": "acme", "model": SMALL.name,
                           "prompt": "hi", "max_tokens": 4}).encode()

    await engine.admit([request_record(standard, 0, body("waits"))])
    assert await engine.cycle() == 0  # no node: it waits
    async with TestKafkaBroker(broker) as br:
        for request_id in ("waits", "early"):
            await br.publish(Cancel(request_id=request_id, reason="client disconnected",
                                    at_ms=1000).to_bytes(), topics.CONTROL.name,
                             key=request_id.encode())
        await br.publish(b"not a cancel", topics.CONTROL.name, key=b"x")  # agents refuse it
    await engine.admit([request_record(standard, 1, body("early")),
                        request_record(standard, 2, body("placed"))])
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 3
    results = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert {(r.request_id, r.status, r.completion_tokens) for r in results} == {
        ("waits", "cancelled", 0), ("early", "cancelled", 0)}
    assert all(r.finish_reason == "cancelled before it was placed: client disconnected"
               for r in results)
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.request.request_id == "placed" and not len(engine.queue)


async def test_a_resumed_request_cancelled_before_it_is_placed_reports_what_came_before(
) -> None:
    """Preempted after 3 tokens, then cancelled while it waited again: its result said 0
    tokens and no text, though they were streamed and billed."""
    engine, sent = leading_engine()
    again = InferenceRequest(request_id="r", tenant="acme", model=SMALL.name, prompt="hi",
                             max_tokens=8, created_at_ms=500, attempt=1, requeued="preempted",
                             resume=Resume(tokens=(" a", " b", " c"), streamed_tokens=3,
                                           next_seq=2))
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 0, again.to_bytes())])
    await engine.cancels([ConsumerRecord(topics.CONTROL.name, 0, 0, 1000, 0, b"r", Cancel(
        request_id="r", reason="user pressed stop", at_ms=1000).to_bytes(), None, 0, 0, ())])
    await engine.cycle()
    [result] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (result.status, result.text, result.completion_tokens, result.prompt_tokens) == (
        "cancelled", " a b c", 3, again.prompt_token_count)


async def test_a_request_waiting_past_its_queue_time_limit_ends_unrun_with_a_503(
        monkeypatch) -> None:
    """A request's own max_queue_ms, capped by its class's limit, bounds the wait for its
    first placement (Triton's queue-policy time-out): past it the request ends with a 503
    rejection that says which limit, and is never placed. Classes without a limit, and
    retries of work placed once, wait as long as it takes."""
    now = [1000]
    monkeypatch.setenv("GPUSCHED_STANDARD_MAX_QUEUE_S", "5")
    limits = SchedulerSettings().class_max_queue_ms()
    assert limits == (("standard", 5000.0),)
    engine, sent = leading_engine(lambda: now[0], class_max_queue_ms=limits)

    def record(offset: int, request_id: str, cls: str = "standard", **extra) -> ConsumerRecord:
        return request_record(topics.REQUESTS[cls].name, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
            "max_tokens": 4, "priority_class": cls, "created_at_ms": 1000, **extra}).encode())

    await engine.admit([record(0, "own", max_queue_ms=2000), record(1, "of-class"),
                        record(2, "lax", max_queue_ms=60_000),
                        record(3, "retry", max_queue_ms=2000, attempt=1, requeued="handback")])
    await engine.admit([record(0, "unlimited", "batch")])

    def rejected() -> dict[str, Rejection]:
        events = [RESULT_EVENT.validate_json(v) for v in sent.get(topics.RESULTS.name, [])]
        return {e.request_id: e for e in events if isinstance(e, Rejection)}

    now[0] = 3000  # waited 2.0 s: at its limit, not past it
    assert await engine.cycle() == 0 and not rejected()
    now[0] = 3500
    assert await engine.cycle() == 1
    own = rejected()["own"]
    assert (own.status_code, own.code) == (503, "queue_time_exceeded")
    assert "waited 2.5 s" in own.reason
    assert "limit of 2 s (its max_queue_ms" in own.reason
    now[0] = 6500
    assert await engine.cycle() == 2
    assert set(rejected()) == {"own", "of-class", "lax"}
    assert all("limit of 5 s (GPUSCHED_STANDARD_MAX_QUEUE_S)" in rejected()[r].reason
               for r in ("of-class", "lax"))
    engine.view.apply_node_state(node("n1", [80000]), now[0], NODE_TIMEOUT_MS)
    assert await engine.cycle() == 2
    placed = {PLACEMENT.validate_json(v).request.request_id
              for v in sent[topics.PLACEMENTS.name]}
    assert placed == {"retry", "unlimited"} and not len(engine.queue)


async def test_a_request_that_expired_in_kafka_takes_none_of_its_tenants_quota(wired) -> None:
    """A backlog read late: the request already past its limit ends with its 503 at the next
    cycle, and hooli's fresh request still fits its 3,000 tokens a minute. Before, the stale
    one was charged 2,000 tokens on admission and the fresh one got a 429."""
    _, engine, sent = wired  # the clock reads 1000
    standard = topics.REQUESTS["standard"].name

    def body(request_id: str, **extra) -> bytes:
        return json.dumps({"request_id": request_id, "tenant": "hooli", "model": SMALL.name,
                           "prompt": "hi", "prompt_tokens": 1, "max_tokens": 1999,
                           **extra}).encode()

    await engine.admit([request_record(standard, 0, body("stale", created_at_ms=100,
                                                         max_queue_ms=500)),
                        request_record(standard, 1, body("fresh"))])
    assert not sent.get(topics.RESULTS.name)  # no 429
    assert await engine.cycle() == 1
    [expired] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (expired.request_id, expired.status_code) == ("stale", 503)
    assert [p.request.request_id for p in engine.queue.in_order()] == ["fresh"]


async def test_a_request_that_expired_in_the_queue_gives_its_quota_back() -> None:
    """hooli (3,000 tokens a minute) sends 2,000 tokens that wait past their 1 s limit on a
    fleet with no room: the 503 says send it again, and the retry a second later fits the
    minute. Before, the expired request kept its charge and the retry got a 429."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    standard = topics.REQUESTS["standard"].name

    def record(offset: int, request_id: str) -> ConsumerRecord:
        return request_record(standard, offset, json.dumps({
            "request_id": request_id, "tenant": "hooli", "model": SMALL.name, "prompt": "hi",
            "prompt_tokens": 1, "max_tokens": 1999, "created_at_ms": now[0],
            "max_queue_ms": 1000}).encode())

    await engine.admit([record(0, "waits")])
    now[0] = 2500
    assert await engine.cycle() == 1
    now[0] = 3000
    await engine.admit([record(1, "again")])
    results = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert [(r.request_id, r.status_code) for r in results] == [("waits", 503)]
    assert [p.request.request_id for p in engine.queue.in_order()] == ["again"]


async def test_a_request_cancelled_while_it_waited_gives_its_quota_back() -> None:
    """hooli (3,000 tokens a minute) sends 2,000 tokens that wait on a fleet with no room,
    and cancels them: nothing ran, so the 2,000 tokens it sends next fit the minute. Before,
    the cancelled request kept its charge and the next one got a 429."""
    engine, sent = leading_engine()
    standard = topics.REQUESTS["standard"].name

    def record(offset: int, request_id: str) -> ConsumerRecord:
        return request_record(standard, offset, json.dumps({
            "request_id": request_id, "tenant": "hooli", "model": SMALL.name, "prompt": "hi",
            "prompt_tokens": 1, "max_tokens": 1999}).encode())

    await engine.admit([record(0, "waits")])
    cancel = Cancel(request_id="waits", reason="client disconnected", at_ms=1000).to_bytes()
    await engine.cancels([request_record(topics.CONTROL.name, 0, cancel)])
    assert await engine.cycle() == 1
    await engine.admit([record(1, "next")])
    results = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert not [r.reason for r in results if isinstance(r, Rejection)]
    assert [(r.request_id, r.status) for r in results] == [("waits", "cancelled")]
    assert [p.request.request_id for p in engine.queue.in_order()] == ["next"]


async def test_a_clock_stepped_back_two_hours_stalls_no_request_topic() -> None:
    """hooli had 2,500 of its 3,000 tokens a minute admitted, then the clock went back two
    hours: its next request's 429 said to retry in 7,260 s, past the rejection's hour, so
    building it raised, `admit` raised, and the request consumer read the batch again
    every second: acme's request in it (every tenant's of the class) was never admitted.
    Now the minute before the step is forgotten and the batch is admitted."""
    now = [10_000_000]
    engine, sent = leading_engine(lambda: now[0])
    standard = topics.REQUESTS["standard"].name

    def record(offset: int, request_id: str, tenant: str, max_tokens: int) -> ConsumerRecord:
        return request_record(standard, offset, json.dumps({
            "request_id": request_id, "tenant": tenant, "model": SMALL.name, "prompt": "hi",
            "prompt_tokens": 1, "max_tokens": max_tokens, "created_at_ms": now[0]}).encode())

    await engine.admit([record(0, "before", "hooli", 2499)])
    now[0] -= 2 * 3_600_000
    await engine.admit([record(1, "acme-req", "acme", 99), record(2, "hooli-req", "hooli", 999)])
    assert topics.RESULTS.name not in sent
    assert [p.request.request_id for p in engine.queue.in_order()] == [
        "before", "acme-req", "hooli-req"]


class BudgetFlags:
    """The running store with accounting's budget flags as Redis holds them (`spent`), and
    the placements agents hold (`claimed`), or refusing to read them while `down`; `reads`
    are the tenants each read asked for."""

    def __init__(self, spent: dict[str, SpentBudget], claimed: tuple[str, ...] = ()) -> None:
        self.spent, self.down, self.reads, self.claimed = spent, False, [], set(claimed)
        self.noted: list = []

    async def spent_budgets(self, tenants: list[str]) -> dict[str, SpentBudget]:
        self.reads.append(sorted(tenants))
        if self.down:
            raise ConnectionError("Redis is away")
        return {t: flag for t, flag in self.spent.items() if t in tenants}

    async def claim_states(self, placement_ids: list[str]) -> dict[str, str]:
        if self.down:
            raise ConnectionError("Redis is away")
        return {pid: "held" if pid in self.claimed else "untaken" for pid in placement_ids}

    async def note_over_quota(self, position, timestamp: int) -> None:
        self.noted.append(position)

    async def save(self, placements, epoch: int) -> bool:
        return True


def budget_record(offset: int, request_id: str, tenant: str, **extra) -> ConsumerRecord:
    return request_record(topics.REQUESTS["standard"].name, offset, json.dumps({
        "request_id": request_id, "tenant": tenant, "model": SMALL.name, "prompt": "hi",
        "prompt_tokens": 1, "max_tokens": 1999, **extra}).encode())


async def test_work_of_a_tenant_whose_budget_is_spent_is_refused_as_it_is_admitted() -> None:
    """hooli's budget is spent; its request produced straight to Kafka is answered the
    router's 429 for a spent budget (insufficient_quota, the flag's reason, a retry when the
    flag expires, an hour at most) and takes none of hooli's minute; acme's request is
    placed, and hooli's preempted request, which ran and streamed part of its reply, runs
    on, as does a first attempt an agent claimed once (read again: it ran, and takes none of
    hooli's minute). Before, only the router read the flag: everything produced to Kafka
    ran and was billed past the budget.
    Each tenant's flag is read once a second at most, and a refused record read again
    stays refused (noted as the over-quota ones are), though the flag is gone by then."""
    registry = CollectorRegistry()
    spent = "tenant 'hooli' has spent its day budget; new requests are accepted again from ..."
    flags = BudgetFlags({"hooli": SpentBudget(spent, left_ms=90_500),
                         "initech": SpentBudget("initech's month is spent", left_ms=86_400_000)},
                        claimed=("ran#0", "resumed#0"))
    engine, sent = leading_engine(registry=registry, store=flags)
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    resumed = {"attempt": 1, "requeued": "preempted", "max_tokens": 8,
               "resume": {"tokens": [" a"], "streamed_tokens": 1, "next_seq": 1}}
    fresh = budget_record(0, "fresh", "hooli")
    await engine.admit([fresh, budget_record(1, "other", "acme"),
                        budget_record(2, "resumed", "hooli", **resumed),
                        budget_record(3, "later", "initech"), budget_record(4, "ran", "hooli")])
    rejections = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert [(r.request_id, r.status_code, r.code, r.reason, r.retry_after_s)
            for r in rejections] == [
        ("fresh", 429, "insufficient_quota", spent, 91),
        ("later", 429, "insufficient_quota", "initech's month is spent", 3600)]
    assert engine.quotas.tokens_last_minute("hooli", 1000) == 0
    assert await engine.cycle() == 3
    placed = {PLACEMENT.validate_json(v).request.request_id
              for v in sent[topics.PLACEMENTS.name]}
    assert placed == {"other", "resumed", "ran"} and not len(engine.queue)
    assert flags.reads == [["hooli"], ["acme"], ["initech"]]
    assert len(flags.noted) == 2 and registry.get_sample_value(
        "gpusched_scheduler_rejections_total", {"reason": "budget_spent"}) == 2
    flags.spent.clear()  # the budget raised: `fresh`, read again, is still refused
    await engine.admit([fresh])
    assert len(sent[topics.RESULTS.name]) == 2 and not len(engine.queue)


async def test_a_cancelled_request_read_again_is_not_refused_for_a_spent_budget() -> None:
    """It ended cancelled (its result went out); read again, its cancel ends it again, as
    before the budget check: not a 429 beside the cancellation."""
    flags = BudgetFlags({"hooli": SpentBudget("spent", left_ms=90_000)})
    engine, sent = leading_engine(store=flags)
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.cancels([request_record(topics.CONTROL.name, 0, Cancel(
        request_id="gone", reason="client left", at_ms=1000).to_bytes())])
    await engine.admit([budget_record(0, "gone", "hooli")])
    await engine.cycle()
    [ended] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (ended.type, ended.status) == ("request_result", "cancelled")


async def test_work_is_admitted_while_redis_cannot_say_whose_budget_is_spent(caplog) -> None:
    """Billing goes on without Redis's flags: a Redis outage must not stop all scheduling.
    The failed read is logged once a minute, not at every read."""
    now = [1000]
    flags = BudgetFlags({"initech": SpentBudget("spent", left_ms=90_000)})
    flags.down = True
    engine, sent = leading_engine(lambda: now[0], store=flags)
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    for offset, at_ms in enumerate((1000, 30_000)):
        now[0] = at_ms
        await engine.admit([budget_record(offset, f"r{offset}", "initech")])
        assert await engine.cycle() == 1
    assert [PLACEMENT.validate_json(v).request.request_id
            for v in sent[topics.PLACEMENTS.name]] == ["r0", "r1"]
    assert len(flags.reads) == 2 and caplog.text.count("reading the budget flags failed") == 1


async def test_budget_flags_are_read_with_their_reason_and_time_left() -> None:
    """One round trip for all tenants; a flag without an expiry has no time left to tell,
    and one that expired between the two reads is no flag."""
    flagged = {BUDGET_EXHAUSTED_KEY.format("hooli"): (b'{"reason": "day spent"}', 5_000),
               BUDGET_EXHAUSTED_KEY.format("initech"): (b"not json", -1),
               BUDGET_EXHAUSTED_KEY.format("stark"): (b'{"reason": "gone"}', -2)}

    class Redis:
        round_trips = 0

        def pipeline(self, transaction: bool):  # noqa: ANN202
            return Pipeline(self)

    class Pipeline:
        def __init__(self, redis: Redis) -> None:
            self.redis, self.answers = redis, []

        async def __aenter__(self):  # noqa: ANN204
            return self

        async def __aexit__(self, *exc) -> None:
            pass

        def mget(self, keys: list[str]) -> None:
            self.answers.append([flagged.get(k, (None,))[0] for k in keys])

        def pttl(self, key: str) -> None:
            self.answers.append(flagged.get(key, (None, -2))[1])

        async def execute(self) -> list:
            self.redis.round_trips += 1
            return self.answers

    redis = Redis()
    read = await RunningStore(redis).spent_budgets(  # type: ignore[arg-type]
        ["acme", "hooli", "initech", "stark"])
    assert read == {"hooli": SpentBudget("day spent", 5_000),
                    "initech": SpentBudget(
                        "this tenant's budget for the current period is spent", None)}
    assert redis.round_trips == 1


async def test_the_queue_is_shown_in_the_order_the_next_cycle_takes_it(wired) -> None:
    """GET /v1/queue lists `in_line`: aged work first, then class by class."""
    _, engine, _ = wired
    for offset, (request_id, cls) in enumerate(
            [("b1", "batch"), ("s1", "standard"), ("i1", "interactive"), ("b2", "batch")]):
        await engine.admit([request_record(topics.REQUESTS[cls].name, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
            "max_tokens": 4, "priority_class": cls}).encode())])
    assert await engine.cycle() == 0  # no node: all wait
    order = [(chunk, p.request.request_id) for chunk, p in engine.in_line(1000)]
    assert order == [("interactive", "i1"), ("standard", "s1"), ("batch", "b1"),
                     ("batch", "b2")]
    # 6 s later the interactive request is past 5x its 1 s target: aged, first of all
    order = [(chunk, p.request.request_id) for chunk, p in engine.in_line(7001)]
    assert order[0] == ("aged", "i1") and order[1] == ("standard", "s1")


async def test_a_request_larger_than_its_tenants_tokens_per_minute_is_refused_for_good(
        wired) -> None:
    """hooli may admit 3,000 tokens a minute: a request of 3,001 is refused with a 400 and
    dead-lettered, as one over the model's context is. Before, it got a 429 saying to retry
    in a minute, and every retry got the same."""
    _, engine, sent = wired
    standard = topics.REQUESTS["standard"].name

    def body(request_id: str, max_tokens: int) -> bytes:
        return json.dumps({"request_id": request_id, "tenant": "hooli", "model": SMALL.name,
                           "prompt": "hi", "prompt_tokens": 1, "max_tokens": max_tokens}).encode()

    await engine.admit([request_record(standard, 0, body("too-big", 3000)),
                        request_record(standard, 1, body("fits", 2999))])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (rejection.request_id, rejection.status_code, rejection.code) == (
        "too-big", 400, "tokens_per_minute_exceeded")
    assert "limit of 3000 tokens per minute, so it is never admitted" in rejection.reason
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert dead.reason == rejection.reason
    assert [p.request.request_id for p in engine.queue.in_order()] == ["fits"]


async def test_a_record_with_a_bad_request_id_among_other_errors_is_dead_lettered(wired) -> None:
    """Before, an error listed ahead of the bad id's made the engine build a rejection for
    that id, which raised: the batch was read again forever and the topic stood still."""
    _, engine, sent = wired
    standard = topics.REQUESTS["standard"].name
    await engine.admit([
        request_record(standard, 0, json.dumps(
            {"version": 2, "request_id": "has space", "tenant": "acme", "model": SMALL.name,
             "prompt": "x"}).encode()),
        request_record(standard, 1, json.dumps(
            {"request_id": "ok", "tenant": "acme", "model": SMALL.name, "prompt": "x"}
        ).encode())])
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert "version" in dead.reason and "request_id" in dead.reason
    assert topics.RESULTS.name not in sent  # no valid id to answer
    assert engine.queue.depth()["standard"] == 1  # the valid request behind it is queued


async def test_a_node_state_the_scheduler_cannot_read_is_dead_lettered_by_the_leader(
        wired) -> None:
    """Before, only a log line said why that node then looked silent and was declared lost."""
    broker, engine, sent = wired
    newer = json.loads(node("n2", [80000]).to_bytes()) | {"rack": "r7"}  # a newer agent
    async with TestKafkaBroker(broker) as br:
        await br.publish(json.dumps(newer).encode(), topics.NODE_STATE.name, key=b"n2")
        await br.publish(node("n1", [80000]).to_bytes(), topics.NODE_STATE.name, key=b"n1")
    [dead] = [DEAD_LETTER.validate_json(v) for v in sent[topics.DEAD_LETTERS.name]]
    assert dead.reason == "invalid node state: rack: Extra inputs are not permitted"
    assert set(engine.view.nodes) == {"n1"}


async def test_unknown_model_from_kafka_gets_a_rejection_with_names(wired) -> None:
    _, engine, sent = wired
    await engine.admit([request_record(topics.REQUESTS["batch"].name, 0, json.dumps(
        {"request_id": "r9", "tenant": "acme", "model": "gpt-9", "prompt": "x"}).encode())])
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert isinstance(rejection, Rejection) and rejection.status_code == 404
    assert SMALL.name in rejection.reason
    assert len(sent[topics.DEAD_LETTERS.name]) == 1


async def test_interactive_is_placed_before_batch_that_arrived_earlier(wired) -> None:
    _, engine, sent = wired
    for rid, cls in (("b1", "batch"), ("i1", "interactive")):
        req = InferenceRequest(request_id=rid, tenant="acme", priority_class=cls,
                               model=SMALL.name, prompt="x", max_tokens=8, created_at_ms=0)
        engine.queue.push(Pending(req, {}, 0))
    # room for exactly one: weights + one KV cache
    engine.view.apply_node_state(node("n1", [SMALL.weight_memory_mib + 1]), 0, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    [placement] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name]]
    assert placement.request.request_id == "i1"
    assert engine.queue.depth()["batch"] == 1


async def test_queue_depth_per_class_and_tenant_is_exported_as_of_the_scrape() -> None:
    registry = CollectorRegistry()

    async def publish(batch):
        return asyncio.gather()

    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), publish, lambda: 1000, NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12),
                              registry=registry)
    engine.lead(3, [])
    for rid, cls, tenant in (("a1", "batch", "acme"), ("a2", "batch", "acme"),
                             ("g1", "interactive", "globex")):
        engine.queue.push(Pending(req(rid, cls, tenant=tenant), {}, 0))

    def depth() -> dict[tuple[str, str], float]:
        return {(s.labels["priority_class"], s.labels["tenant"]): s.value
                for m in registry.collect() if m.name == "gpusched_scheduler_queue_depth"
                for s in m.samples}

    assert depth() == {("batch", "acme"): 2, ("interactive", "globex"): 1}
    engine.view.apply_node_state(node("n1", [80000]), 0, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 3
    assert depth() == {}  # placed: nothing waits, and no stale series is left behind


async def test_the_fleets_gpus_are_exported_by_type_and_state_as_of_the_scrape() -> None:
    """Serving (a request runs, or a placement was sent), loaded (a model, nothing serving),
    empty, unhealthy, and unreachable once a node is silent past the time-out."""
    registry, now = CollectorRegistry(), [1000]
    engine, _ = leading_engine(lambda: now[0], registry, node_timeout_ms=5000)

    def gpus() -> dict[tuple[str, str], float]:
        return {(s.labels["gpu_type"], s.labels["state"]): s.value
                for m in registry.collect() if m.name == "gpusched_scheduler_gpus"
                for s in m.samples}

    busy = node("a", [40000, 40000, 40000, 40000], models=(SMALL.name,))
    busy = busy.model_copy(update={"gpus": (
        busy.gpus[0].model_copy(update={"running_requests": 2}), busy.gpus[1],
        busy.gpus[2].model_copy(update={"healthy": False}),
        busy.gpus[3].model_copy(update={"loaded_models": ()}))})
    engine.view.apply_node_state(busy, 1000, NODE_TIMEOUT_MS)
    engine.view.apply_node_state(node("b", [80000, 80000]), 1000, NODE_TIMEOUT_MS)
    engine.view.reserve(Reservation("p#0", "b", (1,), 1000, SMALL.name))
    assert gpus() == {("H100-80GB", "serving"): 2, ("H100-80GB", "loaded"): 1,
                      ("H100-80GB", "unhealthy"): 1, ("H100-80GB", "empty"): 2}
    now[0] = 7000  # b goes on reporting, a is silent past the time-out
    engine.view.apply_node_state(node("b", [80000, 80000], seq=2), 7000, NODE_TIMEOUT_MS)
    assert gpus() == {("H100-80GB", "unreachable"): 4, ("H100-80GB", "serving"): 1,
                      ("H100-80GB", "empty"): 1}


class Commits:
    def __init__(self) -> None:
        self.offsets: dict = {}

    async def commit(self, offsets) -> None:
        self.offsets.update(offsets)


async def test_offsets_commit_once_kafka_acknowledged_and_a_failed_publish_is_sent_again(
) -> None:
    acks: list[asyncio.Future] = []

    async def send(batch):
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]

    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: 1000, NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12,
                                           commit_interval_ms=0))
    engine.lead(3, [])
    engine.view.apply_node_state(node("n1", [80000]), 0, NODE_TIMEOUT_MS)
    kafka = Commits()
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, 7, json.dumps(
        {"request_id": "r1", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4}).encode())], kafka.commit)
    assert await engine.cycle() == 1
    assert len(engine.running) == 1 and not engine.queue.depth()["standard"]
    acks[0].set_exception(ConnectionError("broker gone"))  # the placement may be lost
    await asyncio.sleep(0.01)
    # or it may run: held where it went, not planned again
    assert len(engine.running) == 1 and not engine.queue.depth()["standard"]
    assert kafka.offsets == {}
    assert await engine.cycle() == 1  # the same placement again: agents run it once
    acks[1].set_result(None)
    await asyncio.sleep(0.01)
    assert kafka.offsets == {TopicPartition(standard, 0): 8}
    assert [r.placement_id for r in engine.running.values()] == ["r1#0"]


class FlakyStore:
    """The running store while Redis is away: `save` fails until `up`."""

    def __init__(self) -> None:
        self.up, self.saved, self.token = False, [], None

    async def save(self, placements, epoch: int) -> bool:
        if not self.up:
            raise ConnectionError("Redis is away")
        if self.token is not None and epoch != self.token:
            return False  # a newer leader took the lease: nothing written
        self.saved += [p.placement_id for p in placements]
        return True


def _saving_to(store: FlakyStore) -> SchedulingEngine:
    """A leader under token 3 on one node, whose publishes Kafka takes at once, saving its
    placements in flight to `store`."""
    async def send(batch):
        return asyncio.gather()
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: 1000, NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12,
                                           commit_interval_ms=0), store=store)
    engine.lead(3, [])
    engine.view.apply_node_state(node("n1", [80000]), 0, NODE_TIMEOUT_MS)
    return engine


async def test_a_leader_deposed_unawares_saves_nothing_and_commits_nothing() -> None:
    """Another instance took the lease (token 4) and read the hash of placements in flight
    while this one, stalled, still thinks it leads under 3: before, its save went into the
    hash after the next leader had read it and its offset was committed; nobody knew the
    placement, agents refused its old token, and the request was lost."""
    store, kafka = FlakyStore(), Commits()
    store.up, store.token = True, 4
    engine = _saving_to(store)
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 7, json.dumps(
        {"request_id": "r1", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4}).encode())], kafka.commit)
    assert await engine.cycle() == 1
    await asyncio.sleep(0.05)
    assert kafka.offsets == {} and not store.saved and not engine.running


async def test_placements_not_saved_before_the_leader_is_deposed_are_placed_again() -> None:
    """Redis goes away after a cycle's placements reached Kafka. While the instance still
    leads, their save is retried and their offsets wait. Deposed meanwhile, it leaves them
    uncommitted and forgotten: agents refuse the old token's placements as stale, and the
    next leader (this instance again, here) reads the requests and places them under its
    own. Before, their offsets were committed unsaved and the requests were lost."""
    store, kafka = FlakyStore(), Commits()
    engine = _saving_to(store)
    standard = topics.REQUESTS["standard"].name
    record = request_record(standard, 7, json.dumps(
        {"request_id": "r1", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4}).encode())
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    await asyncio.sleep(0.05)
    assert kafka.offsets == {}  # not saved: not committed, still retrying
    engine.step_down()  # the lease lapsed: Redis is away
    await asyncio.sleep(0.6)  # the retry sees it no longer leads
    assert kafka.offsets == {} and not engine.running
    store.up = True
    engine.lead(4, [])
    await engine.admit([record], kafka.commit)  # read again from the uncommitted offset
    assert await engine.cycle() == 1
    await asyncio.sleep(0.01)
    assert store.saved == ["r1#0"] and kafka.offsets == {TopicPartition(standard, 0): 8}


async def test_a_placement_saved_after_leading_again_under_the_same_token_is_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis away: the save of a placement Kafka took was being retried when a lease check
    failed and the next one led again under the same token, loading Redis's list from
    before the save. The save then went through and the record committed, but this leader
    no longer counted the placement: nothing reserved for it, and its node's loss retried
    nothing (the request never ended)."""
    from gpusched_scheduler import engine as engine_module

    monkeypatch.setattr(engine_module, "SAVE_RETRY_S", 0.01)
    store, kafka = FlakyStore(), Commits()
    engine = _saving_to(store)
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    await asyncio.sleep(0.02)  # Kafka took it; its save is retried
    engine.step_down()
    engine.lead(3, [], {})  # Redis's list, read before the save
    await engine.admit([record], kafka.commit)  # the new consumers read it again
    store.up = True
    await asyncio.sleep(0.05)
    assert store.saved == ["r1#0"]
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}
    assert list(engine.running) == ["r1#0"] and list(engine.view.reservations) == ["r1#0"]


async def test_a_placement_in_flight_this_release_cannot_read_is_left_out(
        caplog, redis: Redis) -> None:
    """One unreadable entry in Redis's hash of placements in flight (a newer release's
    field, a hand edit) made every lease renewal fail to lead: the instance held the lease
    and never led, and no other instance could take it."""
    readable = RunningPlacement(
        placement_id="ok#0", node_id="n1", gpu_indices=(0,), memory_mib_per_gpu=4000,
        kv_cache_mib=1000, estimate_gpu_s=1.0, placed_at_ms=500,
        request=req("ok"))
    await redis.hset(SCHEDULER_RUNNING_KEY, mapping={
        "ok#0": readable.model_dump_json(),
        "odd#0": '{"placement_id": "odd#0", "from_a_newer_release": 1}'})
    assert await RunningStore(redis).load() == [readable]
    assert "ignoring the unreadable placement in flight odd#0" in caplog.text


async def test_placements_in_flight_are_saved_with_the_mark_the_release_before_requires(
        redis: Redis) -> None:
    """That release decided whether work is borrowed at placement, and requires the mark on
    each placement it takes over (forbidding fields it does not know); this one judges it
    afresh each cycle and reads no mark: saved with it (false), read back without it, as a
    placement that release saved with its own. This release's own marks (placed as aged, as
    a confirmed retry) are not saved: that release forbids them."""
    placement = RunningPlacement(
        placement_id="r#0", node_id="n1", gpu_indices=(0,), memory_mib_per_gpu=4000,
        kv_cache_mib=1000, estimate_gpu_s=1.0, placed_at_ms=500,
        request=InferenceRequest(request_id="r", tenant="acme", model=SMALL.name,
                                 prompt="hi", messages=[{"role": "user", "content": "hi"}],
                                 created_at_ms=0))
    store = RunningStore(redis)
    await redis.set(SCHEDULER_EPOCH_KEY, 3)
    assert await store.save([placement.model_copy(update={"aged": True, "retry": True})], 3)
    saved = (await redis.hget(SCHEDULER_RUNNING_KEY, "r#0")).decode()
    assert set(json.loads(saved)) == set(placement.model_dump(
        exclude_none=True, exclude={"trace_carrier"})) | {"borrowed"}
    assert json.loads(saved)["borrowed"] is False
    await redis.hset(SCHEDULER_RUNNING_KEY, "old#0",
                     saved.replace('"r#0"', '"old#0"').replace("false", "true"))
    assert sorted(await store.load(), key=lambda p: p.placement_id) == [
        placement.model_copy(update={"placement_id": "old#0"}), placement]


class Fences:
    """The running store's fencing, as Redis would answer it: `taken` were claimed by an
    agent already; every other placement id can be fenced."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken
        self.ended: set[str] = set()
        """Of `taken`, those their agent has ended (released from its node's claims)."""
        self.fenced: list[str] = []
        self.removed: list[str] = []
        self.alive_nodes: set[str] = set()
        """Nodes whose agents say in Redis that they are alive."""
        self.filed: dict[str, list] = {}
        """Final records the agent of n1 filed and never released, by placement id."""

    async def alive(self, node_ids: list[str]) -> list[bool]:
        return [n in self.alive_nodes for n in node_ids]

    async def fence(self, placement_ids: list[str]) -> list[bool]:
        self.fenced += placement_ids
        return [pid not in self.taken for pid in placement_ids]

    async def claims(self, placements) -> dict[str, str]:
        return {p.placement_id: "ended" if p.placement_id in self.ended else
                "held" if p.placement_id in self.taken else "untaken" for p in placements}

    async def save(self, placements, epoch: int) -> bool:
        return True

    async def held_as(self, placements) -> dict:
        return {}  # every placement taken runs where it was booked

    async def remove(self, placement_ids: list[str]) -> None:
        self.removed += placement_ids

    async def filed_finals(self, node_ids: list[str]) -> list[Filed]:
        return [Filed("n1", pid, records) for pid, records in self.filed.items()
                if "n1" in node_ids]

    async def release_claims(self, filed: list[Filed]) -> None:
        for f in filed:
            self.filed.pop(f.placement_id)


class OnOneNode:
    """An engine that has placed `taken` and `untaken` on node n1 at 1,000 ms; an agent
    claimed `taken`. `now` moves its clock; `retries` are the requests it sent back,
    `retried` counts them by why in the engine's metrics."""

    def __init__(self, config: EngineConfig) -> None:
        self.now, self.sent = 1000, []
        self.fences = Fences(taken={"taken#0"})
        self.registry = CollectorRegistry()

        async def send(batch):
            self.sent.extend(batch)
            return asyncio.gather()
        self.engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: self.now,
                                       NoOpTracer(), config, store=self.fences,
                                       registry=self.registry)
        self.engine.lead(3, [])
        self.engine.view.apply_node_state(node("n1", [80000]), self.now, NODE_TIMEOUT_MS)

    async def place(self) -> None:
        for rid in ("taken", "untaken"):
            self.engine.queue.push(Pending(req(rid), {}, 0))
        assert await self.engine.cycle() == 2
        await asyncio.sleep(0)  # settled

    def retries(self) -> list[InferenceRequest]:
        return [o.message for o in self.sent if isinstance(o.message, InferenceRequest)]

    def retried(self) -> dict[str, float | None]:
        return {why: self.registry.get_sample_value("gpusched_scheduler_retries_total",
                                                    {"why": why})
                for why in ("node_lost", "untaken", "takeover")}


async def test_a_node_silent_on_kafka_but_alive_in_redis_keeps_its_work() -> None:
    """Before, a Kafka outage past the node time-out had every running placement retried
    while its agent ran it on: each request ran twice, and was billed twice."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    one.fences.alive_nodes.add("n1")
    for t in (12_000, 20_000, 40_000):  # n1 silent 11 s, 19 s, 39 s
        one.now = t
        await one.engine.cycle()
    assert not one.retries() and sorted(one.engine.running) == ["taken#0", "untaken#0"]
    one.fences.alive_nodes.clear()  # the agent is gone now
    one.now = 41_000
    await one.engine.cycle()
    assert sorted(r.request_id for r in one.retries()) == ["taken", "untaken"]
    assert one.retried() == {"node_lost": 2, "untaken": 0, "takeover": 0}


async def test_retries_kafka_refuses_when_a_node_is_lost_are_sent_next_cycle() -> None:
    """A node is reported lost once. Before, a refused retry was dropped with its placement,
    and the placements after it stayed 'running' on the dead node: their requests waited
    until a fail-over. Now every retry goes out once Kafka takes it, and only then do the
    placements leave Redis."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    send = one.engine._send

    async def refuse(batch):
        if any(isinstance(o.message, InferenceRequest) for o in batch):
            raise KafkaConnectionError("broker briefly unavailable")
        return await send(batch)

    one.engine._send = refuse
    one.now = 12_000  # n1 silent 11 s: lost
    await one.engine.cycle()
    assert not one.retries() and not one.fences.removed and not one.engine.running
    one.engine._send = send  # Kafka is back
    one.now = 13_000
    await one.engine.cycle()
    assert sorted((r.request_id, r.attempt) for r in one.retries()) == [
        ("taken", 1), ("untaken", 1)]
    assert sorted(one.fences.removed) == ["taken#0", "untaken#0"]


async def test_a_placement_its_node_never_takes_is_fenced_and_retried() -> None:
    """The node keeps reporting but never lists the placement and no final usage comes:
    after the time-out it is retried, unless fencing shows an agent has taken it."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, untaken_timeout_ms=30_000))
    await one.place()
    for seq, t in enumerate((11_000, 21_000, 31_000, 32_000), start=2):  # heartbeats
        one.now = t
        one.engine.view.apply_node_state(node("n1", [80000], seq=seq), t, NODE_TIMEOUT_MS)
        await one.engine.cycle()
        if t <= 31_000:  # sent at 1,000: not 30 s yet
            assert not one.retries()
    [retry] = one.retries()
    assert (retry.request_id, retry.attempt, retry.requeued) == ("untaken", 1, "node_lost")
    assert one.fences.removed == ["untaken#0"]
    assert "untaken#0" not in one.engine.view.reservations
    assert sorted(one.engine.running) == ["taken#0"]  # an agent has it: it stays
    # n1 reported all along: counted as untaken, which GpuschedNodeLost does not read
    assert one.retried() == {"node_lost": 0, "untaken": 1, "takeover": 0}


async def test_a_request_placed_again_after_its_placement_ended_is_not_left_running() -> None:
    """`taken` was redelivered long after it was decided and placed again under the id of
    its finished placement; the agent ignores the command as a duplicate, so no final usage
    will come. The untaken check sees its agent ended it: dropped, not retried, its memory
    free again."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, untaken_timeout_ms=30_000))
    one.fences.ended.add("taken#0")
    await one.place()
    one.now = 32_000
    one.engine.view.apply_node_state(node("n1", [80000], seq=2), one.now, NODE_TIMEOUT_MS)
    await one.engine.cycle()
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]
    assert not one.engine.running
    assert not one.engine.view.reservations
    assert sorted(one.fences.removed) == ["taken#0", "untaken#0"]


async def test_work_a_lost_nodes_agent_had_ended_is_not_retried() -> None:
    """n1 goes silent after its agent ended `taken` but before its final usage arrived:
    that request is finished, only `untaken` runs again."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    one.fences.ended.add("taken#0")
    await one.place()
    one.now = 12_000
    await one.engine.cycle()
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]
    assert not one.engine.running


async def test_work_of_a_lost_node_is_fenced_and_retried_taken_or_not() -> None:
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    tenant = one.engine.running["taken#0"].request.tenant
    assert one.engine.fair.level(tenant, 12) > 0  # charged the placements' estimates
    one.now = 12_000  # silent for 11 s
    await one.engine.cycle()
    # given back: each retry is charged again when placed (before, the tenant paid twice)
    assert one.engine.fair.level(tenant, 12) == pytest.approx(0, abs=1e-9)
    assert sorted(one.fences.fenced) == ["taken#0", "untaken#0"]  # late deliveries never run
    assert sorted((r.request_id, r.attempt) for r in one.retries()) == [("taken", 1),
                                                                        ("untaken", 1)]
    assert not one.engine.running
    assert sorted(one.fences.removed) == ["taken#0", "untaken#0"]


async def test_work_of_a_lost_node_on_its_last_attempt_ends_failed() -> None:
    """At attempt 100 the retry was published as attempt 101, which no consumer reads: the
    request was dead-lettered and never answered. It ends failed, and is counted so (it
    was counted nowhere: not retried, its lost node raised no alert)."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    last = req("last").model_copy(update={"attempt": 100, "requeued": "node_lost"})
    one.engine.queue.push(Pending(last, {}, 0))
    assert await one.engine.cycle() == 1
    one.now = 12_000  # silent for 11 s
    await one.engine.cycle()
    assert not one.retries() and not one.engine.running
    [result] = [o.message for o in one.sent if isinstance(o.message, RequestResult)]
    assert (result.request_id, result.status) == ("last", "failed")
    assert "on attempt 100, the last a request may have" in result.finish_reason
    assert one.fences.removed == ["last#100"]
    assert one.retried() == {"node_lost": 0, "untaken": 0, "takeover": 0}
    assert {why: one.registry.get_sample_value("gpusched_scheduler_attempts_exhausted_total",
                                               {"why": why})
            for why in ("node_lost", "untaken", "takeover")} == {
        "node_lost": 1, "untaken": 0, "takeover": 0}


async def test_what_is_sent_for_work_of_a_lost_node_goes_on_in_its_requests_trace() -> None:
    """n1 is lost: the retry of its work, the failure of work on its last attempt and the
    final records its agent had filed (published on its behalf) each began a new trace,
    with no link to their request's: a request's later attempts, and how it ended, were
    not in its trace. Each now goes in its request's trace (the retry carries it on to the
    next attempt, read back)."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    last = req("last").model_copy(update={"attempt": 100, "requeued": "node_lost"})
    for trace_id, request in enumerate((req("taken"), req("untaken"), last), start=1):
        one.engine.queue.push(Pending(request, traceparent(trace_id), 0))
    assert await one.engine.cycle() == 3
    await asyncio.sleep(0)  # settled
    one.fences.filed["taken#0"] = [(RequestResult(
        request_id="taken", tenant="acme", model="qwen2.5-1.5b", status="completed",
        finish_reason="length", prompt_tokens=3, completion_tokens=6, queued_ms=1,
        total_ms=1000), topics.RESULTS.name, "taken")]
    one.sent.clear()
    one.now = 12_000  # silent for 11 s
    await one.engine.cycle()
    assert {(o.message.type, o.message.request_id): carried_span(o.trace_carrier).trace_id
            for o in one.sent} == {("request_result", "taken"): 1,
                                   ("inference_request", "untaken"): 2,
                                   ("request_result", "last"): 3}


async def test_a_lost_nodes_filed_final_records_are_published_and_nothing_is_rerun() -> None:
    """The agent of n1 filed final records and died before they all went out: for `taken`
    (usage, result) and for `earlier` (only its result was left: its final usage had
    already ended it here). The scheduler publishes them on its behalf instead of retrying
    `taken`; `untaken` is retried as before."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    usage = UsageRecord(event_id="taken#0:final", request_id="taken", placement_id="taken#0",
                        tenant="acme", model="qwen2.5-1.5b", priority_class="standard",
                        node_id="n1", gpu_type="H100-80GB", prompt_tokens=3, completion_tokens=6,
                        gpu_seconds=0.5, started_at_ms=1000, ended_at_ms=2000)
    result = RequestResult(request_id="taken", tenant="acme", model="qwen2.5-1.5b",
                           status="completed",
                           finish_reason="length", prompt_tokens=3, completion_tokens=6,
                           queued_ms=1, total_ms=1000)
    earlier = result.model_copy(update={"request_id": "earlier"})
    one.fences.filed["taken#0"] = [(usage, topics.USAGE.name, "acme"),
                                   (result, topics.RESULTS.name, "taken")]
    one.fences.filed["earlier#0"] = [(earlier, topics.RESULTS.name, "earlier")]
    one.now = 12_000  # silent for 11 s
    await one.engine.cycle()
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]
    assert [(o.message, o.topic) for o in one.sent[-4:-1]] == [
        (usage, topics.USAGE.name), (result, topics.RESULTS.name),
        (earlier, topics.RESULTS.name)]
    assert one.fences.filed == {}  # taken off the node's claims
    assert list(one.engine.running) == ["taken#0"]  # until its final usage comes back
    await one.engine.usage([request_record(topics.USAGE.name, 0, usage.to_bytes())])
    assert not one.engine.running
    charged = one.engine.fair.level("acme", one.now / 1000)
    # The agent had published its final usage too before it died: the copy is applied once.
    await one.engine.usage([request_record(topics.USAGE.name, 1, usage.to_bytes())])
    assert one.engine.fair.level("acme", one.now / 1000) == charged


@pytest.mark.parametrize("leads_again", [False, True])
async def test_filed_final_records_kafka_refused_are_published_next_cycle_not_rerun(
        leads_again: bool) -> None:
    """Kafka refuses the records the lost node's agent filed for `taken`: the request is
    not retried (it has finished), and the records go out on the next cycle, also when the
    instance stepped down and leads again meanwhile (a Redis blip): before, leading again
    dropped them, and the node, lost to it already, was never found lost again."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    result = RequestResult(request_id="taken", tenant="acme", model="qwen2.5-1.5b",
                           status="completed", finish_reason="length", prompt_tokens=3,
                           completion_tokens=6, queued_ms=1, total_ms=1000)
    one.fences.filed["taken#0"] = [(result, topics.RESULTS.name, "taken")]
    send = one.engine._send  # noqa: SLF001 - the seam to Kafka is the point

    async def refuse_results(batch):
        if any(o.topic == topics.RESULTS.name for o in batch):
            raise KafkaConnectionError("broker down")
        return await send(batch)
    one.engine._send = refuse_results  # noqa: SLF001
    one.now = 12_000
    await one.engine.cycle()
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]
    assert "taken#0" in one.fences.filed
    if leads_again:
        running = list(one.engine.running.values())
        one.engine.step_down()
        one.engine.lead(4, running, {r.placement_id: "held" for r in running})
    one.engine._send = send  # noqa: SLF001 - Kafka is back
    one.now = 13_000
    await one.engine.cycle()
    assert [o.message for o in one.sent if o.topic == topics.RESULTS.name] == [result]
    assert one.fences.filed == {}
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]


def inherited(rid: str, node_id: str = "n1") -> RunningPlacement:
    """A previous leader's placement `<rid>#0` of 4,000 MiB on GPU 0 of `node_id`."""
    return RunningPlacement(
        placement_id=f"{rid}#0", node_id=node_id, gpu_indices=(0,), memory_mib_per_gpu=4000,
        kv_cache_mib=1000, estimate_gpu_s=1.0, placed_at_ms=500,
        request=req(rid))


async def test_a_new_leader_settles_what_it_inherits_by_the_agents_ledger() -> None:
    """Inherited from a leader that died: `ended` finished while nobody led (its final
    usage went by unmatched), `fenced` was fenced but not yet retried, `lost` was never
    taken (its command lost on its way), `running` runs and its node lists it."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, untaken_timeout_ms=30_000))
    one.engine.view.apply_node_state(node("n1", [80000], seq=2, active=("running#0",)),
                                     one.now, NODE_TIMEOUT_MS)
    one.engine.lead(4, [inherited(rid) for rid in ("ended", "fenced", "lost", "running")],
                    {"ended#0": "ended", "fenced#0": "fenced", "lost#0": "untaken",
                     "running#0": "held"})
    await one.engine.cycle()
    assert sorted(one.engine.running) == ["lost#0", "running#0"]
    assert sorted(one.fences.removed) == ["ended#0", "fenced#0"]
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("fenced", 1)]
    assert list(one.engine.view.reservations) == ["lost#0"]  # holds its memory meanwhile
    one.now = 31_000
    one.engine.view.apply_node_state(node("n1", [80000], seq=3, active=("running#0",)),
                                     one.now, NODE_TIMEOUT_MS)
    await one.engine.cycle()  # the untaken check finds the lost command
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("fenced", 1), ("lost", 1)]
    assert sorted(one.engine.running) == ["running#0"]
    assert one.retried() == {"node_lost": 0, "untaken": 1, "takeover": 1}


async def test_a_new_leader_forgets_inherited_work_whose_final_usage_it_read_as_a_standby(
        ) -> None:
    """`done` ended and this instance, standing by, read its final usage; its claim still
    reads held (its agent's release failed). Before, the new leader kept it running for
    good: memory reserved, in flight for its tenant's limit, a preemption victim."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, untaken_timeout_ms=30_000))
    one.engine._ended["done#0"] = None  # what `usage` notes of a final record
    one.engine.lead(4, [inherited("done")], {"done#0": "held"})
    await one.engine.cycle()
    assert not one.engine.running and not one.engine.view.reservations
    assert one.fences.removed == ["done#0"] and not one.retries()


async def test_work_inherited_on_a_node_never_heard_from_is_retried_after_the_time_out() -> None:
    """The previous leader placed `orphan` on n9, whose node-state record is gone: this
    instance never hears from it, so it expects a report within the time-out, then declares
    the node lost and retries the work (n9 is never offered to the solver meanwhile)."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    one.engine.lead(4, [inherited("orphan", "n9")], {"orphan#0": "held"})
    await one.engine.cycle()
    assert "n9" not in one.engine.view.live_nodes(one.now, 10_000)
    one.now = 11_000
    one.engine.view.apply_node_state(node("n1", [80000], seq=2), one.now, NODE_TIMEOUT_MS)
    await one.engine.cycle()
    assert not one.retries()
    one.now = 11_001
    await one.engine.cycle()
    [retry] = one.retries()
    assert (retry.request_id, retry.attempt, retry.requeued) == ("orphan", 1, "node_lost")
    assert "orphan#0" not in one.engine.running


async def test_a_leader_again_reserves_only_what_it_inherits() -> None:
    """This instance placed `taken` and `untaken`, stepped down, and leads again; the
    leader between retried both and Redis holds neither. Before, their reservations stayed
    in the view and held n1's memory for good (nothing lists or ends those placements)."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12))
    await one.place()
    assert sorted(one.engine.view.reservations) == ["taken#0", "untaken#0"]
    one.engine.step_down()
    one.engine.lead(5, [], {})
    await one.engine.cycle()
    assert not one.engine.view.reservations


async def test_work_dropped_on_stepping_down_gives_its_tokens_per_minute_back() -> None:
    """The records are read again by whichever instance leads next, and charged then.
    Before, leading again charged them a second time: hooli's 1,500 tokens counted 3,000
    and its next request was refused over a limit it had not reached."""
    engine, _ = leading_engine()
    record = request_record(topics.REQUESTS["standard"].name, 0, json.dumps({
        "request_id": "A", "tenant": "hooli", "model": SMALL.name, "prompt": "x",
        "max_tokens": 1499}).encode())
    await engine.admit([record])
    charged = engine.quotas.tokens_last_minute("hooli", 1000)
    engine.step_down()  # a lease check failed
    assert engine.quotas.tokens_last_minute("hooli", 1000) == 0
    engine.lead(4, [])
    await engine.admit([record])
    assert engine.quotas.tokens_last_minute("hooli", 1000) == charged
    # so does work whose cycle Kafka had not acknowledged yet
    acked = asyncio.get_running_loop().create_future()

    async def send(batch):
        return acked
    engine._send = send
    engine.view.apply_node_state(node("n1", [80000]), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    engine.step_down()
    acked.set_exception(ConnectionError("broker gone"))
    await asyncio.sleep(0.01)
    assert engine.quotas.tokens_last_minute("hooli", 1000) == 0


async def placed_on_n1(send) -> tuple[SchedulingEngine, list[int], Commits]:  # noqa: ANN001
    """A leading engine (its clock, `now[0]`, at 1,000 ms; nodes time out after 10 s) that
    has sent request `r`, read at offset 7, to node n1; `send` is its seam to Kafka."""
    now, kafka = [1000], Commits()
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: now[0], NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000,
                                           commit_interval_ms=0), store=Fences(taken=set()))
    engine.lead(3, [])
    engine.view.apply_node_state(node("n1", [80000]), now[0], NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 7, json.dumps(
        {"request_id": "r", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4}).encode())], kafka.commit)
    assert await engine.cycle() == 1
    return engine, now, kafka


async def test_a_cycle_undone_after_its_node_was_lost_does_not_place_the_work_again() -> None:
    """n1 is lost while Kafka still holds the cycle that placed `r` there: `r` is fenced and
    retried as attempt 1, then Kafka refuses the cycle. Before, the undo queued attempt 0
    again beside its retry; it was sent to another node, which refused it as fenced, and it
    stayed running and reserved for good. Now its offset is committed once the retry is
    out."""
    acks: list[asyncio.Future] = []
    sent: list = []

    async def send(batch):
        sent.extend(batch)
        if any(isinstance(o.message, Placement) for o in batch):
            acks.append(asyncio.get_running_loop().create_future())
            return acks[-1]
        return asyncio.gather()
    engine, now, kafka = await placed_on_n1(send)
    standard = topics.REQUESTS["standard"].name
    now[0] = 12_000  # n1 silent for 11 s; n2 is up
    engine.view.apply_node_state(node("n2", [80000]), now[0], NODE_TIMEOUT_MS)
    await engine.cycle()
    assert [(o.message.request_id, o.message.attempt) for o in sent
            if isinstance(o.message, InferenceRequest)] == [("r", 1)]
    acks[0].set_exception(ConnectionError("broker gone"))
    await asyncio.sleep(0.01)
    await engine.cycle()
    assert not engine.queue.depth()["standard"] and not engine.running
    assert [o.message.placement_id for o in sent if isinstance(o.message, Placement)] == ["r#0"]
    assert kafka.offsets == {TopicPartition(standard, 0): 8}


def _held_engine(send=None, store=None, sent: list | None = None,  # noqa: ANN001
                 before_send: Callable[[], None] | None = None
                 ) -> tuple[SchedulingEngine, list[asyncio.Future], Commits]:
    """A leading engine whose publishes wait for the test to answer them (`acks`), unless
    it gives its own `send`; `sent`, if given, collects what it publishes; `before_send`,
    if given, runs as each publish begins."""
    acks: list[asyncio.Future] = []

    async def held(batch):
        if before_send is not None:
            before_send()
        if sent is not None:
            sent.extend(batch)
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send or held, lambda: 1000,
                              NoOpTracer(), EngineConfig(cycle_window_ms=0,
                                                         node_timeout_ms=10**12,
                                                         commit_interval_ms=0), store=store)
    engine.lead(3, [])
    engine.view.apply_node_state(node("n1", [80000]), 0, NODE_TIMEOUT_MS)
    return engine, acks, Commits()


async def _acked_at_once(batch) -> asyncio.Future:  # noqa: ANN001
    """A send Kafka takes at once."""
    return asyncio.gather()


def _answer(ack: asyncio.Future, refused: bool) -> None:
    """Kafka's answer to a cycle: taken, or refused."""
    if refused:
        ack.set_exception(ConnectionError("broker gone"))
    else:
        ack.set_result(None)


def _kafka_away_until(back: list[bool]):  # noqa: ANN202
    """A send that Kafka refuses until `back[0]` is set."""
    async def send(batch):
        done = asyncio.get_running_loop().create_future()
        if back[0]:
            done.set_result(None)
        else:
            done.set_exception(ConnectionError("Kafka away"))
        return done
    return send


def _standard_record(offset: int, request_id: str, **extra) -> ConsumerRecord:
    return request_record(topics.REQUESTS["standard"].name, offset, json.dumps(
        {"request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4} | extra).encode())


@pytest.mark.parametrize("token,refused,lead_first", [
    (3, True, True), (4, False, True), (4, False, False)],
    ids=["refused-after-leading-again", "taken-after-a-new-token", "taken-while-not-leading"])
async def test_a_cycle_answered_across_a_change_of_term_is_placed_again(
        token: int, refused: bool, lead_first: bool) -> None:
    """Kafka answered a cycle after its instance stepped down. Refused after it led again
    under the same token (Redis, which holds only what an answer saved, did not have it),
    the undo took the placement for one that had moved on and marked the work decided.
    Taken after it led again under a new token, or while it did not lead, the placement
    (which agents refuse under the old token) was saved and its work marked decided. Each
    time the record, read again, was skipped as placed: the request was never placed."""
    engine, acks, kafka = _held_engine()
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    engine.step_down()
    if lead_first:
        engine.lead(token, [], {})
    _answer(acks[0], refused)
    await asyncio.sleep(0.01)
    if not lead_first:
        engine.lead(token, [], {})
    assert kafka.offsets == {}
    await engine.admit([record], kafka.commit)  # the consumer reads it again
    assert await engine.cycle() == 1
    acks[1].set_result(None)
    await asyncio.sleep(0.01)
    assert list(engine.running) == ["r1#0"] and kafka.offsets


async def test_a_cycle_undone_while_its_retry_is_on_its_way_waits_for_kafka_to_take_it(
) -> None:
    """Kafka refused the cycle while the lost node's retry was being published: the retry
    was out of the list the undo looks at, so the record's offset was committed before
    Kafka had taken the retry, which it then refused too (a crash then lost the request)."""
    acks: list[asyncio.Future] = []

    async def send(batch):
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    engine, now, kafka = await placed_on_n1(send)
    standard = topics.REQUESTS["standard"].name
    now[0] = 12_000  # n1 lost: its retry goes out
    cycle = asyncio.create_task(engine.cycle())
    await asyncio.sleep(0.01)
    acks[0].set_exception(ConnectionError("broker gone"))  # the cycle that placed r
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}
    acks[1].set_exception(ConnectionError("broker gone"))  # the retry
    await cycle
    assert kafka.offsets == {} and [pid for pid, _ in engine._retries] == ["r#0"]
    retried = asyncio.create_task(engine.cycle())  # Kafka is back: the retry goes out
    await asyncio.sleep(0.01)
    acks[2].set_result(None)
    await retried
    await asyncio.sleep(0.01)
    assert kafka.offsets == {TopicPartition(standard, 0): 8} and not engine._retries


async def test_a_cycle_kafka_takes_after_its_node_was_lost_commits_once_the_retry_is_out(
) -> None:
    """n1 is lost while Kafka still holds the cycle that placed `r` there; Kafka refuses r's
    retry, then takes the cycle. Before, r's record was committed then, its retry in this
    instance's memory alone (a retried placement is not saved to Redis): a step-down or a
    crash before Kafka took the retry lost the request. Now the record commits once Kafka
    has taken the retry, and a next leader reads it again until then."""
    acks: list[asyncio.Future] = []
    sent: list = []
    retries_refused = [True]

    async def send(batch):
        sent.extend(batch)
        done = asyncio.get_running_loop().create_future()
        if not any(isinstance(o.message, InferenceRequest) for o in batch):
            acks.append(done)  # the cycle: answered by the test
        elif retries_refused[0]:
            done.set_exception(ConnectionError("request topic leader unavailable"))
        else:
            done.set_result(None)
        return done
    engine, now, kafka = await placed_on_n1(send)
    now[0] = 12_000  # n1 silent for 11 s: lost, r#0 fenced, its retry refused
    await engine.cycle()
    assert [pid for pid, _ in engine._retries] == ["r#0"]
    _answer(acks[0], refused=False)  # the cycle that placed r
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}
    retries_refused[0] = False
    now[0] = 13_000
    await engine.cycle()
    await asyncio.sleep(0.01)
    assert [(o.message.request_id, o.message.attempt) for o in sent
            if isinstance(o.message, InferenceRequest)] == [("r", 1), ("r", 1)]
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}
    assert not engine.running and not engine._retries


async def test_a_placement_kafka_may_have_taken_is_sent_again_where_it_went() -> None:
    """Kafka refused the cycle that sent r1#0 to one node (another record of the cycle
    failed, or the answer timed out after the write), but that node's agent had it and ran
    it. The cycle was undone and r1#0 planned again, to the other node, whose agent ignored
    it as a duplicate: the scheduler held that node's GPU for the whole run, and when that
    node was lost it retried the request while it still ran. Now the placement goes out
    again unchanged (node, GPUs, KV cache, time, token), held where it went meanwhile."""
    now, acks, sent = [1000], [], []

    async def send(batch):
        sent.extend(batch)
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: now[0], NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000,
                                           commit_interval_ms=0), store=Fences(taken=set()))
    engine.lead(3, [])
    for n in ("n1", "n2"):  # room for one 8B request each
        engine.view.apply_node_state(node(n, [20_000]), now[0], NODE_TIMEOUT_MS)
    engine.queue.push(Pending(req("r1", model=EIGHT_B.name, max_tokens=1000), {}, 0))
    await engine.cycle()
    [first] = [o.message for o in sent if isinstance(o.message, Placement)]
    ran_on, other = first.node_id, ({"n1", "n2"} - {first.node_id}).pop()
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    assert list(engine.view.reservations) == ["r1#0"]  # nothing else may take its room
    now[0] = 1500  # its agent runs it: that GPU is full now
    engine.view.apply_node_state(node(ran_on, [60], models=(EIGHT_B.name,), seq=2,
                                      active=("r1#0",)), now[0], NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    assert [o.message for o in sent if isinstance(o.message, Placement)] == [first, first]
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert engine.running["r1#0"].node_id == ran_on
    assert not engine.view.node_reservations(other)[0]
    now[0] = 12_000  # the other node goes silent and is lost: it ran nothing of r1
    engine.view.apply_node_state(node(ran_on, [60], models=(EIGHT_B.name,), seq=3,
                                      active=("r1#0",)), now[0], NODE_TIMEOUT_MS)
    await engine.cycle()
    assert not [o for o in sent if isinstance(o.message, InferenceRequest)]
    assert list(engine.running) == ["r1#0"]


async def test_a_placement_to_send_again_survives_a_cycle_that_fails_before_sending(
) -> None:
    """The cycle after the refusal raised before it sent anything (run() logs it and cycles
    on): the placement it had taken to send again was lost with it, neither sent nor
    decided, so nothing behind its record committed for the rest of the term."""
    sent: list = []
    engine, acks, kafka = _held_engine(store=Fences(taken=set()), sent=sent)
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    assert await engine.cycle() == 1
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    with patch("gpusched_scheduler.engine.plan_cycle", side_effect=RuntimeError("fault")), \
            pytest.raises(RuntimeError):
        await engine.cycle()
    assert await engine.cycle() == 1
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert [o.message.placement_id for o in sent] == ["r1#0", "r1#0"]
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}


async def test_a_cycle_the_producer_refuses_at_once_sends_its_placement_again_unchanged(
) -> None:
    """The producer raised as the cycle handed it its records (a partition's batch that
    could not drain): the placement stayed running and reserved while its work waited
    again, and the next cycle planned it again under the same id, maybe elsewhere."""
    sent: list = []
    raised = [False]

    async def send(batch):
        sent.extend(batch)
        if not raised[0]:
            raised[0] = True
            raise KafkaConnectionError("a partition's batch could not drain")
        return asyncio.gather()
    engine, _, kafka = _held_engine(send=send)
    engine.view.apply_node_state(node("n2", [80000]), 0, NODE_TIMEOUT_MS)
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    await engine.cycle()
    await asyncio.sleep(0.01)
    assert not len(engine.queue) and list(engine.running) == ["r1#0"]
    assert await engine.cycle() == 1
    await asyncio.sleep(0.01)
    [first, again] = [o.message for o in sent]
    assert first == again
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}


async def _untaken_engine(send, now: list[int]  # noqa: ANN001
                          ) -> tuple[SchedulingEngine, Fences]:
    """A leading engine on clock `now` that sends through `send`, fences with a store no
    agent claimed anything in, times placements out as untaken after 30 s, and has r1
    waiting."""
    store = Fences(taken=set())
    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: now[0], NoOpTracer(),
                              EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12,
                                           untaken_timeout_ms=30_000, commit_interval_ms=0),
                              store=store)
    engine.lead(3, [])
    await engine.admit([_standard_record(7, "r1")])
    return engine, store


async def test_a_placement_sent_again_is_untaken_only_that_long_after_kafka_took_it(
) -> None:
    """Kafka refused it for 35 s: the untaken time-out (30 s) ran from its first send, so
    the first cycle after Kafka came back fenced and retried it as never taken by its node,
    which had never been sent it."""
    now, acks, sent = [1000], [], []

    async def send(batch):
        sent.extend(batch)
        acks.append(asyncio.get_running_loop().create_future())
        if now[0] < 36_000:
            acks[-1].set_exception(ConnectionError("broker gone"))
        return acks[-1]
    engine, store = await _untaken_engine(send, now)
    for at in range(1000, 37_001, 1000):  # n1 reports every second, lists nothing yet
        now[0] = at
        engine.view.apply_node_state(node("n1", [80000], seq=at), at, NODE_TIMEOUT_MS)
        await engine.cycle()
        await asyncio.sleep(0)
    assert not store.fenced and not [o for o in sent if isinstance(o.message, InferenceRequest)]
    assert list(engine.running) == ["r1#0"]


async def test_a_placement_kafka_is_slow_to_take_is_untaken_only_that_long_after_it_did(
) -> None:
    """Kafka took 35 s to acknowledge the cycle (aiokafka waits up to 40 s), while its node
    reported every second: the untaken time-out (30 s) ran from the send, so the placement
    was fenced and retried as never taken before Kafka had even taken it."""
    now, acks, sent = [1000], [], []

    async def send(batch):
        sent.extend(batch)
        acks.append(asyncio.get_running_loop().create_future())
        if len(acks) > 1:  # only the first cycle's answer is slow
            acks[-1].set_result([])
        return acks[-1]
    engine, store = await _untaken_engine(send, now)
    for at in range(1000, 66_001, 1000):  # n1 reports every second, lists nothing yet
        now[0] = at
        if at == 36_000:
            acks[0].set_result([])
        engine.view.apply_node_state(node("n1", [80000], seq=at), at, NODE_TIMEOUT_MS)
        await engine.cycle()
        await asyncio.sleep(0)
    assert not store.fenced and list(engine.running) == ["r1#0"]
    now[0] = 67_000  # 30 s after Kafka took it, n1 has still not listed it: lost on its way
    engine.view.apply_node_state(node("n1", [80000], seq=67_000), now[0], NODE_TIMEOUT_MS)
    await engine.cycle()
    assert store.fenced == ["r1#0"]


async def test_a_next_leader_knows_a_placement_kafka_refused_and_settles_it_by_its_claim(
) -> None:
    """Kafka refused the cycle, the instance stepped down before sending it again, and the
    next term did not know the placement: it planned the request afresh, on another node,
    whose agent ignored it as a duplicate while it ran on the first. It is saved for a next
    leader when refused, which then counts it where it went."""
    sent: list = []
    store = FlakyStore()
    store.up = True
    engine, acks, kafka = _held_engine(store=store, sent=sent)
    engine.view.apply_node_state(node("n2", [80000]), 0, NODE_TIMEOUT_MS)
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    [first] = [o.message for o in sent]
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    assert store.saved == ["r1#0"]
    inherited = engine.running["r1#0"]
    engine.step_down()
    engine.lead(4, [inherited], {"r1#0": "held"})  # as Redis lists it, claimed by its agent
    await engine.admit([record], kafka.commit)  # the new term reads it again
    await engine.cycle()
    assert engine.running["r1#0"].node_id == first.node_id
    assert [o.message.placement_id for o in sent] == ["r1#0"]  # nothing planned afresh


async def test_a_save_retried_past_its_placements_end_does_not_write_it_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis away: the refused r1#0's save retried while its final usage came and, Redis
    back, the next cycle removed it from the running hash; then the retry wrote it back,
    for a next leader to inherit a placement that had ended."""
    from gpusched_scheduler import engine as engine_module

    monkeypatch.setattr(engine_module, "SAVE_RETRY_S", 0.01)

    class Hash(Fences):
        def __init__(self) -> None:
            super().__init__(taken=set())
            self.up, self.hash = True, {}

        async def save(self, placements, epoch: int) -> bool:  # noqa: ANN001
            if not self.up:
                raise ConnectionError("Redis is away")
            self.hash.update({p.placement_id: p for p in placements})
            return True

        async def remove(self, placement_ids: list[str]) -> None:
            if not self.up:
                raise ConnectionError("Redis is away")
            for pid in placement_ids:
                self.hash.pop(pid, None)

    store = Hash()
    engine, acks, kafka = _held_engine(store=store)
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    assert await engine.cycle() == 1
    store.up = False
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)  # its save retries
    await engine.usage([request_record(topics.USAGE.name, 0, UsageRecord(
        event_id="r1#0:final", request_id="r1", placement_id="r1#0", tenant="acme",
        model=SMALL.name, priority_class="standard", node_id="n1", gpu_type="H100-80GB",
        prompt_tokens=1, completion_tokens=4, gpu_seconds=0.5, started_at_ms=1000,
        ended_at_ms=1000).to_bytes())])
    store.up = True
    await engine.cycle()  # removes it from the hash
    await asyncio.sleep(0.05)  # the save's next try
    assert not store.hash and not engine.running


async def _cycles_kafka_takes(engine: SchedulingEngine, acks: list[asyncio.Future]
                             ) -> None:
    """Three cycles, each with every publish not answered yet taken by Kafka."""
    for _ in range(3):
        await engine.cycle()
        for ack in acks:
            if not ack.done():
                ack.set_result(None)
        await asyncio.sleep(0.01)


async def _refused_r1(sent: list, before_send: Callable[[], None] | None = None
                      ) -> tuple[SchedulingEngine, list[asyncio.Future], Commits,
                                 FlakyStore, ConsumerRecord]:
    """r1 (offset 7) placed on n1 under token 3 by a cycle Kafka refused, with Redis up:
    the engine, its acks, commits and store, and r1's record; `sent` collects what goes
    out, and `before_send` runs as each publish begins."""
    store = FlakyStore()
    store.up = True
    engine, acks, kafka = _held_engine(store=store, sent=sent, before_send=before_send)
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    return engine, acks, kafka, store, record


@pytest.mark.parametrize("refused_again", [False, True], ids=["taken", "refused-again"])
async def test_a_refused_placement_a_next_term_inherits_lets_its_records_commit(
        refused_again: bool) -> None:
    """Refused, sent again (its answer pending), then the lease lost and taken again under
    token 4, which inherits the placement saved for it: the record read again waited on the
    earlier term's item, which that term's undo never decided, so neither it nor any later
    record of its partition committed for the whole term."""
    engine, acks, kafka, _, record = await _refused_r1([])
    inherited = engine.running["r1#0"].model_copy()  # as Redis gives it back
    assert await engine.cycle() == 1  # sent again, its answer pending
    engine.step_down()
    engine.lead(4, [inherited], {"r1#0": "held"})
    await engine.admit([record], kafka.commit)
    await engine.admit([_standard_record(8, "r2")], kafka.commit)
    _answer(acks[1], refused=refused_again)
    await asyncio.sleep(0.01)
    await _cycles_kafka_takes(engine, acks)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 9}


async def test_a_term_begun_while_a_placement_goes_out_again_lets_its_records_commit(
) -> None:
    """Kafka refused the cycle that placed r1 (saved to Redis at once); while the producer
    took it again the lease lapsed, and this instance led again under token 4, inheriting
    it. The resending cycle then noted its work as in flight in the new term: r1's record
    read again waited on it, whose later-term undo decided nothing, and its partition
    committed nothing more for the whole term."""
    engine: SchedulingEngine
    lapses = [False]

    def lapse() -> None:
        if lapses[0]:
            lapses[0] = False
            inherited = engine.running["r1#0"].model_copy()  # as Redis gives it back
            engine.step_down()
            engine.lead(4, [inherited], {"r1#0": "held"})
    engine, acks, kafka, store, record = await _refused_r1([], before_send=lapse)
    assert store.saved == ["r1#0"]
    lapses[0] = True
    assert await engine.cycle() == 1  # sent again; term 4 begins meanwhile
    assert engine.epoch == 4
    await engine.admit([record, _standard_record(8, "r2")], kafka.commit)  # read again
    await _cycles_kafka_takes(engine, acks)
    assert sorted(engine.running) == ["r1#0", "r2#0"] and not len(engine.queue)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 9}


@pytest.mark.parametrize("after_refusal", [True, False],
                         ids=["cancelled-after-the-refusal", "cancelled-before-the-refusal"])
async def test_a_placement_sent_again_goes_out_though_its_request_was_cancelled(
        after_refusal: bool) -> None:
    """Cancelled while its placement waits to go out again: its agent may run it already
    (the cancel stops it) or take it later (agents read cancels in Redis too, and end it
    unrun), so it goes out again, and no 'cancelled before it was placed' result says that
    nothing ran."""
    sent: list = []
    store = FlakyStore()
    store.up = True
    engine, acks, kafka = _held_engine(store=store, sent=sent)
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    assert await engine.cycle() == 1
    cancel = ConsumerRecord(topics.CONTROL.name, 0, 0, 1000, 0, b"r1", Cancel(
        request_id="r1", reason="client disconnected", at_ms=1000).to_bytes(), None, 0, 0, ())
    if not after_refusal:
        await engine.cancels([cancel])
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    if after_refusal:
        await engine.cancels([cancel])
    assert await engine.cycle() == 1
    assert [type(o.message) for o in sent] == [Placement, Placement]
    assert sent[0].message == sent[1].message
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert list(engine.running) == ["r1#0"] and not len(engine.queue)
    assert store.saved == ["r1#0", "r1#0"]  # refused, then taken
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}


@pytest.mark.parametrize("stepped_down", [True, False],
                         ids=["stepped-down", "led-again-without-stepping-down"])
async def test_a_placement_left_to_send_again_is_decided_afresh_by_a_later_term(
        stepped_down: bool) -> None:
    """Kafka refused the cycle, then the instance stepped down (or led under a new token)
    before the placement went out again: agents refuse its old token, so the next term
    places the request afresh under its own; nothing of the old placement stays running,
    reserved or charged, and the record commits once the new placement is taken."""
    sent: list = []
    engine, acks, kafka, store, record = await _refused_r1(sent)
    charged = engine.fair.level("acme", 1)  # held while it waits to go out again
    if stepped_down:
        engine.step_down()
        assert not engine.running and not engine.view.reservations
        assert engine.fair.level("acme", 1) == pytest.approx(0, abs=1e-9)
        engine.lead(4, [], {})
        await engine.admit([record], kafka.commit)  # the new term reads it again
    else:
        engine.lead(4, [], {})
    assert kafka.offsets == {}
    assert await engine.cycle() == 1
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert [o.message.scheduler_epoch for o in sent] == [3, 4]
    assert list(engine.running) == ["r1#0"] and list(engine.view.reservations) == ["r1#0"]
    assert engine.fair.level("acme", 1) == pytest.approx(charged)
    assert store.saved == ["r1#0", "r1#0"]  # refused (3), placed (4)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}


async def test_a_placement_kafka_refuses_twice_is_saved_and_committed_once_taken() -> None:
    """r1#0 is refused twice while r2#0, placed by a cycle planned before the first refusal
    came, is taken: r1#0 goes out unchanged each time, r2's record (behind r1's) commits
    only once r1#0 is taken; r1#0 is saved for a next leader at each refusal, and taken."""
    sent: list = []
    commits: list[dict] = []
    store = FlakyStore()
    store.up = True
    engine, acks, _ = _held_engine(store=store, sent=sent)

    async def commit(offsets) -> None:  # noqa: ANN001
        commits.append(dict(offsets))
    await engine.admit([_standard_record(7, "r1")], commit)
    assert await engine.cycle() == 1
    await engine.admit([_standard_record(8, "r2")], commit)
    assert await engine.cycle() == 1  # while r1#0's answer is pending
    _answer(acks[0], refused=True)
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert store.saved == ["r1#0", "r2#0"] and not commits
    assert await engine.cycle() == 1
    _answer(acks[2], refused=True)
    await asyncio.sleep(0.01)
    assert await engine.cycle() == 1
    _answer(acks[3], refused=False)
    await asyncio.sleep(0.01)
    placements = [o.message for o in sent]
    assert [p.placement_id for p in placements] == ["r1#0", "r2#0", "r1#0", "r1#0"]
    assert placements[0] == placements[2] == placements[3]
    assert store.saved == ["r1#0", "r2#0", "r1#0", "r1#0"]
    assert commits == [{TopicPartition(topics.REQUESTS["standard"].name, 0): 9}]
    assert sorted(engine.running) == ["r1#0", "r2#0"]


async def test_an_untaken_placement_fenced_before_is_retried() -> None:
    """Redis fenced `untaken` but its answer was lost: the next look found the claim
    fenced, not won, and neither retried nor dropped the placement, which then held its
    request and n1's memory for good."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, untaken_timeout_ms=30_000))
    await one.place()
    fence = one.fences.fence

    async def answer_lost(placement_ids):
        await fence(placement_ids)
        raise ConnectionError("connection reset")
    one.fences.fence = answer_lost
    one.now = 32_000
    one.engine.view.apply_node_state(node("n1", [80000], seq=2), one.now, NODE_TIMEOUT_MS)
    await one.engine.cycle()
    assert not one.retries()
    one.fences.fence = fence
    one.fences.taken.add("untaken#0")  # fenced: fencing it again does not win
    claims = one.fences.claims

    async def fenced(placements):
        return {**await claims(placements), "untaken#0": "fenced"}
    one.fences.claims = fenced
    one.now = 33_000
    one.engine.view.apply_node_state(node("n1", [80000], seq=3), one.now, NODE_TIMEOUT_MS)
    await one.engine.cycle()
    assert [(r.request_id, r.attempt) for r in one.retries()] == [("untaken", 1)]
    assert sorted(one.engine.running) == ["taken#0"]


async def test_an_ended_placement_redis_did_not_remove_is_removed_later() -> None:
    """Redis refused to take an ended placement out of the running hash: the usage handler
    raised, and the entry stayed; a leader after its agent's claim expired would have run
    the request again."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10**12))
    await one.place()
    remove = one.fences.remove

    async def refuse(placement_ids):
        await asyncio.sleep(0.01)  # a round trip that times out
        raise ConnectionError("Redis is away")
    one.fences.remove = refuse
    usage = UsageRecord(event_id="taken#0:final", request_id="taken", placement_id="taken#0",
                        tenant="acme", model="qwen2.5-1.5b", priority_class="standard",
                        node_id="n1", gpu_type="H100-80GB", prompt_tokens=3, completion_tokens=6,
                        gpu_seconds=0.5, started_at_ms=1000, ended_at_ms=2000)
    await one.engine.usage([request_record(topics.USAGE.name, 0, usage.to_bytes())])
    assert sorted(one.engine.running) == ["untaken#0"] and not one.fences.removed
    ended = usage.model_copy(update={"event_id": "untaken#0:final", "request_id": "untaken",
                                     "placement_id": "untaken#0"})
    await asyncio.gather(  # the cycle's try again overlaps another ending, both refused
        one.engine.cycle(),
        one.engine.usage([request_record(topics.USAGE.name, 1, ended.to_bytes())]))
    one.fences.remove = remove  # Redis is back
    await one.engine.cycle()
    assert sorted(one.fences.removed) == ["taken#0", "untaken#0"]  # none dropped on the way


async def test_a_decommissioned_nodes_tombstone_takes_it_out_of_the_fleet() -> None:
    """Its last report stayed in the view: offered to the solver until the time-out, then
    counted in the fleet for good, so work only it could hold waited forever instead of
    getting the 422 a scheduler started after compaction gives. Its work is recovered as a
    lost node's."""
    one = OnOneNode(EngineConfig(cycle_window_ms=0, node_timeout_ms=10_000))
    await one.place()
    small = node("small", [1000])
    small = small.model_copy(update={"gpus": (small.gpus[0].model_copy(
        update={"memory_total_mib": 1000}),)})
    one.engine.view.apply_node_state(small, one.now, NODE_TIMEOUT_MS)
    await one.engine.node_states([node_state_record(5, b"n1", None)])
    assert fleet_gpu_mib(one.engine.view, one.now, STOPPED_GRACE_MS) == [((1000,), None)]
    assert "n1" not in one.engine.view.live_nodes(one.now, 10_000)
    one.now = 12_000  # epoch milliseconds: any real clock is past the time-out since 0
    await one.engine.cycle()
    assert sorted((r.request_id, r.attempt) for r in one.retries()) == [("taken", 1),
                                                                        ("untaken", 1)]
    await one.engine.admit([request_record(topics.REQUESTS["standard"].name, 0, json.dumps(
        {"request_id": "x", "tenant": "acme", "model": SMALL.name, "prompt": "x",
         "max_tokens": 4}).encode())])
    await one.engine.cycle()
    [rejection] = [o.message for o in one.sent if isinstance(o.message, Rejection)]
    assert (rejection.request_id, rejection.status_code) == ("x", 422)


async def test_the_cycle_loop_stops_when_cancelled_as_it_is_woken() -> None:
    """Shutting down cancels it; on Python 3.11, asyncio.wait_for swallowed a cancel that
    came as the wake-up event was set, and the loop ran on (the shutdown hung)."""
    engine, _ = leading_engine()
    loop = asyncio.create_task(engine.run())
    await asyncio.sleep(0.05)
    engine._wake.set()
    loop.cancel()
    async with asyncio.timeout(3):
        await asyncio.gather(loop, return_exceptions=True)
    assert loop.cancelled()


async def test_every_failed_cycle_is_counted() -> None:
    """A cycle that raised was logged and tried again, and counted nowhere: a leader whose
    every cycle failed placed nothing, and no alert could tell."""
    registry = CollectorRegistry()
    engine, _ = leading_engine(registry=registry)

    async def broken() -> int:
        raise RuntimeError("a bug")

    engine.cycle = broken  # type: ignore[method-assign]
    loop = asyncio.create_task(engine.run())
    for _ in range(100):
        await asyncio.sleep(0.05)
        if registry.get_sample_value("gpusched_scheduler_cycle_failures_total") >= 2:
            break
    engine.stop()
    async with asyncio.timeout(3):
        await loop
    assert registry.get_sample_value("gpusched_scheduler_cycle_failures_total") >= 2


def test_quota_book_forgets_admissions_older_than_a_minute() -> None:
    book = QuotaBook()
    for i in range(1000):
        book.admit("t", 1, now_ms=i * 1000)
    assert len(book._admitted["t"]) <= 61  # noqa: SLF001 - the bound is the point


async def test_a_cycle_places_on_while_redis_cannot_fence_an_untaken_placement() -> None:
    """The untaken check's fence raised out of `cycle()`: with Redis away, no cycle placed
    anything once a placement had gone untaken for the time-out."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0], untaken_timeout_ms=30_000)

    class RedisAway:
        async def save(self, placements, epoch: int) -> bool:  # noqa: ANN001
            return True

        async def fence(self, ids):  # noqa: ANN001, ANN201
            raise ConnectionError("Redis away")

    engine._store = RedisAway()  # type: ignore[assignment]
    standard = topics.REQUESTS["standard"].name

    def record(offset: int, request_id: str) -> ConsumerRecord:
        return request_record(standard, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "hi",
            "max_tokens": 3, "created_at_ms": now[0]}).encode())

    engine.view.apply_node_state(node("a", [80000, 80000]), now[0], NODE_TIMEOUT_MS)
    await engine.admit([record(0, "r1")])
    assert await engine.cycle() == 1
    now[0] = 40_000  # r1 never listed by its agent, which kept reporting
    engine.view.apply_node_state(node("a", [80000, 80000], seq=2), now[0], NODE_TIMEOUT_MS)
    await engine.admit([record(1, "r2")])
    assert await engine.cycle() == 1
    assert [PLACEMENT.validate_json(v).request.request_id
            for v in sent[topics.PLACEMENTS.name]] == ["r1", "r2"]


async def test_only_work_that_stays_inside_its_guarantee_may_reclaim_borrowed_work() -> None:
    """A tenant below its guarantee preempted for work beyond it: placed, that work was
    borrowed, and its victim's hand-back (inside its own tenant's guarantee) preempted it
    in turn, every 15 s, while the victim never ran."""
    engine, _ = leading_engine()
    batch = topics.REQUESTS["batch"].name
    assert CATALOG.get("llama-3.1-8b").weight_memory_mib > 4000  # umbrella's guarantee
    await engine.admit([request_record(batch, offset, json.dumps({
        "request_id": request_id, "tenant": "umbrella", "model": model, "prompt": "hi",
        "max_tokens": 3}).encode()) for offset, (request_id, model) in enumerate(
            [("inside", SMALL.name), ("beyond", "llama-3.1-8b")])])
    may_preempt, reclaiming, _ = engine._preemption_rights(
        engine._ordered(1000), lambda: out_of_reach(snapshot(engine.view, set()), [], CATALOG))
    assert may_preempt == {"inside": 0}
    assert reclaiming == {"inside"}


async def test_work_that_would_be_borrowed_preempts_no_work_a_guarantee_keeps() -> None:
    """umbrella, past its guarantee, preempted soylent's batch work (inside soylent's
    guarantee) for an interactive request; placed, that request was borrowed, and the
    batch hand-back reclaimed its room, whose hand-back preempted the batch work again, and
    so on (a probe: 16 preempts in 8 s, the attempts climbing towards the last). A tenant
    whose work is never borrowed (no guarantee) still preempts it by class."""
    engine, sent = leading_engine()
    batch = req("S", "batch", model=EIGHT_B.name, tenant="soylent", max_tokens=7990)
    kv = memory_per_gpu(batch, EIGHT_B)[0]
    engine.view.apply_node_state(node("a", [300], models=(EIGHT_B.name,), active=("S#0",)),
                                 1000, NODE_TIMEOUT_MS)
    engine.running["S#0"] = _victim("S#0", batch, (0,), kv, kv)
    mistral = req("W", model="mistral-7b", tenant="umbrella")  # past its 4,000 MiB
    engine.running["W#0"] = _victim("W#0", mistral, (0,), 13_826, 2).model_copy(
        update={"node_id": "b"})
    interactive = topics.REQUESTS["interactive"].name
    for offset, tenant in enumerate(["umbrella", "acme"]):
        await engine.admit([request_record(interactive, offset, req(
            tenant, "interactive", model=EIGHT_B.name, tenant=tenant,
            max_tokens=7990).to_bytes())])
        await engine.cycle()
    [preempt] = [json.loads(v) for v in sent[topics.PLACEMENTS.name]]
    assert preempt["placement_id"] == "S#0" and "request acme " in preempt["reason"]


async def _cycle_at(engine: SchedulingEngine, now: list[int], at_ms: int,
                   requests: list[InferenceRequest], report: NodeState | None = None) -> None:
    """At `at_ms`: `report` applied, `requests` admitted (each from its class's topic),
    and one cycle run."""
    now[0] = at_ms
    if report is not None:
        engine.view.apply_node_state(report, at_ms, NODE_TIMEOUT_MS)
    for i, request in enumerate(requests):
        await engine.admit([request_record(topics.REQUESTS[request.priority_class].name,
                                           at_ms + i, request.to_bytes())])
    await engine.cycle()


def _preempted(sent: dict[str, list[bytes]]) -> list[str]:
    return [c["placement_id"] for c in map(json.loads, sent.get(topics.PLACEMENTS.name, []))
            if c["type"] == "preempt"]


async def test_a_tenants_waiting_requests_reclaim_no_more_than_its_guarantee_together(
) -> None:
    """umbrella (4,000 MiB guaranteed, holding nothing) had two 1.5B requests waiting, each
    3,765 MiB with the weights: each was judged inside the guarantee against what umbrella
    held alone, and one cycle preempted soylent's borrowed work for both, 7,530 MiB
    reclaimed on 4,000. The second waits now; its turn comes as umbrella's work ends."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    long = 30_000  # tokens: 1.5B work of 821 MiB KV cache, 3,765 MiB with the weights
    await _cycle_at(engine, now, 1000, [req("in", "batch", EIGHT_B.name, "soylent", 7990)],
                    node("a", [40_000]))
    await _cycle_at(engine, now, 2000, [req(f"b{i}", "batch", SMALL.name, "soylent", long)
                                        for i in range(2)])
    assert engine.borrowed() == {"b0#0", "b1#0"}  # past soylent's 20,000 MiB
    await _cycle_at(engine, now, 3000, [req(f"u{i}", "batch", SMALL.name, "umbrella", long)
                                        for i in range(2)],
                    node("a", [0], (EIGHT_B.name, SMALL.name), 2, ("in#0", "b0#0", "b1#0")))
    assert len(_preempted(sent)) == 1


async def test_work_inside_its_guarantee_once_older_work_ended_is_no_longer_borrowed(
) -> None:
    """soylent's mistral job was placed while its 8B job held 15,329 MiB of its 20,000
    guaranteed: marked borrowed then, it stayed so after the 8B job ended, and umbrella
    reclaiming its own guarantee preempted it, though soylent held 13,837 MiB."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    await _cycle_at(engine, now, 1000, [req("old", "batch", EIGHT_B.name, "soylent")],
                    node("a", [40_000]))
    await _cycle_at(engine, now, 2000, [req("new", "batch", "mistral-7b", "soylent")])
    assert engine.borrowed() == {"new#0"}
    await engine.usage([request_record(topics.USAGE.name, 0, UsageRecord(
        event_id="old#0:final", request_id="old", placement_id="old#0", tenant="soylent",
        model=EIGHT_B.name, priority_class="batch", node_id="a", gpu_type="H100-80GB",
        prompt_tokens=1, completion_tokens=10, gpu_seconds=1.0, started_at_ms=1000,
        ended_at_ms=2500).to_bytes())])
    await _cycle_at(engine, now, 3000, [req("u", "batch", SMALL.name, "umbrella")],
                    node("a", [0], (EIGHT_B.name, "mistral-7b"), 2, ("new#0",)))
    assert not _preempted(sent) and not engine.borrowed()


async def test_work_told_to_stop_counts_no_more_in_what_its_tenant_holds() -> None:
    """soylent (20,000 MiB guaranteed) holds old 8B work and new 1.5B work, over its
    guarantee together. acme's interactive request preempts the old work by class; while
    that stops, the new work was still judged borrowed (the old work counted), and
    umbrella reclaimed it too, leaving soylent nothing of its guarantee."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    await _cycle_at(engine, now, 1000, [req("old", "batch", EIGHT_B.name, "soylent", 8000)],
                    node("a", [40_000]))
    await _cycle_at(engine, now, 2000, [req("new", "batch", SMALL.name, "soylent", 30_000)])
    assert engine.borrowed() == {"new#0"}
    await _cycle_at(engine, now, 3000,
                    [req("chat", "interactive", EIGHT_B.name, "acme", 8000)],
                    node("a", [0], (EIGHT_B.name, SMALL.name), 2, ("old#0", "new#0")))
    await asyncio.sleep(0)  # Kafka took the preempt
    assert _preempted(sent) == ["old#0"] and not engine.borrowed()
    await _cycle_at(engine, now, 4000, [req("u", "batch", SMALL.name, "umbrella", 20_000)],
                    node("a", [0], (EIGHT_B.name, SMALL.name), 3, ("old#0", "new#0")))
    assert _preempted(sent) == ["old#0"]


async def test_work_whose_preempt_kafka_refused_still_counts_in_what_its_tenant_holds(
) -> None:
    """The preempt of soylent's old work failed to publish, so it ran on; counted as
    stopping all the same, soylent (over its 20,000 MiB guarantee with it) reclaimed
    umbrella's borrowed work for its new request for the whole preemption time-out."""
    now, sent, refuse = [500], {}, [False]

    async def publish(batch):
        if refuse[0]:
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(KafkaConnectionError("Kafka is away"))
            return failed
        for out in batch:
            sent.setdefault(out.topic, []).append(out.message.to_bytes())
        return asyncio.gather()

    engine = SchedulingEngine(CATALOG, load_tenants(CONFIG), publish, lambda: now[0],
                              NoOpTracer(), EngineConfig(cycle_window_ms=0,
                                                         node_timeout_ms=10**12))
    engine.lead(3, [])
    a_full = node("a", [0], (EIGHT_B.name, SMALL.name), 3, ("old#0", "new#0"))
    await _cycle_at(engine, now, 500, [req("old", "batch", EIGHT_B.name, "soylent", 8000)],
                    node("a", [20_100]))
    await _cycle_at(engine, now, 1000, [req("new", "batch", SMALL.name, "soylent", 30_000)])
    await _cycle_at(engine, now, 2000, [req(f"u{i}", "batch", SMALL.name, "umbrella", 30_000)
                                        for i in (1, 2, 3)], node("b", [8000]))
    engine.view.apply_node_state(node("b", [0], (SMALL.name,), 3, ("u1#0", "u2#0", "u3#0")),
                                 3000, NODE_TIMEOUT_MS)
    refuse[0] = True
    await _cycle_at(engine, now, 3000, [req("chat", "interactive", EIGHT_B.name, "acme", 8000)],
                    a_full)
    for settling in list(engine._in_flight):
        await settling
    refuse[0] = False
    await _cycle_at(engine, now, 4000, [req("w", "standard", SMALL.name, "soylent", 30_000)],
                    a_full.model_copy(update={"seq": 4}))
    assert _preempted(sent) == []


async def test_work_only_away_nodes_could_hold_claims_none_of_its_tenants_guarantee(
) -> None:
    """umbrella (4,000 MiB guaranteed) waits with a 2-GPU request only a draining node
    could hold, then a 1.5B one. The first, judged inside, claimed the guarantee's room
    for as long as the node was away, and the second could reclaim nothing."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    long = 30_000
    await _cycle_at(engine, now, 1000, [req("in", "batch", EIGHT_B.name, "soylent", 7990)],
                    node("a", [40_000]))
    await _cycle_at(engine, now, 2000, [req(f"b{i}", "batch", SMALL.name, "soylent", long)
                                        for i in range(2)])
    assert engine.borrowed() == {"b0#0", "b1#0"}
    drained = node("b", [81559, 81559]).model_copy(update={"status": "draining"})
    engine.view.apply_node_state(drained, 3000, NODE_TIMEOUT_MS)
    gang = req("u1", "batch", SMALL.name, "umbrella", 100, num_gpus=2)
    await _cycle_at(engine, now, 3000, [gang, req("u2", "batch", SMALL.name, "umbrella", long)],
                    node("a", [0], (EIGHT_B.name, SMALL.name), 2, ("in#0", "b0#0", "b1#0")))
    assert len(_preempted(sent)) == 1


@pytest.mark.parametrize(("pong_class", "victim"), [("interactive", "batch#0"),
                                                     ("standard", "other#0")])
async def test_work_that_would_be_borrowed_takes_no_borrowed_work_of_its_class(
        pong_class: str, victim: str) -> None:
    """ping and pong, guaranteed 0 MiB: all their work is borrowed. ping's interactive
    request preempted pong's interactive work (borrowed work was any other tenant's
    victim), whose hand-back preempted ping's in turn, each losing its progress until the
    hand-backs aged. Now it takes pong's batch work, as class priority allows, though
    that loses more (placed earlier). pong's borrowed standard work it still takes (the
    cheaper victim): a standard hand-back takes nothing back from interactive work."""
    zero = TenantQuota(guaranteed_gpu_memory_mib=0)
    config = load_tenants(CONFIG)
    tenants = config.model_copy(update={"tenants": config.tenants + tuple(
        Tenant(name=name, api_keys=(f"sk-{name}",), quota=zero) for name in ("ping", "pong"))})
    now = [1000]
    engine, sent = leading_engine(lambda: now[0], tenants=tenants)
    long = 30_000
    await _cycle_at(engine, now, 1000, [req("batch", "batch", SMALL.name, "pong", long)],
                    node("a", [40_000]))
    await _cycle_at(engine, now, 2000, [req("other", pong_class, SMALL.name, "pong", long)])
    await _cycle_at(engine, now, 3000, [req("x", "interactive", SMALL.name, "ping", long)],
                    node("a", [0], (SMALL.name,), 2, ("batch#0", "other#0")))
    assert _preempted(sent) == [victim]


async def _two_placements_loading_the_8b(engine: SchedulingEngine
                                        ) -> tuple[RunningPlacement, RunningPlacement]:
    """soylent's x and y, 8B work placed in one cycle on node a's empty 40,000 MiB GPU."""
    engine.view.apply_node_state(node("a", [40_000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["batch"].name, offset, req(
        rid, "batch", model=EIGHT_B.name, tenant="soylent").to_bytes())
        for offset, rid in enumerate(["x", "y"])])
    assert await engine.cycle() == 2
    return engine.running["x#0"], engine.running["y#0"]


async def test_placements_loading_one_model_on_a_gpu_in_one_cycle_reserve_its_weights_once(
) -> None:
    """x and y, the first 8B work on an empty GPU, placed in one cycle: each reserved the
    weights the agent loads once, and kept them in what soylent holds while it ran. The
    next cycles saw 15 GB less free than there was, and y was marked borrowed (soylent
    held twice the weights by that count, past its 20,000 MiB guarantee)."""
    engine, _ = leading_engine()
    x, y = await _two_placements_loading_the_8b(engine)
    assert x.memory_mib_per_gpu == x.kv_cache_mib + EIGHT_B.weight_memory_mib
    assert y.memory_mib_per_gpu == y.kv_cache_mib and not engine.borrowed()
    assert snapshot(engine.view, {"a"}).state.gpu_mem_free_mib[0] == \
        40_000 - EIGHT_B.weight_memory_mib - x.kv_cache_mib - y.kv_cache_mib


async def test_work_told_to_stop_is_not_chosen_as_a_victim_again() -> None:
    """i1 preempts b1; i2, a cycle later, chose b1 again (the engine forgot its preempts
    between cycles), so b0 ran on and i2 waited for the preemption time-out, 15 s."""
    from gpusched_scheduler.domain.planner import memory_per_gpu

    now = [1000]
    engine, sent = leading_engine(lambda: now[0])

    def record(topic: str, offset: int, request_id: str, max_tokens: int) -> ConsumerRecord:
        return request_record(topics.REQUESTS[topic].name, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "x",
            "max_tokens": max_tokens, "created_at_ms": now[0]}).encode())

    batch_kv = memory_per_gpu(InferenceRequest(
        request_id="b", tenant="acme", model=SMALL.name, prompt="x", max_tokens=8000,
        created_at_ms=0), SMALL)[0]
    engine.view.apply_node_state(node("a", [2 * batch_kv + 40], models=(SMALL.name,)),
                                 now[0], NODE_TIMEOUT_MS)
    await engine.admit([record("batch", 0, "b0", 8000), record("batch", 1, "b1", 8000)])
    assert await engine.cycle() == 2
    engine.view.apply_node_state(node("a", [40], models=(SMALL.name,), seq=2,
                                      active=("b0#0", "b1#0")), now[0], NODE_TIMEOUT_MS)
    victims = []
    for offset, request_id in enumerate(["i1", "i2"]):
        now[0] += 100
        before = len(sent[topics.PLACEMENTS.name])
        await engine.admit([record("interactive", offset, request_id, 7000)])
        await engine.cycle()
        victims += [json.loads(v)["placement_id"] for v in sent[topics.PLACEMENTS.name][before:]
                    if json.loads(v)["type"] == "preempt"]
    assert sorted(victims) == ["b0#0", "b1#0"]


@pytest.mark.parametrize("apart,usage_first", [(False, False), (True, False), (True, True)],
                         ids=["one-cycle", "a-cycle-later", "its-final-usage-before-the-report"])
async def test_requests_that_fit_in_one_victims_room_stop_one_victim(apart: bool,
                                                                     usage_first: bool) -> None:
    """One batch victim frees room for both interactive requests. In one cycle each was
    planned on the state before any preemption, so each got a victim of its own; a cycle
    later, the victim stopping was left out of the plan and its memory not counted as
    coming free; and once its final usage was read, which usually comes before its node's
    next report, it was no longer counted (the view still showed its memory used). Each
    time the second victim's progress was thrown away for nothing."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])

    def request(request_id: str, cls: str, max_tokens: int) -> InferenceRequest:
        return InferenceRequest(request_id=request_id, tenant="acme", model=SMALL.name,
                                prompt="x", max_tokens=max_tokens, priority_class=cls,
                                created_at_ms=now[0])

    def record(offset: int, r: InferenceRequest) -> ConsumerRecord:
        return request_record(topics.REQUESTS[r.priority_class].name, offset, r.to_bytes())

    batch_kv = memory_per_gpu(request("b", "batch", 22000), SMALL)[0]
    assert 2 * memory_per_gpu(request("i", "interactive", 10000), SMALL)[0] < batch_kv
    engine.view.apply_node_state(node("a", [2 * batch_kv + 5], models=(SMALL.name,)),
                                 now[0], NODE_TIMEOUT_MS)
    await engine.admit([record(0, request("b0", "batch", 22000)),
                        record(1, request("b1", "batch", 22000))])
    assert await engine.cycle() == 2
    engine.view.apply_node_state(node("a", [5], models=(SMALL.name,), seq=2,
                                      active=("b0#0", "b1#0")), now[0], NODE_TIMEOUT_MS)
    before = len(sent[topics.PLACEMENTS.name])
    arrivals = [["i1"], ["i2"]] if apart else [["i1", "i2"]]
    for offset, ids in enumerate(arrivals):
        now[0] += 100
        await engine.admit([record(2 * offset + k, request(rid, "interactive", 10000))
                            for k, rid in enumerate(ids)])
        await engine.cycle()
        if usage_first and offset == 0:  # the agent stopped it; no report since
            [victim] = [json.loads(v)["placement_id"]
                        for v in sent[topics.PLACEMENTS.name][before:]]
            await engine.usage([request_record(topics.USAGE.name, 0, UsageRecord(
                event_id=f"{victim}:final", request_id=victim.split("#")[0],
                placement_id=victim, tenant="acme", model=SMALL.name, priority_class="batch",
                node_id="a", gpu_type="H100-80GB", prompt_tokens=1, completion_tokens=10,
                gpu_seconds=1.0, started_at_ms=1000, ended_at_ms=now[0] + 50).to_bytes())])
            assert victim not in engine.running
    commands = [json.loads(v) for v in sent[topics.PLACEMENTS.name][before:]]
    assert [c["type"] for c in commands] == ["preempt"]
    if usage_first:  # a report without it counts its memory free: no longer coming free
        engine.view.apply_node_state(node("a", [batch_kv + 5], models=(SMALL.name,), seq=3,
                                          active=tuple({"b0#0", "b1#0"} - {victim})),
                                     now[0], NODE_TIMEOUT_MS)
        assert not engine._stopping()


async def test_a_cycle_undone_gives_back_a_cancelled_requests_charge_once() -> None:
    """hooli admits A and B (1,000 tokens each); A is cancelled, and the cycle that ends it
    fails to publish: queued again, A was ended and refunded again, which took B's
    identical charge too, though B still waits."""
    engine, sent = leading_engine()
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, offset, json.dumps({
        "request_id": request_id, "tenant": "hooli", "model": SMALL.name, "prompt": "x",
        "max_tokens": 999}).encode()) for offset, request_id in enumerate(["A", "B"])])
    charged = engine.quotas.tokens_last_minute("hooli", 1000)
    await engine.cancels([ConsumerRecord(topics.CONTROL.name, 0, 0, 1000, 0, b"A", Cancel(
        request_id="A", reason="gone", at_ms=1000).to_bytes(), None, 0, 0, ())])
    send = engine._send

    async def kafka_away(batch):  # noqa: ANN001, ANN202
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(ConnectionError("Kafka away"))
        return failed

    engine._send = kafka_away  # type: ignore[method-assign]
    with contextlib.suppress(ConnectionError):
        await engine.cycle()
    await asyncio.sleep(0.01)
    engine._send = send  # type: ignore[method-assign]
    await engine.cycle()
    assert [RESULT_EVENT.validate_json(v).status for v in sent[topics.RESULTS.name]] == [
        "cancelled"]
    assert engine.quotas.tokens_last_minute("hooli", 1000) == charged // 2
    assert [p.request.request_id for p in engine.queue.in_order()] == ["B"]


async def test_a_request_whose_placement_went_out_in_an_undone_cycle_never_expires() -> None:
    """Kafka's answer to a placement failed (it may have been written): the cycle was
    undone, and the request, past its queue limit by the next cycle, ended 503 'never
    placed, nothing billed' while its placement could run."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    engine.view.apply_node_state(node("a", [80000]), now[0], NODE_TIMEOUT_MS)
    send = engine._send

    async def unanswered(batch):  # noqa: ANN001, ANN202
        for out in batch:  # written, but the answer is lost
            sent.setdefault(out.topic, []).append(out.message.to_bytes())
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(TimeoutError("no answer from Kafka"))
        return failed

    engine._send = unanswered  # type: ignore[method-assign]
    await engine.admit([request_record(topics.REQUESTS["interactive"].name, 0, json.dumps({
        "request_id": "r", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 3, "max_queue_ms": 2000, "created_at_ms": now[0]}).encode())])
    now[0] = 2500
    with contextlib.suppress(TimeoutError):
        await engine.cycle()
    await asyncio.sleep(0.01)
    engine._send = send  # type: ignore[method-assign]
    now[0] = 3500  # past its limit
    await engine.cycle()
    assert topics.RESULTS.name not in sent  # no 503
    assert [PLACEMENT.validate_json(v).placement_id for v in sent[topics.PLACEMENTS.name]] == [
        "r#0", "r#0"]


async def test_a_preempted_request_counts_once_in_flight() -> None:
    """hooli (3 in flight at most) runs h0 and h1; h0's hand-back is read before its final
    usage (another topic): h0 counted twice, and a third request got a 429 at 2 in flight."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("a", [80000, 80000]), 1000, NODE_TIMEOUT_MS)

    def record(offset: int, request_id: str, cls: str = "standard", **extra) -> ConsumerRecord:
        return request_record(topics.REQUESTS[cls].name, offset, json.dumps({
            "request_id": request_id, "tenant": "hooli", "model": SMALL.name, "prompt": "x",
            "max_tokens": 10, "priority_class": cls} | extra).encode())

    await engine.admit([record(0, "h0"), record(1, "h1")])
    assert await engine.cycle() == 2
    await engine.admit([record(2, "h0", attempt=1, requeued="preempted")])  # its hand-back
    await engine.admit([record(3, "h2")])
    assert topics.RESULTS.name not in sent  # no 429


async def test_a_preempted_attempt_ages_from_its_requests_creation() -> None:
    """A hand-back is a new queue item: it aged from its hand-back, so work preempted as
    soon as it aged in waited the whole ageing time again, over and over."""
    now = [400_000]
    engine, _ = leading_engine(lambda: now[0])
    batch = topics.REQUESTS["batch"].name
    await engine.admit([request_record(batch, 0, json.dumps({
        "request_id": "again", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 3, "created_at_ms": 1000, "attempt": 1, "requeued": "preempted",
        "priority_class": "batch"}).encode()),
        request_record(batch, 1, json.dumps({
            "request_id": "fresh", "tenant": "acme", "model": SMALL.name, "prompt": "x",
            "max_tokens": 3, "created_at_ms": 1000, "priority_class": "batch"}).encode())])
    assert [(name, item.request.request_id) for name, item in engine.in_line(now[0])] == [
        ("aged", "again"), ("batch", "fresh")]


def test_work_placed_as_aged_is_no_victim_of_class_priority() -> None:
    """The newest placement loses the least, so aged batch work was the victim at the very
    next cycle, every time it aged in. A tenant reclaiming its guarantee may still take it."""
    view = ClusterView()
    view.apply_node_state(node("a", [0], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    victims = [RunningPlacement(placement_id=f"v{i}", node_id="a", gpu_indices=(0,),
                                memory_mib_per_gpu=SMALL.kv_cache_mib(8100),
                                kv_cache_mib=SMALL.kv_cache_mib(8100),
                                estimate_gpu_s=1.0, placed_at_ms=at, aged=aged,
                                request=req(f"b{i}", "batch", tenant="umbrella",
                                            max_tokens=8000))
               for i, (at, aged) in enumerate(((0, None), (9_000, True)))]
    [pre] = plan(view, [req("i", "interactive", max_tokens=100)], now=10_000,
                 running=victims, may_preempt={"i": 1}, borrowed=("v0", "v1")).preemptions
    assert [v.placement_id for v in pre.victims] == ["v0"]  # not the cheaper, aged v1
    [reclaim] = plan(view, [req("g", "standard", max_tokens=100)], now=10_000,
                     running=victims, may_preempt={"g": 0}, reclaiming=("g",),
                     borrowed=("v0", "v1")).preemptions
    assert [v.placement_id for v in reclaim.victims] == ["v1"]
    # interactive work inside its tenant's guarantee reclaims it too (it may preempt batch
    # work as well: its ceiling stays 1)
    [interactive] = plan(view, [req("i", "interactive", max_tokens=100)], now=10_000,
                         running=victims, may_preempt={"i": 1}, reclaiming=("i",),
                         borrowed=("v0", "v1")).preemptions
    assert [v.placement_id for v in interactive.victims] == ["v1"]


async def test_work_rejected_as_unschedulable_gives_its_tokens_back() -> None:
    """A 422 (no node of the fleet could ever hold it) ends it unrun, but its charge stayed:
    hooli's next request within the minute was refused over its tokens per minute."""
    engine, sent = leading_engine()
    engine.view.apply_node_state(node("a", [80000]), 1000, NODE_TIMEOUT_MS)
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, 0, json.dumps({
        "request_id": "too-big", "tenant": "hooli", "model": "llama-3.1-70b", "prompt": "x",
        "max_tokens": 2000, "num_gpus": 1}).encode())])
    assert engine.quotas.tokens_last_minute("hooli", 1000) > 0
    await engine.cycle()
    [rejection] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert isinstance(rejection, Rejection) and rejection.status_code == 422
    assert engine.quotas.tokens_last_minute("hooli", 1000) == 0


@pytest.mark.parametrize("idle_elsewhere", [False, True],
                         ids=["no-idle-model", "an-idle-model-elsewhere"])
def test_an_aged_gang_keeps_the_node_closest_to_holding_it_from_later_aged_work(
        idle_elsewhere: bool) -> None:
    """An aged gang waiting for two free GPUs on one node: later aged work goes elsewhere
    or waits, and no longer takes the GPU that freed there. Before, in an overloaded class
    whose single-GPU work had aged too, that work took each GPU as it freed and the gang
    never saw two at once (a probe: never placed in 600 s; 10.8 s with the node kept). An
    idle model on any GPU of the fleet, even one that frees too little for anyone, then
    gave that GPU away anyway: the eviction pass solved the waiting work again without it
    kept."""
    view = ClusterView()
    view.apply_node_state(node("a", [80000, 0]), 100_000, NODE_TIMEOUT_MS)  # one GPU of two free
    view.apply_node_state(node("b", [SMALL.weight_memory_mib + 4]),
                          100_000, NODE_TIMEOUT_MS)  # room for one
    if idle_elsewhere:
        view.apply_node_state(node("c", [0], models=(SMALL.name,), idle=(SMALL.name,)),
                              100_000, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("gang", num_gpus=2), req("s1"), req("s2")], now=100_000)
    assert [(p.item.request.request_id, p.node_id) for p in decisions.placed] == [("s1", "b")]
    assert [p.request.request_id for p in decisions.waiting] == ["gang", "s2"]
    # work that is not aged still fits beside waiting work of its own chunk, as before
    fresh = plan(view, [req("gang", num_gpus=2), req("s1"), req("s2")], now=1_000)
    assert len(fresh.placed) == 2 and "a" in {p.node_id for p in fresh.placed}


@pytest.mark.parametrize("model,fleet,queued,wanted", [
    ("llama-3.1-70b", True, 60, 4),   # each gang of 2 H100s holds 44 of them: 2 gangs
    ("llama-3.1-70b", True, 1, 2),
    ("llama-3.1-70b", False, 60, 2),  # sized on the largest GPU type (H200): 1 gang
    ("qwen2.5-1.5b", False, 60, 1),
    ("qwen2.5-1.5b", True, 3000, 3),  # one H100 holds 1,403 of them, as before
], ids=["70b-gangs", "70b-one-queued", "70b-no-node-yet", "small-no-node-yet", "small"])
async def test_the_scaling_signal_wants_whole_gangs_and_a_gang_at_least_while_work_waits(
        model: str, fleet: bool, queued: int, wanted: int) -> None:
    """Work queued on a full fleet of H100s, or with no node reported yet (scaling from
    zero), and each class's target of 1 s at the tightest. The 70B (2 GPUs per copy) was
    weighed whole against one GPU, and every model against no GPU before a node reported:
    both fit none, and the signal asked for 0 GPUs, so an autoscaler never added any."""
    engine, sent = leading_engine(lambda: 10_000)
    if fleet:
        for node_id in ("a", "b"):
            engine.view.apply_node_state(node(node_id, [0, 0]), 10_000, NODE_TIMEOUT_MS)
    for i in range(queued):
        engine.queue.push(Pending(req(f"r{i}", model=model, num_gpus=CATALOG.get(model)
                                      .num_gpus), {}, 10_000))
    await engine._maybe_signal_scaling()
    [signal] = [EVENT.validate_json(v) for v in sent[topics.EVENTS.name]]
    assert (signal.model, signal.gpus_wanted, signal.gpus_in_use) == (model, wanted, 0)


async def test_the_scaling_signal_starts_no_trace() -> None:
    """Every 5 s, a scaling signal per model with work: each was a trace of its own (its
    `schedule` span, then its consumers'), which with the agents' heartbeats filled
    Jaeger's store of 20,000 traces with traces of no request. It goes out unsampled: no
    span is recorded, and its traceparent tells its consumers to record none."""
    engine, spans, records = traced_engine(lambda: 10_000)
    await engine.admit([traced_record(0, "r0", trace_id=7)])  # no node yet: it waits
    await engine._maybe_signal_scaling()
    [(_, value, _, headers)] = [r for r in records if r[0] == topics.EVENTS.name]
    assert EVENT.validate_json(value).type == "scaling_signal"
    assert not int(headers["traceparent"][-2:], 16) & 1  # its sampled flag is off
    assert not spans.get_finished_spans()


def test_a_scheduler_that_steps_down_stops_serving_its_last_gpu_demand() -> None:
    """The dashboard takes the max per model over instances: a standby's last value of
    gpus_wanted outlived its leadership and hid falling demand."""
    registry = CollectorRegistry()
    engine, _ = leading_engine(registry=registry)
    engine._metrics.gpus_wanted.labels(SMALL.name).set(6)  # as its scaling signal set it
    engine.step_down()
    assert registry.get_sample_value("gpusched_scheduler_gpus_wanted",
                                      {"model": SMALL.name}) is None


def test_no_preemption_is_planned_on_the_gpus_kept_for_aged_work_that_waits() -> None:
    """An aged gang keeps node a's GPUs; interactive j fits nowhere and may preempt batch
    work. Its plan stopped the young batch work on a's GPU 0 (the cheapest), and its room
    there, solved first next cycle, took the memory kept for the gang. It now preempts on
    node b. (Work that fit only on the kept GPUs planned nothing at all: it "fit already".)"""
    now = 400_000
    view = ClusterView()
    view.apply_node_state(node("a", [2000, 0], models=(EIGHT_B.name,),
                               active=("va", "vlong")), now, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [0], models=(EIGHT_B.name,), active=("vb",)), now,
                          NODE_TIMEOUT_MS)

    def victim(pid: str, node_id: str, placed_at_ms: int) -> RunningPlacement:
        return RunningPlacement(placement_id=pid, node_id=node_id, gpu_indices=(0,),
                                memory_mib_per_gpu=30000, kv_cache_mib=30000,
                                estimate_gpu_s=1.0, placed_at_ms=placed_at_ms,
                                request=req(pid, "batch", model=EIGHT_B.name, tenant="initech"))
    items = [Pending(req("gang", "batch", model=EIGHT_B.name, num_gpus=2), {}, 0),
             Pending(req("j", "interactive", model=EIGHT_B.name, max_tokens=30000), {}, now)]
    chunks = order_pending(items, now, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    decisions = plan_cycle(snapshot(view, view.live_nodes(now, 10_000)), chunks, CATALOG,
                           "gpusched", [victim("va", "a", now - 1000),
                                        victim("vb", "b", now - 60_000)],
                           now, {"j": 1}, fleet=fleet_of(view, now))
    assert [p.request.request_id for p in decisions.waiting] == ["gang", "j"]
    [plan] = decisions.preemptions
    assert (plan.node_id, [v.placement_id for v in plan.victims]) == ("b", ["vb"])


def test_a_tenant_reclaiming_its_guarantee_may_still_plan_on_gpus_kept_for_aged_work(
) -> None:
    """The only borrowed work runs on the node kept for another tenant's aged gang: hiding
    the kept GPUs from every plan refused the reclaim until the gang was placed (review)."""
    now = 400_000
    view = ClusterView()
    view.apply_node_state(node("a", [0, 0], models=(EIGHT_B.name,), active=("vA0", "vA1")),
                          now, NODE_TIMEOUT_MS)
    running = [RunningPlacement(placement_id=pid, node_id="a", gpu_indices=(gpu,),
                                memory_mib_per_gpu=30000, kv_cache_mib=30000,
                                estimate_gpu_s=1.0, placed_at_ms=now - 1000,
                                request=req(pid, "batch", model=EIGHT_B.name, tenant="initech"))
               for gpu, pid in enumerate(("vA0", "vA1"))]
    items = [Pending(req("gang", "batch", model=EIGHT_B.name, num_gpus=2, tenant="hooli"),
                     {}, 0),
             Pending(req("R", "standard", model=EIGHT_B.name), {}, now)]
    chunks = order_pending(items, now, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    decisions = plan_cycle(snapshot(view, view.live_nodes(now, 10_000)), chunks, CATALOG,
                           "gpusched", running, now, {"R": 0}, fleet=fleet_of(view, now),
                           reclaiming=("R",), borrowed=("vA0", "vA1"))
    [plan] = decisions.preemptions
    assert (plan.item.request.request_id, plan.node_id) == ("R", "a")


def test_an_aged_gang_keeps_only_the_gpus_it_waits_for() -> None:
    """The node's other GPUs stay open to the aged work after it: keeping the whole node
    left up to seven GPUs idle for one waiting unit."""
    view = ClusterView()
    # the 8B gang of two fits only GPU 0 now; GPUs 1 and 2 have room for a loaded model's
    # KV cache alone
    view.apply_node_state(node("a", [80000, 100, 100, 0], models=(SMALL.name,)),
                          100_000, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("gang", model="llama-3.1-8b", num_gpus=2), req("s1")],
                     now=100_000)
    assert [p.request.request_id for p in decisions.waiting] == ["gang"]
    [single] = decisions.placed
    assert (single.item.request.request_id, single.gpu_indices) == ("s1", (2,))


async def test_the_room_a_preemption_frees_is_kept_for_its_preemptor() -> None:
    """Interactive i preempted batch b; b's hand-back, aged (it waits from its request's
    creation), came first in line and took the room back as soon as b stopped, so i waited
    out the preemption time-out and preempted it again, over and over."""
    from gpusched_scheduler.domain.planner import memory_per_gpu

    now = [1000]
    engine, sent = leading_engine(lambda: now[0])

    def record(offset: int, r: InferenceRequest) -> ConsumerRecord:
        return request_record(topics.REQUESTS[r.priority_class].name, offset, r.to_bytes())

    b = InferenceRequest(request_id="b", tenant="acme", model=SMALL.name, prompt="x",
                         max_tokens=22000, priority_class="batch", created_at_ms=now[0])
    kv = memory_per_gpu(b, SMALL)[0]
    engine.view.apply_node_state(node("a", [kv + 5], models=(SMALL.name,)), now[0],
                                 NODE_TIMEOUT_MS)
    await engine.admit([record(0, b)])
    assert await engine.cycle() == 1
    engine.view.apply_node_state(node("a", [5], models=(SMALL.name,), seq=2, active=("b#0",)),
                                 now[0], NODE_TIMEOUT_MS)
    now[0] = 400_000
    i = InferenceRequest(request_id="i", tenant="globex", model=SMALL.name, prompt="x",
                         max_tokens=22000, priority_class="interactive", created_at_ms=now[0])
    await engine.admit([record(0, i)])
    before = len(sent[topics.PLACEMENTS.name])
    await engine.cycle()
    assert [json.loads(v)["type"] for v in sent[topics.PLACEMENTS.name][before:]] == ["preempt"]
    now[0] += 50  # b stopped and handed back
    await engine.admit([record(1, b.model_copy(update={"attempt": 1, "requeued": "preempted"}))])
    engine.view.apply_node_state(node("a", [kv + 5], models=(SMALL.name,), seq=3), now[0],
                                 NODE_TIMEOUT_MS)
    before = len(sent[topics.PLACEMENTS.name])
    await engine.cycle()
    [placed] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name][before:]]
    assert placed.placement_id == "i#0"
    assert [p.request.request_id for p in engine.queue.in_order()] == ["b"]


async def test_admission_waiting_for_room_sees_the_queue_a_hand_back_reordered() -> None:
    """A full class's admission watched the dict its class had when it began to wait; a
    hand-back put first in line (a cycle undone) replaced that dict, and the admission
    waited on a copy that never drained: the class read nothing more until a step-down."""
    engine, _ = leading_engine(max_pending_per_class=2)
    batch = topics.REQUESTS["batch"].name

    def record(offset: int, request_id: str, **extra) -> ConsumerRecord:
        return request_record(batch, offset, json.dumps({
            "request_id": request_id, "tenant": "acme", "model": SMALL.name, "prompt": "x",
            "max_tokens": 3, "priority_class": "batch"} | extra).encode())

    await engine.admit([record(0, "x1"), record(1, "x2")])
    third = asyncio.create_task(engine.admit([record(2, "x3")]))
    await asyncio.sleep(0.01)
    assert not third.done()
    engine.queue.push(Pending(InferenceRequest(
        request_id="h", tenant="acme", model=SMALL.name, prompt="x", max_tokens=3,
        priority_class="batch", attempt=1, requeued="preempted", created_at_ms=1000), {}, 1000,
        retry=True))
    engine.view.apply_node_state(node("a", [80000]), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 3
    await asyncio.wait_for(third, 1)
    assert [p.request.request_id for p in engine.queue.in_order()] == ["x3"]


async def test_work_a_cycle_undone_ended_waits_again_with_its_charge() -> None:
    """A 422 (no node of the fleet holds its gang) gave the request's tokens back; Kafka
    refused that cycle, so it waited again, and a node that joined meanwhile ran it with its
    tokens-per-minute charge given back."""
    send_ok = [False]
    engine, _, _ = _held_engine(_kafka_away_until(send_ok))
    engine.view.apply_node_state(node("a", [80000]), 1000, NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 0, json.dumps({
        "request_id": "big", "tenant": "hooli", "model": "llama-3.1-70b", "prompt": "x",
        "max_tokens": 2000}).encode())])
    charged = engine.quotas.tokens_last_minute("hooli", 1000)
    assert charged > 2000
    with contextlib.suppress(ConnectionError):
        await engine.cycle()  # rejected 422, refunded; Kafka refuses the cycle
    await asyncio.sleep(0.01)
    assert engine.quotas.tokens_last_minute("hooli", 1000) == charged  # it waits again
    send_ok[0] = True
    engine.view.apply_node_state(node("big", [80000, 80000]), 1000, NODE_TIMEOUT_MS)
    assert await engine.cycle() == 1
    assert [r.request.request_id for r in engine.running.values()] == ["big"]
    assert engine.quotas.tokens_last_minute("hooli", 1000) == charged


async def test_a_batch_read_while_stepping_down_is_left_to_the_next_leader() -> None:
    """The lease was lost while admission waited for Kafka to take a dead letter: the rest
    of its batch was queued and charged on an instance no longer leading, after
    `step_down` had emptied its queue; leading again later, it placed that stale item."""
    engine, held, _ = _held_engine()
    standard = topics.REQUESTS["standard"].name
    admitting = asyncio.create_task(engine.admit([
        request_record(standard, 0, b"{not json"),
        request_record(standard, 1, json.dumps({
            "request_id": "g", "tenant": "hooli", "model": SMALL.name, "prompt": "x",
            "max_tokens": 1000}).encode())]))
    await asyncio.sleep(0.01)
    engine.step_down()
    held[0].set_result(None)
    await admitting
    assert not len(engine.queue) and not engine.quotas.tokens_last_minute("hooli", 1000)


async def test_fair_share_keeps_a_long_jobs_measured_use_once_it_ends() -> None:
    """The final usage took back the whole estimate charged at placement, long decayed by
    then, and its partial records were charged on top of it: a tenant counted double while
    its job ran had its use wiped out when it ended, and went ahead of lighter tenants."""
    now = [1000]
    engine, _ = leading_engine(lambda: now[0], fair_half_life_s=60.0)
    engine.view.apply_node_state(node("a", [80000]), now[0], NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["standard"].name, 0, json.dumps({
        "request_id": "job", "tenant": "globex", "model": SMALL.name, "prompt": "x",
        "max_tokens": 20000}).encode())])
    assert await engine.cycle() == 1
    estimate = engine.running["job#0"].estimate_gpu_s

    def usage(used: float, at_ms: int, final: bool) -> ConsumerRecord:
        return request_record(topics.USAGE.name, at_ms, UsageRecord(
            event_id=f"job#0:{at_ms}", request_id="job", placement_id="job#0",
            tenant="globex", model=SMALL.name, priority_class="standard", node_id="a",
            gpu_type="H100-80GB", prompt_tokens=1, completion_tokens=10, gpu_seconds=used,
            started_at_ms=1000, ended_at_ms=at_ms, final=final).to_bytes())

    part = estimate / 4
    now[0] = 61_000  # a half-life: the estimate counts half now
    await engine.usage([usage(part, now[0], final=False)])
    assert engine.fair.level("globex", 61) == pytest.approx(estimate / 2 - part / 2 + part)
    now[0] = 121_000
    await engine.usage([usage(part, now[0], final=True)])
    assert engine.fair.level("globex", 121) == pytest.approx(part / 2 + part)


async def test_a_record_refused_over_quota_and_read_again_stays_refused() -> None:
    """A batch's later publish failed, so the consumer read the batch again: a record
    answered 429 before was judged again, admitted once the minute had moved on, and ran
    (billed) for a client that had its 429."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])

    def record(offset: int, request_id: str) -> ConsumerRecord:
        return _standard_record(offset, request_id, tenant="hooli", max_tokens=1999)

    await engine.admit([record(0, "first"), record(1, "over")])
    [refused] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert refused.request_id == "over" and refused.status_code == 429
    now[0] += 61_000  # the minute moved on; the batch is read again
    await engine.admit([record(0, "first"), record(1, "over")])
    assert [p.request.request_id for p in engine.queue.in_order()] == ["first"]
    assert len(sent[topics.RESULTS.name]) == 1
    await engine.admit([record(2, "over")])  # the client sends it again: a new record
    assert [p.request.request_id for p in engine.queue.in_order()] == ["first", "over"]


def _victim(pid: str, request: InferenceRequest, gpus: tuple[int, ...], mib: int,
            kv: int) -> RunningPlacement:
    return RunningPlacement(placement_id=pid, node_id="a", gpu_indices=gpus,
                            memory_mib_per_gpu=mib, kv_cache_mib=kv,
                            estimate_gpu_s=1.0, placed_at_ms=0, request=request)


def _plan_with_rooms(view: ClusterView, requests: list[InferenceRequest], now: int = 10_000,
                     running: list | None = None, may_preempt: dict | None = None,
                     rooms: dict | None = None):
    items = [Pending(r, {}, now) for r in requests]
    chunks = order_pending(items, now, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0,
                           preempting=rooms or {})
    snap = snapshot(view, view.live_nodes(now, 10**12))
    return plan_cycle(snap, chunks, CATALOG, "gpusched", running or [], now, may_preempt or {},
                      fleet=fleet_of(view), rooms=rooms)


def test_a_gangs_kept_room_holds_the_free_gpu_its_plan_counts_on_too() -> None:
    """A 2-GPU gang fits on GPU0 already and preempts the batch work on GPU1: the room kept
    was the victim's GPU alone, so other work took GPU0 while the victim stopped and the
    gang never fitted; the victim's progress was lost for nothing."""
    from gpusched_scheduler.domain.planner import Room

    total = 81559
    view = ClusterView()
    view.apply_node_state(node("a", [total - 1000, 1000]), 0, NODE_TIMEOUT_MS)
    gang = req("g", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    victim = _victim("v#0", req("v", "batch"), (1,), total - 1000,
                     total - 1000 - SMALL.weight_memory_mib)
    [pre] = _plan_with_rooms(view, [gang], running=[victim],
                             may_preempt={"g": 1}).preemptions
    assert pre.room == Room("a", (0, 1))
    other = req("s", "standard", model=EIGHT_B.name, max_tokens=4000)
    stopping = _plan_with_rooms(view, [gang, other], rooms={"g": pre.room})
    assert not stopping.placed  # GPU0's memory is the gang's
    view.apply_node_state(node("a", [total - 1000, total - SMALL.weight_memory_mib], seq=2,
                               models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    stopped = _plan_with_rooms(view, [gang, other], rooms={"g": pre.room})
    assert [p.item.request.request_id for p in stopped.placed] == ["g"]


def test_a_preemptor_whose_plan_unloads_idle_models_is_placed_once_its_victim_stops(
) -> None:
    """The plan was made on the state with idle models unloaded; once the victim stopped,
    the preemptor was solved with them loaded only and waited out the time-out."""
    view = ClusterView()
    view.apply_node_state(node("a", [10_000], models=(SMALL.name, "mistral-7b"),
                               idle=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    i = req("i", "interactive", model=EIGHT_B.name, max_tokens=100)
    victim = _victim("v#0", req("v", "batch", model="mistral-7b"), (0,), 5000, 5000)
    [pre] = _plan_with_rooms(view, [i], running=[victim], may_preempt={"i": 1}).preemptions
    view.apply_node_state(node("a", [15_000], models=(SMALL.name, "mistral-7b"),
                               idle=(SMALL.name,), seq=2), 0, NODE_TIMEOUT_MS)
    placed = _plan_with_rooms(view, [i], rooms={"i": pre.room}).placed
    assert [p.item.request.request_id for p in placed] == ["i"]


def test_work_that_fits_but_waits_behind_held_work_preempts_nothing() -> None:
    """An interactive request held behind aged work waiting for room got a plan without
    victims: recorded as preempting, it was solved first the next cycle, past the aged
    work, and every interactive request after it did the same."""
    view = ClusterView()
    view.apply_node_state(node("a", [500], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    aged = req("G", "batch", max_tokens=30_000)
    aged = aged.model_copy(update={"created_at_ms": 0})
    victim = _victim("v#0", req("v", "batch"), (0,), 60_000, 60_000)
    items = [Pending(aged, {}, 0), Pending(req("i", "interactive"), {}, 400_000)]
    chunks = order_pending(items, 400_000, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    assert [c.name for c in chunks] == ["aged", "interactive"]
    decisions = plan_cycle(snapshot(view, view.live_nodes(400_000, 10**12)), chunks, CATALOG,
                           "gpusched", [victim], 400_000, {"i": 1},
                           fleet=fleet_of(view))
    assert [p.request.request_id for p in decisions.waiting] == ["G", "i"]
    assert all(p.victims for p in decisions.preemptions)
    assert "i" not in {p.item.request.request_id for p in decisions.preemptions}


async def test_an_aged_preemptor_is_placed_as_aged() -> None:
    """Aged work placed from the 'preempting' chunk lost its aged mark (it was read from
    the chunk's name), and the next interactive request preempted it."""
    from gpusched_scheduler.domain.planner import Room

    now = [400_000]
    engine, _ = leading_engine(lambda: now[0])
    engine.view.apply_node_state(node("a", [80000]), now[0], NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["batch"].name, 0, json.dumps({
        "request_id": "s", "tenant": "soylent", "model": SMALL.name, "prompt": "x",
        "max_tokens": 10, "priority_class": "batch", "created_at_ms": 1000, "attempt": 1,
        "requeued": "preempted"}).encode())])
    engine._preempting["s"] = (now[0] + 15_000, Room("a", (0,)))
    assert [name for name, _ in engine.in_line(now[0])] == ["preempting"]
    assert await engine.cycle() == 1
    assert engine.running["s#1"].aged is True


def test_the_memory_kept_for_a_preemptor_is_out_of_reach_while_its_victim_stops() -> None:
    """While the victim stops, a request that fits in the GPU's free memory would take part
    of what the preemptor needs there once the victim is gone."""
    from gpusched_scheduler.domain.planner import memory_per_gpu

    view = ClusterView()
    i = req("i", "interactive", max_tokens=20_000)
    need = memory_per_gpu(i, SMALL)[0]
    small = req("s", "interactive", tenant="globex", max_tokens=100)
    view.apply_node_state(node("a", [need // 2], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    victim = _victim("v#0", req("v", "batch", max_tokens=20_000), (0,), need, need)
    [pre] = _plan_with_rooms(view, [i], running=[victim], may_preempt={"i": 1}).preemptions
    assert not _plan_with_rooms(view, [i, small], rooms={"i": pre.room}).placed
    assert [p.item.request.request_id for p in _plan_with_rooms(view, [i, small]).placed] == [
        "s"]  # what it would have done without the room kept


async def test_a_rejection_kafka_answers_after_leading_again_stands() -> None:
    """Undone like a placement, a 422 answered after a re-lead queued its request again,
    which then ran once a node that could hold it joined, after its client had the 422."""
    engine, acks, kafka = _held_engine()
    await engine.admit([_standard_record(8, "big", model="llama-3.1-70b")], kafka.commit)
    assert await engine.cycle() == 1
    engine.step_down()
    engine.lead(4, [], {})
    acks[0].set_result(None)
    await asyncio.sleep(0.01)
    assert not len(engine.queue)


async def test_a_refusal_in_flight_at_a_step_down_commits_nothing_past_the_batch() -> None:
    """[valid, garbage]: the step-down came while Kafka took the dead letter; the refused
    record was then tracked in the emptied offsets and committed past the valid one, which
    no leader read again."""
    engine, acks, kafka = _held_engine()
    admitting = asyncio.create_task(engine.admit([
        _standard_record(0, "g"), request_record(topics.REQUESTS["standard"].name, 1,
                                                 b"{not json")], kafka.commit))
    await asyncio.sleep(0.01)
    engine.step_down()
    acks[0].set_result(None)
    await admitting
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}


async def test_work_only_an_away_node_could_hold_does_not_fill_every_cycle() -> None:
    """More gangs than a cycle takes waited for an 8-GPU node gone silent: every cycle took
    only them, and a request that fitted at once behind them was never solved."""
    now = [1000]
    engine, _ = leading_engine(lambda: now[0], node_timeout_ms=10_000, max_units_per_cycle=4)
    engine.view.apply_node_state(node("big", [80000] * 8), now[0], NODE_TIMEOUT_MS)
    now[0] = 20_000  # big is silent past the time-out; small reports
    engine.view.apply_node_state(node("small", [80000]), now[0], NODE_TIMEOUT_MS)
    standard = topics.REQUESTS["standard"].name
    await engine.admit([request_record(standard, offset, json.dumps({
        "request_id": f"gang{offset}", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 10, "num_gpus": 8}).encode()) for offset in range(6)])
    await engine.admit([request_record(standard, 6, json.dumps({
        "request_id": "fits", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 10}).encode())])
    await engine.cycle()
    assert list(engine.running) == ["fits#0"]


def test_idle_memory_a_preemptor_took_is_not_counted_free_again() -> None:
    """A preemptor placed with a GPU's idle model unloaded had that memory; the work that
    fitted nowhere after it was solved with the same GPU's idle memory added once more."""
    from gpusched_scheduler.domain.planner import Room

    free = 16_000
    view = ClusterView()
    view.apply_node_state(node("a", [free], models=(SMALL.name,), idle=(SMALL.name,)), 0,
                          NODE_TIMEOUT_MS)
    preemptor = req("P", "interactive", model="mistral-7b", max_tokens=20_000)
    other = req("U", "batch", model=SMALL.name, tenant="globex")
    decisions = _plan_with_rooms(view, [preemptor, other], rooms={"P": Room("a", (0,))})
    assert [p.item.request.request_id for p in decisions.placed] == ["P"]
    assert sum(p.memory_mib_per_gpu for p in decisions.placed) <= \
        free + SMALL.weight_memory_mib


def test_idle_memory_a_waiting_preemptors_plan_counts_on_stays_for_it() -> None:
    """The plan counted on the room's idle models unloaded; while the victim stopped, other
    work was given that memory, and the preemptor no longer fitted once it stopped."""
    mistral = CATALOG.get("mistral-7b")
    preemptor = req("P", "interactive", model=EIGHT_B.name, max_tokens=20_000)
    kv, weights = memory_per_gpu(preemptor, EIGHT_B)
    gain, victim_kv = SMALL.weight_memory_mib + mistral.weight_memory_mib, 500
    free = kv + weights - gain - victim_kv + 10
    idle = (SMALL.name, mistral.name)
    view = ClusterView()
    view.apply_node_state(node("a", [free], models=idle, idle=idle, active=("v#0",)), 0,
                          NODE_TIMEOUT_MS)
    victim = _victim("v#0", req("v", "batch"), (0,), victim_kv, victim_kv)
    [pre] = _plan_with_rooms(view, [preemptor], running=[victim],
                             may_preempt={"P": 1}).preemptions
    other = req("U", "batch", model=SMALL.name, tenant="globex")
    assert not _plan_with_rooms(view, [preemptor, other], rooms={"P": pre.room}).placed
    view.apply_node_state(node("a", [free + victim_kv], models=idle, idle=idle, seq=2), 0,
                          NODE_TIMEOUT_MS)
    placed = _plan_with_rooms(view, [preemptor], rooms={"P": pre.room}).placed
    assert [p.item.request.request_id for p in placed] == ["P"]


@pytest.mark.parametrize("placed_first,refused", [(False, False), (True, False), (True, True)],
                         ids=["answer-first", "placed-first", "placed-first-refused"])
async def test_a_record_the_next_term_reads_before_the_old_answer_runs_once(
        placed_first: bool, refused: bool) -> None:
    """The next term read the record again before Kafka answered the old term's cycle. Its
    decision, remembered from the old term, had the record committed while the work only
    waited in memory (another step-down lost it). Placed by the new term before the
    answer, the answer's undo (Kafka took the cycle, or refused it) took the new placement
    out of running and its reservation off the node, and queued the request a third time
    (charged twice)."""
    engine, acks, kafka = _held_engine()
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    engine.step_down()
    engine.lead(4, [], {})
    engine.view.apply_node_state(node("n1", [80000], seq=2), 0, NODE_TIMEOUT_MS)
    await engine.admit([record], kafka.commit)
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}
    charged = engine.quotas.tokens_last_minute("acme", 1000)
    if placed_first:
        assert await engine.cycle() == 1
        acks[1].set_result(None)
        await asyncio.sleep(0.01)
    _answer(acks[0], refused)
    await asyncio.sleep(0.01)
    if not placed_first:
        assert await engine.cycle() == 1
        acks[1].set_result(None)
        await asyncio.sleep(0.01)
    assert list(engine.running) == ["r1#0"] and list(engine.view.reservations) == ["r1#0"]
    assert not len(engine.queue) and kafka.offsets
    assert engine.quotas.tokens_last_minute("acme", 1000) < charged  # charged once now


@pytest.mark.parametrize("newer_token", [True, False], ids=["deposed", "no-leader-since"])
async def test_a_step_down_while_kafka_takes_a_cycle_saves_it_only_under_its_token(
        newer_token: bool) -> None:
    """The cycle's token was read after the send: a step-down during it gave the settle the
    same None as the instance, which saved the placement to Redis after the next leader
    had read it and kept it as running. Saved under the token it went with, it is refused
    once a newer leader took the lease, and kept for the next one otherwise (its agent may
    run it); this instance, not leading, counts it as running in neither case."""
    store = FlakyStore()
    store.up, store.token = True, 4 if newer_token else 3

    async def send(batch):
        engine.step_down()  # the lease lapses while the producer waits
        return asyncio.gather()
    engine, _, kafka = _held_engine(send, store)
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    await engine.cycle()
    await asyncio.sleep(0.01)
    assert store.saved == ([] if newer_token else ["r1#0"]) and not engine.running


async def test_a_cycle_loop_cancelled_while_kafka_holds_its_cycles_leaves_them_to_settle(
) -> None:
    """Kafka slow: the fifth cycle in flight waits for the oldest to settle, and shutting
    down cancels the cycle loop there. That cancelled the oldest settle too, so its
    placement, sent and maybe run, was saved nowhere for the next leader; now every cycle
    in flight settles, and is saved, once Kafka answers (`settle_in_flight`)."""
    store = FlakyStore()
    store.up = True
    engine, acks, kafka = _held_engine(store=store)
    for i in range(5):
        await engine.admit([_standard_record(i, f"r{i}")], kafka.commit)
        if i < 4:
            assert await engine.cycle() == 1
    fifth = asyncio.create_task(engine.cycle())
    await asyncio.sleep(0.01)
    assert len(acks) == 5 and not fifth.done()  # waiting for the oldest
    fifth.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await fifth
    for ack in acks:
        if not ack.done():  # (the oldest's answer was cancelled with it)
            ack.set_result(None)
    await asyncio.wait_for(engine.settle_in_flight(), 1.0)
    assert sorted(store.saved) == [f"r{i}#0" for i in range(5)]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client of the module's Redis, emptied first."""
    client = make_redis(RedisSettings(url=redis_url))
    await client.flushall()
    yield client
    await client.aclose()


@pytest.mark.parametrize("a_ends,n1,n2", [
    ("steps-down", "reports", "reports"), ("crashes", "reports", "reports"),
    ("crashes", "reports", "dies"), ("crashes", "dies", "reports"),
    ("crashes", "unheard", "reports")],
    ids=["a-steps-down", "a-crashes", "a-crashes-n2-dies-before-the-untaken-check",
         "a-crashes-n1-dies-before-the-untaken-check", "a-crashes-b-never-hears-n1"])
async def test_a_request_an_earlier_leader_placed_is_counted_where_it_runs_and_retried(
        a_ends: str, n1: str, n2: str, redis: Redis) -> None:
    """Leader A (token 1) placed r on GPU 1 of n1, whose agent claimed it at once. A
    stepped down (shutting down, a lease check failed) before Kafka's answer came, and its
    settle saved nothing; or A crashed. B (token 2) read r again and placed it on n2 (n1
    was full), whose agent ignored it as a duplicate: B counted it on n2 for good, and
    when n1 died r was never retried. Now A's settle saves it under token 1 (no newer
    token yet), and B inherits it on n1 and places nothing; after a crash, B's untaken
    check finds n1's agent holding it and books it there (or retries it, n1 lost by then;
    never heard from, n1 is lost a node time-out later). n2 lost first, before the untaken
    check, had r retried while it ran on n1 (run and billed twice): now it is booked on n1
    then. Either way r's record commits, and r is retried once n1 is lost."""
    store, now = RunningStore(redis), [1000]
    record = _standard_record(7, "r")

    def instance(send) -> SchedulingEngine:  # noqa: ANN001
        return SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: now[0],
                                NoOpTracer(), EngineConfig(cycle_window_ms=0,
                                                           node_timeout_ms=NODE_TIMEOUT_MS,
                                                           commit_interval_ms=0),
                                store=store)

    async def agent_takes(placement: Placement) -> Claim | Taken:
        return await RedisLedger(redis).claim(
            placement.placement_id, placement.node_id, 111, placement.to_bytes(),
            placement.request.request_id, placement.request.asks_digest())

    acks: list[asyncio.Future] = []  # Kafka answers A's cycles when the test says
    a_sent: list = []

    async def held(batch):
        a_sent.extend(batch)
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    a, lease_a = instance(held), LeaderLease(redis, "A", 3000)
    a.lead(await lease_a.acquire_or_renew(), await store.load())
    a.view.apply_node_state(node("n1", [0, 70000], models=(SMALL.name,)), now[0],
                            NODE_TIMEOUT_MS)
    a.view.apply_node_state(node("n2", [80000]), now[0], NODE_TIMEOUT_MS)
    await a.admit([record], Commits().commit)
    assert await a.cycle() == 1
    [placement] = [o.message for o in a_sent]
    assert (placement.node_id, placement.gpu_indices, placement.scheduler_epoch) == (
        "n1", (1,), 1)
    assert isinstance(await agent_takes(placement), Claim)
    await lease_a.release()  # (a crash: the lease lapses)
    if a_ends == "steps-down":
        a.step_down()
        acks[0].set_result(None)
        await asyncio.sleep(0.05)

    b_sent: list = []

    async def taken(batch):
        b_sent.extend(batch)
        return asyncio.gather()
    b, kafka = instance(taken), Commits()
    running = await store.load()
    b.lead(await LeaderLease(redis, "B", 3000).acquire_or_renew(), running,
           await store.claims(running))

    def reports(seq: int, n1_reports: bool) -> None:
        """n1 (if it reports) runs r#0, full; n2 (if it reports) is free and runs nothing."""
        if n1_reports:
            b.view.apply_node_state(node("n1", [0, 0], models=(SMALL.name,), seq=seq,
                                         active=("r#0",)), now[0], NODE_TIMEOUT_MS)
        if seq == 2 or n2 == "reports":
            b.view.apply_node_state(node("n2", [80000], seq=seq), now[0], NODE_TIMEOUT_MS)

    def retries() -> list[tuple[str, int]]:
        return [(o.message.request_id, o.message.attempt) for o in b_sent
                if isinstance(o.message, InferenceRequest)]

    now[0] = 2000
    reports(2, n1_reports=n1 != "unheard")
    await b.admit([record], kafka.commit)  # A never committed it
    await b.cycle()
    await asyncio.sleep(0.01)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}
    if a_ends == "crashes":
        [again] = [o.message for o in b_sent]
        assert again.node_id == "n2" and isinstance(await agent_takes(again), Taken)
    else:  # inherited where it runs: nothing placed again
        assert not b_sent and b.running["r#0"].node_id == "n1"
    for seq, now[0] in enumerate(range(3000, 34_001, 1000), start=3):  # past the untaken
        reports(seq, n1_reports=n1 == "reports")  # time-out
        await b.cycle()
    if n1 == "dies":
        assert retries() == [("r", 1)] and not b.running and not b.view.reservations
        return
    assert not retries()
    r = b.running["r#0"]
    # where it runs, since A placed it: the progress a preemption would lose counts from then
    assert (r.node_id, r.gpu_indices, r.placed_at_ms) == ("n1", (1,), placement.placed_at_ms)
    assert list(b.view.reservations) == ([] if n1 == "reports" else ["r#0"])
    [(_, saved)] = (await redis.hgetall(SCHEDULER_RUNNING_KEY)).items()
    assert json.loads(saved)["node_id"] == "n1"  # a next leader inherits it there
    now[0] = 45_000  # n1 silent 11 s (or unheard since r was booked there), not alive in
    reports(45, n1_reports=False)  # Redis: lost
    await b.cycle()
    assert retries() == [("r", 1)] and not b.running and not b.view.reservations


async def test_a_next_leaders_retry_goes_on_in_the_requests_trace(redis: Redis) -> None:
    """Leader A placed r on n1 and crashed; n1 was lost. B's retry of r began a new trace:
    r's trace context was in A's memory only. It is saved with the placement (apart from
    the running hash, which a scheduler one release behind reads), so B's retry goes on in
    r's trace; it leaves Redis with the placement."""
    store, now = RunningStore(redis), [1000]

    def instance(sent: list) -> SchedulingEngine:
        async def send(batch):
            sent.extend(batch)
            return asyncio.gather()
        return SchedulingEngine(CATALOG, load_tenants(CONFIG), send, lambda: now[0],
                                NoOpTracer(), EngineConfig(cycle_window_ms=0,
                                                           node_timeout_ms=NODE_TIMEOUT_MS),
                                store=store)
    a = instance([])
    a.lead(await LeaderLease(redis, "A", 3000).acquire_or_renew(), await store.load())
    a.view.apply_node_state(node("n1", [80000]), now[0], NODE_TIMEOUT_MS)
    await a.admit([traced_record(0, "r", trace_id=5)])
    assert await a.cycle() == 1
    await asyncio.sleep(0.05)  # Kafka took it: saved
    await redis.delete(LEADER_KEY)  # A crashed: its lease lapses
    # left by a release that does not save them: removed as B takes over
    await redis.hset(TRACES_KEY, "ended-long-ago#0", json.dumps(traceparent(6)))

    b_sent: list = []
    b = instance(b_sent)
    running = await store.load()
    b.lead(await LeaderLease(redis, "B", 3000).acquire_or_renew(), running,
           await store.claims(running))
    await b.cycle()
    now[0] += NODE_TIMEOUT_MS + 1000  # n1 never reported to B: lost
    await b.cycle()
    [retry] = [o for o in b_sent if isinstance(o.message, InferenceRequest)]
    assert (retry.message.request_id, retry.message.attempt) == ("r", 1)
    assert carried_span(retry.trace_carrier).trace_id == 5
    assert not await redis.exists(SCHEDULER_RUNNING_KEY, TRACES_KEY)


def _hooli_record(offset: int, request_id: str, timestamp_ms: int = 1000,
                  **extra) -> ConsumerRecord:
    """A request of hooli (3 in flight, 3,000 tokens a minute) of 1,000 tokens, written at
    `timestamp_ms`."""
    return replace(_standard_record(offset, request_id, **{
        "tenant": "hooli", "prompt_tokens": 1, "max_tokens": 999} | extra),
        timestamp=timestamp_ms)


async def test_admissions_made_while_a_batch_waited_still_count_against_it() -> None:
    """A batch read the clock once, then waited on Redis (its tenant's budget flag) while
    another class's batch admitted the same tenant: judged by the older reading, that
    admission looked stamped after a clock stepped back and left the window, and hooli
    (3,000 tokens a minute) had 4,000 admitted in a fraction of a second."""
    now, slow = [1000], [True]

    class Flags:
        async def spent_budgets(self, tenants: list[str]) -> dict[str, SpentBudget]:
            now[0] += 200
            if slow[0]:  # the first read is slow: the other batch goes by meanwhile
                slow[0] = False
                await asyncio.sleep(0.05)
            return {}

    engine, sent = leading_engine(lambda: now[0], store=Flags())
    batch = replace(_hooli_record(0, "b", max_tokens=1999), topic=topics.REQUESTS["batch"].name)
    await asyncio.gather(engine.admit([_hooli_record(0, "a", max_tokens=1999)]),
                         engine.admit([batch]))
    refused = [Rejection.model_validate_json(v).request_id
               for v in sent.get(topics.RESULTS.name, [])]
    assert refused == ["a"] and engine.quotas.tokens_last_minute("hooli", now[0]) == 2000


async def test_first_attempts_read_again_after_a_take_over_are_settled_by_the_agents_ledger(
        redis: Redis) -> None:
    """A new leader reads again, from the last commit, records that a request still
    waiting held back: hooli's `ended` ran to its end, `retried` was fenced and went on as
    attempt 1, and `runs` still runs (the leader that placed it died before saving it).
    Before, all three were charged and counted in flight again: hooli's `fresh` request
    got a 429 "3 requests in flight" though one ran, and the other two were placed again
    for nothing, held as running until the untaken check. Now those two are decided at
    once (their offsets commit), and `runs` is placed again (the untaken check books it
    where it runs) but neither charged nor refused."""
    store, ledger = RunningStore(redis), RedisLedger(redis)
    await redis.set(SCHEDULER_EPOCH_KEY, 3)
    for pid in ("ended#0", "runs#0"):
        assert isinstance(await ledger.claim(pid, "n1", 111, b"{}", pid[:-2], "1:x"), Claim)
    await ledger.release("ended#0", "n1")
    assert await store.fence(["retried#0"]) == [True]
    engine, sent = leading_engine(lambda: 5000, store=store, commit_interval_ms=0)
    engine.view.apply_node_state(node("n1", [80000]), 5000, NODE_TIMEOUT_MS)
    kafka = Commits()
    await engine.admit([_hooli_record(0, "ended"), _hooli_record(1, "retried"),
                        _hooli_record(2, "runs"), _hooli_record(3, "fresh"),
                        _hooli_record(4, "next")], kafka.commit)
    assert topics.RESULTS.name not in sent
    assert [p.request.request_id for p in engine.queue.in_order()] == ["runs", "fresh", "next"]
    assert engine.quotas.tokens_last_minute("hooli", 5000) == 2000  # `fresh` and `next`
    await asyncio.sleep(0.01)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 2}
    assert await engine.cycle() == 3
    assert sorted(PLACEMENT.validate_json(v).placement_id
                  for v in sent[topics.PLACEMENTS.name]) == ["fresh#0", "next#0", "runs#0"]


async def test_a_record_that_only_says_it_is_a_retry_is_judged_as_new_work(
        redis: Redis) -> None:
    """Records produced straight to Kafka that say they are retries (attempt 1, requeued)
    skipped every admission limit: initech's spent budget, hooli's 3 requests in flight and
    its 3,000 tokens a minute, even a request larger than that whole minute (a first
    attempt's 400). Now a later attempt is a retry only where the agents' ledger holds its
    previous attempt, claimed by an agent (a hand-back) or fenced by a scheduler (a lost
    node's work); the others are judged as new work."""
    store, ledger = RunningStore(redis), RedisLedger(redis)
    await redis.set(BUDGET_EXHAUSTED_KEY.format("initech"),
                    json.dumps({"reason": "initech has spent its day budget"}), px=3_600_000)
    assert isinstance(await ledger.claim("handed#0", "n1", 111, b"{}", "handed", "1:x"), Claim)
    assert await store.fence(["lost#0"]) == [True]
    engine, sent = leading_engine(store=store)
    retry = {"attempt": 1, "requeued": "handback"}
    await engine.admit([
        replace(_standard_record(0, "i-forged", tenant="initech", **retry), timestamp=1000),
        *[_hooli_record(offset, f"h{offset}") for offset in (1, 2, 3)],
        _hooli_record(4, "h-forged", **retry),
        _hooli_record(5, "h-forged-huge", **retry | {"max_tokens": 20_000}),
        _hooli_record(6, "handed", **retry),
        _hooli_record(7, "lost", attempt=1, requeued="node_lost")])
    results = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert [(r.request_id, r.status_code, r.code) for r in results] == [
        ("i-forged", 429, "insufficient_quota"), ("h-forged", 429, None),
        ("h-forged-huge", 400, "tokens_per_minute_exceeded")]
    assert "3 requests in flight" in results[1].reason
    assert [p.key for p in engine.queue.in_order()] == [
        ("lost", 1), ("h1", 0), ("h2", 0), ("h3", 0), ("handed", 1)]
    assert engine.quotas.tokens_last_minute("hooli", 1000) == 3000  # the retries take none


class _ReadsLedger:
    """The agents' ledger as `_standing`'s lookups read it, with the states of `claims`
    (placement id -> state; untaken where it has none), noting the ids each call asks
    about (`calls`); every call fails while `down`."""

    def __init__(self, claims: dict[str, str] | None = None) -> None:
        self.claims = claims or {}
        self.calls: list[list[str]] = []
        self.down = False

    @property
    def reads(self) -> list[str]:
        return [pid for call in self.calls for pid in call]

    async def claim_states(self, placement_ids: list[str]) -> dict[str, str]:
        self.calls.append(list(placement_ids))
        if self.down:
            raise ConnectionError("Redis is away")
        return {pid: self.claims.get(pid, "untaken") for pid in placement_ids}

    async def spent_budgets(self, tenants: list[str]) -> dict[str, SpentBudget]:
        return {}


async def test_the_ledger_is_read_for_retries_and_for_records_an_earlier_leader_may_have_read(
        ) -> None:
    """One Redis read per later attempt, and per first attempt written before this
    instance took the lead (a leader before may have placed it); none for a first attempt
    written since (this instance would know it), nor for one whose earlier attempt this
    instance saw end."""
    now, ledger = [1000], _ReadsLedger()
    engine, _ = leading_engine(lambda: now[0], store=ledger)
    now[0] += 10 * 60_000
    engine._ended["seen#0"] = None  # its final usage was read
    await engine.admit([_standard_record(0, "before"),
                        replace(_standard_record(1, "since"), timestamp=now[0]),
                        replace(_standard_record(2, "retry", attempt=1, requeued="preempted"),
                                timestamp=now[0]),
                        replace(_standard_record(3, "seen", attempt=1, requeued="handback"),
                                timestamp=now[0])])
    assert ledger.reads == ["before#0", "retry#0"]
    assert len(engine.queue) == 4


async def test_the_ledger_is_read_only_for_first_attempts_of_the_first_half_minute(
        ) -> None:
    """Every first attempt written in the 5 minutes after this instance took the lead was
    looked up, a Redis round trip each, record by record. Now only those of the first half
    minute are (by their producer's clock)."""
    now, ledger = [1000], _ReadsLedger()
    engine, _ = leading_engine(lambda: now[0], store=ledger)
    await engine.admit([replace(_standard_record(0, "early"), timestamp=1000 + 10_000),
                        replace(_standard_record(1, "later"), timestamp=1000 + 60_000)])
    assert ledger.reads == ["early#0"] and len(engine.queue) == 2


def _backlog(retries: int, first_attempts: int) -> list[ConsumerRecord]:
    """Records a new leader reads again after a fail-over: `retries` later attempts, then
    `first_attempts` first ones, all written before it took the lead."""
    retry = {"attempt": 1, "requeued": "handback"}
    return [*[_standard_record(i, f"retry{i}", **retry) for i in range(retries)],
            *[_standard_record(retries + i, f"first{i}") for i in range(first_attempts)]]


@pytest.mark.parametrize("retries,first_attempts", [(1, 1), (100, 100)])
async def test_a_batch_reads_the_ledger_in_one_call_however_many_records_it_looks_up(
        retries: int, first_attempts: int) -> None:
    """A backlog read again after a fail-over: each record looked up in the agents' ledger
    was a Redis round trip of its own, one after the other (10,000 records took 2.7 s).
    Now a batch asks for all of them at once."""
    ledger = _ReadsLedger(dict.fromkeys((f"retry{i}#0" for i in range(retries)), "held"))
    engine, _ = leading_engine(store=ledger)
    await engine.admit(_backlog(retries, first_attempts))
    assert len(ledger.calls) == 1
    assert ledger.reads == [*(f"retry{i}#0" for i in range(retries)),
                            *(f"first{i}#0" for i in range(first_attempts))]
    assert len(engine.queue) == retries + first_attempts


async def test_a_batch_read_from_the_ledger_at_once_is_judged_as_record_by_record() -> None:
    """Each record of one batch is taken in by the state of its own placement in the
    agents' ledger, all read in one call: a first attempt no agent took is new work
    (charged), one an agent holds ran (placed again, not charged), one that ended or was
    fenced is done (not placed again); a retry whose previous attempt no agent claimed is
    new work, any other ran. Not asked: a first attempt written since this instance took
    the lead (new), and a placement this instance saw end or retried."""
    led_ms = 1000
    ledger = _ReadsLedger({"held#0": "held", "ended#0": "ended", "fenced#0": "fenced",
                           "r-held#0": "held", "r-ended#0": "ended", "r-fenced#0": "fenced",
                           "since#0": "ended", "seen#0": "untaken", "moved#0": "untaken"})
    engine, _ = leading_engine(lambda: led_ms, store=ledger)
    engine._ended["seen#0"] = None  # its final usage was read here
    engine._moved_on["moved#0"] = None  # retried here, its node lost
    retry = {"attempt": 1, "requeued": "handback"}
    await engine.admit([
        _standard_record(0, "untaken"), _standard_record(1, "held"),
        _standard_record(2, "ended"), _standard_record(3, "fenced"),
        _standard_record(4, "r-untaken", **retry), _standard_record(5, "r-held", **retry),
        _standard_record(6, "r-ended", **retry), _standard_record(7, "r-fenced", **retry),
        replace(_standard_record(8, "since"), timestamp=led_ms + RE_READ_SKEW_MS + 1),
        _standard_record(9, "seen"), _standard_record(10, "moved", **retry)])
    assert ledger.calls == [["untaken#0", "held#0", "ended#0", "fenced#0", "r-untaken#0",
                             "r-held#0", "r-ended#0", "r-fenced#0"]]
    assert {p.request.request_id: p.charged for p in engine.queue.in_order()} == {
        "untaken": True, "held": False, "r-untaken": True, "r-held": False,
        "r-ended": False, "r-fenced": False, "since": True, "moved": False}


async def test_a_placement_seen_ending_as_the_batch_began_stays_ended_at_its_turn() -> None:
    """The batch's ledger read does not ask about a placement this instance saw end; should
    it forget that (a bounded memory) before the record's turn, the record is still done,
    not judged as a first attempt nobody took."""
    ledger = _ReadsLedger()
    engine, _ = leading_engine(store=ledger)
    engine._ended["seen#0"] = None
    reading = ledger.claim_states

    async def forgetting(placement_ids: list[str]) -> dict[str, str]:
        del engine._ended["seen#0"]  # forgotten while the batch waits for Redis
        return await reading(placement_ids)
    ledger.claim_states = forgetting
    await engine.admit([_standard_record(0, "asked"), _standard_record(1, "seen")])
    assert ledger.calls == [["asked#0"]]
    assert [p.request.request_id for p in engine.queue.in_order()] == ["asked"]


async def test_a_batch_the_ledger_cannot_answer_costs_one_failed_read() -> None:
    """Redis away after a fail-over: each looked-up record waited for its client's
    time-out in turn, until the lease lapsed. Now the batch's one read fails, and every
    record is taken as it says: a first attempt as new work, a retry as one."""
    ledger = _ReadsLedger()
    ledger.down = True
    engine, _ = leading_engine(store=ledger)
    await engine.admit(_backlog(50, 50))
    assert len(ledger.calls) == 1 and len(ledger.reads) == 100
    assert {p.request.request_id: p.charged for p in engine.queue.in_order()} == {
        **{f"retry{i}": False for i in range(50)}, **{f"first{i}": True for i in range(50)}}


class _SavesLedger(_ReadsLedger):
    """`_ReadsLedger` whose running hash takes every save a cycle makes."""

    async def save(self, placements, epoch: int) -> bool:  # noqa: ANN001
        return True

    async def remove(self, placement_ids: list[str]) -> None:
        pass


_NOW_MS = 100_000_000
_POSING = {"attempt": 1, "created_at_ms": 1}
"""A later attempt whose record says its request was created in 1970."""


def _retry_record(offset: int, request_id: str, tenant: str, cls: str, **extra
                  ) -> ConsumerRecord:
    """A request record of class `cls` of `tenant`, written at `_NOW_MS`."""
    return replace(request_record(topics.REQUESTS[cls].name, offset, json.dumps({
        "request_id": request_id, "tenant": tenant, "model": SMALL.name, "prompt": "x",
        "max_tokens": 4, "priority_class": cls, **extra}).encode()), timestamp=_NOW_MS)


@pytest.mark.parametrize("confirmed", [True, False], ids=["confirmed", "judged-new"])
async def test_a_record_posing_as_a_preempted_retry_waits_in_line_as_a_first_attempt(
        confirmed: bool) -> None:
    """A record produced straight to Kafka that says it is a preempted retry, with a
    `created_at_ms` of 1, was judged new work (no agent took its previous attempt) but
    queued by its own fields: aged at once, ahead of another tenant's interactive request,
    and at the front of its class. Only a retry the agents' ledger confirms waits from its
    request's creation and goes first in its class; the other waits from now, at the back."""
    ledger = _ReadsLedger({"retry#0": "held"} if confirmed else {})
    engine, _ = leading_engine(lambda: _NOW_MS, store=ledger)
    await engine.admit([_retry_record(0, "honest", "acme", "interactive")])
    await engine.admit([_retry_record(0, "early", "globex", "batch"),
                        _retry_record(1, "retry", "initech", "batch", requeued="preempted",
                                      **_POSING)])
    assert ledger.reads[-1] == "retry#0"
    retry = engine.queue.get(("retry", 1))
    line = [(chunk, p.request.request_id) for chunk, p in engine.in_line(_NOW_MS)]
    queued = [p.request.request_id for p in engine.queue.in_order()]
    if confirmed:
        assert line == [("aged", "retry"), ("interactive", "honest"), ("batch", "early")]
        assert queued == ["honest", "retry", "early"]
        assert retry.aging_from_ms == 1
    else:
        assert line == [("interactive", "honest"), ("batch", "early"), ("batch", "retry")]
        assert queued == ["honest", "early", "retry"]
        assert retry.aging_from_ms == _NOW_MS
    assert (retry.retry, retry.charged) == (confirmed, not confirmed)


@pytest.mark.parametrize("confirmed", [True, False], ids=["confirmed", "judged-new"])
async def test_a_record_posing_as_a_retry_is_placed_as_a_first_attempt_and_may_be_preempted(
        confirmed: bool) -> None:
    """Judged new work, a record that says it is a hand-back created in 1970 was placed as
    aged work, which no class priority takes back: an interactive request of another tenant
    that fit nowhere else waited behind it. Placed as a first attempt now, it is preempted
    for that request; a confirmed retry, placed as aged, keeps its place."""
    ledger = _SavesLedger({"b#0": "held"} if confirmed else {})
    now = [_NOW_MS]
    engine, _ = leading_engine(lambda: now[0], store=ledger)
    await engine.admit([_retry_record(0, "b", "initech", "batch", prompt_tokens=20000,
                                      requeued="handback", **_POSING)])
    engine.view.apply_node_state(node("n1", [3800]), now[0], NODE_TIMEOUT_MS)
    await engine.cycle()
    [placed] = engine.running.values()
    assert (placed.placement_id, placed.aged) == ("b#1", True if confirmed else None)
    now[0] += 1000
    engine.view.apply_node_state(node("n1", [3800 - placed.memory_mib_per_gpu],
                                      models=(SMALL.name,), active=("b#1",), seq=2),
                                 now[0], NODE_TIMEOUT_MS)
    await engine.admit([_retry_record(0, "i", "acme", "interactive", prompt_tokens=20000)])
    await engine.cycle()
    assert ("b#1" in engine._victims) == (not confirmed)


@pytest.mark.parametrize("confirmed", [True, False], ids=["confirmed", "judged-new"])
async def test_a_record_posing_as_attempt_99_is_priced_as_a_first_attempt_by_a_plan(
        confirmed: bool) -> None:
    """Each earlier attempt of a victim costs a plan 30 GPU-seconds, so a record that only
    said `"attempt": 99` was the last victim any plan picked, and others' work, running
    longer, was stopped instead. Judged new work, it is priced as a first attempt now: of
    two batch placements, the one placed last (least progress lost) stops for an
    interactive request; a confirmed retry on its 99th attempt is spared."""
    ledger = _SavesLedger({"posing#98": "held"} if confirmed else {})
    now = [_NOW_MS]
    engine, _ = leading_engine(lambda: now[0], store=ledger)
    engine.view.apply_node_state(node("n1", [SMALL.weight_memory_mib + 2 * 600]), now[0],
                                 NODE_TIMEOUT_MS)
    await engine.admit([_retry_record(0, "first", "globex", "batch", prompt_tokens=20000)])
    await engine.cycle()
    now[0] += 10_000
    free = SMALL.weight_memory_mib + 2 * 600 - engine.running["first#0"].memory_mib_per_gpu
    engine.view.apply_node_state(node("n1", [free], models=(SMALL.name,), active=("first#0",),
                                      seq=2), now[0], NODE_TIMEOUT_MS)
    await engine.admit([_retry_record(1, "posing", "initech", "batch", prompt_tokens=20000,
                                      attempt=99, requeued="handback", created_at_ms=now[0])])
    await engine.cycle()
    now[0] += 1000
    free -= engine.running["posing#99"].memory_mib_per_gpu
    engine.view.apply_node_state(node("n1", [free], models=(SMALL.name,),
                                      active=("first#0", "posing#99"), seq=3), now[0],
                                 NODE_TIMEOUT_MS)
    await engine.admit([_retry_record(0, "i", "acme", "interactive", prompt_tokens=20000)])
    await engine.cycle()
    assert list(engine._victims) == ["first#0" if confirmed else "posing#99"]
    assert engine.running["posing#99"].retry == (True if confirmed else None)


@pytest.mark.parametrize("confirmed", [True, False], ids=["confirmed", "judged-new"])
async def test_a_record_posing_as_a_retry_expires_under_its_queue_time_limit(
        confirmed: bool) -> None:
    """Retries of placed work never expire, and a record that only said it was one never
    did either: judged new work, it now ends with a 503 past its class's queue time limit,
    as a first attempt does, and gives its tokens-per-minute charge back."""
    ledger = _ReadsLedger({"r#0": "held"} if confirmed else {})
    now = [_NOW_MS]
    engine, sent = leading_engine(lambda: now[0], store=ledger,
                                  class_max_queue_ms=(("standard", 5000.0),))
    await engine.admit([_retry_record(0, "r", "hooli", "standard", attempt=1,
                                      requeued="handback", created_at_ms=_NOW_MS)])
    assert (engine.quotas.tokens_last_minute("hooli", now[0]) > 0) == (not confirmed)
    now[0] += 5000  # at its limit, not past it
    assert await engine.cycle() == 0
    now[0] += 1
    assert await engine.cycle() == (0 if confirmed else 1)
    if confirmed:
        assert engine.queue.get(("r", 1)) is not None
        return
    [expired] = [RESULT_EVENT.validate_json(v) for v in sent[topics.RESULTS.name]]
    assert (expired.request_id, expired.status_code, expired.code) == (
        "r", 503, "queue_time_exceeded")
    assert not len(engine.queue) and engine.quotas.tokens_last_minute("hooli", now[0]) == 0


async def test_a_placement_sent_again_after_kafka_refused_its_cycle_is_charged_once() -> None:
    """Kafka refused the cycle and its request was placed again by the next: its tenant was
    charged the estimate twice, and weighed as if it had run twice as long. Now the
    placement is held, charged, while it goes out again."""
    engine, acks, kafka = _held_engine()
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    assert await engine.cycle() == 1
    charged = engine.fair.level("acme", 1)
    assert charged > 0
    _answer(acks[0], refused=True)
    await asyncio.sleep(0.01)
    assert engine.fair.level("acme", 1) == pytest.approx(charged)
    assert await engine.cycle() == 1  # sent again
    assert engine.fair.level("acme", 1) == pytest.approx(charged)


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "taken"])
async def test_a_cycle_of_an_earlier_term_gives_back_its_fair_share_estimate(
        refused: bool) -> None:
    """The instance led again under a new token while Kafka answered a cycle of its earlier
    term, whose placement Redis never had (`lead` replaced `running`): its estimate stayed
    charged, and the request placed again by the new term was charged a second time."""
    engine, acks, kafka = _held_engine()
    await engine.admit([_standard_record(7, "r1")], kafka.commit)
    assert await engine.cycle() == 1
    charged = engine.fair.level("acme", 1)
    engine.step_down()
    engine.lead(4, [], {})
    _answer(acks[0], refused)
    await asyncio.sleep(0.01)
    assert await engine.cycle() == 1  # placed again under token 4
    assert engine.fair.level("acme", 1) == pytest.approx(charged)


async def test_a_later_term_placing_it_first_leaves_one_fair_share_charge() -> None:
    """The same, the new term having read and placed the record again before Kafka refused
    the earlier term's cycle."""
    engine, acks, kafka = _held_engine()
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    charged = engine.fair.level("acme", 1)
    engine.step_down()
    engine.lead(4, [], {})
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    _answer(acks[0], refused=True)
    _answer(acks[1], refused=False)
    await asyncio.sleep(0.01)
    assert list(engine.running) == ["r1#0"]
    assert engine.fair.level("acme", 1) == pytest.approx(charged)


class QuotaNotes:
    """Redis's notes of the request records answered 429, which every instance reads when
    it leads; taking one fails while `down`."""

    def __init__(self) -> None:
        self.kept: list[tuple[tuple[str, int, int], int]] = []
        self.down = False

    async def note_over_quota(self, position, timestamp_ms: int) -> None:  # noqa: ANN001
        if self.down:
            raise ConnectionError("Redis is away")
        self.kept = [*self.kept, (position, timestamp_ms)]

    async def forget_over_quota(self, floors) -> None:  # noqa: ANN001
        self.kept = [(p, at) for p, at in self.kept if p[2] >= floors.get(p[:2], 0)]

    async def over_quota(self) -> list[tuple[tuple[str, int, int], int]]:
        return list(self.kept)


def _records_behind_waiting_work() -> list[ConsumerRecord]:
    """A request that waits (no cycle runs here), then one of 2,500 tokens from a tenant
    allowed 3,000 a minute."""
    return [_standard_record(0, "first"),
            _standard_record(1, "over", tenant="hooli", max_tokens=2499)]


@pytest.mark.parametrize("redis_up", [True, False])
async def test_a_record_answered_429_stays_refused_when_a_new_leader_reads_it_again(
        caplog, redis_up: bool) -> None:
    """The request in front, still waiting, held its partition's offset back; the leader
    answered the record behind it 429 and died. The next leader read both again and judged
    the refused one anew against its own, empty minute: it ran for a client that had its
    429. Redis away when the 429 went out, the leader still knows it and says so."""
    notes, answers = QuotaNotes(), []
    notes.down = not redis_up

    async def send(batch):
        answers.extend(o.message for o in batch if isinstance(o.message, Rejection))
        return asyncio.gather()
    old, _, kafka = _held_engine(send, notes)
    old.quotas.admit("hooli", 2000, 1000)  # most of its minute taken
    await old.admit(_records_behind_waiting_work(), kafka.commit)
    assert [(r.request_id, r.status_code) for r in answers] == [("over", 429)]
    assert kafka.offsets == {}  # "first" waits: both are read again
    if redis_up:
        new, _, _ = _held_engine(send, notes)  # the next leader, another instance
        new.lead(4, [], {}, await notes.over_quota())
        await new.admit(_records_behind_waiting_work(), kafka.commit)
        assert [p.request.request_id for p in new.queue.in_order()] == ["first"]
        assert len(answers) == 1
    else:
        assert "not kept in Redis" in caplog.text
        old.step_down()
        old.lead(4, [], {}, await notes.over_quota())
        await old.admit(_records_behind_waiting_work(), kafka.commit)
        assert [p.request.request_id for p in old.queue.in_order()] == ["first"]


async def test_a_429_answered_as_the_leader_steps_down_is_noted_for_the_next_one() -> None:
    """The step-down cancels the consumer while Kafka takes the 429: it goes out (it is in
    the producer's batch), and before, no note did; the next leader ran the request."""
    notes = QuotaNotes()
    old, acks, kafka = _held_engine(store=notes)
    old.quotas.admit("hooli", 2000, 1000)
    admitting = asyncio.create_task(old.admit([_records_behind_waiting_work()[1]],
                                              kafka.commit))
    for _ in range(50):
        await asyncio.sleep(0)
        if acks:
            break
    assert acks  # the 429 is in the producer's batch, Kafka's answer pending
    old.step_down()
    admitting.cancel()  # as requests.stop() does, right after the step-down
    await asyncio.gather(admitting, return_exceptions=True)
    acks[0].set_result(None)  # Kafka takes it
    for _ in range(10):
        await asyncio.sleep(0)
    assert [position for position, _ in notes.kept] == [(topics.REQUESTS["standard"].name, 0, 1)]


async def test_a_note_of_a_429_does_not_refuse_another_record_at_its_position() -> None:
    """The request topic was deleted and made again (offsets start at 0 again) while Redis
    kept its notes: a new request at a noted position was committed unanswered, neither
    queued nor refused, and its client waited for ever."""
    notes = QuotaNotes()
    old, _, kafka = _held_engine(_acked_at_once, notes)
    old.quotas.admit("hooli", 2000, 1000)
    await old.admit([_records_behind_waiting_work()[1]], kafka.commit)  # a 429 at offset 1
    assert notes.kept
    new, _, kafka = _held_engine(_acked_at_once, notes)
    new.lead(4, [], {}, await notes.over_quota())
    fresh = replace(_standard_record(1, "fresh"), timestamp=5_000)  # the same position
    await new.admit([fresh], kafka.commit)
    assert [p.request.request_id for p in new.queue.in_order()] == ["fresh"]


async def test_a_note_this_release_cannot_read_is_left_out(caplog, redis: Redis) -> None:
    """As with the placements in flight: one note of a 429 this release cannot read (a
    newer release's, a hand edit) failed every take-over: the instance held the lease and
    never led. Those the release before kept are read too."""
    standard = topics.REQUESTS["standard"].name
    store = RunningStore(redis)
    await store.note_over_quota((standard, 1, 9), 2000)
    await redis.zadd(f"gpusched:scheduler:over-quota:{standard}:1", {b"newer-release": 10})
    await redis.zadd("gpusched:scheduler:over-quota", {f"{standard}:0:7": 1000,
                                                       "from-a-newer-release": 1000})
    assert sorted(await store.over_quota()) == [((standard, 0, 7), 1000),
                                                ((standard, 1, 9), 2000)]
    assert caplog.text.count("unreadable note of a 429") == 2


async def test_a_429_whose_note_a_step_down_cuts_short_stays_refused() -> None:
    """The step-down stops the request consumer (cancelling its admission) while Redis
    takes the note of a 429 that went out: the note was lost, and the next leader ran the
    request for a client that had its 429."""
    class SlowNotes(QuotaNotes):
        async def note_over_quota(self, position, timestamp_ms):  # noqa: ANN001
            await asyncio.sleep(0.05)  # one Redis round trip
            await super().note_over_quota(position, timestamp_ms)

    notes = SlowNotes()
    old, _, kafka = _held_engine(_acked_at_once, notes)
    old.quotas.admit("hooli", 2000, 1000)
    admitting = asyncio.create_task(old.admit(_records_behind_waiting_work(), kafka.commit))
    await asyncio.sleep(0.01)  # the 429 went out; its note is on its way
    old.step_down()
    admitting.cancel()
    await asyncio.gather(admitting, return_exceptions=True)
    await asyncio.sleep(0.1)
    new, _, _ = _held_engine(_acked_at_once, notes)
    new.lead(4, [], {}, await notes.over_quota())
    await new.admit(_records_behind_waiting_work(), kafka.commit)
    assert [p.request.request_id for p in new.queue.in_order()] == ["first"]


async def test_a_429_that_went_out_stays_refused_across_a_step_down() -> None:
    """The step-down came while Kafka took the 429: the note that it went out was skipped,
    and the same instance leading again admitted the record read again."""
    engine, held, _ = _held_engine()
    standard = topics.REQUESTS["standard"].name
    record = request_record(standard, 1, json.dumps({
        "request_id": "over", "tenant": "hooli", "model": SMALL.name, "prompt": "x",
        "max_tokens": 2500}).encode())
    engine.quotas.admit("hooli", 2000, 1000)  # most of the minute taken
    admitting = asyncio.create_task(engine.admit([record]))
    await asyncio.sleep(0.01)
    engine.step_down()
    held[0].set_result(None)
    await admitting
    engine.lead(3, [])
    engine.quotas = type(engine.quotas)()  # a fresh minute
    await engine.admit([record])
    assert not len(engine.queue)


async def test_a_429_held_back_by_waiting_work_stays_refused_however_many_429s_follow(
        redis: Redis) -> None:
    """hooli's `victim`, answered 429, sits behind `first`, which waits, so its partition
    commits nothing; then a client hammering at hooli's limit on another partition is
    answered as many 429s as the notes kept (RECENT_DECISIONS, made small here to keep the
    test short). The notes were trimmed to that many: the next leader, reading partition 0
    again with a fresh minute, ran `victim` for a client told it was refused. Now a note is
    kept until its partition's commit passes it, and no longer: the flood's partition
    committed, and Redis keeps none of its notes."""
    standard = topics.REQUESTS["standard"].name
    with patch("gpusched_scheduler.engine.RECENT_DECISIONS", 1000):
        store, kafka = RunningStore(redis), Commits()
        old, sent = leading_engine(store=store, commit_interval_ms=0)
        old.quotas.admit("hooli", 2500, 1000)  # most of its minute taken
        held_back = [_standard_record(0, "first"), _hooli_record(1, "victim", max_tokens=1999)]
        await old.admit(held_back, kafka.commit)
        flood = [replace(_hooli_record(offset, f"w{offset}"), partition=1)
                 for offset in range(1001)]
        for start in range(0, len(flood), 200):
            await old.admit(flood[start:start + 200], kafka.commit)
        await asyncio.sleep(0.05)
        assert len(sent[topics.RESULTS.name]) == 1002  # all 429s
        assert kafka.offsets == {TopicPartition(standard, 1): 1001}
        new, sent = leading_engine(store=store)
        new.lead(4, [], {}, await store.over_quota())
        await new.admit(held_back, kafka.commit)
    assert [p.request.request_id for p in new.queue.in_order()] == ["first"]
    assert topics.RESULTS.name not in sent
    assert await store.over_quota() == [((standard, 0, 1), 1000)]


async def test_a_429_stays_refused_when_its_batch_is_read_again_after_a_commit_passed_it(
        ) -> None:
    """A cycle's answer let the partition commit past a record just answered 429 while its
    batch was still being admitted; then Kafka refused the answer to a later record of the
    batch, and the consumer read the batch again from its start. The note, forgotten at the
    commit, must still refuse the record read again (a fresh minute would now admit it)."""
    sends = [0]

    async def send(batch):  # noqa: ANN001, ANN202
        sends[0] += 1
        if sends[0] == 2:  # the dead letter of the garbage record
            engine._commit_decided()  # as a cycle's settle does, meanwhile
            await asyncio.sleep(0.01)
            raise KafkaConnectionError()
        return asyncio.gather()
    notes = QuotaNotes()
    engine, _, kafka = _held_engine(send, notes)
    engine.quotas.admit("hooli", 2000, 1000)  # most of its minute taken
    standard = topics.REQUESTS["standard"].name
    batch = [_hooli_record(0, "over", max_tokens=1999), request_record(standard, 1, b"{")]
    with pytest.raises(KafkaConnectionError):
        await engine.admit(batch, kafka.commit)
    assert kafka.offsets == {TopicPartition(standard, 0): 1}  # past the 429
    engine.quotas = QuotaBook()  # a minute later
    await engine.admit(batch, kafka.commit)
    assert not len(engine.queue) and sends[0] == 3  # the garbage record's dead letter alone
    await asyncio.sleep(0.01)
    assert [p for p, _ in notes.kept] == []  # both committed: forgotten in Redis too


async def test_leading_again_under_the_same_token_keeps_its_decisions() -> None:
    """A lease check failed once and the next led again with the same token: the decisions
    were forgotten, and the record read again was placed (and charged) a second time."""
    engine, acks, kafka = _held_engine()
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    assert await engine.cycle() == 1
    acks[0].set_result(None)
    await asyncio.sleep(0.01)
    engine.step_down()
    engine.lead(3, [], {})  # (no Redis here: its decisions are all it knows)
    await engine.admit([record], kafka.commit)
    assert not len(engine.queue)


def test_a_stopping_victim_on_a_node_reporting_fewer_gpus_is_no_crash() -> None:
    """A victim on GPU 2 of a node whose report lists two GPUs indexed past the arrays (an
    IndexError every cycle) or gave its memory to the next node's GPU."""
    view = ClusterView()
    view.apply_node_state(node("a", [100, 100], models=(SMALL.name,), active=("v#0",)), 0,
                          NODE_TIMEOUT_MS)
    stopping = _victim("v#0", req("v", "batch"), (2,), 5000, 5000)
    items = [Pending(req("q", "interactive", max_tokens=30_000), {}, 0)]
    chunks = order_pending(items, 0, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    decisions = plan_cycle(snapshot(view, view.live_nodes(0, 10**12)), chunks, CATALOG,
                           "gpusched", [_victim("w#0", req("w", "batch"), (0,), 50, 50)], 0,
                           {"q": 1}, fleet=fleet_of(view), stopping=[stopping])
    assert [p.request.request_id for p in decisions.waiting] == ["q"]


async def test_a_preemption_whose_room_is_on_a_draining_node_lets_its_request_go() -> None:
    """A draining node is live but takes no work: its preemptor stayed first in line with
    nothing kept for it and no right to plan again until the 15 s time-out."""
    from gpusched_scheduler.domain.planner import Room

    engine, _ = leading_engine()
    engine.view.apply_node_state(node("a", [100]), 1000, NODE_TIMEOUT_MS)
    draining = node("b", [100]).model_copy(update={"status": "draining"})
    engine.view.apply_node_state(draining, 1000, NODE_TIMEOUT_MS)
    await engine.admit([request_record(topics.REQUESTS["interactive"].name, 0, json.dumps({
        "request_id": "i", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 30_000, "priority_class": "interactive"}).encode())])
    engine._preempting["i"] = (16_000, Room("b", (0,)))
    await engine.cycle()
    assert "i" not in engine._preempting


async def test_a_preemptor_placed_in_a_cycle_kafka_refuses_keeps_its_room() -> None:
    """Its preemption ended when the cycle placed it: undone, it waited again without its
    room, and the victims' hand-backs could take that room back once more. Now it is held
    in its room and sent there again; its preemption ends once Kafka took it."""
    from gpusched_scheduler.domain.planner import Room

    send_ok = [False]
    engine, _, _ = _held_engine(_kafka_away_until(send_ok))
    await engine.admit([request_record(topics.REQUESTS["interactive"].name, 0, json.dumps({
        "request_id": "i", "tenant": "acme", "model": SMALL.name, "prompt": "x",
        "max_tokens": 10, "priority_class": "interactive"}).encode())])
    engine._preempting["i"] = (16_000, Room("n1", (0,)))
    with contextlib.suppress(ConnectionError):
        await engine.cycle()
    await asyncio.sleep(0.01)
    assert [(r.node_id, r.gpu_indices) for r in engine.running.values()] == [("n1", (0,))]
    assert "i" in engine._preempting
    send_ok[0] = True
    assert await engine.cycle() == 1
    await asyncio.sleep(0.01)
    assert "i" not in engine._preempting


@pytest.mark.parametrize("token,refused,model", [
    (4, False, SMALL.name), (4, True, SMALL.name), (4, True, SEVENTY_B.name),
    (3, False, SMALL.name)],
    ids=["new-token-taken", "new-token-refused", "new-token-rejection-refused", "same-token"])
async def test_a_term_begun_while_kafka_takes_a_cycle_decides_its_work_once(
        token: int, refused: bool, model: str) -> None:
    """The lease lapsed and this instance led again while the producer took a cycle. Under
    a new token, the cycle noted its decision in the new term, which took the note for its
    own: a placement was dropped (never placed under the new token; agents refuse the old
    one's), a 422 whose cycle Kafka refused was never sent again and its record never
    committed. Under the same token, the placement was not noted, the record read again
    was queued as new work, and the request was placed (and charged) twice."""
    engine: SchedulingEngine

    async def send(batch):
        if not acks:
            engine.step_down()
            if token != 3:
                engine.lead(token, [], {})
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    engine, acks, kafka = _held_engine(send)
    record = _standard_record(7, "r1", model=model)
    await engine.admit([record], kafka.commit)
    await engine.cycle()
    if token == 3:
        engine.lead(3, [], {})
    await engine.admit([record], kafka.commit)  # the consumer reads it again
    _answer(acks[0], refused)
    await asyncio.sleep(0.01)
    decided = await engine.cycle()
    for ack in acks[1:]:
        ack.set_result(None)
    await asyncio.sleep(0.01)
    assert kafka.offsets and not len(engine.queue)
    if model == SEVENTY_B.name:
        assert decided == 1  # its 422 again
    else:
        assert list(engine.running) == ["r1#0"] and len(acks) == (1 if token == 3 else 2)


async def test_a_record_read_again_while_its_lost_nodes_retry_waits_for_kafka_waits_too(
) -> None:
    """Kafka refused both the cycle that placed the request and its lost node's retry; a
    record of it read again (a seek-back) was committed before Kafka took the retry (the
    placement never saved: a crash then lost the request)."""
    acks: list[asyncio.Future] = []

    async def send(batch):
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]
    engine, now, kafka = await placed_on_n1(send)
    now[0] = 12_000  # n1 lost: its retry goes out
    cycle = asyncio.create_task(engine.cycle())
    await asyncio.sleep(0.01)
    _answer(acks[0], refused=True)  # the cycle that placed r
    await asyncio.sleep(0.01)
    _answer(acks[1], refused=True)  # the retry
    await cycle
    assert [pid for pid, _ in engine._retries] == ["r#0"]
    await engine.admit([_standard_record(7, "r")], kafka.commit)
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}


async def test_a_record_read_again_while_its_cycle_is_in_flight_waits_for_its_answer() -> None:
    """Read again (a re-lead under the same token, a seek-back) while its cycle waited for
    Kafka, the record was committed as decided; Kafka then refused the cycle, its work
    waited in memory only, and the next step-down lost it. Now it commits once Kafka has
    taken the placement, sent again."""
    engine, acks, kafka = _held_engine()
    record = _standard_record(7, "r1")
    await engine.admit([record], kafka.commit)
    await engine.cycle()
    engine.step_down()
    engine.lead(3, [], {})
    await engine.admit([record], kafka.commit)
    await asyncio.sleep(0.01)
    assert kafka.offsets == {}
    acks[0].set_exception(ConnectionError("broker gone"))
    await asyncio.sleep(0.01)
    assert kafka.offsets == {} and list(engine.running) == ["r1#0"]
    assert list(engine.view.reservations) == ["r1#0"]  # `lead` had dropped it: held again
    assert await engine.cycle() == 1
    acks[1].set_result(None)
    await asyncio.sleep(0.01)
    assert kafka.offsets == {TopicPartition(topics.REQUESTS["standard"].name, 0): 8}


def test_an_earlier_preemptor_is_planned_before_later_work_takes_the_room_coming_free(
) -> None:
    """One solve of all waiting requests on what a stopping victim frees let a later one
    that fits take that room first; the earlier one, planned on what was left, found no
    plan, and the later one took the room for good."""
    mistral = CATALOG.get("mistral-7b")

    def sized(rid: str, kv: int, tenant: str) -> InferenceRequest:
        tokens = next(t for t in range(1, 32_768, 16)
                      if memory_per_gpu(req("x", model=mistral.name, max_tokens=t),
                                        mistral)[0] >= kv)
        return req(rid, "interactive", model=mistral.name, max_tokens=tokens, tenant=tenant)

    earlier, later = sized("E", 4000, "acme"), sized("L", 1000, "globex")
    view = ClusterView()
    view.apply_node_state(node("a", [500], models=(mistral.name,), active=("S#0", "V#0")), 0,
                          NODE_TIMEOUT_MS)
    stopping = _victim("S#0", req("S", "batch"), (0,), 2000, 2000)
    running = _victim("V#0", req("V", "batch"), (0,), 2000, 2000)
    chunks = [Chunk("interactive", [Pending(earlier, {}, 0), Pending(later, {}, 0)])]
    decisions = plan_cycle(snapshot(view, view.live_nodes(0, 10**12)), chunks, CATALOG,
                           "gpusched", [running], 0, {"E": 1, "L": 1},
                           fleet=fleet_of(view), stopping=[stopping])
    assert [(p.item.request.request_id, [v.placement_id for v in p.victims])
            for p in decisions.preemptions] == [("E", ["V#0"])]


def test_an_ended_placement_no_report_listed_keeps_its_memory_until_one_shows_it() -> None:
    """Its final usage came before any report listed it: released at once, the GPU looked
    as free as the last report, before the weights it loaded, and the agent refused every
    placement that counted on that memory until its next report."""
    view = ClusterView()
    empty = node("a", [80000]).model_copy(update={"reported_at_ms": 1000})
    view.apply_node_state(empty, 1000, NODE_TIMEOUT_MS)
    view.reserve(Reservation("p#0", "a", (0,), 15_000, EIGHT_B.name))
    view.release_ended("p#0", 1500)
    assert list(view.reservations) == ["p#0"]
    view.apply_node_state(empty.model_copy(update={"seq": 2, "reported_at_ms": 1400}), 1400,
                          NODE_TIMEOUT_MS)  # from before its end: not yet
    assert list(view.reservations) == ["p#0"]
    view.apply_node_state(node("a", [66000], seq=3).model_copy(
        update={"reported_at_ms": 1600}), 1600, NODE_TIMEOUT_MS)
    assert not view.reservations


def test_an_ended_placement_no_report_listed_frees_its_memory_once_another_agent_run_reports(
) -> None:
    """Then its agent started again with its clock set back an hour (NTP fixed it): every
    report of the new run was stamped before the end, so the 15 GB stayed reserved for an
    hour, though the new run never held those weights (they went with the old process).
    It no longer ran, so the untaken check never looked at it. Now the new run's next
    report frees it (its first may be from before the placement loaded anything)."""
    view = ClusterView()
    old_run = node("a", [80000]).model_copy(
        update={"started_at_ms": 3_000_000, "reported_at_ms": 3_500_000})
    view.apply_node_state(old_run, 1000, NODE_TIMEOUT_MS)
    view.reserve(Reservation("p#0", "a", (0,), 15_000, EIGHT_B.name))
    view.release_ended("p#0", 3_600_000)
    new_run = old_run.model_copy(update={"started_at_ms": 100_000, "reported_at_ms": 160_000})
    assert view.apply_node_state(new_run, 20_000, NODE_TIMEOUT_MS)  # silent past the time-out
    assert view.apply_node_state(new_run.model_copy(update={
        "seq": new_run.seq + 1, "reported_at_ms": 161_000}), 21_000, NODE_TIMEOUT_MS)
    assert not view.reservations


def test_a_gang_an_agent_refused_counts_on_no_shards_it_finds_loaded() -> None:
    """Two 70B gangs run on GPUs (0, 1) and (2, 3); GPUs 1 and 2 each hold a shard (of a
    different gang) and room for a KV cache: a third gang was placed on (1, 2) as if its
    shards were loaded, the agent (which needs its own) refused it, and every next cycle
    chose the same pair until it failed after five refusals."""
    shard = weights_name(SEVENTY_B.name, 2)
    view = ClusterView()
    view.apply_node_state(NodeState(
        node_id="a", seq=1, started_at_ms=0, reported_at_ms=0,
        gpus=tuple(GpuState(index=i, uuid=f"a-{i}", gpu_type="H100-80GB",
                            memory_total_mib=81559, memory_free_mib=free,
                            loaded_models=(shard,), kv_cache_free_mib=free)
                   for i, free in enumerate([0, 13_605, 13_605, 0]))), 0, NODE_TIMEOUT_MS)
    gang = req("g", "interactive", model=SEVENTY_B.name, num_gpus=2)
    assert [p.gpu_indices for p in plan(view, [gang]).placed] == [(1, 2)]  # as it was
    refused = gang.model_copy(update={"attempt": 1, "refused": 1})
    assert not plan(view, [refused]).placed  # no room for shards of its own: it waits


async def test_an_interactive_request_past_its_guarantee_still_preempts_its_own_batch_work(
) -> None:
    """soylent's batch job S loaded the 8B (16,315 MiB, inside soylent's 20,000); soylent's
    interactive request would take soylent past it, so it counts as `borrowing`, and S is
    `_guarded`: it waits behind its own tenant's batch work. No loop is possible: S's
    hand-back may not preempt its own tenant's work, borrowed or not (`_victim_priority`),
    and the docs keep a tenant's batch work a victim of its own interactive work by class."""
    engine, sent = leading_engine()
    batch = req("S", "batch", model=EIGHT_B.name, tenant="soylent", max_tokens=7990)
    kv, weights = memory_per_gpu(batch, EIGHT_B)
    engine.view.apply_node_state(node("a", [300], models=(EIGHT_B.name,), active=("S#0",)),
                                 1000, NODE_TIMEOUT_MS)
    engine.running["S#0"] = _victim("S#0", batch, (0,), kv + weights, kv)
    await engine.admit([request_record(topics.REQUESTS["interactive"].name, 0, req(
        "I", "interactive", model=EIGHT_B.name, tenant="soylent", max_tokens=7990).to_bytes())])
    await engine.cycle()
    commands = [json.loads(v) for v in sent.get(topics.PLACEMENTS.name, [])]
    assert [(c["type"], c["placement_id"]) for c in commands] == [("preempt", "S#0")]


async def test_a_placement_counting_on_a_siblings_weights_keeps_them_reserved_once_it_goes(
) -> None:
    """x and y (8B, one cycle, one GPU): y reserves its KV cache alone, counting on x's
    weights. The agent took x (loading the 8B) and was restarted before it took y; its new
    run reports the GPU empty (x's weights went with the old process), and takes y now,
    loading the 8B again for it. The view has 15,316 MiB more free than the agent until
    that run lists y; a placement sent meanwhile on that memory is refused (`refused`
    used up). Before c52b501, y's own reservation held the weights."""
    engine, _ = leading_engine()
    x, y = await _two_placements_loading_the_8b(engine)
    w = EIGHT_B.weight_memory_mib
    engine.view.apply_node_state(node("a", [40_000 - w - x.kv_cache_mib], models=(
        EIGHT_B.name,), seq=2, active=("x#0",)), 1100, NODE_TIMEOUT_MS)  # run 1 took x only
    new_run = node("a", [40_000]).model_copy(update={"started_at_ms": 5_000,
                                                     "reported_at_ms": 5_000})
    assert engine.view.apply_node_state(new_run, 5_100, NODE_TIMEOUT_MS)
    # what the agent has free once it took y, as its next report will say
    assert snapshot(engine.view, {"a"}).state.gpu_mem_free_mib[0] == 40_000 - w - y.kv_cache_mib


def test_a_new_runs_report_from_before_an_ended_placements_end_keeps_its_reservation(
) -> None:
    """p was sent on run 1's reports; run 1 died, run 2 (started at 3,000) reported at
    3,100, then took p, loaded the 8B, and p ended at 3,500 before any report listed it.
    Its final usage was read before that 3,100 report (another topic): the report is of
    another run, so p's reservation went, though the report was stamped before p loaded
    anything; the 15 GB it left loaded show in no report yet."""
    view = ClusterView()
    run1 = node("a", [80_000]).model_copy(update={"started_at_ms": 1_000,
                                                  "reported_at_ms": 2_000})
    view.apply_node_state(run1, 2_000, NODE_TIMEOUT_MS)
    view.reserve(Reservation("p#0", "a", (0,), 15_316, EIGHT_B.name))
    view.release_ended("p#0", 3_500)
    assert view.reservations
    run2 = run1.model_copy(update={"started_at_ms": 3_000, "reported_at_ms": 3_100})
    assert view.apply_node_state(run2, 3_600, NODE_TIMEOUT_MS)
    assert view.reservations  # observed: released


H100_MIB = 81559


def _on_gpus(node_id: str, gpus: list[tuple[int, tuple[str, ...], tuple[str, ...]]],
             seq: int = 1, active: tuple[str, ...] = ()) -> NodeState:
    """H100s, each as (free MiB, loaded single-GPU models, those of them idle)."""
    return NodeState(node_id=node_id, seq=seq, started_at_ms=0, reported_at_ms=0,
                     active_placement_ids=active, gpus=tuple(
                         GpuState(index=i, uuid=f"{node_id}-{i}", gpu_type="H100-80GB",
                                  memory_total_mib=H100_MIB, memory_free_mib=free,
                                  loaded_models=models, idle_models=idle or None,
                                  kv_cache_free_mib=free + sum(
                                      CATALOG.get(m).weight_memory_mib for m in idle))
                         for i, (free, models, idle) in enumerate(gpus)))


def _eight_b(pid: str, gpu: int, placed_at_ms: int = 0, cls: str = "batch",
             aged: bool | None = None) -> RunningPlacement:
    request = req(pid.split("#")[0], cls, model=EIGHT_B.name, max_tokens=4000)
    kv = EIGHT_B.kv_cache_mib(request.prompt_token_count + 4000)
    return RunningPlacement(placement_id=pid, node_id="a", gpu_indices=(gpu,),
                            memory_mib_per_gpu=kv, kv_cache_mib=kv,
                            estimate_gpu_s=1.0, placed_at_ms=placed_at_ms, request=request,
                            aged=aged)


def test_an_interactive_gang_preempts_batch_work_whose_model_goes_idle_once_it_stops(
) -> None:
    """Plans counted a victim's KV cache alone as coming free: with batch 8B work on both
    GPUs of a node, the 8B's weights left no room for a 70B gang's shards, so the
    interactive gang waited for as long as the batch work ran, though the 8B goes idle
    once its work stops and the agent unloads idle models to admit work."""
    from gpusched_scheduler.domain.planner import Room

    victims = [_eight_b("b0#0", 0), _eight_b("b1#0", 1)]
    free = H100_MIB - EIGHT_B.weight_memory_mib - victims[0].kv_cache_mib
    view = ClusterView()
    view.apply_node_state(_on_gpus("a", [(free, (EIGHT_B.name,), ())] * 2,
                                   active=("b0#0", "b1#0")), 0, NODE_TIMEOUT_MS)
    gang = req("i", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    shard = -(-SEVENTY_B.weight_memory_mib // 2)
    assert free + victims[0].kv_cache_mib < shard  # their KV caches alone make no room
    d = plan(view, [gang], now=10_000, running=victims, may_preempt={"i": 1})
    [pre] = d.preemptions
    assert sorted(v.placement_id for v in pre.victims) == ["b0#0", "b1#0"]
    assert pre.room == Room("a", (0, 1))
    assert sorted(pre.unloads) == [(0, EIGHT_B.name, EIGHT_B.weight_memory_mib),
                                   (1, EIGHT_B.name, EIGHT_B.weight_memory_mib)]


@pytest.mark.parametrize("blocker", ["higher-class", "aged", "stopping"])
def test_weights_another_user_keeps_busy_are_not_counted_as_coming_free(blocker: str
                                                                         ) -> None:
    """GPU2's batch 8B work is the cheapest to stop, but another user of the 8B there
    (standard work, aged batch work, or a victim stopping for another request, whose
    preemptor may count on the 8B) keeps it loaded: the plan takes GPUs 0 and 1."""
    from gpusched_scheduler.domain.planner import Room

    victims = [_eight_b("b0#0", 0), _eight_b("b1#0", 1), _eight_b("b2#0", 2, 9_000)]
    other = _eight_b("o#0", 2, cls="standard" if blocker == "higher-class" else "batch",
                     aged=True if blocker == "aged" else None)
    kv = victims[0].kv_cache_mib
    view = ClusterView()
    view.apply_node_state(_on_gpus(
        "a", [(H100_MIB - EIGHT_B.weight_memory_mib - kv, (EIGHT_B.name,), ())] * 2
        + [(H100_MIB - EIGHT_B.weight_memory_mib - 2 * kv, (EIGHT_B.name,), ())],
        active=("b0#0", "b1#0", "b2#0", "o#0")), 0, NODE_TIMEOUT_MS)
    gang = req("i", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    items = [Pending(gang, {}, 10_000)]
    chunks = order_pending(items, 10_000, FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    d = plan_cycle(snapshot(view, view.live_nodes(10_000, 10**12)), chunks, CATALOG,
                   "gpusched", victims + ([] if blocker == "stopping" else [other]), 10_000,
                   {"i": 1}, fleet=fleet_of(view),
                   stopping=[other] if blocker == "stopping" else ())
    [pre] = d.preemptions
    assert sorted(v.placement_id for v in pre.victims) == ["b0#0", "b1#0"]
    assert pre.room == Room("a", (0, 1))


async def test_a_gang_preempting_work_whose_model_goes_idle_is_placed_once_it_stops() -> None:
    """End to end: the preempts go out, the victims' node reports them gone and the 8B
    idle, and the next cycle places the gang on those GPUs (the agent unloads the idle 8B
    to admit it: its reservation counts the 70B's shards, not the 8B), ahead of the
    victims' hand-backs."""
    now = [1000]
    engine, sent = leading_engine(lambda: now[0])
    engine.view.apply_node_state(_on_gpus("a", [(H100_MIB, (), ())] * 2), now[0],
                                 NODE_TIMEOUT_MS)

    def record(offset: int, r: InferenceRequest) -> ConsumerRecord:
        return request_record(topics.REQUESTS[r.priority_class].name, offset, r.to_bytes())

    batch = [InferenceRequest(request_id=f"b{k}", tenant="soylent", model=EIGHT_B.name,
                              prompt="x", max_tokens=8000, priority_class="batch",
                              created_at_ms=now[0]) for k in range(2)]
    await engine.admit([record(k, b) for k, b in enumerate(batch)])
    assert await engine.cycle() == 2

    def report(seq: int, ended: bool) -> NodeState:
        gpus = []
        for g in range(2):
            on = [r for r in engine.running.values() if r.gpu_indices == (g,)]
            kv = 0 if ended else sum(r.kv_cache_mib for r in on)
            models = (EIGHT_B.name,) if on else ()
            gpus.append((H100_MIB - kv - (EIGHT_B.weight_memory_mib if on else 0), models,
                         models if ended else ()))
        return _on_gpus("a", gpus, seq, () if ended else ("b0#0", "b1#0"))

    engine.view.apply_node_state(report(2, ended=False), now[0], NODE_TIMEOUT_MS)
    now[0] += 1000
    gang = InferenceRequest(request_id="i", tenant="globex", model=SEVENTY_B.name,
                            prompt="x", max_tokens=100, num_gpus=2,
                            priority_class="interactive", created_at_ms=now[0])
    await engine.admit([record(0, gang)])
    before = len(sent[topics.PLACEMENTS.name])
    await engine.cycle()
    preempts = [json.loads(v) for v in sent[topics.PLACEMENTS.name][before:]]
    assert sorted((c["type"], c["placement_id"]) for c in preempts) == [
        ("preempt", "b0#0"), ("preempt", "b1#0")]
    before = len(sent[topics.PLACEMENTS.name])
    await engine.cycle()  # still running: the gang waits, nothing else is sent
    assert len(sent[topics.PLACEMENTS.name]) == before

    now[0] += 50  # they stopped: their final usage, the report, and their hand-backs
    ended = report(3, ended=True)
    await engine.usage([request_record(topics.USAGE.name, k, UsageRecord(
        event_id=f"b{k}#0:final", request_id=f"b{k}", placement_id=f"b{k}#0",
        tenant="soylent", model=EIGHT_B.name, priority_class="batch", node_id="a",
        gpu_type="H100-80GB", prompt_tokens=1, completion_tokens=10, gpu_seconds=1.0,
        started_at_ms=1000, ended_at_ms=now[0]).to_bytes()) for k in range(2)])
    assert not engine.running
    engine.view.apply_node_state(ended, now[0], NODE_TIMEOUT_MS)
    await engine.admit([record(2 + k, b.model_copy(update={
        "attempt": 1, "requeued": "preempted"})) for k, b in enumerate(batch)])
    await engine.cycle()
    [placed] = [PLACEMENT.validate_json(v) for v in sent[topics.PLACEMENTS.name][before:]]
    assert (placed.placement_id, placed.gpu_indices) == ("i#0", (0, 1))
    shard = -(-SEVENTY_B.weight_memory_mib // 2)
    assert engine.view.reservations["i#0"].memory_mib_per_gpu == placed.kv_cache_mib + shard
    assert sorted(p.request.request_id for p in engine.queue.in_order()) == ["b0", "b1"]


def test_weights_work_placed_in_the_same_cycle_runs_on_are_not_counted_as_coming_free(
) -> None:
    """Interactive 8B work placed this cycle beside batch 8B work uses the 8B there: a
    gang planned after it does not count on unloading it."""
    victims = [_eight_b("b0#0", 0), _eight_b("b1#0", 1), _eight_b("b2#0", 2, 9_000)]
    free = H100_MIB - EIGHT_B.weight_memory_mib - victims[0].kv_cache_mib
    view = ClusterView()
    view.apply_node_state(_on_gpus("a", [(free, (EIGHT_B.name,), ())] * 3,
                                   active=("b0#0", "b1#0", "b2#0")), 0, NODE_TIMEOUT_MS)
    small = req("s", "interactive", model=EIGHT_B.name, tenant="globex", max_tokens=100)
    gang = req("i", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    d = plan(view, [small, gang], now=10_000, running=victims, may_preempt={"i": 1})
    [placed] = d.placed
    [pre] = d.preemptions
    assert placed.gpu_indices[0] not in pre.room.gpu_indices
    assert {g for g, _, _ in pre.unloads} == set(pre.room.gpu_indices)
    assert placed.gpu_indices[0] not in {v.gpu_indices[0] for v in pre.victims}


def _user(pid: str, gpu: int, model: str, kv: int, placed_at_ms: int = 0
          ) -> RunningPlacement:
    """Batch work of `model` on GPU `gpu` of node a, holding `kv` MiB of KV cache."""
    return _victim(pid, req(pid.split("#")[0], "batch", model=model), (gpu,), kv,
                   kv).model_copy(update={"placed_at_ms": placed_at_ms})


def test_a_gpu_that_needs_one_victims_kv_cache_does_not_lose_all_its_models_users() -> None:
    """A gang's plan unloads the 8B on GPU 1; on GPU 0 stopping q0 alone makes room. The
    plan took every user of the qwen there as one victim: q1 stopped for nothing, and the
    qwen was counted as unloading."""
    q0, q1 = _user("q0#0", 0, SMALL.name, 20_000), _user("q1#0", 0, SMALL.name, 1_000, 9_000)
    b1 = _user("b1#0", 1, EIGHT_B.name, 5_000)
    free0 = H100_MIB - SMALL.weight_memory_mib - q0.kv_cache_mib - q1.kv_cache_mib
    free1 = H100_MIB - EIGHT_B.weight_memory_mib - b1.kv_cache_mib
    view = ClusterView()
    view.apply_node_state(_on_gpus("a", [(free0, (SMALL.name,), ()),
                                         (free1, (EIGHT_B.name,), ())],
                                   active=("q0#0", "q1#0", "b1#0")), 0, NODE_TIMEOUT_MS)
    gang = req("i", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    kv, shard = -(-SEVENTY_B.kv_cache_mib(gang.prompt_token_count + 100) // 2), \
        -(-SEVENTY_B.weight_memory_mib // 2)
    assert free0 + q0.kv_cache_mib >= shard + kv  # stopping q0 makes room on GPU 0
    assert free0 + q1.kv_cache_mib < shard + kv
    assert free1 + b1.kv_cache_mib < shard + kv  # GPU 1 needs the 8B unloaded
    d = plan(view, [gang], now=10_000, running=[q0, q1, b1], may_preempt={"i": 1})
    [pre] = d.preemptions
    assert sorted(v.placement_id for v in pre.victims) == ["b1#0", "q0#0"]
    assert [g for g, _, _ in pre.unloads] == [1]


def test_weights_work_waiting_for_room_counts_on_are_not_counted_as_coming_free() -> None:
    """r1 waits for the room s's stop frees on GPU 0, where the 8B it runs on is loaded;
    the gang after it planned to stop u, the 8B's other user there, and unload the 8B, so
    r1 lost the place it waited for (and the gang took room r1 was first in line for)."""
    u, s = _user("u#0", 0, EIGHT_B.name, 1_000), _user("s#0", 0, SMALL.name, 62_294)
    t = _user("t#0", 1, SMALL.name, H100_MIB - SMALL.weight_memory_mib - 5)
    free0 = H100_MIB - EIGHT_B.weight_memory_mib - SMALL.weight_memory_mib - 1_000 - 62_294
    view = ClusterView()
    view.apply_node_state(_on_gpus("a", [(free0, (EIGHT_B.name, SMALL.name), ()),
                                         (5, (SMALL.name,), ())],
                                   active=("u#0", "s#0", "t#0")), 0, NODE_TIMEOUT_MS)
    r1 = req("r1", "interactive", model=EIGHT_B.name, max_tokens=100)
    gang = req("i", "interactive", model=SEVENTY_B.name, num_gpus=2, max_tokens=100)
    chunks = order_pending([Pending(r1, {}, 10_000), Pending(gang, {}, 10_000)], 10_000,
                           FairShare(), {}, TARGETS, 5.0, lambda p: 1.0)
    d = plan_cycle(snapshot(view, view.live_nodes(10_000, 10**12)), chunks, CATALOG,
                   "gpusched", [u], 10_000, {"r1": 1, "i": 1},
                   fleet=fleet_of(view), stopping=[s, t])
    assert [w.request.request_id for w in d.waiting] == ["r1", "i"] and not d.preemptions


def serving(state: NodeState, *models: str) -> NodeState:
    """`state` of a node whose agent runs only `models` (GPUSCHED_MODELS, or its server's)."""
    return state.model_copy(update={"models": models})


def test_a_change_of_a_nodes_models_alone_reaches_the_cached_snapshot() -> None:
    """The view's version of a node moved only when its GPUs changed: a node that came to
    serve another model kept its old solver types in the cycle's cached snapshot, and that
    model's work waited for ever."""
    view, cache = ClusterView(), NodeSpecCache()
    view.apply_node_state(serving(node("a", [80000]), SMALL.name), 0, NODE_TIMEOUT_MS)
    snapshot(view, view.live_nodes(0, 10_000), cache)
    view.apply_node_state(serving(node("a", [80000], seq=2), SMALL.name, "mistral-7b"), 0,
                          NODE_TIMEOUT_MS)
    snap = snapshot(view, view.live_nodes(0, 10_000), cache)
    chunks = order_pending([Pending(req("m", model="mistral-7b"), {}, 0)], 0, FairShare(), {},
                           TARGETS, 5.0, lambda p: 1.0)
    decisions = plan_cycle(snap, chunks, CATALOG, "gpusched", [], 0, {},
                           fleet=fleet_of(view))
    assert [p.node_id for p in decisions.placed] == ["a"]


def test_a_model_is_placed_only_on_nodes_that_serve_it() -> None:
    """Any catalog model went to any node; on a node whose inference server serves others
    the request failed (404, a 502 to the client) and the node stayed ready for more."""
    view = ClusterView()
    view.apply_node_state(serving(node("a", [80000, 80000]), "mistral-7b"), 0,
                          NODE_TIMEOUT_MS)
    view.apply_node_state(serving(node("b", [30000]), SMALL.name, "llama-3.1-8b"), 0,
                          NODE_TIMEOUT_MS)
    decisions = plan(view, [req(f"q{i}") for i in range(3)] + [req("m", model="mistral-7b"),
                                                               req("e", model="llama-3.1-8b")])
    assert sorted((p.item.request.request_id, p.node_id) for p in decisions.placed) == [
        ("e", "b"), ("m", "a"), ("q0", "b"), ("q1", "b"), ("q2", "b")]
    # more than b holds: the rest waits for b, not for a's free memory
    decisions = plan(view, [req(f"q{i}", max_tokens=30_000) for i in range(40)])
    assert {p.node_id for p in decisions.placed} == {"b"} and decisions.waiting
    assert not decisions.rejected


def test_preemption_picks_no_victims_on_a_node_that_does_not_serve_the_model() -> None:
    """Batch work on a node that serves only the 8B is no victim for an interactive
    request of another model: stopping it would free room the request cannot use."""
    view = ClusterView()
    view.apply_node_state(serving(node("a", [0], models=("llama-3.1-8b",)), "llama-3.1-8b"),
                          0, NODE_TIMEOUT_MS)
    view.apply_node_state(serving(node("b", [0]), SMALL.name), 0, NODE_TIMEOUT_MS)
    victims = [RunningPlacement(placement_id="v", node_id="a", gpu_indices=(0,),
                                memory_mib_per_gpu=40000, kv_cache_mib=40000,
                                estimate_gpu_s=1.0, placed_at_ms=0,
                                request=req("b", "batch", model="llama-3.1-8b"))]
    decisions = plan(view, [req("i", "interactive")], now=10_000, running=victims,
                     may_preempt={"i": 1})
    assert not decisions.preemptions and not decisions.placed
    assert [i.request.request_id for i in decisions.waiting] == ["i"]  # b frees up one day


def test_a_model_no_node_serves_is_rejected_saying_so() -> None:
    """It waited forever (no node would take it), or, where it fit no GPU either, was told
    to use fewer tokens. A node that serves it and is away (silent) keeps it waiting."""
    view = ClusterView()
    view.apply_node_state(serving(node("a", [80000]), "mistral-7b"), 0, NODE_TIMEOUT_MS)
    decisions = plan(view, [req("q"), req("m", model="mistral-7b")])
    assert [p.item.request.request_id for p in decisions.placed] == ["m"]
    [reject] = decisions.rejected
    assert reject.item.request.request_id == "q"
    assert reject.reason.startswith("no node of the fleet serves qwen2.5-1.5b")
    view.apply_node_state(serving(node("b", [80000]), SMALL.name), -20_000, NODE_TIMEOUT_MS)
    snap = snapshot(view, view.live_nodes(0, 10_000))
    assert "b" not in snap.node_index  # silent past the time-out
    assert out_of_reach(snap, fleet_gpu_mib(view, 0, STOPPED_GRACE_MS), CATALOG)(req("q"))
    decisions = plan(view, [req("q")])
    assert not decisions.rejected and [i.request.request_id for i in decisions.waiting] == ["q"]


def test_with_no_node_restricting_its_models_the_solver_input_is_unchanged() -> None:
    """Model sets cost nothing where no agent sets one: GPU type names and units' allowed
    types are those of before (any type)."""
    from gpusched_scheduler.domain.planner import _batch

    view = ClusterView()
    view.apply_node_state(node("a", [80000, 70000]), 0, NODE_TIMEOUT_MS)
    view.apply_node_state(node("b", [30000], models=(SMALL.name,)), 0, NODE_TIMEOUT_MS)
    snap = snapshot(view, view.live_nodes(0, 10_000))
    assert snap.state.type_names == ("H100-80GB",)
    batch = _batch([req("q"), req("m", model="mistral-7b")], CATALOG, snap.state.type_names)
    assert batch.type_sets == () and (batch.type_set == -1).all()
    view.apply_node_state(serving(node("b", [30000], seq=2), SMALL.name), 0, NODE_TIMEOUT_MS)
    restricted = snapshot(view, view.live_nodes(0, 10_000))
    assert restricted.state.type_names == ("H100-80GB", "H100-80GB|qwen2.5-1.5b")
    batch = _batch([req("q"), req("m", model="mistral-7b")], CATALOG,
                   restricted.state.type_names)
    assert [batch.type_sets[t] for t in batch.type_set] == [
        {"H100-80GB", "H100-80GB|qwen2.5-1.5b"}, {"H100-80GB"}]


async def test_retries_on_their_way_back_through_kafka_count_in_flight_for_their_tenant(
        ) -> None:
    """hooli (3 requests in flight at most) has 3 running when their node is lost: the
    retries leave `running` before they are read back. Before, 3 new requests were admitted
    meanwhile and hooli ran 6."""
    now = [1000]
    engine, sent = leading_engine(clock=lambda: now[0], node_timeout_ms=10_000)
    standard = topics.REQUESTS["standard"].name

    def body(request_id: str) -> bytes:
        return json.dumps({"request_id": request_id, "tenant": "hooli", "model": SMALL.name,
                           "prompt": "hi", "prompt_tokens": 1, "max_tokens": 9}).encode()

    engine.view.apply_node_state(node("n1", [80000]), now[0], 10_000)
    await engine.admit([request_record(standard, i, body(f"a{i}")) for i in range(3)])
    await engine.cycle()
    assert engine.running.count("hooli") == 3
    now[0] = 62_000  # n1 silent for a minute (the tokens-per-minute window is past too)
    engine.view.apply_node_state(node("n2", [80000]), now[0], 10_000)
    await engine.cycle()
    retries = [v for v in sent[standard]]
    assert len(retries) == 3 and not engine.running.count("hooli")
    await engine.admit([request_record(standard, 10 + i, body(f"b{i}")) for i in range(3)])
    refused = [RESULT_EVENT.validate_json(v) for v in sent.get(topics.RESULTS.name, [])]
    assert sorted(r.request_id for r in refused if r.status_code == 429) == ["b0", "b1", "b2"]
    # read back, the retries count as queued, and in transit no more
    await engine.admit([request_record(standard, 20 + i, v) for i, v in enumerate(retries)])
    assert engine.queue.by_tenant["hooli"] == 3 and not engine._in_transit("hooli", now[0])


def _app_without_kafka(monkeypatch: pytest.MonkeyPatch, consumer: type,  # noqa: ANN202
                       redis_url: str | None = None):
    """The scheduler's app with Kafka stubbed out (`consumer` stands in for each request
    consumer; the producer starts and stops, and a test stubs what it sends), its lease
    living 600 ms. Redis too, unless `redis_url` names a Redis of the test's own: the lease
    is held (token 7) and released at once, and Redis holds no placement in flight, claim
    or note of a 429."""
    import gpusched_scheduler.adapters.requests as requests_adapter
    import gpusched_scheduler.main as scheduler_main
    from gpusched_scheduler.adapters.decisions import DecisionProducer

    async def nothing(*args, **kwargs) -> list:
        return []

    class Broker:
        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    async def holds_the_lease(self) -> int:
        return 7

    async def no_claims(self, running) -> dict:
        return {}

    monkeypatch.setattr(requests_adapter, "AIOKafkaConsumer", consumer)
    monkeypatch.setattr(scheduler_main.topics, "ensure_topics", nothing)
    monkeypatch.setattr(scheduler_main, "warm_up", lambda policy: None)
    monkeypatch.setattr(scheduler_main, "make_broker", lambda *args, **kwargs: Broker())
    monkeypatch.setattr(scheduler_main.handlers, "register_cluster", lambda *args: None)
    monkeypatch.setattr(DecisionProducer, "start", nothing)
    monkeypatch.setattr(DecisionProducer, "stop", nothing)
    if redis_url is None:
        monkeypatch.setattr(LeaderLease, "acquire_or_renew", holds_the_lease)
        monkeypatch.setattr(LeaderLease, "release", nothing)
        monkeypatch.setattr(RunningStore, "load", nothing)
        monkeypatch.setattr(RunningStore, "over_quota", nothing)
        monkeypatch.setattr(RunningStore, "claims", no_claims)
    return scheduler_main.create_app(SchedulerSettings(
        telemetry=TelemetrySettings(otlp_endpoint=""),
        redis=RedisSettings(url=redis_url or "redis://127.0.0.1:1/0"), lease_ttl_ms=600))


class _IdleConsumer:
    """A request consumer that starts and reads nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    async def start(self) -> None:
        pass

    async def getmany(self, **kwargs) -> dict:
        await asyncio.sleep(0.05)
        return {}

    async def stop(self) -> None:
        pass


async def test_a_leader_whose_consumers_failed_to_start_tries_again_at_the_next_renewal(
        monkeypatch) -> None:
    """Kafka unreachable for a moment as this instance takes the lead: before, it led with
    no request consumer (the engine had its token, so no renewal tried again) and, renewing
    its lease, kept every standby out; no request was read until a restart."""
    from aiokafka.errors import KafkaConnectionError

    starts: list[str] = []

    class Consumer(_IdleConsumer):  # the first start fails, as against a broker not back yet
        async def start(self) -> None:
            starts.append("failed" if not starts else "ok")
            if starts[-1] == "failed":
                raise KafkaConnectionError("Unable to bootstrap")

    app = _app_without_kafka(monkeypatch, Consumer)
    async with app.router.lifespan_context(app):
        for _ in range(40):
            await asyncio.sleep(0.05)
            if "ok" in starts:
                break
    assert starts[0] == "failed" and "ok" in starts  # the next renewal led again


async def test_a_leader_whose_request_consumer_fails_steps_down_and_reads_again(
        monkeypatch) -> None:
    """A fetch that raised ended its consumer's task unseen: the instance led on, renewing
    its lease (no standby took over), and read no more requests of that class. Now the
    failure is logged, the instance steps down, and the next renewal leads again with new
    consumers."""
    from aiokafka.errors import KafkaError

    starts: list[str] = []
    fetches = 0

    class Consumer(_IdleConsumer):  # the interactive consumer's first fetch fails
        def __init__(self, topic: str, *args, **kwargs) -> None:
            self.topic = topic

        async def start(self) -> None:
            starts.append(self.topic)

        async def getmany(self, **kwargs) -> dict:
            nonlocal fetches
            if self.topic == topics.REQUESTS["interactive"].name:
                fetches += 1
                if fetches == 1:
                    raise KafkaError("fetch failed")
            return await super().getmany(**kwargs)

    app = _app_without_kafka(monkeypatch, Consumer)
    async with app.router.lifespan_context(app):
        for _ in range(60):
            await asyncio.sleep(0.05)
            if fetches >= 2 and app.state.engine.epoch is not None:
                break
        assert fetches >= 2 and app.state.engine.epoch == 7  # it reads on, leading again
    assert starts.count(topics.REQUESTS["interactive"].name) == 2  # a new consumer


async def test_a_request_consumer_failing_while_the_leader_stops_leaves_it_to_stop(
        monkeypatch) -> None:
    """A consumer that failed while the stopping leader's last cycles settled made it step
    down there: the renewals of the lease it still held then led again, starting consumers
    while it stopped, or, none coming, nothing released the lease and a standby waited out
    its time-to-live. Now it stays the leader until the shutdown steps down and lets the
    lease go."""
    from gpusched_scheduler.engine import SchedulingEngine

    shutting = asyncio.Event()
    starts: list[str] = []
    released: list[int] = []

    async def settles(self) -> None:  # the cycles sent take a while to be answered
        await shutting.wait()
        await asyncio.sleep(0.8)

    async def holds_the_lease(self) -> int:
        return 7

    async def release(self) -> None:
        released.append(7)

    class Consumer(_IdleConsumer):  # the interactive one fails once the leader stops
        def __init__(self, topic: str, *args, **kwargs) -> None:
            self.topic = topic

        async def start(self) -> None:
            starts.append(self.topic)

        async def getmany(self, **kwargs) -> dict:
            if shutting.is_set() and self.topic == topics.REQUESTS["interactive"].name:
                raise KafkaConnectionError("fetch failed")
            return await super().getmany(**kwargs)

    monkeypatch.setattr(SchedulingEngine, "run", settles)
    monkeypatch.setattr(SchedulingEngine, "stop", lambda self: shutting.set())
    app = _app_without_kafka(monkeypatch, Consumer)
    monkeypatch.setattr(LeaderLease, "renew", holds_the_lease)
    monkeypatch.setattr(LeaderLease, "release", release)
    async with app.router.lifespan_context(app):
        await asyncio.sleep(0.5)
        led_with = len(starts)
    assert led_with == len(topics.REQUESTS) and len(starts) == led_with  # none started since
    assert released == [7]


async def test_a_leader_shutting_down_saves_what_kafka_takes_before_it_lets_the_lease_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader stopped (a rolling update) while Kafka had not yet answered its last cycle,
    whose placement an agent may run already: it stepped down and released the lease at
    once, and the answer, coming after a standby took a newer token, saved nothing. That
    leader read the request again and placed it afresh, maybe on another node, whose agent
    ignored it as a duplicate: counted there, it was never retried when the node that ran
    it failed. Now the leader waits for the answer (at most settle_on_shutdown_s) and saves
    the placement under its token before letting the lease go."""
    from gpusched_common.kafka_records import wall_clock_ms
    from gpusched_scheduler.adapters.decisions import DecisionProducer

    events: list = []
    acks: list[asyncio.Future] = []

    async def send(self, batch) -> asyncio.Future:  # noqa: ANN001
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]

    async def save(self, placements, epoch: int) -> bool:  # noqa: ANN001
        events.append(("saved", [p.placement_id for p in placements], epoch))
        return True

    async def release(self) -> None:
        events.append("lease released")

    async def no_flags(self, tenants) -> dict:  # noqa: ANN001
        return {}

    monkeypatch.setattr(DecisionProducer, "send", send)  # before the engine takes it
    app = _app_without_kafka(monkeypatch, _IdleConsumer)
    monkeypatch.setattr(RunningStore, "save", save)
    monkeypatch.setattr(RunningStore, "spent_budgets", no_flags)
    monkeypatch.setattr(LeaderLease, "release", release)
    async with app.router.lifespan_context(app):
        engine: SchedulingEngine = app.state.engine
        for _ in range(40):
            if engine.epoch is not None:
                break
            await asyncio.sleep(0.05)
        engine.view.apply_node_state(node("n1", [80000]), wall_clock_ms(), NODE_TIMEOUT_MS)
        await engine.admit([_standard_record(7, "r1", created_at_ms=wall_clock_ms())],
                           Commits().commit)
        for _ in range(40):
            if acks:
                break
            await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_later(0.2, acks[0].set_result, None)
    await asyncio.sleep(0.3)
    assert events == [("saved", ["r1#0"], 7), "lease released"]


async def _until(done: Callable[[], object]) -> None:
    """Wait (2 s at most) until `done()` is true."""
    async with asyncio.timeout(2):
        while not done():
            await asyncio.sleep(0.02)


async def test_a_leader_shutting_down_lets_the_producer_take_its_cycle_and_saves_it(
        monkeypatch: pytest.MonkeyPatch, redis_url: str, redis: Redis) -> None:
    """Kafka slow: the producer had taken the first record of a cycle and waited for room
    in its batch for the others when the leader was stopped. Shutting down cancelled the
    cycle loop there, and the cycle, whose first placement went out, got no settle: saved
    nowhere, it ran while a next leader that did not know it placed its request again,
    maybe on another node. Now the cycle under way ends (within settle_on_shutdown_s) and
    settles, and its placements are saved under the leader's token, renewed meanwhile: a
    standby trying to take the lease all along takes it only after, and inherits them."""
    from gpusched_common.kafka_records import wall_clock_ms
    from gpusched_scheduler.adapters.decisions import DecisionProducer

    handed: list = []

    async def send(self, batch) -> asyncio.Future:  # noqa: ANN001
        for i, out in enumerate(batch):  # handed one by one, as DecisionProducer does
            handed.append(out.message)
            if i == 0 and len(batch) > 1:
                await asyncio.sleep(1.0)  # no room for the next: past the lease's 600 ms
        return asyncio.gather()

    monkeypatch.setattr(DecisionProducer, "send", send)  # before the engine takes it
    app = _app_without_kafka(monkeypatch, _IdleConsumer, redis_url)
    standby, tokens = LeaderLease(redis, "standby", 600), []

    async def take_the_lead() -> None:
        while (token := await standby.acquire_or_renew()) is None:
            await asyncio.sleep(0.05)
        tokens.append(token)

    async with app.router.lifespan_context(app):
        engine: SchedulingEngine = app.state.engine
        await _until(lambda: engine.epoch == 1)
        taking = asyncio.create_task(take_the_lead())
        engine.view.apply_node_state(node("n1", [80000]), wall_clock_ms(), NODE_TIMEOUT_MS)
        await engine.admit([_standard_record(7, "r1", created_at_ms=wall_clock_ms()),
                            _standard_record(8, "r2", created_at_ms=wall_clock_ms())],
                           Commits().commit)
        await _until(lambda: handed)
    await asyncio.wait_for(taking, 2)
    assert tokens == [2] and sorted(r.placement_id for r in await RunningStore(redis).load()) \
        == sorted(o.placement_id for o in handed if isinstance(o, Placement)) \
        == ["r1#0", "r2#0"]


async def test_an_instance_shutting_down_takes_no_free_lease(
        monkeypatch: pytest.MonkeyPatch, redis_url: str, redis: Redis) -> None:
    """A leader deposed (another instance took its lapsed lease) with a cycle Kafka had not
    answered, then stopped as that other instance died: while it waited for the answer,
    its renewals took the free lease under a newer token (which refuses the save of any
    cycle sent under the last), and it led again, starting its request consumers, as it
    stopped. Now it only renews a lease it holds: the free lease stays free, its token
    unchanged, for a standby to take."""
    from gpusched_common.kafka_records import wall_clock_ms
    from gpusched_scheduler.adapters.decisions import DecisionProducer

    acks: list[asyncio.Future] = []
    starts: list[int | None] = []

    async def send(self, batch) -> asyncio.Future:  # noqa: ANN001
        acks.append(asyncio.get_running_loop().create_future())
        return acks[-1]

    class Consumer(_IdleConsumer):
        async def start(self) -> None:
            starts.append(engine.epoch)

    monkeypatch.setattr(DecisionProducer, "send", send)  # before the engine takes it
    app = _app_without_kafka(monkeypatch, Consumer, redis_url)
    engine: SchedulingEngine = app.state.engine

    async def other_instance_dies() -> None:
        await asyncio.sleep(0.3)
        await redis.delete(LEADER_KEY)

    async with app.router.lifespan_context(app):
        await _until(lambda: engine.epoch == 1)
        engine.view.apply_node_state(node("n1", [80000]), wall_clock_ms(), NODE_TIMEOUT_MS)
        await engine.admit([_standard_record(7, "r1", created_at_ms=wall_clock_ms())],
                           Commits().commit)
        await _until(lambda: acks)
        async with redis.pipeline(transaction=True) as pipe:  # its lease lapsed (a stall),
            pipe.set(LEADER_KEY, "other", px=60_000)  # and another instance took it
            pipe.incr(SCHEDULER_EPOCH_KEY)
            await pipe.execute()
        await _until(lambda: engine.epoch is None)
        dying = asyncio.create_task(other_instance_dies())  # while this one stops
        asyncio.get_running_loop().call_later(1.0, acks[0].set_result, None)
    await dying
    assert set(starts) == {1} and int(await redis.get(SCHEDULER_EPOCH_KEY)) == 2
    assert await redis.get(LEADER_KEY) is None


async def test_a_shutdown_ends_the_lease_loop_though_a_renewal_swallowed_its_cancel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On Python 3.11, asyncio.wait_for, which redis-py writes a command under, swallows a
    cancel that comes as the write is done: the renewal returned, the lease loop renewed on,
    and the shutdown waited for it for good (renewing the lease all along, so no standby
    took over until the process was killed). Now the loop is cancelled again until it
    ends."""
    renewals: list[str] = []

    async def renew_swallowing_a_cancel(self) -> int:  # noqa: ANN001
        if renewals == ["took the lease"]:  # the next renewal answers as it is cancelled
            renewals.append("renewing")
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                renewals.append("cancel swallowed")
        else:
            renewals.append("took the lease" if not renewals else "renewed")
        return 7

    app = _app_without_kafka(monkeypatch, _IdleConsumer)
    monkeypatch.setattr(LeaderLease, "acquire_or_renew", renew_swallowing_a_cancel)
    monkeypatch.setattr(LeaderLease, "renew", renew_swallowing_a_cancel)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(3):  # (a cancel the shutdown swallows too ends its wait)
        async with app.router.lifespan_context(app):
            await _until(lambda: app.state.engine.epoch == 7 and "renewing" in renewals)
            stopping_at_s = loop.time()
    assert loop.time() - stopping_at_s < 1
    assert renewals[:3] == ["took the lease", "renewing", "cancel swallowed"]
