"""Solver outcomes as values: per-unit placement arrays plus ``Placed``/``Unschedulable`` views.

"No room" is an expected outcome, reported with a reason code and a sentence for the user.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .state import ClusterState


class Reason(IntEnum):
    """Why a unit was not placed (the kernels report these codes)."""

    PLACED = 0
    INVALID_REQUEST = 1
    NO_ALLOWED_GPU_TYPE = 2
    GANG_TOO_LARGE = 3
    INSUFFICIENT_CPU_MEMORY = 4
    INSUFFICIENT_GPU_SHARE = 5
    INSUFFICIENT_GPU_MEMORY = 6


REASON_TEXT = {
    Reason.PLACED: "placed",
    Reason.INVALID_REQUEST: (
        "the request is invalid: num_gpu must be 0-8, gpu_milli 1-1000 when GPUs are asked "
        "for, and no size may be negative; fix the work unit's resource request"
    ),
    Reason.NO_ALLOWED_GPU_TYPE: (
        "no healthy GPU of an allowed type exists in the cluster; widen the allowed GPU types "
        "or add nodes of that type"
    ),
    Reason.GANG_TOO_LARGE: (
        "no single node has that many healthy GPUs of an allowed type; a gang must fit on one "
        "node, so ask for fewer GPUs per unit"
    ),
    Reason.INSUFFICIENT_CPU_MEMORY: (
        "no node that could hold the GPUs has enough free CPU and memory right now; it may "
        "fit after other work finishes, or ask for less CPU/memory"
    ),
    Reason.INSUFFICIENT_GPU_SHARE: (
        "not enough free GPU share on any suitable node right now (whole-GPU units need "
        "fully free GPUs); it may fit after other work finishes or via preemption"
    ),
    Reason.INSUFFICIENT_GPU_MEMORY: (
        "not enough free GPU memory (including model weights where the model is not loaded) "
        "on any suitable node right now"
    ),
}


@dataclass(frozen=True)
class Placed:
    unit: int
    node_index: int
    node_id: str
    gpu_indices: tuple[int, ...]  # indices of the GPUs within the node (0-based)


@dataclass(frozen=True)
class Unschedulable:
    unit: int
    reason: Reason
    message: str


@dataclass(frozen=True, eq=False)
class SolveResult:
    """Per unit (batch order): ``node[u]`` (-1 = unschedulable), ``gpus[u, :num_gpu]`` as
    cluster-wide GPU indices (-1 padded), ``reason[u]`` (``Reason``). ``state`` is the
    cluster after all placements; the input state is never modified."""

    node: np.ndarray
    gpus: np.ndarray
    reason: np.ndarray
    state: ClusterState
    policy: str
    evaluations: np.ndarray | None = None  # node evaluations: builds, rescored, winners, scans

    @property
    def placed(self) -> np.ndarray:
        return self.node >= 0

    def local_gpu_indices(self, u: int) -> tuple[int, ...]:
        n = int(self.node[u])
        if n < 0:
            return ()
        lo = int(self.state.node_gpu_start[n])
        return tuple(int(g) - lo for g in self.gpus[u] if g >= 0)

    def outcome(self, u: int) -> Placed | Unschedulable:
        n = int(self.node[u])
        if n >= 0:
            return Placed(u, n, self.state.node_ids[n], self.local_gpu_indices(u))
        r = Reason(int(self.reason[u]))
        return Unschedulable(u, r, REASON_TEXT[r])

    def outcomes(self) -> list[Placed | Unschedulable]:
        return [self.outcome(u) for u in range(len(self.node))]
