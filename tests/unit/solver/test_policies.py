"""Table-driven behaviour of each policy and of the reason codes on tiny clusters."""

from __future__ import annotations

import numpy as np
import pytest

from gpusched_scheduler.domain.solver import (
    POLICIES,
    ClusterState,
    GpuSpec,
    NodeSpec,
    Placed,
    Reason,
    ShapeDistribution,
    SolverSession,
    Unschedulable,
    WorkBatch,
    get_policy,
    lookahead_order,
    solve,
)
from gpusched_scheduler.domain.solver.solve import MAX_TYPICAL_SHAPES, group_rows


def cluster(*nodes: tuple[int, list[int]], gpu_type: str = "T4", mem: int = 16000,
            cpu: int = 32000) -> ClusterState:
    """Nodes given as (cpu_free or None, [milli free per GPU])."""
    return ClusterState.from_nodes(
        NodeSpec(f"node-{i}", c if c is not None else cpu, 65536,
                 tuple(GpuSpec(gpu_type, m, mem) for m in gpus),
                 cpu_total_milli=cpu, memory_total_mib=65536)
        for i, (c, gpus) in enumerate(nodes)
    )


def one(num_gpu=1, gpu_milli=500, cpu=1000, mem=1024, **kw) -> WorkBatch:
    return WorkBatch.from_units(num_gpu=[num_gpu], gpu_milli=[gpu_milli], cpu_milli=[cpu],
                                mem_mib=[mem], **{k: [v] for k, v in kw.items()})


@pytest.mark.parametrize(
    "policy, expected_node, expected_gpu",
    [
        ("first-fit", 0, 0),  # lowest index that fits
        ("best-fit", 1, 1),  # tightest node, tightest GPU (600 free)
        ("gpu-packing", 1, 1),  # partially used GPU first
        ("fgd", 1, 1),  # filling the 600 GPU leaves least unusable share
        ("gpusched", 1, 1),
    ],
)
def test_sharing_unit_choice(policy, expected_node, expected_gpu):
    state = cluster((None, [1000, 1000]), (None, [1000, 600]))
    workload = WorkBatch.from_units(num_gpu=[1, 1, 1], gpu_milli=[1000, 1000, 500],
                                    cpu_milli=[1000] * 3, mem_mib=[1024] * 3)
    res = solve(state, one(gpu_milli=500), policy,
                shapes=ShapeDistribution.from_batch(workload))
    out = res.outcome(0)
    assert isinstance(out, Placed)
    assert (out.node_index, out.gpu_indices) == (expected_node, (expected_gpu,))


@pytest.mark.parametrize("policy, expected_gpu", [("best-fit", 0), ("gpusched", 1)])
def test_gpusched_pairs_shares_the_way_the_workload_packs(policy, expected_gpu):
    """A 320 next to a 470 strands 210 that this workload never uses; next to another 320
    it leaves room for a third (320+320+320 is part of the workload's best packing)."""
    state = cluster((None, [530, 680]))  # a 470 and a 320 already placed
    workload = WorkBatch.from_units(num_gpu=[1] * 4, gpu_milli=[650, 470, 320, 320],
                                    cpu_milli=[1000] * 4, mem_mib=[1024] * 4)
    res = solve(state, one(gpu_milli=320), policy,
                shapes=ShapeDistribution.from_batch(workload))
    assert res.outcome(0).gpu_indices == (expected_gpu,)


def test_whole_gpu_unit_needs_a_fully_free_gpu():
    state = cluster((None, [999, 999]), (None, [999, 1000]))
    res = solve(state, one(gpu_milli=1000), "first-fit")
    assert res.outcome(0) == Placed(0, 1, "node-1", (1,))


def test_gang_is_all_or_nothing_on_one_node():
    state = cluster((None, [1000, 1000]), (None, [1000, 1000]))
    res = solve(state, one(num_gpu=3, gpu_milli=1000), "first-fit")
    out = res.outcome(0)
    assert isinstance(out, Unschedulable) and out.reason == Reason.GANG_TOO_LARGE
    assert res.state.gpu_milli_free.tolist() == [1000] * 4


