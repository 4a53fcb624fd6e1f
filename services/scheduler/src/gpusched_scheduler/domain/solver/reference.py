"""Plain-Python reference of every placement policy: slow, obvious, and the oracle the
property tests hold the Numba kernels to (same decisions, same tie-breaks, same floats).

It scans every node for every unit (no caches, no trees) over Python lists.
"""

from __future__ import annotations

import math

import numpy as np

from . import kernels as K
from .policies import get_policy
from .result import SolveResult
from .solve import ShapeDistribution, policy_params, resolve, unit_order
from .state import MAX_GANG_GPUS, ClusterState, WorkBatch


class _Cluster:
    """Python-list mirror of a ClusterState (mutable during one reference solve)."""

    def __init__(self, state: ClusterState):
        self.cpu = state.node_cpu_free_milli.tolist()
        self.mem = state.node_mem_free_mib.tolist()
        self.cpu_total = state.node_cpu_total_milli.tolist()
        self.mem_total = state.node_mem_total_mib.tolist()
        start = state.node_gpu_start.tolist()
        self.gpus = [list(range(start[n], start[n + 1])) for n in range(len(self.cpu))]
        self.gtype = state.gpu_type.tolist()
        self.gmilli = state.gpu_milli_free.tolist()
        self.gmem = state.gpu_mem_free_mib.tolist()
        self.healthy = state.gpu_healthy.tolist()
        self.models = [[m for m in row] for row in state.gpu_models.tolist()]

    def loaded(self, g: int, model: int) -> bool:
        return model >= 0 and model in self.models[g]


def _gpu_fits(c: _Cluster, g: int, unit: dict) -> bool:
    if not c.healthy[g] or not (unit["mask"] >> c.gtype[g]) & 1:
        return False
    if c.gmilli[g] < unit["milli"]:
        return False
    need = unit["gmem"] + (0 if unit["model"] < 0 or c.loaded(g, unit["model"]) else unit["weight"])
    return c.gmem[g] >= need


def _frag(milli, gtype, gmem, healthy, cpu_free, mem_free, shapes) -> float:
    """FGD fragmentation of one node described by per-GPU lists (see kernels.node_frag)."""
    total = sum(m for m, ok in zip(milli, healthy) if ok)
    frag_sum = 0.0
    for s in shapes:
        w = s["count"]
        if s["k"] == 0 or cpu_free < s["cpu"] or mem_free < s["mem"]:
            frag_sum += w * total
            continue
        fit = 0
        frag = 0
        for m, t, gm, ok in zip(milli, gtype, gmem, healthy):
            if not ok:
                continue
            if (s["mask"] >> t) & 1 and m >= s["milli"] and gm >= s["gmem"]:
                fit += 1
            else:
                frag += m
        frag_sum += w * (total if fit < s["k"] else frag)
    return frag_sum


def _frag_of(c: _Cluster, n: int, unit: dict | None, sel: list[int], shapes) -> float:
    gl = c.gpus[n]
    milli = [c.gmilli[g] for g in gl]
    gmem = [c.gmem[g] for g in gl]
    cpu, mem = c.cpu[n], c.mem[n]
    if unit is not None:
        cpu -= unit["cpu"]
        mem -= unit["mem"]
        for g in sel:
            i = g - gl[0]
            milli[i] -= unit["milli"]
            gmem[i] -= unit["gmem"] + (
                0 if unit["model"] < 0 or c.loaded(g, unit["model"]) else unit["weight"]
            )
    gtype = [c.gtype[g] for g in gl]
    return _frag(milli, gtype, gmem, [c.healthy[g] for g in gl], cpu, mem, shapes)


def _fgd_score(growth: float, weight_sum: float) -> float:
    """kernels.fgd_score: the published FGD's quantised 0-100 score, negated."""
    x = -(growth / weight_sum) / 1000.0
    return -math.floor((1.0 / (1.0 + math.exp(-x))) * 100.0)


def _stranded(gfree, cpu, mem, params) -> float:
    s = 0.0
    if params[2] > 0:
        s = max(s, gfree - cpu / params[2])
    if params[3] > 0:
        s = max(s, gfree - mem / params[3])
    return s


