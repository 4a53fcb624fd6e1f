"""Preemption plans are valid (lower priority, one node, the unit then fits) and as cheap
as a brute-force search over every victim subset."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched_scheduler.domain.solver import (
    ClusterState,
    GpuSpec,
    NodeSpec,
    RunningWork,
    WorkBatch,
    plan_preemption,
    release,
    solve,
)
from gpusched_scheduler.domain.solver.preemption import reference_plan

from .conftest import batches, clusters

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(state=clusters(max_nodes=3), running_req=batches(max_units=10),
       incoming=batches(max_units=1),
       costs=st.lists(st.integers(0, 50), min_size=10, max_size=10),
       tenths=st.booleans(),
       priorities=st.lists(st.integers(0, 4), min_size=10, max_size=10))
def test_plan_is_valid_and_cheapest(state, running_req, incoming, costs, tenths, priorities):
    """Against the brute force: units with GPU memory, models and type limits; victims of
    lower, equal and higher class; costs in whole GPU-seconds or tenths (sums that floats
    round differently by order)."""
    placed = solve(state, running_req, "first-fit")
    keep = np.flatnonzero(placed.node >= 0)
    batch = running_req.take(keep)
    batch = replace(batch, priority=np.array(priorities[: len(keep)], np.int64))
    lost = np.array(costs[: len(keep)], np.float64) / (10.0 if tenths else 1.0)
    running = RunningWork(batch=batch, node=placed.node[keep], gpus=placed.gpus[keep],
                          gpu_seconds_lost=lost)
    now = placed.state
    unit = replace(incoming, priority=np.array([3], np.int64))
    if solve(now, unit, "first-fit").node[0] >= 0:
        return  # fits without preemption
    plan = plan_preemption(now, running, unit)
    oracle = reference_plan(now, running, unit)
    assert plan.feasible == oracle.feasible
    if not plan.feasible:
        assert plan.message
        return
    assert plan.proven_optimal
    assert plan.gpu_seconds_lost == oracle.gpu_seconds_lost
    assert len(plan.victims) == len(oracle.victims)
    assert plan.node == oracle.node  # cost, then victims, then the lower node
    victims = np.array(plan.victims, np.int64)
    assert np.all(running.node[victims] == plan.node)
    assert np.all(running.batch.priority[victims] < 3)
    freed = release(now, running.batch.take(victims), running.node[victims],
                    running.gpus[victims])
    assert solve(freed, unit, "first-fit").node[0] == plan.node


def _shared_gpu_node(n_gpus: int = 2, mem: int = 16000) -> ClusterState:
    return ClusterState.from_nodes([
        NodeSpec("a", 64000, 65536, tuple(GpuSpec("T4", 1000, mem) for _ in range(n_gpus))),
    ])


def test_many_cheap_victims_do_not_hide_one_dearer_victim_that_frees_a_gpu_alone():
    """20 requests of 50 milli-GPU cost 1 each on GPU 0, one whole-GPU request costs 5 on
    GPU 1: the greedy plan (cheapest first) stops the 20 (cost 20); the search stops one."""
    state = _shared_gpu_node()
    req = WorkBatch.from_units(num_gpu=[1] * 21, gpu_milli=[50] * 20 + [1000],
                               cpu_milli=[0] * 21, mem_mib=[0] * 21, priority=[0] * 21)
    placed = solve(state, req, "first-fit")
    assert placed.placed.all() and set(placed.gpus[:20, 0]) == {0}
    running = RunningWork(req, placed.node, placed.gpus, np.array([1.0] * 20 + [5.0]))
    whole = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                 priority=[1])
    plan = plan_preemption(placed.state, running, whole)
    assert plan.victims == (20,) and plan.gpu_seconds_lost == 5.0 and plan.proven_optimal


def test_equal_costs_tie_exactly_and_the_fewest_victims_win():
    """0.1 + 0.2 + 0.7 is 0.9999999999999999 in floats, below 1.0: three victims were
    stopped where one of the same cost does."""
    state = _shared_gpu_node()
    req = WorkBatch.from_units(num_gpu=[1] * 4, gpu_milli=[300, 300, 400, 1000],
                               cpu_milli=[0] * 4, mem_mib=[0] * 4, priority=[0] * 4)
    placed = solve(state, req, "first-fit")
    assert placed.gpus[:3, 0].tolist() == [0, 0, 0] and placed.gpus[3, 0] == 1
    running = RunningWork(req, placed.node, placed.gpus, np.array([0.1, 0.2, 0.7, 1.0]))
    whole = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                 priority=[1])
    plan = plan_preemption(placed.state, running, whole)
    assert plan.victims == (3,) and plan.gpu_seconds_lost == 1.0


def test_a_gang_that_needs_every_victim_of_many_nodes_is_planned_in_few_steps():
    """200 nodes of 8 GPUs, two requests holding memory on each GPU, an 8-GPU gang that
    needs both gone from every GPU of a node: the old exhaustive search looked at 2^16
    subsets per node (seconds on the scheduler's event loop); the search's bounds cut every
    branch that leaves a needed victim, so it takes a few steps per node."""
    nodes = [NodeSpec(f"n{i}", 64000, 65536, tuple(GpuSpec("H100", 1, 2048) for _ in range(8)))
             for i in range(200)]
    state = ClusterState.from_nodes(nodes)
    n_run = 200 * 16
    req = WorkBatch.from_units(num_gpu=[1] * n_run, gpu_milli=[0] * n_run,
                               cpu_milli=[0] * n_run, mem_mib=[0] * n_run,
                               gpu_mem_mib=[1024] * n_run, priority=[0] * n_run)
    node = np.repeat(np.arange(200), 16)
    gpus = np.full((n_run, 8), -1, np.int64)
    gpus[:, 0] = node * 8 + np.tile(np.repeat(np.arange(8), 2), 200)
    lost = 1.0 + (np.arange(n_run) % 7) / 10
    busy = replace(state, gpu_mem_free_mib=np.zeros(state.num_gpus, np.int64))
    gang = WorkBatch.from_units(num_gpu=[8], gpu_milli=[1], cpu_milli=[0], mem_mib=[0],
                                gpu_mem_mib=[2048], priority=[1])
    plan = plan_preemption(busy, RunningWork(req, node, gpus, lost), gang)
    assert plan.feasible and plan.proven_optimal and len(plan.victims) == 16
    assert plan.steps < 200 * 16 * 4


def test_a_search_cut_short_returns_a_valid_plan_no_worse_than_greedy(monkeypatch):
    """Past its step budget the search stops and says so; its plan stays valid."""
    from gpusched_scheduler.domain.solver import preemption

    state = _shared_gpu_node()
    req = WorkBatch.from_units(num_gpu=[1] * 21, gpu_milli=[50] * 20 + [1000],
                               cpu_milli=[0] * 21, mem_mib=[0] * 21, priority=[0] * 21)
    placed = solve(state, req, "first-fit")
    costs = np.array([1.0 + i / 100 for i in range(20)] + [5.0])  # no two alike
    running = RunningWork(req, placed.node, placed.gpus, costs)
    whole = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                 priority=[1])
    monkeypatch.setattr(preemption, "SEARCH_BUDGET", 3)
    plan = plan_preemption(placed.state, running, whole)
    assert plan.feasible and not plan.proven_optimal
    victims = np.array(plan.victims, np.int64)
    freed = release(placed.state, req.take(victims), placed.node[victims],
                    placed.gpus[victims])
    assert solve(freed, whole, "first-fit").node[0] == 0
    assert plan.gpu_seconds_lost <= float(costs[:20].sum())  # the greedy plan's


def _hard_and_easy_nodes(hard_first: bool):
    """Node "hard": one GPU, 40 small requests whose costs follow their memory (the
    dominance rule prunes nothing); node "easy": twenty requests of cost 1.0 on GPU 0 and
    one of 1.01 holding GPU 1. A request needing 1,000 MiB: easy's greedy plan stops the
    twenty (20.0), hard's about 10, the optimum is easy's one request (1.01)."""
    rng = np.random.default_rng(0)
    names = ["hard", "easy"] if hard_first else ["easy", "hard"]
    state = ClusterState.from_nodes([
        NodeSpec(name, 10**6, 10**6, tuple(GpuSpec("T", 1000, 0)
                                           for _ in range(1 if name == "hard" else 2)))
        for name in names])
    hard, easy = names.index("hard"), names.index("easy")
    h0, e0 = int(state.node_gpu_start[hard]), int(state.node_gpu_start[easy])
    mem_hard = rng.integers(20, 40, 40)
    rows = [h0] * 40 + [e0] * 20 + [e0 + 1]
    gpus = np.full((len(rows), 8), -1, np.int64)
    gpus[:, 0] = rows
    cost = [*(mem_hard * 0.01 + np.arange(40) * 1e-5).round(6), *[1.0] * 20, 1.01]
    n = len(rows)
    running = RunningWork(
        WorkBatch.from_units([1] * n, [1] * n, [0] * n, [0] * n,
                             gpu_mem_mib=[*mem_hard, *[50] * 20, 1000], priority=[0] * n),
        np.array([hard] * 40 + [easy] * 21), gpus, np.array(cost))
    unit = WorkBatch.from_units([1], [1], [0], [0], gpu_mem_mib=[1000], priority=[1])
    return state, running, unit, easy


@pytest.mark.parametrize("hard_first", [False, True])
def test_one_hard_node_does_not_spend_the_search_budget_of_the_others(hard_first):
    """The step budget was shared in node order: with the hard node first it spent all of
    it, and the easy node kept its greedy plan (about 10x the optimum, depending on nothing
    but the node order). Each node now gets a fair share of the steps left."""
    state, running, unit, easy = _hard_and_easy_nodes(hard_first)
    plan = plan_preemption(state, running, unit)
    assert plan.node == easy and plan.victims == (60,) and plan.gpu_seconds_lost == 1.01


@pytest.mark.parametrize("lost, index, says", [
    ([float("nan")], 0, "row 0 is nan"),
    ([-1.0], 0, "row 0 is -1.0"),
    ([1e13], 0, "row 0 is 10000000000000.0"),  # overflowed to a negative cost
    ([1.0], 1, "index 1 is outside"),
])
def test_bad_costs_and_indexes_are_refused_with_a_reason(lost, index, says):
    state = _shared_gpu_node(n_gpus=1)
    req = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                               priority=[0])
    placed = solve(state, req, "first-fit")
    whole = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                 priority=[1])
    with pytest.raises(ValueError, match=says):
        plan_preemption(placed.state, RunningWork(req, placed.node, placed.gpus,
                                                  np.array(lost)), whole, index)


def test_table_cheapest_victims_and_no_plan():
    state = ClusterState.from_nodes([
        NodeSpec("a", 32000, 65536, (GpuSpec("T4", 1000, 16000), GpuSpec("T4", 1000, 16000))),
    ])
    running_req = WorkBatch.from_units(num_gpu=[1, 1, 1], gpu_milli=[1000, 500, 500],
                                       cpu_milli=[0, 0, 0], mem_mib=[0, 0, 0],
                                       priority=[0, 0, 5])
    placed = solve(state, running_req, "first-fit")
    assert placed.placed.all()
    running = RunningWork(running_req, placed.node, placed.gpus,
                          np.array([100.0, 30.0, 1.0]))
    whole = WorkBatch.from_units(num_gpu=[1], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                 priority=[1])
    plan = plan_preemption(placed.state, running, whole)
    # only unit 0 frees a whole GPU by itself (unit 2 outranks the newcomer)
    assert plan.feasible and plan.victims == (0,) and plan.gpu_seconds_lost == 100.0
    gang = WorkBatch.from_units(num_gpu=[2], gpu_milli=[1000], cpu_milli=[0], mem_mib=[0],
                                priority=[1])
    assert not plan_preemption(placed.state, running, gang).feasible