def test_type_constraint():
    state = ClusterState.from_nodes([
        NodeSpec("a", 8000, 8000, (GpuSpec("T4", 1000, 16000),)),
        NodeSpec("b", 8000, 8000, (GpuSpec("A100", 1000, 80000),)),
    ])
    res = solve(state, one(gpu_milli=1000, allowed_gpu_types=["A100"]), "first-fit")
    assert res.outcome(0).node_id == "b"
    res = solve(state, one(allowed_gpu_types=["H100"]), "first-fit")
    assert res.outcome(0).reason == Reason.NO_ALLOWED_GPU_TYPE


@pytest.mark.parametrize("policy", ["best-fit", "gpusched"])
def test_a_cluster_without_nodes_places_nothing_and_says_why(policy):
    batch = WorkBatch.from_units(num_gpu=[1, 0], gpu_milli=[500, 0], cpu_milli=[1000, 1000],
                                 mem_mib=[1024, 1024])
    empty = ClusterState.from_nodes([])
    for res in (solve(empty, batch, policy),
                SolverSession(policy, ShapeDistribution.from_batch(batch)).solve(empty, batch)):
        assert [res.outcome(u).reason for u in range(2)] == [
            Reason.NO_ALLOWED_GPU_TYPE, Reason.INSUFFICIENT_CPU_MEMORY]


def test_model_weight_charged_only_where_not_loaded():
    state = ClusterState.from_nodes([
        NodeSpec("cold", 8000, 8000, (GpuSpec("T4", 1000, 10000),)),
        NodeSpec("warm", 8000, 8000, (GpuSpec("T4", 1000, 10000, loaded_models=("llama",)),)),
    ])
    unit = one(gpu_milli=300, gpu_mem_mib=2000, model_id="llama", model_weight_mib=7000)
    res = solve(state, unit, "gpusched")
    assert res.outcome(0).node_id == "warm"  # affinity bonus and no load needed
    assert res.state.gpu_mem_free_mib.tolist() == [10000, 8000]
    cold = solve(state, unit, "first-fit")  # first-fit ignores affinity: pays the load
    assert cold.outcome(0).node_id == "cold"
    assert cold.state.gpu_mem_free_mib.tolist() == [1000, 10000]
    assert "llama" in cold.state.model_names
    too_big = one(gpu_milli=300, gpu_mem_mib=4000, model_id="other",
                  model_weight_mib=7000)
    assert solve(state, too_big, "first-fit").outcome(0).reason == (
        Reason.INSUFFICIENT_GPU_MEMORY)


@pytest.mark.parametrize(
    "unit, reason",
    [
        (one(num_gpu=9, gpu_milli=1000), Reason.INVALID_REQUEST),
        (one(num_gpu=1, gpu_milli=0), Reason.INVALID_REQUEST),
        (one(cpu=10**9), Reason.INSUFFICIENT_CPU_MEMORY),
        (one(gpu_milli=1000), Reason.INSUFFICIENT_GPU_SHARE),
    ],
)
def test_reasons(unit, reason):
    state = cluster((None, [400, 900]))
    out = solve(state, unit, "best-fit").outcome(0)
    assert isinstance(out, Unschedulable) and out.reason == reason and out.message


def test_cpu_only_units_and_unknown_policy():
    state = cluster((4000, [1000]), (32000, [1000]))
    res = solve(state, one(num_gpu=0, gpu_milli=0, cpu=8000), "first-fit")
    assert res.outcome(0).node_id == "node-1"
    with pytest.raises(ValueError, match="unknown placement policy"):
        get_policy("worst-fit")
    assert set(POLICIES) >= {"first-fit", "best-fit", "dot-product", "gpu-packing", "fgd",
                             "gpusched"}


def test_gpusched_keeps_cpu_rich_nodes_for_cpu_heavy_work():
    """A CPU-only unit goes where it strands the least GPU share (the CPU-rich node)."""
    state = ClusterState.from_nodes([
        NodeSpec("gpu-dense", 16000, 65536, tuple(GpuSpec("G", 1000, 0) for _ in range(8)),
                 ),
        NodeSpec("cpu-rich", 96000, 65536, (GpuSpec("G", 1000, 0),)),
    ])
    workload = WorkBatch.from_units(num_gpu=[1] * 9 + [0], gpu_milli=[1000] * 9 + [0],
                                    cpu_milli=[2000] * 9 + [12000], mem_mib=[0] * 10)
    shapes = ShapeDistribution.from_batch(workload)
    res = solve(state, one(num_gpu=0, gpu_milli=0, cpu=12000, mem=0), "gpusched",
                shapes=shapes)
    assert res.outcome(0).node_id == "cpu-rich"


