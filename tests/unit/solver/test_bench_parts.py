"""The benchmark's parts on tiny inputs (no ../shared needed): throughput rows, the
distance-to-optimal rows and lower bound, the cluster/batch builders, and the openb
replay's seeds on a three-node trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpusched_scheduler.bench import openb, optimal, throughput
from gpusched_scheduler.bench import solver as bench_solver
from gpusched_scheduler.bench.openb import NodeList, PodList


def _tiny_trace() -> tuple[NodeList, PodList]:
    nodes = NodeList(("a", "b"), np.array([32000, 96000]), np.array([65536, 262144]),
                     np.array([2, 8]), ("T4", "G2"))
    pods = PodList("tiny", ("p0", "p1", "p2"), np.array([4000, 8000, 2000]),
                   np.array([8192, 16384, 4096]), np.array([1, 1, 0]),
                   np.array([500, 1000, 0]), ("", "", ""))
    return nodes, pods


def test_cluster_of_hits_the_gpu_count_and_batch_fills_about_90_percent():
    nodes, pods = _tiny_trace()
    state = throughput.cluster_of(nodes, 37)
    assert state.num_gpus == 37
    batch = throughput.single_gpu_batch(pods, 200, 37, seed=0)
    assert np.all(batch.num_gpu == 1)
    assert batch.gpu_milli.sum() <= 0.9 * 37 * 1000 + 200


def test_measure_reports_rates_latency_and_memory():
    nodes, pods = _tiny_trace()
    state = throughput.cluster_of(nodes, 20)
    batch = throughput.single_gpu_batch(pods, 50, 20, seed=1)
    row = throughput.measure("gpusched", state, batch, repeats=2, reference_budget_s=0.01,
                             lookahead=True)
    assert row.numba_per_s > 0 and row.reference_per_s > 0 and row.peak_mib > 0
    assert row.p99_ms >= row.p50_ms and row.order == "lookahead"


def test_optimality_rows_and_lower_bound():
    inst = optimal.random_instance(0, n_units=6, n_nodes=3, gpus_per_node=2)
    lb = optimal.lower_bound(inst)
    rows = optimal.evaluate(inst, ["first-fit", "gpusched"], exact=False, time_limit_s=0)
    assert len(rows) == 4
    for r in rows:
        assert r.gpus_used is None or r.gpus_used >= lb


def test_share_patterns_are_maximal_fills_of_one_gpu():
    pats = optimal.share_patterns([600, 300, 150])
    assert (1, 1, 0) in pats and (0, 3, 0) in pats and (0, 0, 6) in pats
    for counts in pats:
        used = 600 * counts[0] + 300 * counts[1] + 150 * counts[2]
        assert used <= 1000 and 1000 - used < 150  # nothing else fits


def test_prefix_bound_stops_where_the_shares_no_longer_fit():
    pytest.importorskip("ortools")
    # 3 GPUs: the 1000 and two 600s take all three; the third 600 would need a fourth
    b = optimal.prefix_bound(np.array([1, 1, 1, 1]), np.array([1000, 600, 600, 600]), 3)
    assert b == optimal.PrefixBound(prefix_len=3, unalloc_gpus=0.8)
    # 4 GPUs: 700 + 300 share one, so all four requests fit (a 2-GPU gang last)
    b = optimal.prefix_bound(np.array([1, 1, 1, 2]), np.array([700, 300, 600, 1000]), 4)
    assert b == optimal.PrefixBound(prefix_len=4, unalloc_gpus=0.4)


def test_packing_gap_compares_the_gpus_used_with_the_lp_for_the_same_pods():
    pytest.importorskip("ortools")
    # three 500s on three GPUs (the LP needs 1.5); whole-GPU pods are left out
    used, lp = optimal.packing_gap(np.array([1, 1, 1, 1]), np.array([500, 500, 500, 1000]),
                                   np.array([[0], [1], [2], [3]]))
    assert used == 3 and lp == pytest.approx(1.5)


def _write_tiny_traces(folder) -> None:
    (folder / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        "n0,32000,131072,4,G2\nn1,32000,131072,4,G2\nn2,16000,65536,2,T4\n")
    (folder / "openb_pod_list_default.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "p0,4000,8192,1,1000,\np1,2000,4096,1,470,\np2,2000,4096,1,320,\n"
        "p3,8000,16384,2,1000,\np4,1000,2048,0,0,\n")
    (folder / "fgd_reference.csv").write_text(
        "workload,policy,n_seeds,alloc_pct_at_100,alloc_pct_at_130,"
        "unalloc_gpus_at_130_of_6212\nopenb_pod_list_default,06-FGD,10,90,92,1\n")


@pytest.mark.parametrize("extra, lookahead_seeds", [([], [0, 1, 2]),
                                                    (["--lookahead-seeds", "1"], [0])])
def test_lookahead_rows_run_on_the_online_rows_seeds_unless_told_fewer(
        tmp_path, extra, lookahead_seeds):
    """Look-ahead rows sit next to the online rows in the table, so by default they
    average the same seeds (they once ran on 2 seeds against 10 and misled)."""
    _write_tiny_traces(tmp_path)
    out = tmp_path / "out.json"
    assert bench_solver.main(["--traces", str(tmp_path), "--seeds", "3",
                              "--policies", "gpusched", "--skip", "throughput,first,optimal",
                              "--json", str(out)] + extra) == 0
    result = json.loads(out.read_text())
    assert sorted({r["seed"] for r in result["openb"]}) == [0, 1, 2]
    for mode in ("batch16", "batch64"):
        assert sorted(r["seed"] for r in result["openb_lookahead"]
                      if r["mode"] == mode) == lookahead_seeds


def test_unallocated_gpus_come_exactly_from_the_integer_milli_gpu():
    """``unalloc_gpus_130`` once went through the float percentage and was rounded to 0.1
    (474.7 for an exact 474.75); it is now the integer milli-GPU left free, over 1000."""
    nodes = NodeList(("a", "b"), np.array([64000, 64000]), np.array([262144, 262144]),
                     np.array([4, 2]), ("G", "G"))
    pods = PodList("t", ("p0", "p1", "p2"), np.full(3, 1000), np.full(3, 1024),
                   np.array([1, 1, 2]), np.array([350, 650, 1000]), ("", "", ""))
    r = openb.replay(nodes, pods, "best-fit", seed=1)
    allocated = int((pods.gpu_request_milli[r.sequence] * (r.node >= 0)).sum())
    assert allocated == 3950  # 6 GPUs, 2.05 free: the old float path gave 2.0
    assert r.unalloc_gpus_130 == 2.05 and r.alloc_pct_130 == round(100 * 3950 / 6000, 3)
