"""Preemption plans are valid (lower priority, one node, the unit then fits) and as cheap
as a brute-force search over every victim subset."""

from __future__ import annotations

import numpy as np
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

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(state=clusters(max_nodes=3), running_req=batches(max_units=8),
       incoming=batches(max_units=1), costs=st.lists(st.integers(0, 50), min_size=10,
                                                       max_size=10))
def test_plan_is_valid_and_cheapest(state, running_req, incoming, costs):
    placed = solve(state, running_req, "first-fit")
    keep = np.flatnonzero(placed.node >= 0)
    running = RunningWork(
        batch=running_req.take(keep),
        node=placed.node[keep],
        gpus=placed.gpus[keep],
        gpu_seconds_lost=np.array(costs[: len(keep)], np.float64),
    )
    now = placed.state
    unit = WorkBatch.from_units(
        num_gpu=incoming.num_gpu, gpu_milli=incoming.gpu_milli, cpu_milli=incoming.cpu_milli,
        mem_mib=incoming.mem_mib, priority=[3],
    )
    if solve(now, unit, "first-fit").node[0] >= 0:
        return  # fits without preemption
    plan = plan_preemption(now, running, unit)
    oracle = reference_plan(now, running, unit)
    assert plan.feasible == oracle.feasible
    if not plan.feasible:
        assert plan.message
        return
    assert plan.gpu_seconds_lost == oracle.gpu_seconds_lost
    assert len(plan.victims) == len(oracle.victims)
    victims = np.array(plan.victims, np.int64)
    assert np.all(running.node[victims] == plan.node)
    assert np.all(running.batch.priority[victims] < 3)
    freed = release(now, running.batch.take(victims), running.node[victims],
                    running.gpus[victims])
    assert solve(freed, unit, "first-fit").node[0] == plan.node


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
