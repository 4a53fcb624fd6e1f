"""Whatever the policy: never over-commit, gangs stay on one node, types and whole GPUs are
respected, and apply/release keep the state's accounting straight."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched_scheduler.domain.solver import POLICIES, Reason, apply, release, solve

from .conftest import batches, clusters

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _check_placements(state, batch, res):
    after = res.state
    cpu = state.node_cpu_free_milli.copy()
    mem = state.node_mem_free_mib.copy()
    milli = state.gpu_milli_free.copy()
    start = state.node_gpu_start
    for u in range(len(batch)):
        n = int(res.node[u])
        gpus = [int(g) for g in res.gpus[u] if g >= 0]
        if n < 0:
            assert res.reason[u] != Reason.PLACED and not gpus
            continue
        assert res.reason[u] == Reason.PLACED
        k = int(batch.num_gpu[u])
        assert len(gpus) == k and len(set(gpus)) == k, "gang gets distinct GPUs"
        assert all(start[n] <= g < start[n + 1] for g in gpus), "gang on one node"
        for g in gpus:
            assert state.gpu_healthy[g]
            if batch.type_set[u] >= 0:
                allowed = batch.type_sets[batch.type_set[u]]
                assert state.type_names[state.gpu_type[g]] in allowed
            if batch.gpu_milli[u] == 1000:
                assert milli[g] == 1000, "whole-GPU units need fully free GPUs"
            milli[g] -= batch.gpu_milli[u]
        cpu[n] -= batch.cpu_milli[u]
        mem[n] -= batch.mem_mib[u]
    np.testing.assert_array_equal(after.node_cpu_free_milli, cpu)
    np.testing.assert_array_equal(after.node_mem_free_mib, mem)
    np.testing.assert_array_equal(after.gpu_milli_free, milli)
    for name in ("node_cpu_free_milli", "node_mem_free_mib", "gpu_milli_free",
                 "gpu_mem_free_mib"):
        a, b = getattr(after, name), getattr(state, name)
        assert np.all((a >= 0) | (a >= b)), f"{name} over-committed"


@pytest.mark.parametrize("policy", sorted(POLICIES))
@SETTINGS
@given(state=clusters(), batch=batches(max_units=10), lookahead=st.booleans())
def test_never_overcommits_and_respects_constraints(policy, state, batch, lookahead):
    before = state.copy()
    res = solve(state, batch, policy, lookahead=lookahead)
    for name in ("node_cpu_free_milli", "gpu_milli_free", "gpu_mem_free_mib", "gpu_models"):
        np.testing.assert_array_equal(getattr(state, name), getattr(before, name))  # untouched
    _check_placements(state, batch, res)


@SETTINGS
@given(state=clusters(), batch=batches(max_units=10))
def test_release_after_solve_restores_free_capacity(state, batch):
    res = solve(state, batch, "gpusched")
    back = release(res.state, batch, res.node, res.gpus)
    np.testing.assert_array_equal(back.node_cpu_free_milli, state.node_cpu_free_milli)
    np.testing.assert_array_equal(back.node_mem_free_mib, state.node_mem_free_mib)
    np.testing.assert_array_equal(back.gpu_milli_free, state.gpu_milli_free)
    # model weights stay charged while the model stays loaded
    assert np.all(back.gpu_mem_free_mib <= state.gpu_mem_free_mib)


@SETTINGS
@given(state=clusters(), batch=batches(max_units=10))
def test_apply_replays_solve_exactly(state, batch):
    res = solve(state, batch, "best-fit")
    replayed = apply(state, batch, res.node, res.gpus)
    for name in ("node_cpu_free_milli", "node_mem_free_mib", "gpu_milli_free",
                 "gpu_mem_free_mib", "gpu_models"):
        np.testing.assert_array_equal(getattr(replayed, name), getattr(res.state, name))


@SETTINGS
@given(state=clusters(), first=batches(max_units=6), second=batches(max_units=6))
def test_incremental_solves_equal_one_solve(state, first, second):
    """Solving micro-batch by micro-batch on the returned state equals one big batch."""
    from gpusched_scheduler.domain.solver import WorkBatch

    both = WorkBatch.from_units(
        num_gpu=np.concatenate([first.num_gpu, second.num_gpu]),
        gpu_milli=np.concatenate([first.gpu_milli, second.gpu_milli]),
        cpu_milli=np.concatenate([first.cpu_milli, second.cpu_milli]),
        mem_mib=np.concatenate([first.mem_mib, second.mem_mib]),
    )
    a = both.take(slice(0, len(first)))
    b = both.take(slice(len(first), None))
    r1 = solve(state, a, "best-fit")
    r2 = solve(r1.state, b, "best-fit")
    r = solve(state, both, "best-fit")
    np.testing.assert_array_equal(np.concatenate([r1.node, r2.node]), r.node)
    np.testing.assert_array_equal(r2.state.gpu_milli_free, r.state.gpu_milli_free)