def _share_loss_key(free: int, unit: dict, loaded: bool, prices, params) -> float:
    """kernels.share_loss_key: the share a placement costs at the LP prices, in milli-GPU,
    a hair toward the tighter GPU, minus the affinity bonus."""
    fill_value, price = prices
    free = min(free, 1000)
    loss = fill_value[free] - price[unit["milli"]] - fill_value[free - unit["milli"]]
    key = (loss + 500) // 1000 + free * K.HAIR
    if loaded:
        key -= params[0]
    return key


def score_node(policy: int, c: _Cluster, n: int, unit: dict, shapes, params,
               prices) -> tuple[float, list]:
    """(score, chosen GPUs) of placing ``unit`` on node ``n``; lower wins, inf = no fit.
    ``prices``: gpusched's (fill_value, price) lists."""
    k = unit["k"]
    if c.cpu[n] < unit["cpu"] or c.mem[n] < unit["mem"]:
        return math.inf, []
    cand = [g for g in c.gpus[n] if _gpu_fits(c, g, unit)] if k > 0 else []
    if len(cand) < k:
        return math.inf, []
    priced = policy == K.GPUSCHED and params[5] > 0.0
    use_frag = policy == K.FGD or (policy == K.GPUSCHED and (k > 1 or (k == 1 and not priced)))
    fnow = _frag_of(c, n, None, [], shapes) if use_frag else 0.0
    keys = {}
    memo = {}  # GPUs alike in every way the score sees share one fragmentation delta
    for g in cand:
        if policy == K.FIRST_FIT:
            keys[g] = 0.0
        elif policy in (K.BEST_FIT, K.DOT_PRODUCT):
            keys[g] = float(c.gmilli[g])
        elif policy == K.GPU_PACKING:
            keys[g] = float(c.gmilli[g]) if c.gmilli[g] < 1000 else 2000.0
        elif priced:
            keys[g] = _share_loss_key(c.gmilli[g], unit, c.loaded(g, unit["model"]), prices,
                                      params)
        else:
            alike = (c.gmilli[g], c.gtype[g], c.gmem[g], c.loaded(g, unit["model"]))
            if alike not in memo:
                memo[alike] = _frag_of(c, n, unit, [g], shapes) - fnow
                if policy == K.GPUSCHED and c.loaded(g, unit["model"]):
                    memo[alike] -= params[0] * params[4]
            keys[g] = memo[alike]
    ranked = sorted(cand, key=lambda g: (keys[g], g))[:k]
    first_key = keys[ranked[0]] if k > 0 else 0.0
    sel = sorted(ranked)
    if policy == K.FIRST_FIT:
        return 0.0, sel
    cpu_after = c.cpu[n] - unit["cpu"]
    mem_after = c.mem[n] - unit["mem"]
    gfree = sum(c.gmilli[g] for g in c.gpus[n] if c.healthy[g])
    gcap = 1000 * sum(1 for g in c.gpus[n] if c.healthy[g])
    greq = k * unit["milli"]
    cpu_tot, mem_tot = max(c.cpu_total[n], 1), max(c.mem_total[n], 1)
    if policy == K.BEST_FIT:
        sc = cpu_after / cpu_tot + mem_after / mem_tot
        if gcap > 0:
            sc += (gfree - greq) / gcap
        return sc, sel
    if policy == K.DOT_PRODUCT:
        sc = (unit["cpu"] / cpu_tot) * (c.cpu[n] / cpu_tot)
        sc += (unit["mem"] / mem_tot) * (c.mem[n] / mem_tot)
        if gcap > 0:
            sc += (greq / gcap) * (gfree / gcap)
        return -sc, sel
    if policy == K.GPU_PACKING:
        if k > 0 and first_key < 1000:
            tier = 0.0
        elif any(c.healthy[g] and c.gmilli[g] < 1000 for g in c.gpus[n]):
            tier = 1.0
        else:
            tier = 2.0
        return tier * K.TIER_MILLI + (gfree - greq), sel
    if policy == K.FGD:
        delta = first_key if k == 1 else _frag_of(c, n, unit, sel, shapes) - fnow
        return _fgd_score(delta, params[4]), sel
    before = _stranded(gfree, c.cpu[n], c.mem[n], params)
    after = _stranded(gfree - greq, cpu_after, mem_after, params)
    if k == 0:
        taken = unit["cpu"] * gfree / max(c.cpu[n], 1)
        return taken + K.HAIR * params[1] * (after - before), sel
    if priced and k == 1:
        return first_key + params[1] * (after - before), sel
    if k == 1:
        delta = first_key
    else:
        delta = _frag_of(c, n, unit, sel, shapes) - fnow
        for g in sel:
            if c.loaded(g, unit["model"]):
                delta -= params[0] * params[4]
    return delta / params[4] + params[1] * (after - before), sel