def test_gpusched_puts_cpu_only_work_where_gpus_need_the_cpu_least():
    """Beside busy GPUs a core costs no GPU anything; beside free ones it may strand them."""
    state = ClusterState.from_nodes([
        NodeSpec("roomy-but-free-gpus", 64000, 65536,
                 tuple(GpuSpec("G", 1000, 0) for _ in range(8))),
        NodeSpec("busy-gpus", 16000, 65536, tuple(GpuSpec("G", 0, 0) for _ in range(8))),
    ])
    res = solve(state, one(num_gpu=0, gpu_milli=0, cpu=4000, mem=0), "gpusched")
    assert res.outcome(0).node_id == "busy-gpus"


def test_gpusched_holds_the_last_wholly_free_node_for_the_largest_gang():
    """A unit that is not the workload's largest gang avoids the last node whose GPUs are
    all free while another node fits it, even where its score prefers that node; it goes
    there when nothing else fits."""
    workload = WorkBatch.from_units(num_gpu=[1, 1, 2], gpu_milli=[300, 1000, 1000],
                                    cpu_milli=[1000] * 3, mem_mib=[0] * 3)
    shapes = ShapeDistribution.from_batch(workload, coverage=1.0)
    no_gang = ShapeDistribution.from_batch(workload.take([0, 1]), coverage=1.0)
    share = one(gpu_milli=300, cpu=1000, mem=0)
    # node-0 is short of CPU: a share there strands GPU, so the score prefers node-1
    state = cluster((2000, [1000, 700]), (None, [1000, 1000]))
    assert solve(state, share, "gpusched", shapes=no_gang).node.tolist() == [1]
    assert solve(state, share, "gpusched", shapes=shapes).node.tolist() == [0]
    # only the held node has the CPU: it is used
    assert solve(state, one(gpu_milli=300, cpu=3000, mem=0), "gpusched",
                 shapes=shapes).node.tolist() == [1]
    # two wholly free nodes: neither is the last one, the score decides
    roomy = cluster((2000, [1000, 700]), (None, [1000, 1000]), (None, [1000, 1000]))
    assert solve(roomy, share, "gpusched", shapes=shapes).node.tolist() == [1]


def _gang_workload(gang_milli: int = 1000, gang_types=None) -> ShapeDistribution:
    return ShapeDistribution.from_batch(WorkBatch.from_units(
        num_gpu=[1, 1, 2], gpu_milli=[300, 1000, gang_milli], cpu_milli=[1000] * 3,
        mem_mib=[0] * 3, allowed_gpu_types=[None, None, gang_types]), coverage=1.0)


def test_gpusched_holds_a_node_only_where_the_unit_would_leave_the_gang_no_room():
    """The node is held for the gang as it asks (share, memory, type, CPU): a gang of
    shares that still fits beside the unit holds nothing (the live scheduler's requests
    share GPUs by memory: an idle node with their model loaded stays theirs), nor does a
    gang whose GPU type the node lacks."""
    share = one(gpu_milli=300, cpu=1000, mem=0)
    # node-0 has no room for two GPUs of 300 or of 1000; node-1 for both
    state = cluster((2000, [1000, 200]), (None, [1000, 1000]))
    assert solve(state, share, "gpusched", shapes=_gang_workload()).node.tolist() == [0]
    assert solve(state, share, "gpusched",
                 shapes=_gang_workload(gang_milli=300)).node.tolist() == [1]
    # the gang runs on A100s only: this T4 node is not held for it (as without a gang)
    state = cluster((2000, [1000, 700]), (None, [1000, 1000]))
    assert solve(state, share, "gpusched", shapes=_gang_workload()).node.tolist() == [0]
    assert solve(state, share, "gpusched",
                 shapes=_gang_workload(gang_types=["A100"])).node.tolist() == [1]


