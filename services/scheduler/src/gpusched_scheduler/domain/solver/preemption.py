"""Preemption planning: the cheapest set of lower-priority victims on one node whose removal
lets a unit that fits nowhere run (fewest GPU-seconds lost), or a plain "no plan".

Per node, a depth-first branch and bound over its candidate victims (cheapest first):
every node first gets a greedy plan (cheapest victims until the unit fits, then those not
needed dropped); the search then looks for cheaper ones, cutting a branch when even every
victim still undecided would not make the unit fit, when it cannot beat the best plan so
far, or when it would take a victim while leaving out one that frees as much on the same
GPUs for no more cost. Exact unless it runs past SEARCH_BUDGET steps (``proven_optimal``
says which); nodes are searched cheapest greedy plan first, each with a fair share of the
steps left. ``reference_plan`` is the brute-force oracle used by the property tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numba import njit

from .kernels import valid_request
from .solve import resolve, state_tuple
from .state import ClusterState, WorkBatch

SEARCH_BUDGET = 200_000
"""Search steps (subsets looked at) one plan may take; a search cut short returns the best
plan found so far (never worse than the greedy one every node starts from) with
``proven_optimal=False``. Keeps one call within tens of milliseconds on the scheduler's
event loop."""
MAX_COST_GPU_S = 1e8
"""Largest cost of one victim (about 3 GPU-years): in micro GPU-seconds the sum of 90,000
of them still fits an int64."""
MICRO = 1_000_000
"""Costs are compared in micro GPU-seconds (integers), so sums are exact whatever their order
and equal costs tie (then the fewest victims win)."""


@dataclass(frozen=True, eq=False)
class RunningWork:
    """Units currently running: their requests (``batch``), where they run (``node``,
    cluster-wide ``gpus`` [R, 8], -1 padded, as ``solve`` returns them) and the GPU-seconds
    of work each would lose if preempted now (``gpu_seconds_lost``)."""

    batch: WorkBatch
    node: np.ndarray
    gpus: np.ndarray
    gpu_seconds_lost: np.ndarray


@dataclass(frozen=True)
class PreemptionPlan:
    """``feasible``: a plan exists. Then ``node`` is the node to free, ``victims`` indexes
    rows of the RunningWork, ``gpu_seconds_lost`` their total cost, and
    ``proven_optimal`` says whether the search finished. Otherwise ``message`` says why.
    ``steps``: the victim subsets the search looked at after the greedy plans (at most
    SEARCH_BUDGET)."""

    feasible: bool
    node: int = -1
    victims: tuple[int, ...] = ()
    gpu_seconds_lost: float = 0.0
    proven_optimal: bool = True
    message: str = ""
    steps: int = 0


@njit(cache=True)
def _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight, c, m, gm, gk, add):
    """Does the unit fit node ``n`` with free CPU ``c``, memory ``m`` and, for its GPUs in
    order, free share ``gm`` and memory ``gk``, plus row ``add`` of the freed amounts
    (``add`` = (cpu[R], mem[R], share[R, G], memory[R, G]); the plan's suffix sums)?"""
    i = add[4][0]
    if c + add[0][i] < cpu or m + add[1][i] < mem:
        return False
    if k == 0:
        return True
    lo = S[4][n]
    cnt = 0
    for g in range(lo, S[4][n + 1]):
        j = g - lo
        if not S[8][g] or (mask >> S[5][g]) & 1 == 0 or gm[j] + add[2][i, j] < milli:
            continue
        need = gmem
        if model >= 0:
            loaded = False
            for s in range(S[9].shape[1]):
                if S[9][g, s] == model:
                    loaded = True
            if not loaded:
                need += weight
        if gk[j] + add[3][i, j] >= need:
            cnt += 1
            if cnt >= k:
                return True
    return False


@njit(cache=True)
def _better(cost, count, node, best):
    """(cost, victims, node) below the best plan's (``best`` = [cost, victims, node])."""
    if cost != best[0]:
        return cost < best[0]
    if count != best[1]:
        return count < best[1]
    return node < best[2]


@njit(cache=True)
def _keep_if_better(cost, count, n, best, vic, nv, state, out_take):
    """Make the victims taken on node ``n`` (``state`` 1) the best plan if they beat it."""
    if not _better(cost, count, n, best):
        return
    best[0] = cost
    best[1] = count
    best[2] = n
    out_take[:] = False
    for i in range(nv):
        if state[i] == 1:
            out_take[vic[i]] = True


@njit(cache=True)
def _take(n, vic, nv, sign, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli, v_gmem, S, i):
    """Add (``sign`` 1) or take back (-1) victim ``vic[i]``'s resources on node ``n``."""
    v = vic[i]
    c_m[0] += sign * v_cpu[v]
    c_m[1] += sign * v_mem[v]
    lo = S[4][n]
    for j in range(v_gpus.shape[1]):
        g = v_gpus[v, j]
        if g >= lo and g < S[4][n + 1]:
            gm[g - lo] += sign * v_milli[v]
            gk[g - lo] += sign * v_gmem[v]


@njit(cache=True)
def _plan_kernel(S, k, milli, gmem, cpu, mem, mask, model, weight, prio,
                 vic_start, vic_idx, v_cpu, v_mem, v_gpus, v_milli, v_gmem, v_prio, v_cost,
                 out_take, budget):
    """Best node and victim set: returns (node, cost, n_victims, proven, steps); out_take[v]
    marks the victims. ``v_cost`` in micro GPU-seconds."""
    n_nodes = S[0].shape[0]
    max_g = 1
    max_v = 1
    for n in range(n_nodes):
        max_g = max(max_g, S[4][n + 1] - S[4][n])
        max_v = max(max_v, vic_start[n + 1] - vic_start[n])
    gm = np.empty(max_g, np.int64)  # the node's free share / memory per GPU, victims taken
    gk = np.empty(max_g, np.int64)
    c_m = np.zeros(2, np.int64)  # its free CPU and memory, victims taken
    # suffix sums: what victims i.. free (row i); row nv is zeros
    suf = (np.zeros(max_v + 1, np.int64), np.zeros(max_v + 1, np.int64),
           np.zeros((max_v + 1, max_g), np.int64), np.zeros((max_v + 1, max_g), np.int64),
           np.zeros(1, np.int64))
    vic = np.empty(max_v, np.int64)
    state = np.zeros(max_v, np.int64)  # 0 undecided, 1 taken, 2 left out
    phase = np.zeros(max_v + 1, np.int64)
    dominated_by = np.zeros((max_v, max_v), np.bool_)
    best = np.array([np.iinfo(np.int64).max, 1 << 30, n_nodes], np.int64)
    steps = 0
    proven = True
    none = np.iinfo(np.int64).max
    greedy_cost = np.full(n_nodes, none, np.int64)  # each node's greedy plan (none: no fit)
    greedy_count = np.zeros(n_nodes, np.int64)
    order = np.arange(n_nodes)
    for sweep in range(2):  # 0: a greedy plan on every node; 1: the search
        left = 0  # nodes still to search
        if sweep == 1:
            # cheapest greedy plan first, and each node a fair share of the steps left: one
            # hard node must not spend the budget of all the others
            order = order[np.argsort(greedy_count[order], kind="mergesort")]
            order = order[np.argsort(greedy_cost[order], kind="mergesort")]
            for n in range(n_nodes):
                left += greedy_cost[n] != none
        node_limit = budget
        for idx in range(n_nodes):
            n = order[idx]
            if sweep == 1:
                if greedy_cost[n] == none:
                    continue  # the unit fits there with no victim set at all
                if steps >= budget:
                    proven = False
                    break
                node_limit = steps + max(1, (budget - steps) // left)
                left -= 1
            lo = S[4][n]
            ng = S[4][n + 1] - lo
            nv = 0
            for p in range(vic_start[n], vic_start[n + 1]):
                v = vic_idx[p]
                if v_prio[v] < prio:
                    vic[nv] = v
                    nv += 1
            # cheapest first (insertion sort by cost, then index)
            for a in range(1, nv):
                x = vic[a]
                b = a - 1
                while b >= 0 and (v_cost[vic[b]] > v_cost[x] or
                                  (v_cost[vic[b]] == v_cost[x] and vic[b] > x)):
                    vic[b + 1] = vic[b]
                    b -= 1
                vic[b + 1] = x
            for j in range(ng):
                suf[2][nv, j] = 0
                suf[3][nv, j] = 0
            suf[0][nv] = 0
            suf[1][nv] = 0
            for i in range(nv - 1, -1, -1):
                c_m[0] = suf[0][i + 1]
                c_m[1] = suf[1][i + 1]
                for j in range(ng):
                    gm[j] = suf[2][i + 1, j]
                    gk[j] = suf[3][i + 1, j]
                _take(n, vic, nv, 1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli, v_gmem, S, i)
                suf[0][i] = c_m[0]
                suf[1][i] = c_m[1]
                for j in range(ng):
                    suf[2][i, j] = gm[j]
                    suf[3][i, j] = gk[j]
            c_m[0] = S[0][n]
            c_m[1] = S[1][n]
            for j in range(ng):
                gm[j] = S[6][lo + j]
                gk[j] = S[7][lo + j]
            suf[4][0] = 0
            if not _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight, c_m[0], c_m[1],
                         gm, gk, suf):
                continue  # not even with every candidate gone
            suf[4][0] = nv  # from here on: what is taken so far, nothing added
            if sweep == 0:
                cost = 0
                count = 0
                for i in range(nv):
                    state[i] = 0
                for i in range(nv):
                    if _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight, c_m[0],
                             c_m[1], gm, gk, suf):
                        break
                    _take(n, vic, nv, 1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli, v_gmem,
                          S, i)
                    state[i] = 1
                for i in range(nv - 1, -1, -1):  # drop those not needed, dearest first
                    if state[i] != 1:
                        continue
                    _take(n, vic, nv, -1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli, v_gmem,
                          S, i)
                    if _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight, c_m[0],
                             c_m[1], gm, gk, suf):
                        state[i] = 0
                    else:
                        _take(n, vic, nv, 1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli,
                              v_gmem, S, i)
                for i in range(nv):
                    if state[i] == 1:
                        cost += v_cost[vic[i]]
                        count += 1
                greedy_cost[n] = cost
                greedy_count[n] = count
                _keep_if_better(cost, count, n, best, vic, nv, state, out_take)
                continue
            # the search: victim b is dominated by an earlier (cheaper) a on the same GPUs
            # that frees at least as much of everything; taking b while leaving a out is
            # never needed (a in b's stead costs no more and frees no less)
            for b in range(nv):
                vb = vic[b]
                for a in range(b):
                    va = vic[a]
                    same = (v_gpus[va, 0] == v_gpus[vb, 0] and v_gmem[va] >= v_gmem[vb]
                            and v_milli[va] >= v_milli[vb] and v_cpu[va] >= v_cpu[vb]
                            and v_mem[va] >= v_mem[vb])
                    j = 1
                    while same and j < v_gpus.shape[1]:
                        same = v_gpus[va, j] == v_gpus[vb, j]
                        j += 1
                    dominated_by[b, a] = same
            for i in range(nv):
                state[i] = 0
            cost = 0
            count = 0
            i = 0
            phase[0] = 0
            while i >= 0:
                if phase[i] == 0:  # first visit of this branch
                    if steps >= node_limit:
                        proven = False
                        break
                    steps += 1
                    up = False
                    suf[4][0] = nv
                    if _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight, c_m[0],
                             c_m[1], gm, gk, suf):
                        _keep_if_better(cost, count, n, best, vic, nv, state, out_take)
                        up = True  # more victims only cost more
                    elif i == nv or not _better(cost, count + 1, n, best):
                        up = True
                    else:
                        suf[4][0] = i
                        if not _fits(S, n, k, milli, gmem, cpu, mem, mask, model, weight,
                                     c_m[0], c_m[1], gm, gk, suf):
                            up = True  # not even with every victim still undecided
                    if up:
                        i -= 1
                        continue
                    phase[i] = 1
                    allowed = True
                    for a in range(i):
                        if dominated_by[i, a] and state[a] == 2:
                            allowed = False
                            break
                    if allowed:
                        _take(n, vic, nv, 1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli,
                              v_gmem, S, i)
                        state[i] = 1
                        cost += v_cost[vic[i]]
                        count += 1
                        i += 1
                        phase[i] = 0
                        continue
                if phase[i] == 1:  # the branch that takes victim i is done: leave it out
                    if state[i] == 1:
                        _take(n, vic, nv, -1, c_m, gm, gk, v_cpu, v_mem, v_gpus, v_milli,
                              v_gmem, S, i)
                        cost -= v_cost[vic[i]]
                        count -= 1
                    state[i] = 2
                    phase[i] = 2
                    i += 1
                    phase[i] = 0
                    continue
                state[i] = 0  # both branches done
                i -= 1
    return best[2] if best[2] < n_nodes else -1, best[0], best[1], proven, steps