def _place(c: _Cluster, n: int, unit: dict, sel: list[int]) -> None:
    c.cpu[n] -= unit["cpu"]
    c.mem[n] -= unit["mem"]
    for g in sel:
        c.gmilli[g] -= unit["milli"]
        need = unit["gmem"]
        if unit["model"] >= 0 and not c.loaded(g, unit["model"]):
            need += unit["weight"]
            row = c.models[g]
            if -1 in row:
                row[row.index(-1)] = unit["model"]
        c.gmem[g] -= need


def _shape_fits(c: _Cluster, n: int, shape: dict, unit: dict | None = None,
                sel: list[int] = ()) -> bool:
    """One unit of ``shape`` fits node ``n``, were ``unit`` placed on GPUs ``sel`` of it
    first (kernels.shape_fits)."""
    cpu, mem = c.cpu[n], c.mem[n]
    if unit is not None:
        cpu -= unit["cpu"]
        mem -= unit["mem"]
    if cpu < shape["cpu"] or mem < shape["mem"]:
        return False
    fit = 0
    for g in c.gpus[n]:
        if not c.healthy[g] or not (shape["mask"] >> c.gtype[g]) & 1:
            continue
        free, gmem = c.gmilli[g], c.gmem[g]
        if unit is not None and g in sel:
            free -= unit["milli"]
            gmem -= unit["gmem"] + (0 if unit["model"] < 0 or c.loaded(g, unit["model"])
                                    else unit["weight"])
        fit += free >= shape["milli"] and gmem >= shape["gmem"]
    return fit >= shape["k"]


def _held_shape(policy: int, c: _Cluster, shapes: list[dict]) -> tuple[dict | None, int]:
    """The gang shape gpusched holds a node for and the nodes it fits (kernels.held_shape)."""
    best, best_fit = None, 0
    if policy != K.GPUSCHED:
        return best, best_fit
    for s in shapes:
        if s["k"] < 2 or best is not None and (s["k"], s["count"]) <= (best["k"], best["count"]):
            continue
        fit = sum(1 for n in range(len(c.cpu)) if _shape_fits(c, n, s))
        if fit:
            best, best_fit = s, fit
    return best, best_fit


def _lowest(scored: list, nodes) -> int:
    """The node of ``nodes`` with the lowest finite score (ties: the lowest index), or -1."""
    best, best_score = -1, math.inf
    for n in nodes:
        if scored[n][0] < best_score:
            best, best_score = n, scored[n][0]
    return best


def _valid(unit: dict) -> bool:
    k, milli = unit["k"], unit["milli"]
    if not 0 <= k <= MAX_GANG_GPUS or not 0 <= milli <= 1000 or (k > 0 and milli == 0):
        return False
    return min(unit["cpu"], unit["mem"], unit["gmem"], unit["weight"]) >= 0


