"""The solver's entry points: ``solve`` a batch against a snapshot, ``apply``/``release`` work.

Adapters pass plain arrays in and read plain arrays out; no I/O, clock or globals here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import kernels as K
from .policies import DEFAULT_POLICY, Policy, get_policy
from .prices import price_tables
from .result import SolveResult
from .state import ANY_GPU_TYPE, MAX_GANG_GPUS, WHOLE_GPU_MILLI, ClusterState, WorkBatch

SHAPE_CACHE_BUDGET_BYTES = 48 << 20
"""Memory the per-shape score caches of one solve may use (beyond it units are scanned)."""

MAX_TYPICAL_SHAPES = 128
"""At most this many typical shapes: FGD's cost per scored node grows with their number.
openb keeps 31-111 at 95% coverage; a workload of mostly one-off shapes would keep all."""


@dataclass(frozen=True, eq=False)
class ShapeDistribution:
    """The workload's typical unit shapes and their frequencies (integer counts).

    FGD-style policies measure fragmentation against these shapes. Built from a sample of
    the workload (never from the order of future arrivals).
    """

    cpu_milli: np.ndarray
    mem_mib: np.ndarray
    num_gpu: np.ndarray
    gpu_milli: np.ndarray
    gpu_mem_mib: np.ndarray
    type_sets: tuple[frozenset[str] | None, ...]
    count: np.ndarray
    cpu_per_gpu_milli: float = 0.0  # workload's CPU milli per milli-GPU (GPU units)
    mem_per_gpu_milli: float = 0.0  # workload's memory MiB per milli-GPU (GPU units)
    # what free share is worth to the workload (``prices.price_tables``, micro-GPUs by
    # milli-GPU 0..1000): gpusched's GPU choice; all zero = no sharing requests
    fill_value: np.ndarray = field(default_factory=lambda: np.zeros(WHOLE_GPU_MILLI + 1, np.int64))
    price: np.ndarray = field(default_factory=lambda: np.zeros(WHOLE_GPU_MILLI + 1, np.int64))

    @classmethod
    def from_batch(
        cls,
        batch: WorkBatch,
        coverage: float = 0.95,
        with_memory: bool = False,
        max_shapes: int = MAX_TYPICAL_SHAPES,
    ) -> ShapeDistribution:
        """Most frequent shapes (CPU, GPUs, share, GPU memory, allowed types, and host memory
        when ``with_memory``) that together cover ``coverage`` of the units, at most
        ``max_shapes`` of them. Like the FGD paper, host memory is left out of the shapes by
        default."""
        if len(batch) == 0:
            return cls.empty()
        cols = np.stack(
            [
                batch.cpu_milli,
                batch.mem_mib if with_memory else np.zeros(len(batch), np.int64),
                batch.num_gpu,
                batch.gpu_milli,
                batch.gpu_mem_mib,
                batch.type_set,
            ],
            axis=1,
        )
        gid, counts = group_rows(cols)
        uniq = np.zeros((len(counts), cols.shape[1]), np.int64)
        uniq[gid] = cols
        order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first, stable
        cum = np.cumsum(counts[order])
        keep = order[: min(int(np.searchsorted(cum, coverage * cum[-1]) + 1), max_shapes)]
        u = uniq[keep]
        gpu_units = batch.num_gpu > 0
        gpu_milli = int((batch.num_gpu * batch.gpu_milli)[gpu_units].sum())
        # Prices over every unit, not just the typical shapes (rare small shares matter),
        # and only where the workload shares GPUs by compute share alone: the tables see
        # only the share, so where requests hold GPU memory too (LLM serving shares a GPU
        # by memory) FGD's shapes, which count memory, keep deciding.
        tables = {}  # none: the fields' all-zero defaults (a live cycle pays nothing here)
        if not batch.gpu_mem_mib[gpu_units].any():
            sharing = gpu_units & (batch.gpu_milli > 0) & (batch.gpu_milli < WHOLE_GPU_MILLI)
            if sharing.any():
                sizes, at = np.unique(batch.gpu_milli[sharing], return_inverse=True)
                fill_value, price = price_tables(sizes,
                                                 np.bincount(at, batch.num_gpu[sharing]))
                tables = {"fill_value": fill_value, "price": price}
        return cls(
            cpu_milli=u[:, 0].copy(),
            mem_mib=u[:, 1].copy(),
            num_gpu=u[:, 2].copy(),
            gpu_milli=u[:, 3].copy(),
            gpu_mem_mib=u[:, 4].copy(),
            type_sets=tuple(None if t < 0 else batch.type_sets[t] for t in u[:, 5]),
            count=counts[keep].astype(np.int64),
            cpu_per_gpu_milli=float(batch.cpu_milli[gpu_units].sum()) / max(gpu_milli, 1),
            mem_per_gpu_milli=float(batch.mem_mib[gpu_units].sum()) / max(gpu_milli, 1),
            **tables,
        )

    @classmethod
    def empty(cls) -> ShapeDistribution:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, z, z, (), z)

    def arrays(self, state: ClusterState) -> tuple:
        """The kernels' W tuple, shapes in ascending CPU order (stable): the single-GPU
        scorer stops at the first shape a node's CPU cannot host. Any order gives the same
        scores (integer sums), so the reference uses this order too. Then the two price
        tables."""
        masks = np.array([state.type_mask(t) for t in self.type_sets], np.int64).reshape(-1)
        by_cpu = np.argsort(self.cpu_milli, kind="stable")
        return tuple(
            np.ascontiguousarray(a[by_cpu])
            for a in (
                self.cpu_milli,
                self.mem_mib,
                self.num_gpu,
                self.gpu_milli,
                self.gpu_mem_mib,
                masks,
                self.count,
            )
        ) + (self.fill_value, self.price)


def state_tuple(state: ClusterState) -> tuple:
    return (
        state.node_cpu_free_milli,
        state.node_mem_free_mib,
        state.node_cpu_total_milli,
        state.node_mem_total_mib,
        state.node_gpu_start,
        state.gpu_type,
        state.gpu_milli_free,
        state.gpu_mem_free_mib,
        state.gpu_healthy,
        state.gpu_models,
    )


def resolve(state: ClusterState, batch: WorkBatch) -> tuple[ClusterState, tuple]:
    """Map the batch's names onto the state's codes: (state with merged model table, U)."""
    masks = np.array(
        [state.type_mask(t) for t in batch.type_sets] + [int(ANY_GPU_TYPE)], np.int64
    )
    type_mask = masks[batch.type_set]  # -1 indexes the trailing "any"
    model_names = state.model_names + tuple(
        m for m in batch.model_names if m not in state.model_names
    )
    if model_names != state.model_names:
        state = state.with_models(model_names)
    remap = np.array([model_names.index(m) for m in batch.model_names] + [-1], np.int64)
    model = remap[batch.model]
    units = (
        batch.num_gpu,
        batch.gpu_milli,
        batch.gpu_mem_mib,
        batch.cpu_milli,
        batch.mem_mib,
        type_mask,
        model,
        batch.model_weight_mib,
    )
    return state, units


def group_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group equal rows of a 2-D int array: (group id per row, group sizes). Group ids
    follow the order of each group's first row (stable, deterministic)."""
    return K.group_rows_kernel(np.ascontiguousarray(rows, np.int64))


