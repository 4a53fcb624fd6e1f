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
    assert row.shapes_ms > 0  # building the shapes the solves are handed, timed apart


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


def _write_tiny_traces(folder, pod_list: str = "default") -> None:
    (folder / "openb_node_list_gpu_node.csv").write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        "n0,32000,131072,4,G2\nn1,32000,131072,4,G2\nn2,16000,65536,2,T4\n")
    (folder / f"openb_pod_list_{pod_list}.csv").write_text(
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


def test_without_default_throughput_takes_the_first_pod_lists_shapes_and_json_keeps_parts(
        tmp_path, monkeypatch, capsys):
    """A traces folder without ``default`` once crashed the throughput part after the
    replay, and the JSON, written only at the end, lost every result. Now the shapes come
    from the run's first pod list (said in the output), and the JSON is written after each
    part, so a later part that fails keeps the earlier ones."""
    _write_tiny_traces(tmp_path, pod_list="tiny")
    row = throughput.ThroughputRow("gpusched", "arrival", 4096, 1000, 1.0, 1.0, 1.0, 1.0,
                                   1.0, 100.0, 1.0, 1, 1.0)
    monkeypatch.setattr(throughput, "measure", lambda *a, **k: row)  # the grid, not timing

    def fails(*_a, **_k):
        raise RuntimeError("a later part fails")

    monkeypatch.setattr(bench_solver, "run_first_placement", fails)
    out = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        bench_solver.main(["--traces", str(tmp_path), "--quick", "--seeds", "1",
                           "--policies", "fgd", "--skip", "optimal", "--json", str(out)])
    assert "tiny's shapes" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["trace"] for r in result["openb"]] == ["tiny"]
    assert result["throughput_pod_list"] == "tiny" and len(result["throughput"]) == 4
    assert "seconds" not in result  # the run did not finish


def test_small_instances_without_an_optimum_stay_out_of_the_large_column(tmp_path,
                                                                           monkeypatch):
    """Without OR-Tools (or when CP-SAT finds nothing in time) the small instances once
    landed in the "large: used/LB" column because they had no optimum."""
    monkeypatch.setattr(optimal, "cp_sat_optimum", lambda inst, time_limit_s=10.0: (None, False))
    out = tmp_path / "out.json"
    assert bench_solver.main(["--traces", str(tmp_path), "--quick", "--skip",
                              "openb,throughput,first", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for a in result["optimal_summary"]:
        rows = [r for r in result["optimal"] if (r["policy"], r["mode"]) == (a["policy"],
                                                                             a["mode"])]
        large = [r for r in rows if r["n_units"] == optimal.LARGE_UNITS]
        assert len(large) < len(rows)
        assert a["small_used"] is None and a["small_gap_pct"] is None
        if all(r["gpus_used"] is not None for r in large):
            assert a["large_used"] == sum(r["gpus_used"] for r in large)
            assert a["large_lb"] == sum(r["lower_bound"] for r in large)
    # no optimum: only a mode that left units unplaced has a (missed) target
    assert all(t["value"] is None and not t["ok"] for t in result.get("targets", []))


def _row(instance: str, n_units: int, mode: str, used: int | None, unplaced: int,
         optimum: int | None, lower_bound: int) -> optimal.OptimalityRow:
    return optimal.OptimalityRow(instance, n_units, "gpusched", mode, used, unplaced, optimum,
                                 optimum is not None, lower_bound, None)


def test_optimum_target_names_each_mode_and_misses_when_units_are_left_unplaced(
        tmp_path, monkeypatch, capsys):
    """The target once took the best of the two modes and dropped the online row that
    left a unit unplaced, reporting ok; each mode is now its own target, and unplaced
    units are a miss with their count."""
    rows = [_row("s0", 12, "online", None, 1, 10, 9), _row("s1", 12, "online", 12, 0, 12, 12),
            _row("s0", 12, "lookahead", 10, 0, 10, 9),
            _row("s1", 12, "lookahead", 12, 0, 12, 12),
            _row("l0", 400, "online", 100, 0, None, 98),
            _row("l0", 400, "lookahead", 101, 0, None, 98)]
    monkeypatch.setattr(optimal, "run", lambda policies, quick: (rows, 0.0))
    out = tmp_path / "out.json"
    assert bench_solver.main(["--traces", str(tmp_path), "--skip", "openb,throughput,first",
                              "--json", str(out)]) == 0
    targets = {t["row"]["mode"]: t for t in json.loads(out.read_text())["targets"]}
    assert targets["online"]["ok"] is False and targets["online"]["unplaced_units"] == 1
    assert targets["lookahead"]["ok"] is True and targets["lookahead"]["value"] == 0.0
    printed = capsys.readouterr().out
    assert ("[MISS] gpusched online within 3% of the optimum on the small instances: "
            "1 unit(s) left unplaced") in printed
    assert "[ok] gpusched lookahead within 3% of the optimum on the small instances: 0.0" \
        in printed
    summary = {a["mode"]: a for a in json.loads(out.read_text())["optimal_summary"]
               if a["policy"] == "gpusched"}
    assert (summary["online"]["large_used"], summary["online"]["large_lb"]) == (100, 98)


@pytest.mark.parametrize("argv, says", [
    (["--seeds", "0"], "argument --seeds: '0': Input should be greater than or equal to 1"),
    (["--seeds", "nan"], "argument --seeds: 'nan': Input should be a valid integer"),
    (["--lookahead-seeds", "-1"], "argument --lookahead-seeds: '-1': Input should be greater "
     "than or equal to 0"),
    (["--skip", "throughputs"], "unknown part(s) throughputs"),
    (["--policies", "fgd,gpushed"], "unknown policy gpushed"),
    (["--pod-lists", "default,defualt"], "for defualt; the pod lists there are default"),
])
def test_bench_cli_refuses_unknown_names_and_counts_before_any_work(
        tmp_path, monkeypatch, capsys, argv, says):
    """``--seeds 0`` once ran 10 seeds, an unknown ``--skip`` part was ignored, and an
    unknown policy or pod list ended in a traceback (a policy only after the valid ones
    had run). Now each exits 2 with one line naming it, before anything runs."""
    _write_tiny_traces(tmp_path)

    def no_work(*_a, **_k):
        raise AssertionError("work started before the arguments were checked")

    for part in ("run_openb", "run_throughput", "run_first_placement", "run_optimal"):
        monkeypatch.setattr(bench_solver, part, no_work)
    with pytest.raises(SystemExit) as exit_:
        bench_solver.main(["--traces", str(tmp_path), "--json", str(tmp_path / "o.json")]
                          + argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpusched bench solver: error: ") and says in err[-1]
    assert not (tmp_path / "o.json").exists()


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
