"""The scheduler's view of the fleet: the agents' latest node states plus reservations for
placements the agents have not reported yet. Pure data, no I/O, time passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpusched_common.contracts import GpuState, NodeState


@dataclass(frozen=True)
class Reservation:
    placement_id: str
    node_id: str
    gpu_index: int
    memory_mib: int
    model: str


@dataclass
class ClusterView:
    """Mutable between cycles only; a cycle works on `snapshot()`.

    Invariant: a reservation is counted until the agent's node state lists its placement
    as active (the agent's free memory then includes it) or its final usage arrives.
    """

    nodes: dict[str, NodeState] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    last_seen_ms: dict[str, int] = field(default_factory=dict)

    def apply_node_state(self, state: NodeState, now_ms: int) -> bool:
        """Take a newer report of a node; returns False for a stale or reordered one."""
        old = self.nodes.get(state.node_id)
        if old is not None and (state.started_at_ms, state.seq) < (old.started_at_ms, old.seq):
            return False
        self.nodes[state.node_id] = state
        self.last_seen_ms[state.node_id] = now_ms
        active = set(state.active_placement_ids)
        for pid in [p for p, r in self.reservations.items()
                    if r.node_id == state.node_id and p in active]:
            del self.reservations[pid]
        return True

    def reserve(self, reservation: Reservation) -> None:
        self.reservations[reservation.placement_id] = reservation

    def release(self, placement_id: str) -> None:
        self.reservations.pop(placement_id, None)

    def schedulable_gpus(self, now_ms: int, node_timeout_ms: int) -> list[FreeGpu]:
        """Healthy GPUs of ready, live nodes with their free memory net of reservations."""
        reserved: dict[tuple[str, int], int] = {}
        pending_models: dict[tuple[str, int], set[str]] = {}
        for r in self.reservations.values():
            reserved[(r.node_id, r.gpu_index)] = reserved.get((r.node_id, r.gpu_index), 0) \
                + r.memory_mib
            pending_models.setdefault((r.node_id, r.gpu_index), set()).add(r.model)
        out = []
        for node_id, state in self.nodes.items():
            if state.status != "ready":
                continue
            if now_ms - self.last_seen_ms.get(node_id, 0) > node_timeout_ms:
                continue
            for gpu in state.gpus:
                if not gpu.healthy:
                    continue
                key = (node_id, gpu.index)
                out.append(FreeGpu(
                    node_id=node_id, gpu=gpu,
                    free_mib=gpu.memory_free_mib - reserved.get(key, 0),
                    models=frozenset(gpu.loaded_models) | pending_models.get(key, set())))
        return out


@dataclass(frozen=True)
class FreeGpu:
    node_id: str
    gpu: GpuState
    free_mib: int
    models: frozenset[str]
    """Loaded, or being loaded for a placement already sent."""