def shape_slots(units: tuple, n_nodes: int) -> tuple[np.ndarray, int]:
    """Cache slot per unit: units with identical requests share one; rare shapes get -1."""
    n = len(units[0])
    if n == 0:
        return np.zeros(0, np.int64), 0
    inverse, counts = group_rows(np.stack(units, axis=1))
    size = 1 << max(0, int(n_nodes - 1).bit_length())
    per_slot = 8 * (n_nodes + 2 * size)
    budget = max(1, SHAPE_CACHE_BUDGET_BYTES // max(per_slot, 1))
    # slots go to repeated shapes, most frequent first
    eligible = np.flatnonzero(counts >= 2)
    eligible = eligible[np.argsort(-counts[eligible], kind="stable")][:budget]
    slot_of_shape = np.full(len(counts), -1, np.int64)
    slot_of_shape[eligible] = np.arange(len(eligible))
    return slot_of_shape[inverse], len(eligible)


def work_buffers(n_nodes: int, n_slots: int, n_shapes: int, uses_shapes: bool):
    """(scores, trees, C) for ``solve_kernel``: per-slot node scores and tournament trees,
    and the FGD per-node row cache (empty when the policy does not use shapes)."""
    size = 1 << max(0, int(n_nodes - 1).bit_length())
    rows = n_nodes if uses_shapes else 0
    return (
        np.empty((n_slots, n_nodes), np.float64),
        np.empty((n_slots, 2 * size), np.int64),
        (
            np.full(n_nodes, np.nan),
            np.zeros((rows, n_shapes), np.int64),
            np.zeros((rows, n_shapes), np.int64),
            np.zeros(n_nodes, np.int64),
        ),
    )


def fresh_bookkeeping(n_nodes: int, n_slots: int, log_capacity: int) -> tuple:
    """Empty cache bookkeeping ``P`` for ``solve_kernel`` (see its docstring)."""
    return (
        np.zeros(n_slots, np.bool_),
        np.zeros(n_slots, np.int64),
        np.empty(max(log_capacity, 1), np.int64),
        np.zeros(n_nodes, np.int64),
        np.zeros(n_nodes, np.int64),
        np.zeros(2, np.int64),
    )


def lookahead_order(batch: WorkBatch, how: str = "biggest-first") -> np.ndarray:
    """Order for a batch the solver may see whole (stable; results are still reported in
    batch order). "biggest-first": biggest GPU demand first, then CPU, i.e. first-fit-
    decreasing style. "gangs-first": gangs (all or nothing, the hardest to fit) first,
    largest first, then the rest in batch order; for gpusched, whose prices assume the
    units keep coming in the workload's mix, which biggest-first breaks inside a batch."""
    if how == "gangs-first":
        gang = np.where(batch.num_gpu > 1, batch.num_gpu, 0)
        return np.lexsort((np.arange(len(batch)), -gang)).astype(np.int64)
    demand = batch.num_gpu * batch.gpu_milli
    return np.lexsort((np.arange(len(batch)), -batch.cpu_milli, -demand)).astype(np.int64)


def unit_order(batch: WorkBatch, policy: Policy, lookahead: bool) -> np.ndarray:
    """The order the kernels place ``batch`` in: batch order (online), or the policy's
    look-ahead order."""
    if lookahead:
        return lookahead_order(batch, policy.lookahead)
    return np.arange(len(batch), dtype=np.int64)


def solve(
    state: ClusterState,
    batch: WorkBatch,
    policy: str = DEFAULT_POLICY,
    *,
    shapes: ShapeDistribution | None = None,
    lookahead: bool = False,
    affinity_bonus_milli: float = 200.0,
    stranded_weight: float = 5.0,
) -> SolveResult:
    """Place every unit of ``batch`` on ``state`` with the named policy.

    Units are considered in batch order, each seeing the placements before it (online);
    with ``lookahead=True`` the whole batch is reordered first (the policy's
    ``lookahead``: biggest-first, or gangs-first for gpusched).
    ``shapes`` is the workload distribution FGD-style policies score against (default: the
    batch's own). Never over-commits CPU, memory, GPU share or GPU memory; a unit that
    fits nowhere gets node -1 and a reason. ``state`` is left untouched.
    """
    pol = get_policy(policy)
    work, units = resolve(state.copy(), batch)
    if work.num_nodes == 0:
        return nowhere(work, batch, pol.name)
    dist = ShapeDistribution.empty()
    if pol.uses_shapes:
        dist = shapes or ShapeDistribution.from_batch(batch)
    w = dist.arrays(work)
    params = policy_params(dist, affinity_bonus_milli, stranded_weight)
    slots, n_slots = shape_slots(units, work.num_nodes)
    order = unit_order(batch, pol, lookahead)
    out_node, out_gpus, out_reason, stats = result_buffers(len(batch))
    K.solve_kernel(
        pol.kernel_id,
        state_tuple(work),
        units,
        w,
        order,
        slots,
        *work_buffers(work.num_nodes, n_slots, len(w[0]), pol.uses_shapes),
        fresh_bookkeeping(work.num_nodes, n_slots, len(batch) + 1),
        out_node,
        out_gpus,
        out_reason,
        params,
        stats,
    )
    return SolveResult(out_node, out_gpus, out_reason, work, pol.name, stats)


def policy_params(dist: ShapeDistribution, affinity_bonus_milli: float,
                  stranded_weight: float) -> np.ndarray:
    """The kernels' ``params`` (see ``kernels``); gpusched prices single-GPU units when
    the distribution has price tables."""
    priced = bool(dist.fill_value.any())
    return np.array([affinity_bonus_milli, stranded_weight, dist.cpu_per_gpu_milli,
                     dist.mem_per_gpu_milli, max(float(dist.count.sum()), 1.0),
                     float(priced)], np.float64)


def result_buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``solve_kernel``'s outputs for ``n`` units, all unplaced: (node, GPUs, reason,
    stats)."""
    return (np.full(n, -1, np.int64), np.full((n, MAX_GANG_GPUS), -1, np.int64),
            np.zeros(n, np.int64), np.zeros(4, np.int64))


def nowhere(work: ClusterState, batch: WorkBatch, policy: str) -> SolveResult:
    """The result on a cluster without nodes: nothing placed, each unit with its reason."""
    out_node, out_gpus, out_reason, stats = result_buffers(len(batch))
    out_reason[:] = K.NO_ALLOWED_GPU_TYPE
    out_reason[batch.num_gpu == 0] = K.INSUFFICIENT_CPU_MEMORY
    return SolveResult(out_node, out_gpus, out_reason, work, policy, stats)


def release(
    state: ClusterState,
    batch: WorkBatch,
    node: np.ndarray,
    gpus: np.ndarray,
    *,
    inplace: bool = False,
) -> ClusterState:
    """Give back the resources of finished units (rows of ``batch`` placed at ``node`` /
    ``gpus`` as returned by ``solve``; rows with node -1 are ignored). Loaded models stay
    loaded (their weight memory stays charged) until ``unload_model``."""
    out = state if inplace else state.copy()
    placed = np.flatnonzero(np.asarray(node) >= 0)
    np.add.at(out.node_cpu_free_milli, node[placed], batch.cpu_milli[placed])
    np.add.at(out.node_mem_free_mib, node[placed], batch.mem_mib[placed])
    g = gpus[placed]
    mask = g >= 0
    rows = np.broadcast_to(placed[:, None], g.shape)[mask]
    np.add.at(out.gpu_milli_free, g[mask], batch.gpu_milli[rows])
    np.add.at(out.gpu_mem_free_mib, g[mask], batch.gpu_mem_mib[rows])
    return out


def apply(
    state: ClusterState, batch: WorkBatch, node: np.ndarray, gpus: np.ndarray, *,
    inplace: bool = False,
) -> ClusterState:
    """Charge already-decided placements (e.g. replayed from a log) to a state. Same
    accounting as ``solve``: a unit's model weight is charged on GPUs where it is not
    loaded, and the model is then recorded as loaded there."""
    out = state if inplace else state.copy()
    out, units = resolve(out, batch)
    sel = np.empty(MAX_GANG_GPUS, np.int64)
    s = state_tuple(out)
    for u in np.flatnonzero(np.asarray(node) >= 0):
        sel[:] = gpus[u]
        K.apply_unit(s, int(node[u]), int(u), units, sel)
    return out


def unload_model(state: ClusterState, gpu: int, model: str, weight_mib: int, *,
                 inplace: bool = False) -> ClusterState:
    """Forget that ``model`` is loaded on cluster-wide GPU index ``gpu`` and give back its
    weight memory. No-op when it is not loaded there."""
    out = state if inplace else state.copy()
    if model not in out.model_names:
        return out
    code = out.model_names.index(model)
    row = out.gpu_models[gpu]
    hit = np.flatnonzero(row == code)
    if len(hit):
        row[hit[0]] = -1
        out.gpu_mem_free_mib[gpu] += weight_mib
    return out