def test_gpusched_online_places_the_late_gang_of_the_small_optimality_instance():
    """``rand-12u-4x4-s0`` (bench: distance to optimal) ends with a 4-GPU gang; before the
    held node its CPU-heavy sharing units had broken all four nodes by then."""
    from gpusched_scheduler.bench.optimal import random_instance

    inst = random_instance(0, n_units=12, n_nodes=4, gpus_per_node=4)
    res = solve(inst.state(), inst.batch, "gpusched")
    assert res.placed.all()
    # a gang shape larger than any node (8 GPUs) is not held for: the 4-GPU one still is
    b = inst.batch
    sample = WorkBatch.from_units(num_gpu=[*b.num_gpu, 8], gpu_milli=[*b.gpu_milli, 1000],
                                  cpu_milli=[*b.cpu_milli, 8], mem_mib=[*b.mem_mib, 0])
    res = solve(inst.state(), b, "gpusched", shapes=ShapeDistribution.from_batch(sample))
    assert res.placed.all()


def test_lookahead_places_big_units_first_but_reports_in_batch_order():
    state = cluster((None, [1000, 1000]))
    batch = WorkBatch.from_units(num_gpu=[1, 1, 2], gpu_milli=[500, 500, 1000],
                                 cpu_milli=[0, 0, 0], mem_mib=[0, 0, 0])
    online = solve(state, batch, "first-fit")
    assert online.node.tolist() == [0, 0, -1]  # the gang arrives too late
    batched = solve(state, batch, "first-fit", lookahead=True)
    assert batched.node.tolist() == [-1, -1, 0]
    assert np.all(batched.gpus[2, :2] == [0, 1])


def test_gpusched_lookahead_moves_only_gangs_forward():
    """Prices assume units keep coming in the workload's mix: look-ahead keeps the batch
    order except for gangs, which go first, largest first."""
    batch = WorkBatch.from_units(num_gpu=[1, 1, 2, 0, 4, 1], gpu_milli=[320, 810, 1000, 0,
                                 1000, 1000], cpu_milli=[9, 1, 1, 9, 1, 1], mem_mib=[0] * 6)
    assert get_policy("gpusched").lookahead == "gangs-first"
    assert lookahead_order(batch, "gangs-first").tolist() == [4, 2, 0, 1, 3, 5]
    assert lookahead_order(batch).tolist() == [4, 2, 5, 1, 0, 3]  # biggest-first


def _group_rows_by_sorting(cols):
    """Plain NumPy grouping: equal rows via a lexsort, ids renumbered by first row."""
    keys = np.stack(cols, axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    gid = rank[inverse.reshape(-1)]
    return gid, np.bincount(gid)


@pytest.mark.parametrize("seed", range(6))
def test_group_rows_matches_a_sorting_grouping(seed):
    """Hash grouping: same groups and numbering as sorting, also for negative values and
    values that differ only in their high bits (a weak hash would chain those)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    distinct = int(rng.integers(1, n + 1))
    base = rng.integers(-3, 4, size=(distinct, 4)) * (1 << int(rng.integers(0, 40)))
    rows = base[rng.integers(0, distinct, size=n)]
    cols = tuple(np.ascontiguousarray(rows[:, j]) for j in range(rows.shape[1]))
    gid, counts = group_rows(np.stack(cols, axis=1))
    want_gid, want_counts = _group_rows_by_sorting(cols)
    assert gid.tolist() == want_gid.tolist()
    assert counts.tolist() == want_counts.tolist()


def test_typical_shapes_are_capped_most_frequent_first():
    """A batch of mostly one-off shapes would otherwise keep nearly all of them, and FGD's
    cost per scored node grows with their number."""
    cpu = np.concatenate([np.full(50, 7), np.full(30, 5), np.arange(1000, 1900)])
    batch = WorkBatch.from_units(num_gpu=np.ones(len(cpu), np.int64),
                                 gpu_milli=np.full(len(cpu), 500), cpu_milli=cpu,
                                 mem_mib=np.zeros(len(cpu), np.int64))
    assert len(ShapeDistribution.from_batch(batch, max_shapes=10_000).count) > 800
    assert len(ShapeDistribution.from_batch(batch).count) == MAX_TYPICAL_SHAPES
    capped = ShapeDistribution.from_batch(batch, max_shapes=4)
    assert capped.count.tolist()[:2] == [50, 30] and len(capped.count) == 4
    assert capped.cpu_milli.tolist()[:2] == [7, 5]