def _diagnose(c: _Cluster, unit: dict) -> int:
    k = unit["k"]
    milli = unit["milli"]
    if not _valid(unit):
        return K.INVALID_REQUEST
    any_type = gang_ok = k == 0
    cpu_ok = share_ok = False
    for n, gl in enumerate(c.gpus):
        typed = [g for g in gl if c.healthy[g] and (unit["mask"] >> c.gtype[g]) & 1]
        any_type = any_type or bool(typed)
        if len(typed) < k:
            continue
        gang_ok = True
        if c.cpu[n] < unit["cpu"] or c.mem[n] < unit["mem"]:
            continue
        cpu_ok = True
        share_ok = share_ok or sum(1 for g in typed if c.gmilli[g] >= milli) >= k
    if not any_type:
        return K.NO_ALLOWED_GPU_TYPE
    if not gang_ok:
        return K.GANG_TOO_LARGE
    if not cpu_ok:
        return K.INSUFFICIENT_CPU_MEMORY
    if not share_ok:
        return K.INSUFFICIENT_GPU_SHARE
    return K.INSUFFICIENT_GPU_MEMORY


def reference_solve(
    state: ClusterState,
    batch: WorkBatch,
    policy: str,
    *,
    shapes: ShapeDistribution | None = None,
    lookahead: bool = False,
    affinity_bonus_milli: float = 200.0,
    stranded_weight: float = 5.0,
    limit: int | None = None,
) -> SolveResult:
    """Same contract as ``solve``; ``limit`` stops after that many units (benchmarks)."""
    pol = get_policy(policy)
    work, units = resolve(state.copy(), batch)
    dist = ShapeDistribution.empty()
    if pol.uses_shapes:
        dist = shapes or ShapeDistribution.from_batch(batch)
    w = dist.arrays(work)
    shape_rows = [
        dict(cpu=int(w[0][i]), mem=int(w[1][i]), k=int(w[2][i]), milli=int(w[3][i]),
             gmem=int(w[4][i]), mask=int(w[5][i]), count=int(w[6][i]))
        for i in range(len(w[0]))
    ]
    prices = (w[7].tolist(), w[8].tolist())
    params = policy_params(dist, affinity_bonus_milli, stranded_weight).tolist()
    c = _Cluster(work)
    cols = [a.tolist() for a in units]
    n_units = len(batch)
    out_node = np.full(n_units, -1, np.int64)
    out_gpus = np.full((n_units, MAX_GANG_GPUS), -1, np.int64)
    out_reason = np.zeros(n_units, np.int64)
    order = unit_order(batch, pol, lookahead)
    held, n_fit = _held_shape(pol.kernel_id, c, shape_rows)
    for u in order.tolist()[: limit if limit is not None else n_units]:
        unit = dict(k=cols[0][u], milli=cols[1][u], gmem=cols[2][u], cpu=cols[3][u],
                    mem=cols[4][u], mask=cols[5][u], model=cols[6][u], weight=cols[7][u])
        if not _valid(unit):
            out_reason[u] = K.INVALID_REQUEST
            continue
        scored = [score_node(pol.kernel_id, c, n, unit, shape_rows, params, prices)
                  for n in range(len(c.cpu))]
        best = _lowest(scored, range(len(c.cpu)))
        if best < 0:
            out_reason[u] = _diagnose(c, unit)
            continue
        best_sel = scored[best][1]
        if (held is not None and unit["k"] < held["k"] and n_fit <= K.HELD_NODES
                and _shape_fits(c, best, held) and not _shape_fits(c, best, held, unit, best_sel)):
            # it would take the last node the gang fits: the best other node, if any fits
            alt = _lowest(scored, [n for n in range(len(c.cpu)) if not _shape_fits(c, n, held)])
            if alt >= 0:
                best, best_sel = alt, scored[alt][1]
        fitted = held is not None and _shape_fits(c, best, held)
        _place(c, best, unit, best_sel)
        if fitted and not _shape_fits(c, best, held):
            n_fit -= 1
        out_node[u] = best
        out_gpus[u, : len(best_sel)] = best_sel
    after = work.copy()
    after.node_cpu_free_milli[:] = c.cpu
    after.node_mem_free_mib[:] = c.mem
    after.gpu_milli_free[:] = c.gmilli
    after.gpu_mem_free_mib[:] = c.gmem
    after.gpu_models[:] = np.array(c.models, np.int64).reshape(after.gpu_models.shape)
    return SolveResult(out_node, out_gpus, out_reason, after, pol.name)
