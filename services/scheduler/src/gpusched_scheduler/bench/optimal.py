"""Distance to optimal: GPUs used by each policy vs the CP-SAT optimum (small instances,
optional ``bench`` extra with OR-Tools) and vs a simple lower bound (larger instances).

An instance is a batch of units that must all be placed on identical nodes; the objective
is the number of GPUs with anything on them. Policies run online (batch order) and with
look-ahead (the whole batch, in the policy's look-ahead order).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from gpusched_scheduler.domain.solver import ClusterState, WorkBatch, solve

SMALL_UNITS = 12  # units per small instance (against the CP-SAT optimum)
LARGE_UNITS = 400  # units per large instance (against the lower bound)


@dataclass(frozen=True)
class Instance:
    name: str
    n_nodes: int
    gpus_per_node: int
    cpu_per_node: int
    batch: WorkBatch

    def state(self) -> ClusterState:
        n = self.n_nodes
        return ClusterState.from_arrays(
            [f"n{i}" for i in range(n)],
            [self.cpu_per_node] * n,
            [1 << 20] * n,
            [self.gpus_per_node] * n,
            ["G"] * n,
        )


def random_instance(seed: int, n_units: int, n_nodes: int, gpus_per_node: int = 4) -> Instance:
    """Units shaped like openb's mix: mostly sharing single-GPU, some whole, a few gangs."""
    rng = np.random.default_rng(seed)
    shares = np.array([110, 230, 320, 470, 590, 650, 810, 1000, 1000, 1000])
    k = np.where(rng.random(n_units) < 0.12, rng.choice([2, 4], n_units), 1)
    k = np.minimum(k, gpus_per_node)
    milli = np.where(k > 1, 1000, rng.choice(shares, n_units))
    cpu = rng.choice([2, 4, 6, 8], n_units) * k
    return Instance(
        f"rand-{n_units}u-{n_nodes}x{gpus_per_node}-s{seed}",
        n_nodes,
        gpus_per_node,
        8 * gpus_per_node + 8,
        WorkBatch.from_units(num_gpu=k, gpu_milli=milli, cpu_milli=cpu,
                             mem_mib=np.zeros(n_units, np.int64)),
    )


def gpus_used(state: ClusterState) -> int:
    return int((state.gpu_milli_free < 1000).sum())


def lower_bound(inst: Instance) -> int:
    """Whole-GPU units need their own GPUs; sharing units need at least their total share;
    and the busiest CPU demand needs enough nodes (each contributes >= 1 used GPU)."""
    b = inst.batch
    whole = b.gpu_milli >= 1000
    lb_gpu = int((b.num_gpu * whole).sum()) + math.ceil(
        int((b.num_gpu * b.gpu_milli * ~whole).sum()) / 1000
    )
    lb_nodes = math.ceil(int(b.cpu_milli[b.num_gpu > 0].sum()) / inst.cpu_per_node)
    return max(lb_gpu, lb_nodes)