def _prepare(state: ClusterState, running: RunningWork, unit: WorkBatch):
    state, units = resolve(state, unit)
    rs, rb = resolve(state, running.batch)
    node = np.asarray(running.node, np.int64)
    order = np.argsort(node, kind="stable")
    order = order[node[order] >= 0]
    starts = np.searchsorted(node[order], np.arange(state.num_nodes + 1)).astype(np.int64)
    return state, units, rb, order.astype(np.int64), starts


def plan_preemption(
    state: ClusterState, running: RunningWork, unit: WorkBatch, index: int = 0
) -> PreemptionPlan:
    """Cheapest victims (strictly lower ``priority`` than row ``index`` of ``unit``) on a
    single node whose removal makes that unit fit; fewest victims breaks cost ties, then the
    lower node index. Victims' loaded models are assumed to stay loaded. Costs count to the
    micro GPU-second. Raises ValueError for a cost that is not a number or outside 0 to
    MAX_COST_GPU_S, or an ``index`` outside ``unit``."""
    if not 0 <= index < len(unit):
        raise ValueError(f"index {index} is outside the {len(unit)} unit(s) given")
    lost = np.asarray(running.gpu_seconds_lost, np.float64)
    bad = np.flatnonzero(~((lost >= 0) & (lost <= MAX_COST_GPU_S)))
    if len(bad):
        raise ValueError(f"gpu_seconds_lost must be 0 to {MAX_COST_GPU_S:g}; row "
                         f"{int(bad[0])} is {float(lost[bad[0]])!r}")
    one = unit.take(slice(index, index + 1))
    state, u, rb, vic_idx, vic_start = _prepare(state, running, one)
    take = np.zeros(len(running.node), np.bool_)
    k = int(u[0][0])
    if not valid_request(0, u):
        return PreemptionPlan(
            False, message="the unit's request is invalid (num_gpu 0-8, gpu_milli 1-1000 per "
            "GPU when GPUs are asked for, no negative sizes); fix the request"
        )
    node, cost, _count, proven, steps = _plan_kernel(
        state_tuple(state), k, int(u[1][0]), int(u[2][0]), int(u[3][0]), int(u[4][0]),
        int(u[5][0]), int(u[6][0]), int(u[7][0]), int(one.priority[0]),
        vic_start, vic_idx, rb[3], rb[4], np.asarray(running.gpus, np.int64), rb[1], rb[2],
        running.batch.priority, _micro(lost), take, SEARCH_BUDGET,
    )
    if node < 0:
        return PreemptionPlan(
            False,
            message="no single node would fit the unit even after preempting all of its "
            "lower-priority work; it has to wait for capacity", steps=int(steps),
        )
    return PreemptionPlan(
        True, int(node), tuple(int(v) for v in np.flatnonzero(take)), int(cost) / MICRO,
        bool(proven), steps=int(steps),
    )


