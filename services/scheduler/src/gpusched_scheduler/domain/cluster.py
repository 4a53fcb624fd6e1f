"""The scheduler's view of the fleet: the agents' latest node states plus reservations for
placements the agents have not reported yet. Pure data, no I/O, time passed in."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpusched_common.contracts import NodeState


@dataclass(frozen=True)
class Reservation:
    placement_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    memory_mib_per_gpu: int
    model: str


@dataclass
class ClusterView:
    """Mutable between cycles only; a cycle works on a snapshot of it.

    Invariant: a reservation is counted until the agent's node state lists its placement
    as active (the agent's free memory then includes it) or its final usage arrives.
    """

    nodes: dict[str, NodeState] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    last_seen_ms: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    """Nodes declared lost (silent past the time-out) and not heard from since."""

    def apply_node_state(self, state: NodeState, now_ms: int) -> bool:
        """Take a newer report of a node; returns False for a stale or reordered one."""
        old = self.nodes.get(state.node_id)
        if old is not None and (state.started_at_ms, state.seq) < (old.started_at_ms, old.seq):
            return False
        self.nodes[state.node_id] = state
        self.last_seen_ms[state.node_id] = now_ms
        self.lost.discard(state.node_id)
        active = set(state.active_placement_ids)
        for pid in [p for p, r in self.reservations.items()
                    if r.node_id == state.node_id and p in active]:
            del self.reservations[pid]
        return True

    def reserve(self, reservation: Reservation) -> None:
        self.reservations[reservation.placement_id] = reservation

    def release(self, placement_id: str) -> None:
        self.reservations.pop(placement_id, None)

    def live_nodes(self, now_ms: int, node_timeout_ms: int) -> set[str]:
        return {n for n, seen in self.last_seen_ms.items() if now_ms - seen <= node_timeout_ms
                and self.nodes[n].status != "stopped"}

    def newly_lost(self, now_ms: int, node_timeout_ms: int) -> list[str]:
        """Nodes that just went silent past the time-out (each reported once)."""
        gone = [n for n, seen in self.last_seen_ms.items()
                if now_ms - seen > node_timeout_ms and n not in self.lost]
        self.lost.update(gone)
        for pid in [p for p, r in self.reservations.items() if r.node_id in gone]:
            del self.reservations[pid]
        return gone

    def reserved_mib(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for r in self.reservations.values():
            for g in r.gpu_indices:
                out[(r.node_id, g)] = out.get((r.node_id, g), 0) + r.memory_mib_per_gpu
        return out

    def pending_models(self) -> dict[tuple[str, int], set[str]]:
        """Models that placements already sent will load (count as loaded for affinity)."""
        out: dict[tuple[str, int], set[str]] = {}
        for r in self.reservations.values():
            for g in r.gpu_indices:
                out.setdefault((r.node_id, g), set()).add(r.model)
        return out
