"""A solver session keeps the per-shape score caches between ``solve`` calls on successive
states of one cluster, so a small micro-batch costs what a unit of a large batch costs.

Each call diffs the incoming state against the state the session last returned and
rescores only the nodes that changed (placements, releases, health, anything). Decisions
are exactly those of a plain ``solve`` with the same policy and shapes (tested).
"""

from __future__ import annotations

import numpy as np

from . import kernels as K
from .policies import DEFAULT_POLICY, get_policy
from .result import SolveResult
from .solve import (
    SHAPE_CACHE_BUDGET_BYTES,
    ShapeDistribution,
    fresh_bookkeeping,
    group_rows,
    nowhere,
    policy_params,
    resolve,
    result_buffers,
    state_tuple,
    unit_order,
    work_buffers,
)
from .state import ClusterState, WorkBatch


class SolverSession:
    """Stateful front of ``solve`` for one cluster, one policy and one shape distribution.

    Not thread-safe; one session per scheduling loop. ``shapes`` defaults to the first
    batch's own distribution (pass the workload's distribution for stable FGD weights).
    """

    def __init__(
        self,
        policy: str = DEFAULT_POLICY,
        shapes: ShapeDistribution | None = None,
        *,
        affinity_bonus_milli: float = 200.0,
        stranded_weight: float = 5.0,
        max_slots: int | None = None,
    ):
        self.policy = get_policy(policy)
        self.shapes = shapes
        self._bonus = affinity_bonus_milli
        self._stranded = stranded_weight
        self._max_slots = max_slots
        self._last: ClusterState | None = None

    # ---- internals --------------------------------------------------------------------
    def _compatible(self, state: ClusterState) -> bool:
        last = self._last
        return (
            last is not None
            and last.type_names == state.type_names
            and state.model_names[: len(last.model_names)] == last.model_names
            and np.array_equal(last.node_gpu_start, state.node_gpu_start)
            and np.array_equal(last.gpu_type, state.gpu_type)
            and last.gpu_models.shape == state.gpu_models.shape
        )

    def _reset(self, state: ClusterState, batch: WorkBatch) -> None:
        dist = ShapeDistribution.empty()
        if self.policy.uses_shapes:
            if self.shapes is None:
                self.shapes = ShapeDistribution.from_batch(batch)
            dist = self.shapes
        self._w = dist.arrays(state)
        self._params = policy_params(dist, self._bonus, self._stranded)
        n = state.num_nodes
        size = 1 << max(0, int(n - 1).bit_length())
        budget = max(1, SHAPE_CACHE_BUDGET_BYTES // (8 * (n + 2 * size)))
        self._n_slots = min(budget, self._max_slots or budget)
        self._scores, self._trees, self._C = work_buffers(
            n, self._n_slots, len(self._w[0]), self.policy.uses_shapes
        )
        self._P = fresh_bookkeeping(n, self._n_slots, 4 * n + 1024)
        self._registry: dict[bytes, int] = {}

    def _clear_slots(self) -> None:
        """Forget every cached score (log full or slots exhausted); rows stay."""
        self._P[0][:] = False
        self._P[5][0] = 0
        self._registry.clear()

    def _changed_nodes(self, state: ClusterState) -> np.ndarray:
        last = self._last
        node_diff = (
            (last.node_cpu_free_milli != state.node_cpu_free_milli)
            | (last.node_mem_free_mib != state.node_mem_free_mib)
            | (last.node_cpu_total_milli != state.node_cpu_total_milli)
            | (last.node_mem_total_mib != state.node_mem_total_mib)
        )
        gpu_diff = (
            (last.gpu_milli_free != state.gpu_milli_free)
            | (last.gpu_mem_free_mib != state.gpu_mem_free_mib)
            | (last.gpu_healthy != state.gpu_healthy)
            | (last.gpu_models != state.gpu_models).any(axis=1)
        )
        counts = np.diff(state.node_gpu_start)
        gpu_node = np.repeat(np.arange(state.num_nodes), counts)
        node_diff[gpu_node[gpu_diff]] = True
        return np.flatnonzero(node_diff).astype(np.int64)

    def _slots_for(self, units: tuple) -> np.ndarray:
        rows = np.stack(units, axis=1)
        gid, _ = group_rows(rows)
        first = np.full(int(gid.max()) + 1, -1, np.int64)
        first[gid[::-1]] = np.arange(len(gid))[::-1]
        slot_of_group = np.empty(len(first), np.int64)
        if len(self._registry) + len(first) > self._n_slots:
            self._clear_slots()
        for g, i in enumerate(first):
            key = rows[i].tobytes()
            slot = self._registry.get(key)
            if slot is None:
                slot = len(self._registry)
                if slot >= self._n_slots:
                    slot = -1  # more distinct shapes in one batch than slots: scan
                else:
                    self._registry[key] = slot
                    self._P[0][slot] = False
            slot_of_group[g] = slot
        return slot_of_group[gid]

    # ---- API --------------------------------------------------------------------------
    def solve(self, state: ClusterState, batch: WorkBatch, *, lookahead: bool = False
              ) -> SolveResult:
        """Same contract and decisions as ``solve(state, batch, policy, shapes=...)``."""
        work, units = resolve(state.copy(), batch)
        if work.num_nodes == 0:
            return nowhere(work, batch, self.policy.name)
        n = len(batch)
        out_node, out_gpus, out_reason, stats = result_buffers(n)
        if not self._compatible(work):
            self._reset(work, batch)
            changed = np.zeros(0, np.int64)
        else:
            changed = self._changed_nodes(work)
        log_room = len(self._P[2]) - int(self._P[5][0])
        if len(changed) + n + 1 > log_room:
            self._clear_slots()
            if n + len(changed) + 1 > len(self._P[2]):
                grown = fresh_bookkeeping(work.num_nodes, self._n_slots,
                                          2 * (n + work.num_nodes) + 1024)
                self._P = (self._P[0], self._P[1], grown[2], self._P[3], self._P[4],
                           self._P[5])
        S = state_tuple(work)
        if len(changed):
            K.note_changed(changed, self._P, self._C)
        slots = self._slots_for(units) if n else np.zeros(0, np.int64)
        order = unit_order(batch, self.policy, lookahead)
        K.solve_kernel(
            self.policy.kernel_id, S, units, self._w, order, slots, self._scores,
            self._trees, self._C, self._P, out_node, out_gpus, out_reason, self._params,
            stats,
        )
        self._last = work.copy()
        return SolveResult(out_node, out_gpus, out_reason, work, self.policy.name, stats)