def cp_sat_optimum(inst: Instance, time_limit_s: float = 10.0) -> tuple[int | None, bool]:
    """(GPUs used, proven optimal) from CP-SAT, or (None, False) without OR-Tools."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return None, False
    b = inst.batch
    n_units = len(b)
    G = inst.gpus_per_node
    N = inst.n_nodes
    m = cp_model.CpModel()
    y = [[m.new_bool_var(f"y{u}_{n}") for n in range(N)] for u in range(n_units)]
    x = [[m.new_bool_var(f"x{u}_{g}") for g in range(N * G)] for u in range(n_units)]
    used = [m.new_bool_var(f"used{g}") for g in range(N * G)]
    for u in range(n_units):
        m.add_exactly_one(y[u])
        for n in range(N):
            m.add(sum(x[u][n * G + j] for j in range(G)) == int(b.num_gpu[u]) * y[u][n])
    for g in range(N * G):
        m.add(sum(int(b.gpu_milli[u]) * x[u][g] for u in range(n_units)) <= 1000 * used[g])
    for n in range(N):
        m.add(sum(int(b.cpu_milli[u]) * y[u][n] for u in range(n_units)) <= inst.cpu_per_node)
    # symmetry: GPUs within a node fill in index order
    for n in range(N):
        for j in range(G - 1):
            m.add(used[n * G + j] >= used[n * G + j + 1])
    m.minimize(sum(used))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, False
    return int(round(solver.objective_value)), status == cp_model.OPTIMAL


@dataclass(frozen=True)
class OptimalityRow:
    instance: str
    n_units: int  # SMALL_UNITS or LARGE_UNITS: which column the row counts in
    policy: str
    mode: str
    gpus_used: int | None  # None when the policy could not place every unit
    unplaced: int  # units the policy could not place
    optimum: int | None
    proven_optimal: bool
    lower_bound: int
    gap_pct: float | None  # vs optimum (small) or lower bound (large)


def evaluate(inst: Instance, policies: list[str], exact: bool, time_limit_s: float
             ) -> list[OptimalityRow]:
    opt, proven = cp_sat_optimum(inst, time_limit_s) if exact else (None, False)
    lb = lower_bound(inst)
    rows = []
    for pol in policies:
        for mode, la in (("online", False), ("lookahead", True)):
            res = solve(inst.state(), inst.batch, pol, lookahead=la)
            unplaced = int((~res.placed).sum())
            used = None if unplaced else gpus_used(res.state)
            ref = opt if opt is not None else lb
            gap = None if used is None or not ref else round(100.0 * (used - ref) / ref, 2)
            rows.append(OptimalityRow(inst.name, len(inst.batch), pol, mode, used, unplaced,
                                      opt, proven, lb, gap))
    return rows


def run(policies: list[str], quick: bool, seed: int = 0) -> tuple[list[OptimalityRow], float]:
    t0 = time.perf_counter()
    rows: list[OptimalityRow] = []
    n_small = 3 if quick else 12
    for i in range(n_small):
        inst = random_instance(seed + i, n_units=SMALL_UNITS, n_nodes=4, gpus_per_node=4)
        rows += evaluate(inst, policies, exact=True, time_limit_s=5.0 if quick else 20.0)
    for i in range(1 if quick else 4):
        inst = random_instance(1000 + seed + i, n_units=LARGE_UNITS, n_nodes=120,
                               gpus_per_node=8)
        rows += evaluate(inst, policies, exact=False, time_limit_s=0)
    return rows, time.perf_counter() - t0


# ---- openb: how far into an arrival sequence can any policy place every pod? -------------


def share_patterns(sizes: list[int], capacity_milli: int = 1000) -> list[tuple[int, ...]]:
    """Every maximal way to fill one GPU with shares from ``sizes`` (counts per size, in the
    order given): no further share of any size fits. The columns of the configuration LP."""
    out: list[tuple[int, ...]] = []
    smallest = min(sizes, default=capacity_milli + 1)

    def rec(i: int, left: int, counts: list[int]) -> None:
        if i == len(sizes):
            if left < smallest:
                out.append(tuple(counts))
            return
        for c in range(left // sizes[i], -1, -1):
            counts.append(c)
            rec(i + 1, left - c * sizes[i], counts)
            counts.pop()

    rec(0, capacity_milli, [])
    return out


def min_gpus_for_shares(count_by_share: dict[int, int], patterns: list[tuple[int, ...]],
                        sizes: list[int]) -> int | None:
    """Lower bound on the GPUs that can hold the given sharing requests (milli-GPU -> number
    of requests): the configuration LP's optimum rounded up, or None as ``share_lp``.
    Valid whatever the nodes, CPU, memory and GPU types: it only relaxes them."""
    gpus = share_lp(count_by_share, patterns, sizes)
    return None if gpus is None else math.ceil(gpus - 1e-6)


def share_lp(count_by_share: dict[int, int], patterns: list[tuple[int, ...]],
             sizes: list[int]) -> float | None:
    """The configuration LP's optimum (fractional GPUs) for the given sharing requests (GLOP),
    or None without OR-Tools or when GLOP reports no optimum."""
    try:
        from ortools.linear_solver import pywraplp
    except ImportError:
        return None
    solver = pywraplp.Solver.CreateSolver("GLOP")
    use = [solver.NumVar(0.0, solver.infinity(), "") for _ in patterns]
    for j, size in enumerate(sizes):
        need = count_by_share.get(size, 0)
        if need:
            solver.Add(sum(use[p] * pat[j] for p, pat in enumerate(patterns) if pat[j]) >= need)
    solver.Minimize(sum(use))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return solver.Objective().Value()


@dataclass(frozen=True)
class PrefixBound:
    """``prefix_len``: no policy can place all of the first ``prefix_len + 1`` GPU-requesting
    arrivals (their GPU demand needs more GPUs than the cluster has, even with nodes, CPU,
    memory and GPU types ignored), so every policy's first failure comes by then, with at
    least ``unalloc_gpus`` GPUs unallocated at that moment. Pods placed after the first
    failure (into whatever gaps are left) are not bounded by this."""

    prefix_len: int
    unalloc_gpus: float


def prefix_bound(num_gpu: np.ndarray, gpu_milli: np.ndarray, cluster_gpus: int
                 ) -> PrefixBound | None:
    """``PrefixBound`` for requests in arrival order (whole GPUs: ``gpu_milli`` 1000, any
    ``num_gpu``; sharing: one GPU of ``gpu_milli`` < 1000), or None as ``share_lp`` (for
    any step: a step taken as "does not fit" would overstate the bound). Binary search on
    the prefix length; each step is one configuration LP."""
    num_gpu = np.asarray(num_gpu, np.int64)
    gpu_milli = np.asarray(gpu_milli, np.int64)
    gpu = (num_gpu > 0) & (gpu_milli > 0)
    k, m = num_gpu[gpu], gpu_milli[gpu]
    sizes = sorted({int(s) for s in m if s < 1000}, reverse=True)
    patterns = share_patterns(sizes)
    whole_prefix = np.concatenate([[0], np.cumsum(np.where(m >= 1000, k, 0))])

    def fits(length: int) -> bool | None:
        shares = m[:length]
        vals, counts = np.unique(shares[shares < 1000], return_counts=True)
        need = min_gpus_for_shares(dict(zip(vals.tolist(), counts.tolist())), patterns, sizes)
        return None if need is None else int(whole_prefix[length]) + need <= cluster_gpus

    lo, hi = 0, len(m)
    if fits(hi) is None:
        return None
    while lo < hi:  # largest prefix the bound cannot rule out
        mid = (lo + hi + 1) // 2
        ok = fits(mid)
        if ok is None:
            return None
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    placed_milli = int((k[:lo] * m[:lo]).sum())
    return PrefixBound(lo, round(cluster_gpus - placed_milli / 1000.0, 1))


def packing_gap(num_gpu: np.ndarray, gpu_milli: np.ndarray, gpus: np.ndarray
                ) -> tuple[int, float] | None:
    """How well a replay packed the sharing pods it placed: (GPUs holding them, the
    configuration LP's minimum for the same pods), or None as ``share_lp``. ``num_gpu``,
    ``gpu_milli`` and ``gpus`` (cluster GPU indices, -1 padded) are per placed pod."""
    one = (num_gpu == 1) & (gpu_milli < 1000)
    vals, counts = np.unique(gpu_milli[one], return_counts=True)
    sizes = sorted(vals.tolist(), reverse=True)
    lp = share_lp(dict(zip(vals.tolist(), counts.tolist())), share_patterns(sizes), sizes)
    return None if lp is None else (len(np.unique(gpus[one, 0])), lp)
