"""The Numba kernels make exactly the decisions of the plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched_scheduler.domain.solver import (
    POLICIES,
    ClusterState,
    GpuSpec,
    NodeSpec,
    ShapeDistribution,
    WorkBatch,
    solve,
)
from gpusched_scheduler.domain.solver.reference import reference_solve

from .conftest import batches, clusters, gpus_st

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", sorted(POLICIES))
@SETTINGS
@given(state=clusters(), batch=batches(), lookahead=st.booleans())
def test_kernel_matches_reference(policy, state, batch, lookahead):
    fast = solve(state, batch, policy, lookahead=lookahead)
    slow = reference_solve(state, batch, policy, lookahead=lookahead)
    np.testing.assert_array_equal(fast.node, slow.node)
    np.testing.assert_array_equal(fast.gpus, slow.gpus)
    np.testing.assert_array_equal(fast.reason, slow.reason)
    for name in ("node_cpu_free_milli", "node_mem_free_mib", "gpu_milli_free",
                 "gpu_mem_free_mib", "gpu_models"):
        np.testing.assert_array_equal(getattr(fast.state, name), getattr(slow.state, name))


@pytest.mark.parametrize("policy", ["fgd", "gpusched"])
@SETTINGS
@given(state=clusters(), batch=batches(max_units=12), shape_source=batches(max_units=12))
def test_kernel_matches_reference_with_foreign_shapes(policy, state, batch, shape_source):
    """Shape weights from another sample of the workload (as the live scheduler passes)."""
    shapes = ShapeDistribution.from_batch(shape_source, coverage=1.0, with_memory=True)
    fast = solve(state, batch, policy, shapes=shapes)
    slow = reference_solve(state, batch, policy, shapes=shapes)
    np.testing.assert_array_equal(fast.node, slow.node)
    np.testing.assert_array_equal(fast.gpus, slow.gpus)


@SETTINGS
@given(state=clusters(max_nodes=6), batch=batches(max_units=30))
def test_cached_scores_match_full_scan(state, batch):
    """Repeated shapes go through the per-shape tournament trees; same answers as a scan."""
    from gpusched_scheduler.domain.solver import solve as solve_mod

    rep = batch.take(np.repeat(np.arange(len(batch)), 3))  # every shape at least 3 times
    cached = solve(state, rep, "gpusched")
    old = solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"]
    solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"] = 0
    try:
        scanned = solve(state, rep, "gpusched")
    finally:
        solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"] = old
    np.testing.assert_array_equal(cached.node, scanned.node)
    np.testing.assert_array_equal(cached.gpus, scanned.gpus)



@st.composite
def repeated_clusters(draw, max_nodes: int = 3, max_copies: int = 4) -> ClusterState:
    """A few drawn nodes, each repeated: groups of equal nodes with several members."""
    specs = []
    for _ in range(draw(st.integers(1, max_nodes))):
        gpus = tuple(draw(st.lists(gpus_st, max_size=4)))
        cpu = draw(st.integers(0, 8))
        mem = draw(st.integers(0, 8))
        specs.append((gpus, cpu, mem))
    copies = draw(st.integers(1, max_copies))
    nodes = [
        NodeSpec(f"n{i}-{c}", cpu, mem, gpus, cpu_total_milli=8, memory_total_mib=8)
        for c in range(copies)
        for i, (gpus, cpu, mem) in enumerate(specs)
    ]
    return ClusterState.from_nodes(nodes, model_slots=3)


@pytest.mark.parametrize("policy", ["fgd", "gpusched"])
@SETTINGS
@given(state=repeated_clusters(), batch=batches(max_units=10), seed=st.integers(0, 2**16))
def test_single_gpu_fast_path_matches_reference(policy, state, batch, seed):
    """Single-GPU units take the batched scorer (cached slots, groups of equal nodes, lazy
    rescoring of changed nodes); repeated units and nodes exercise all three."""
    one = np.flatnonzero(batch.num_gpu == 1)
    if len(one) == 0:
        return
    rng = np.random.default_rng(seed)
    units = batch.take(one[rng.integers(len(one), size=3 * len(one))])
    fast = solve(state, units, policy)
    slow = reference_solve(state, units, policy)
    np.testing.assert_array_equal(fast.node, slow.node)
    np.testing.assert_array_equal(fast.gpus, slow.gpus)


@st.composite
def gang_clusters(draw, max_nodes: int = 4) -> ClusterState:
    """Nodes of 2-4 GPUs, most of them wholly free: few enough that gpusched's held node
    (the last one wholly free for the workload's largest gang) comes into play."""
    fresh = st.builds(GpuSpec, type_name=st.just("A"),
                      milli_free=st.sampled_from([1000, 1000, 1000, 500]),
                      memory_free_mib=st.just(16), memory_total_mib=st.none(),
                      healthy=st.sampled_from([True, True, True, False]))
    nodes = [
        NodeSpec(f"n{i}", draw(st.integers(2, 8)), 8,
                 tuple(draw(st.lists(fresh, min_size=2, max_size=4))),
                 cpu_total_milli=8, memory_total_mib=8)
        for i in range(draw(st.integers(2, max_nodes)))
    ]
    return ClusterState.from_nodes(nodes, model_slots=3)


@settings(SETTINGS, max_examples=150)
@given(state=gang_clusters(), batch=batches(max_units=10), gang=st.integers(2, 5),
       gang_milli=st.sampled_from([1000, 1000, 500, 250]),
       gang_types=st.sampled_from([None, ["A"], ["B"]]),
       seed=st.integers(0, 2**16), scanned=st.booleans())
def test_held_node_matches_reference(state, batch, gang, gang_milli, gang_types, seed,
                                     scanned):
    """The held node, through the cached trees and a one-slot cache: units in random order,
    repeated, with a gang of ``gang`` GPUs (whole or shared, typed or not; 5 fits no node)
    in the workload's shapes."""
    from gpusched_scheduler.domain.solver import solve as solve_mod

    sample = WorkBatch.from_units(num_gpu=[*batch.num_gpu, gang],
                                  gpu_milli=[*batch.gpu_milli, gang_milli],
                                  cpu_milli=[*batch.cpu_milli, 1], mem_mib=[*batch.mem_mib, 0],
                                  allowed_gpu_types=[None] * len(batch) + [gang_types])
    shapes = ShapeDistribution.from_batch(sample, coverage=1.0)
    rng = np.random.default_rng(seed)
    units = batch.take(rng.integers(len(batch), size=3 * len(batch)))
    old = solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"]
    if scanned:
        solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"] = 0
    try:
        fast = solve(state, units, "gpusched", shapes=shapes)
    finally:
        solve_mod.__globals__["SHAPE_CACHE_BUDGET_BYTES"] = old
    slow = reference_solve(state, units, "gpusched", shapes=shapes)
    np.testing.assert_array_equal(fast.node, slow.node)
    np.testing.assert_array_equal(fast.gpus, slow.gpus)
