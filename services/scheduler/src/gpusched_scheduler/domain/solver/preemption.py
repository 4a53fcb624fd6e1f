"""Preemption planning: the cheapest set of lower-priority victims on one node whose removal
lets a unit that fits nowhere run (fewest GPU-seconds lost), or a plain "no plan".

Exact subset search per node (up to EXACT_MAX_VICTIMS candidates; greedy beyond, flagged
``proven_optimal=False``). ``reference_plan`` is the
brute-force oracle used by the property tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numba import njit

from .kernels import valid_request
from .solve import resolve, state_tuple
from .state import ClusterState, WorkBatch

EXACT_MAX_VICTIMS = 16
"""Nodes with up to this many lower-priority units are searched exhaustively (2^n subsets);
beyond it a greedy plan is returned with ``proven_optimal=False``."""


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
    ``proven_optimal`` says whether the search finished. Otherwise ``message`` says why."""

    feasible: bool
    node: int = -1
    victims: tuple[int, ...] = ()
    gpu_seconds_lost: float = 0.0
    proven_optimal: bool = True
    message: str = ""


@njit(cache=True)
def _fits_after(S, n, k, milli, gmem, cpu, mem, mask, model, weight,
                vic, n_vic, take, v_cpu, v_mem, v_gpus, v_milli, v_gmem, gm_buf, gk_buf):
    """Does the unit fit node ``n`` once victims ``vic[i]`` with ``take[i]`` are removed?"""
    c = S[0][n]
    m = S[1][n]
    lo = S[4][n]
    hi = S[4][n + 1]
    for g in range(lo, hi):
        gm_buf[g - lo] = S[6][g]
        gk_buf[g - lo] = S[7][g]
    for i in range(n_vic):
        if take[i]:
            v = vic[i]
            c += v_cpu[v]
            m += v_mem[v]
            for j in range(v_gpus.shape[1]):
                g = v_gpus[v, j]
                if g >= lo and g < hi:
                    gm_buf[g - lo] += v_milli[v]
                    gk_buf[g - lo] += v_gmem[v]
    if c < cpu or m < mem:
        return False
    if k == 0:
        return True
    cnt = 0
    for g in range(lo, hi):
        if not S[8][g] or (mask >> S[5][g]) & 1 == 0 or gm_buf[g - lo] < milli:
            continue
        need = gmem
        if model >= 0:
            loaded = False
            for s in range(S[9].shape[1]):
                if S[9][g, s] == model:
                    loaded = True
            if not loaded:
                need += weight
        if gk_buf[g - lo] >= need:
            cnt += 1
    return cnt >= k


