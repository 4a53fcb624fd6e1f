"""``gpusched bench solver``: openb replay vs published FGD numbers, throughput vs the
pure-Python reference, and distance to optimal. Prints tables; ``--json``/``--dump`` files.

Run as ``python -m gpusched_scheduler.bench.solver [--quick] [--json PATH] [--dump DIR]
[--traces DIR]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field

from gpusched_common.bench_options import Count, option
from gpusched_scheduler.domain.solver import POLICIES

from . import openb, optimal, throughput


def _default_traces() -> Path:
    """``../shared/data/openb`` beside the repository root (source checkout), else beside
    the working directory."""
    here = Path(__file__).resolve()
    for root in (here.parents[5] if len(here.parents) > 5 else None, Path.cwd()):
        if root is not None:
            cand = root.parent / "shared" / "data" / "openb"
            if cand.exists():
                return cand
    return Path.cwd().parent / "shared" / "data" / "openb"


DEFAULT_TRACES = _default_traces()

PUBLISHED_POLICY = {
    "01-Random": "random",
    "02-DotProd": "dot-product",
    "03-GpuClustering": "gpu-clustering",
    "04-GpuPacking": "gpu-packing",
    "05-BestFit": "best-fit",
    "06-FGD": "fgd",
}
BEST_POLICY = "gpusched"
LOOKAHEAD_BATCHES = (16, 64)
PARTS = ("openb", "throughput", "first", "optimal")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpusched bench solver", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="a run under 60 s: default pod list, 2 seeds, small throughput grid")
    p.add_argument("--json", type=Path, metavar="PATH", help="write all results as JSON")
    p.add_argument("--dump", type=Path, metavar="DIR",
                   help="write one CSV of placements per (policy, pod list, seed)")
    p.add_argument("--traces", type=Path, default=DEFAULT_TRACES, metavar="DIR",
                   help=f"folder with the openb node list and pod lists (default {DEFAULT_TRACES})")
    p.add_argument("--seeds", type=option(Count), default=None,
                   help="seeds per pod list (default 10, quick 2)")
    p.add_argument("--lookahead-seeds", type=option(Annotated[int, Field(ge=0)]), default=None,
                   help="seeds for the look-ahead (batch16/batch64) rows (default: as many "
                   "as --seeds, so they compare with the online rows); only pod lists with "
                   "published numbers")
    p.add_argument("--pod-lists", default=None,
                   help="comma-separated pod lists (default: every openb_pod_list_*.csv; "
                   "quick: default)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policies to replay")
    p.add_argument("--node-order", choices=openb.NODE_ORDERS, default="file",
                   help="node order of the openb replay (ties go to the lowest index): the "
                   "node list's, or a permutation drawn from each seed as the paper's "
                   "artifact does")
    p.add_argument("--skip", default="",
                   help=f"comma-separated parts to skip: {','.join(PARTS)}")
    return p


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace
             ) -> tuple[set[str], list[str], int]:
    """The parts to skip, the pod lists to replay and the seeds per pod list, every name
    checked before any work (the counts are checked by their types, as they are read): a
    typo once ran silently (``--seeds 0`` as 10 seeds, an unknown ``--skip`` part ignored)
    or ended in a traceback after the valid policies had run. Exits 2 with a one-line
    message (``parser.error``)."""
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(PARTS):
        parser.error(f"--skip: unknown part(s) {','.join(sorted(skip - set(PARTS)))}; "
                     f"the parts are {','.join(PARTS)}")
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown policy {','.join(unknown)}; the policies are "
                     f"{','.join(POLICIES)}")
    available = openb.pod_list_names(args.traces)
    names = available
    if args.pod_lists:
        names = args.pod_lists.split(",")
    elif args.quick:
        names = ["default"] if "default" in available else available[:1]
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 10)
    if not (args.traces / openb.NODE_LIST).exists() or {"openb", "throughput"} <= skip:
        return skip, names, seeds  # no pod list is read (main says why when traces lack)
    if not available:
        parser.error(f"no {openb.POD_PREFIX}*.csv in {args.traces}: pass --traces DIR with "
                     "the openb pod lists, or --skip openb,throughput")
    missing = [n for n in names if n not in available]
    if missing:
        parser.error(f"--pod-lists: no {openb.POD_PREFIX}<name>.csv in {args.traces} for "
                     f"{','.join(missing)}; the pod lists there are {','.join(available)}")
    return skip, names, seeds


def load_published(traces: Path) -> dict[tuple[str, str], dict]:
    path = traces / "fgd_reference.csv"
    out: dict[tuple[str, str], dict] = {}
    if not path.exists():
        return out
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            trace = r["workload"].removeprefix(openb.POD_PREFIX)
            out[(trace, PUBLISHED_POLICY.get(r["policy"], r["policy"]))] = {
                "alloc_pct_100": float(r["alloc_pct_at_100"]),
                "alloc_pct_130": float(r["alloc_pct_at_130"]),
                "unalloc_gpus_130": float(r["unalloc_gpus_at_130_of_6212"]),
            }
    return out


def dump_csv(path: Path, nodes: openb.NodeList, pods: openb.PodList, r: openb.ReplayResult,
             gpu_start: np.ndarray) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seq", "pod", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli",
                    "gpu_spec", "node", "gpus"])
        for i, (p, n) in enumerate(zip(r.sequence.tolist(), r.node.tolist())):
            if n >= 0:
                local = [str(g - int(gpu_start[n])) for g in r.gpus[i].tolist() if g >= 0]
                node, gpus = nodes.sn[n], "|".join(local)
            else:
                node, gpus = "", ""
            w.writerow([i, pods.pod_names[p], int(pods.cpu_milli[p]), int(pods.memory_mib[p]),
                        int(pods.num_gpu[p]), int(pods.gpu_milli[p]), pods.gpu_spec[p], node,
                        gpus])


def run_openb(args, traces: Path, names: list[str], seeds: int, out: dict) -> None:
    nodes = openb.load_nodes(traces / openb.NODE_LIST)
    gpu_start = nodes.state().node_gpu_start
    published = load_published(traces)
    lookahead_seeds = seeds if args.lookahead_seeds is None else min(seeds, args.lookahead_seeds)
    policies = args.policies.split(",")
    rows, lookahead_rows = [], []
    t0 = time.perf_counter()
    for name in names:
        pods = openb.load_pods(traces / f"{openb.POD_PREFIX}{name}.csv")
        for policy in policies:
            for seed in range(seeds):
                r = openb.replay(nodes, pods, policy, seed, order=args.node_order)
                rows.append(r)
                if args.dump:
                    dump_csv(args.dump / f"{policy}__{name}__{seed}.csv", nodes, pods, r,
                             gpu_start)
        if BEST_POLICY in policies and (args.quick or any(t == name for t, _ in published)):
            for bs in LOOKAHEAD_BATCHES:
                for seed in range(lookahead_seeds):
                    lookahead_rows.append(
                        openb.replay(nodes, pods, BEST_POLICY, seed, batch_size=bs,
                                     order=args.node_order))
    elapsed = time.perf_counter() - t0

    def fields(r: openb.ReplayResult) -> dict:
        return {"trace": r.trace, "policy": r.policy, "seed": r.seed, "mode": r.mode,
                "alloc_pct_100": r.alloc_pct_100, "alloc_pct_130": r.alloc_pct_130,
                "unalloc_gpus_130": r.unalloc_gpus_130, "seconds": round(r.seconds, 3)}

    out["openb"] = [fields(r) for r in rows]
    out["openb_lookahead"] = [fields(r) for r in lookahead_rows]
    # ---- summary table: mean over seeds next to the published numbers -------------------
    groups: dict[tuple[str, str, str], list[openb.ReplayResult]] = defaultdict(list)
    for r in rows + lookahead_rows:
        groups[(r.trace, r.policy, r.mode)].append(r)
    summary = []
    print(f"\n== 1. openb replay (FGD protocol, arrival-only, {seeds} seed(s), "
          f"{elapsed:.1f} s) ==")
    print("online rows place each pod before seeing the next; batchN rows (look-ahead over N "
          "arrivals) are reported separately")
    hdr = (f"{'pod list':<12} {'policy':<12} {'mode':<8} {'alloc@100':>9} {'alloc@130':>9} "
           f"{'unalloc':>8} | {'published@100':>13} {'@130':>7} {'unalloc':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name in names:
        pub_rows = sorted(p for (t, p) in published if t == name)
        for (trace, policy, mode), rs in groups.items():
            if trace != name:
                continue
            a100 = float(np.mean([r.alloc_pct_100 for r in rs]))
            a130 = float(np.mean([r.alloc_pct_130 for r in rs]))
            un = float(np.mean([r.unalloc_gpus_130 for r in rs]))
            pub = published.get((name, policy)) if mode == "online" else None
            summary.append({"trace": name, "policy": policy, "mode": mode, "seeds": len(rs),
                            "alloc_pct_100": round(a100, 3), "alloc_pct_130": round(a130, 3),
                            "unalloc_gpus_130": round(un, 1), "published": pub})
            p_txt = (f"{pub['alloc_pct_100']:>13.2f} {pub['alloc_pct_130']:>7.2f} "
                     f"{pub['unalloc_gpus_130']:>8.0f}" if pub else f"{'':>13} {'':>7} {'':>8}")
            print(f"{name:<12} {policy:<12} {mode:<8} {a100:>9.2f} {a130:>9.2f} {un:>8.1f} | "
                  f"{p_txt}")
        for p in pub_rows:
            if p not in policies:
                pub = published[(name, p)]
                print(f"{name:<12} {p:<12} {'(paper)':<8} {'':>9} {'':>9} {'':>8} | "
                      f"{pub['alloc_pct_100']:>13.2f} {pub['alloc_pct_130']:>7.2f} "
                      f"{pub['unalloc_gpus_130']:>8.0f}")
    out["openb_summary"] = summary
    # ---- targets ---------------------------------------------------------------------
    checks = []
    for name in names:
        fgd_pub = published.get((name, "fgd"))
        ours = {(s["policy"], s["mode"]): s for s in summary if s["trace"] == name}
        if fgd_pub and ("fgd", "online") in ours:
            d = ours[("fgd", "online")]["alloc_pct_130"] - fgd_pub["alloc_pct_130"]
            checks.append({"target": f"our fgd within 0.5 of published FGD@130 on {name}",
                           "value": round(d, 3), "ok": abs(d) <= 0.5})
        if fgd_pub and (BEST_POLICY, "online") in ours:
            b = ours[(BEST_POLICY, "online")]
            checks.append({"target": f"{BEST_POLICY} beats published FGD@130 on {name}",
                           "value": round(b["alloc_pct_130"] - fgd_pub["alloc_pct_130"], 3),
                           "ok": b["alloc_pct_130"] > fgd_pub["alloc_pct_130"]})
            if name == "default":
                checks.append({"target": f"{BEST_POLICY} leaves <= 220 GPUs unallocated on "
                               "default", "value": b["unalloc_gpus_130"],
                               "ok": b["unalloc_gpus_130"] <= 220})
    out.setdefault("targets", []).extend(checks)
    if "default" in names:
        report_prefix_bound(traces, nodes, seeds, [r for r in rows if r.trace == "default"],
                            out)


def report_prefix_bound(traces: Path, nodes: openb.NodeList, seeds: int,
                        rows: list[openb.ReplayResult], out: dict) -> None:
    """How full can ``default`` be when the first pod fails, whatever the policy? (the
    configuration-LP bound of ``optimal.prefix_bound``; needs OR-Tools)"""
    pods = openb.load_pods(traces / f"{openb.POD_PREFIX}default.csv")
    bounds = []
    for seed in range(seeds):
        seq = openb.arrival_sequence(pods, 1000 * nodes.total_gpus, seed)
        b = optimal.prefix_bound(pods.num_gpu[seq], pods.gpu_milli[seq], nodes.total_gpus)
        if b is None:
            print("\nprefix bound skipped: OR-Tools not installed (pip install "
                  "'gpusched-scheduler[bench]'), or GLOP found no optimum")
            return
        bounds.append({"seed": seed, **asdict(b)})
    out["openb_prefix_bound"] = bounds
    mean = float(np.mean([b["unalloc_gpus"] for b in bounds]))
    print(f"\ndefault, any policy: >= {mean:.1f} GPUs unallocated when the first pod fails "
          f"(mean of {seeds} seed(s); configuration-LP bound on the arrival prefix, nodes/CPU/"
          "memory ignored; pods placed after the first failure are not bounded)")
    by_policy: dict[str, list[openb.ReplayResult]] = defaultdict(list)
    for r in rows:
        by_policy[r.policy].append(r)
    packing = []
    for policy, rs in by_policy.items():
        at_fail = float(np.mean([unalloc_at_first_failure(pods, nodes, r) for r in rs]))
        end = float(np.mean([r.unalloc_gpus_130 for r in rs]))
        gaps = []
        for r in rs:
            placed = r.node >= 0
            gap = optimal.packing_gap(pods.num_gpu[r.sequence][placed],
                                      pods.gpu_milli[r.sequence][placed], r.gpus[placed])
            if gap is None:  # GLOP found no optimum: report the rest without this seed
                continue
            used, lp = gap
            gaps.append(used - lp)
            packing.append({"policy": policy, "seed": r.seed, "sharing_gpus": used,
                            "lp_min_gpus": round(lp, 2)})
        print(f"  {policy:<12} {at_fail:6.1f} at its first 1-GPU failure, {end:6.1f} at 130%; "
              + (f"its sharing pods take {float(np.mean(gaps)):.1f} GPUs more than the "
                 "configuration LP needs for the same pods" if gaps else
                 "packing gap not measured (GLOP found no optimum)"))
    out["openb_packing_gap"] = packing


def unalloc_at_first_failure(pods: openb.PodList, nodes: openb.NodeList,
                             r: openb.ReplayResult) -> float:
    """GPUs unallocated right after the first single-GPU pod of the replay failed (gangs
    fail earlier, when no node has all its GPUs free, long before the cluster is full)."""
    req = pods.gpu_request_milli[r.sequence]
    allocated = np.cumsum(np.where(r.node >= 0, req, 0))
    failed = np.flatnonzero((r.node < 0) & (pods.num_gpu[r.sequence] == 1))
    i = int(failed[0]) if len(failed) else len(req) - 1
    return round(nodes.total_gpus - float(allocated[i]) / 1000.0, 1)


def run_throughput(args, traces: Path, names: list[str], out: dict) -> None:
    """Shapes from ``default`` when the folder has it (the numbers in docs/SOLVER.md), else
    from the run's first pod list, named in the output and the JSON."""
    nodes = openb.load_nodes(traces / openb.NODE_LIST)
    shapes_from = "default" if (traces / f"{openb.POD_PREFIX}default.csv").exists() else names[0]
    pods = openb.load_pods(traces / f"{openb.POD_PREFIX}{shapes_from}.csv")
    out["throughput_pod_list"] = shapes_from
    if args.quick:
        grid = [(4096, 1000), (4096, 10000)]
        policies = [BEST_POLICY]
        budget = 0.3
    else:
        grid = [(g, b) for g in (512, 4096, 16384) for b in (1000, 10000, 50000)]
        policies = [BEST_POLICY, "best-fit"]
        budget = 1.0
    rows = []
    print(f"\n== 2. throughput (single core, single-GPU units, {shapes_from}'s shapes scaled "
          "to ~90% fill; reference timed on a prefix; solves are handed the batch's shapes "
          "and price tables, built in 'shapes ms') ==")
    hdr = (f"{'policy':<10} {'order':<9} {'gpus':>6} {'batch':>6} {'numba/s':>10} "
           f"{'ref/s':>8} {'x ref':>7} {'p50 ms':>8} {'p99 ms':>8} {'placed%':>7} "
           f"{'peak MiB':>8} {'shapes ms':>9}")
    print(hdr)
    print("-" * len(hdr))
    for gpus, batch in grid:
        state = throughput.cluster_of(nodes, gpus)
        units = throughput.single_gpu_batch(pods, batch, gpus, seed=gpus + batch)
        for policy in policies:
            for lookahead in (False, True):
                repeats = max(3, min(15, 30000 // batch))
                r = throughput.measure(policy, state, units, repeats, budget, lookahead)
                row = asdict(r)
                rows.append(row)
                print(f"{r.policy:<10} {r.order:<9} {r.gpus:>6} {r.batch:>6} "
                      f"{r.numba_per_s:>10.0f} {r.reference_per_s:>8.1f} {r.speedup:>7.0f} "
                      f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.placed_pct:>7.1f} "
                      f"{r.peak_mib:>8.2f} {r.shapes_ms:>9.2f}")
                sys.stdout.flush()
    out["throughput"] = rows
    at4k = [r for r in rows if r["gpus"] == 4096]
    if at4k:
        # the policy we ship at its slowest, whatever the order or batch size
        slow = min((r for r in at4k if r["policy"] == BEST_POLICY),
                   key=lambda r: r["numba_per_s"])
        out.setdefault("targets", []).append(
            {"target": f">= 100,000 placements/s at 4,096 GPUs ({BEST_POLICY}, slowest row)",
             "value": slow["numba_per_s"], "ok": slow["numba_per_s"] >= 100_000,
             "row": {k: slow[k] for k in ("policy", "order", "batch")}})
        worst = min(r["speedup"] for r in at4k)
        out["targets"].append({"target": ">= 100x the pure-Python reference (every row at "
                               "4,096 GPUs)", "value": worst, "ok": worst >= 100})
    big = [r for r in rows if r["gpus"] == 16384 and r["batch"] == 50000]
    if big:
        peak = max(r["peak_mib"] for r in big)
        out["targets"].append({"target": "< 100 MiB solver memory at 16,384 GPUs x 50,000 "
                               "units", "value": peak, "ok": peak < 100})


FIRST_PLACEMENT_SNIPPET = """
import time
t0 = time.perf_counter()
from gpusched_scheduler.domain.solver import ClusterState, WorkBatch, solve
t1 = time.perf_counter()
state = ClusterState.from_arrays(["a", "b"], [8000, 8000], [8000, 8000], [2, 2], ["T4", "T4"])
unit = WorkBatch.from_units(num_gpu=[1], gpu_milli=[500], cpu_milli=[100], mem_mib=[100])
solve(state, unit, "gpusched")
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def run_first_placement(out: dict) -> None:
    """A fresh process (JIT cache already on disk from this run): import, then time the
    first placement."""
    import subprocess

    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", FIRST_PLACEMENT_SNIPPET], env=env,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        print(f"first-placement probe failed: {proc.stderr.strip()[-300:]}")
        return
    import_s, first_s = (float(x) for x in proc.stdout.split())
    out["first_placement"] = {"import_s": round(import_s, 3), "first_placement_s":
                              round(first_s, 3)}
    print(f"\nwarm process: import {import_s:.2f} s, first placement {first_s:.2f} s after "
          "import")
    out.setdefault("targets", []).append(
        {"target": "first placement within 1 s of import (warm JIT cache)",
         "value": round(first_s, 3), "ok": first_s <= 1.0})


def run_optimal(args, out: dict) -> None:
    policies = list(POLICIES)
    rows, secs = optimal.run(policies, args.quick)
    out["optimal"] = [asdict(r) for r in rows]
    print(f"\n== 3. distance to optimal (GPUs used; CP-SAT on {optimal.SMALL_UNITS}-unit "
          f"instances, lower bound on {optimal.LARGE_UNITS}-unit ones; {secs:.1f} s) ==")
    # the columns split on the instance's size: a small instance without an optimum (no
    # OR-Tools, or CP-SAT out of time) once slipped into the large column
    small_rows = [r for r in rows if r.n_units == optimal.SMALL_UNITS]
    no_opt = {r.instance for r in small_rows if r.optimum is None}
    if no_opt:
        print(f"no CP-SAT optimum for {len(no_opt)} of {len({r.instance for r in small_rows})}"
              " small instance(s) (OR-Tools not installed: pip install "
              "'gpusched-scheduler[bench]', or no solution within the time limit): the small "
              "column is not measured")
    print(f"{'policy':<12} {'mode':<10} {'small: used/opt':>16} {'gap%':>6} "
          f"{'large: used/LB':>15} {'gap%':>6}")

    def total(rs: list[optimal.OptimalityRow], ref: str) -> tuple[int | None, int | None]:
        """GPUs used and the reference, summed; None when a unit was left unplaced or an
        instance lacks its reference."""
        if not rs or any(r.gpus_used is None or getattr(r, ref) is None for r in rs):
            return None, None
        return sum(r.gpus_used for r in rs), sum(getattr(r, ref) for r in rs)

    def cell(used: int | None, ref: int | None, rs: list[optimal.OptimalityRow]) -> str:
        unplaced = sum(r.unplaced for r in rs)
        if unplaced:
            return f"{unplaced} unplaced"
        return "n/a" if used is None else f"{used}/{ref}"

    agg = []
    for policy in policies:
        for mode in ("online", "lookahead"):
            sel = [r for r in rows if r.policy == policy and r.mode == mode]
            small = [r for r in sel if r.n_units == optimal.SMALL_UNITS]
            large = [r for r in sel if r.n_units != optimal.SMALL_UNITS]
            su, so = total(small, "optimum")
            lu, lb = total(large, "lower_bound")
            sg = None if su is None else round(100.0 * (su - so) / so, 2)
            lg = None if lu is None else round(100.0 * (lu - lb) / lb, 2)
            agg.append({"policy": policy, "mode": mode, "small_used": su, "small_opt": so,
                        "small_gap_pct": sg, "large_used": lu, "large_lb": lb,
                        "large_gap_pct": lg,
                        "small_unplaced": sum(1 for r in small if r.unplaced),
                        "small_unplaced_units": sum(r.unplaced for r in small)})
            print(f"{policy:<12} {mode:<10} {cell(su, so, small):>16} "
                  f"{sg if sg is not None else '-':>6} {cell(lu, lb, large):>15} "
                  f"{lg if lg is not None else '-':>6}")
    out["optimal_summary"] = agg
    for a in agg:
        if a["policy"] != BEST_POLICY:
            continue
        # one target per mode: a min() over the modes once hid an online row that left a
        # unit unplaced
        target = {"target": f"{BEST_POLICY} {a['mode']} within 3% of the optimum on the "
                  "small instances", "row": {"policy": BEST_POLICY, "mode": a["mode"]}}
        if a["small_unplaced_units"]:
            target |= {"value": None, "ok": False,
                       "unplaced_units": a["small_unplaced_units"]}
        elif a["small_gap_pct"] is not None:
            target |= {"value": a["small_gap_pct"], "ok": a["small_gap_pct"] <= 3.0}
        else:
            continue  # no optimum to measure against (said above)
        out.setdefault("targets", []).append(target)


def target_line(t: dict) -> str:
    """``[ok] target: value``; a target missed because units were left unplaced has no
    value and says how many."""
    value = (f"{t['unplaced_units']} unit(s) left unplaced" if t.get("unplaced_units")
             else t["value"])
    return f"[{'ok' if t['ok'] else 'MISS'}] {t['target']}: {value}"


def write_json(path: Path, out: dict) -> None:
    """Replace ``path`` with ``out`` in one rename, so a run stopped mid-write leaves the
    previous parts' file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=float))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    skip, names, seeds = _checked(parser, args)
    traces: Path = args.traces
    t0 = time.perf_counter()
    out: dict = {"quick": args.quick, "traces": str(traces), "pid": os.getpid()}
    have_traces = (traces / openb.NODE_LIST).exists()
    if not have_traces:
        print(f"openb traces not found in {traces}: pass --traces DIR pointing at a folder "
              f"with {openb.NODE_LIST} and openb_pod_list_*.csv", file=sys.stderr)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    parts = [("openb", have_traces, lambda: run_openb(args, traces, names, seeds, out)),
             ("throughput", have_traces, lambda: run_throughput(args, traces, names, out)),
             ("first", True, lambda: run_first_placement(out)),
             ("optimal", True, lambda: run_optimal(args, out))]
    for name, runnable, run in parts:
        if runnable and name not in skip:
            run()
            if args.json:  # after each part: a later part that fails loses nothing before it
                write_json(args.json, out)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if out.get("targets"):
        print("\n== targets ==")
        for t in out["targets"]:
            print(target_line(t))
    print(f"\ntotal {out['seconds']} s")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0 if have_traces or "openb" in skip else 2


if __name__ == "__main__":
    raise SystemExit(main())