def _micro(gpu_seconds: np.ndarray) -> np.ndarray:
    return np.rint(np.asarray(gpu_seconds, np.float64) * MICRO).astype(np.int64)


def reference_plan(
    state: ClusterState, running: RunningWork, unit: WorkBatch, index: int = 0
) -> PreemptionPlan:
    """Brute force over every subset of every node's lower-priority work (tests only)."""
    from .reference import _Cluster, _gpu_fits, _valid

    one = unit.take(slice(index, index + 1))
    state, u, rb, _, _ = _prepare(state, running, one)
    unit_d = dict(k=int(u[0][0]), milli=int(u[1][0]), gmem=int(u[2][0]), cpu=int(u[3][0]),
                  mem=int(u[4][0]), mask=int(u[5][0]), model=int(u[6][0]), weight=int(u[7][0]))
    prio = int(one.priority[0])
    if not _valid(unit_d):
        return PreemptionPlan(False, message="invalid request")
    micro = _micro(running.gpu_seconds_lost).tolist()
    best = None
    for n in range(state.num_nodes):
        vic = [int(v) for v in np.flatnonzero(
            (running.node == n) & (running.batch.priority < prio))]
        for r in range(len(vic) + 1):
            for subset in itertools.combinations(vic, r):
                c = _Cluster(state)
                for v in subset:
                    c.cpu[n] += int(rb[3][v])
                    c.mem[n] += int(rb[4][v])
                    for g in running.gpus[v]:
                        if g >= 0:
                            c.gmilli[g] += int(rb[1][v])
                            c.gmem[g] += int(rb[2][v])
                if c.cpu[n] < unit_d["cpu"] or c.mem[n] < unit_d["mem"]:
                    continue
                if sum(1 for g in c.gpus[n] if _gpu_fits(c, g, unit_d)) < unit_d["k"]:
                    continue
                cost = int(sum(micro[v] for v in subset))
                key = (cost, len(subset), n)
                if best is None or key < best[0]:
                    best = (key, subset)
    if best is None:
        return PreemptionPlan(False, message="no plan")
    (cost, _, n), subset = best
    return PreemptionPlan(True, n, tuple(sorted(subset)), cost / MICRO)