@njit(cache=True)
def _plan_kernel(S, k, milli, gmem, cpu, mem, mask, model, weight, prio,
                 vic_start, vic_idx, v_cpu, v_mem, v_gpus, v_milli, v_gmem, v_prio, v_cost,
                 out_take, exact_max):
    """Best node and victim set: returns (node, cost, n_victims, proven); out_take[v] marks."""
    n_nodes = S[0].shape[0]
    max_g = 1
    max_v = 1
    for n in range(n_nodes):
        max_g = max(max_g, S[4][n + 1] - S[4][n])
        max_v = max(max_v, vic_start[n + 1] - vic_start[n])
    gm_buf = np.empty(max_g, np.int64)
    gk_buf = np.empty(max_g, np.int64)
    vic = np.empty(max_v, np.int64)
    take = np.zeros(max_v, np.bool_)
    best_node = -1
    best_cost = np.inf
    best_count = 1 << 30
    proven = True
    for n in range(n_nodes):
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
        for i in range(nv):
            take[i] = True
        if not _fits_after(S, n, k, milli, gmem, cpu, mem, mask, model, weight, vic, nv, take,
                           v_cpu, v_mem, v_gpus, v_milli, v_gmem, gm_buf, gk_buf):
            continue
        local_take = np.zeros(nv, np.bool_)
        node_best = np.inf
        node_count = 1 << 30
        if nv <= exact_max:
            # every subset; cost[mask] = cost[mask without its lowest bit] + that victim's
            n_masks = 1 << nv
            mcost = np.zeros(n_masks, np.float64)
            mcount = np.zeros(n_masks, np.int64)
            for mask_v in range(n_masks):
                if mask_v > 0:
                    low = 0
                    while (mask_v >> low) & 1 == 0:
                        low += 1
                    rest = mask_v & (mask_v - 1)
                    mcost[mask_v] = mcost[rest] + v_cost[vic[low]]
                    mcount[mask_v] = mcount[rest] + 1
                if mcost[mask_v] > node_best or (
                    mcost[mask_v] == node_best and mcount[mask_v] >= node_count
                ):
                    continue
                for i in range(nv):
                    take[i] = (mask_v >> i) & 1 == 1
                if _fits_after(S, n, k, milli, gmem, cpu, mem, mask, model, weight, vic, nv,
                               take, v_cpu, v_mem, v_gpus, v_milli, v_gmem, gm_buf, gk_buf):
                    node_best = mcost[mask_v]
                    node_count = mcount[mask_v]
                    for i in range(nv):
                        local_take[i] = take[i]
        else:
            # greedy: cheapest first until it fits, then drop the ones not needed
            proven = False
            for i in range(nv):
                take[i] = False
            for i in range(nv):
                take[i] = True
                if _fits_after(S, n, k, milli, gmem, cpu, mem, mask, model, weight, vic, nv,
                               take, v_cpu, v_mem, v_gpus, v_milli, v_gmem, gm_buf, gk_buf):
                    break
            for i in range(nv - 1, -1, -1):
                if take[i]:
                    take[i] = False
                    if not _fits_after(S, n, k, milli, gmem, cpu, mem, mask, model, weight,
                                       vic, nv, take, v_cpu, v_mem, v_gpus, v_milli, v_gmem,
                                       gm_buf, gk_buf):
                        take[i] = True
            node_best = 0.0
            node_count = 0
            for i in range(nv):
                local_take[i] = take[i]
                if take[i]:
                    node_best += v_cost[vic[i]]
                    node_count += 1
        if node_best < best_cost or (node_best == best_cost and node_count < best_count):
            best_cost = node_best
            best_count = node_count
            best_node = n
            for v in range(out_take.shape[0]):
                out_take[v] = False
            for i in range(nv):
                if local_take[i]:
                    out_take[vic[i]] = True
        for i in range(nv):
            take[i] = False
    return best_node, best_cost, best_count, proven


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
    lower node index. Victims' loaded models are assumed to stay loaded."""
    one = unit.take(slice(index, index + 1))
    state, u, rb, vic_idx, vic_start = _prepare(state, running, one)
    take = np.zeros(len(running.node), np.bool_)
    k = int(u[0][0])
    if not valid_request(0, u):
        return PreemptionPlan(
            False, message="the unit's request is invalid (num_gpu 0-8, gpu_milli 1-1000 per "
            "GPU when GPUs are asked for, no negative sizes); fix the request"
        )
    node, cost, _count, proven = _plan_kernel(
        state_tuple(state), k, int(u[1][0]), int(u[2][0]), int(u[3][0]), int(u[4][0]),
        int(u[5][0]), int(u[6][0]), int(u[7][0]), int(one.priority[0]),
        vic_start, vic_idx, rb[3], rb[4], np.asarray(running.gpus, np.int64), rb[1], rb[2],
        running.batch.priority, np.asarray(running.gpu_seconds_lost, np.float64), take,
        EXACT_MAX_VICTIMS,
    )
    if node < 0:
        return PreemptionPlan(
            False,
            message="no single node would fit the unit even after preempting all of its "
            "lower-priority work; it has to wait for capacity",
        )
    return PreemptionPlan(
        True, int(node), tuple(int(v) for v in np.flatnonzero(take)), float(cost), bool(proven)
    )


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
                cost = float(sum(running.gpu_seconds_lost[v] for v in subset))
                key = (cost, len(subset), n)
                if best is None or key < best[0]:
                    best = (key, subset)
    if best is None:
        return PreemptionPlan(False, message="no plan")
    (cost, _, n), subset = best
    return PreemptionPlan(True, n, tuple(sorted(subset)), cost)
