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
    weights: str
    """What it loads on each of its GPUs (`request_weights`: its model or a gang's shard)."""
    relies_mib: int = 0
    """Its weights' MiB per GPU when it reserves its KV cache alone, counting on them being
    loaded (reported, or loaded by another placement of its cycle): counted once per GPU
    while no report shows them there and no reservation holds them."""


@dataclass
class ClusterView:
    """Mutable between cycles only; a cycle works on a snapshot of it.

    Invariant: a reservation is counted until the agent's node state lists its placement
    as active (the agent's free memory then includes it), or its final usage arrives and a
    report from after its end, or one of another agent run, shows what it loaded.
    """

    nodes: dict[str, NodeState] = field(default_factory=dict)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    last_seen_ms: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    """Nodes declared lost (silent past the time-out) and not heard from since."""
    first_heard_ms: int | None = None
    """When the first node report was taken (None: none yet)."""
    version: dict[str, int] = field(default_factory=dict)
    """Per node, bumped whenever its GPUs or its reservations change: what a snapshot is
    built from (a report of the same GPUs leaves it alone)."""
    _by_node: dict[str, dict[str, Reservation]] = field(default_factory=dict)
    _ending: dict[str, int] = field(default_factory=dict)
    """Placement id -> when it ended (its agent's clock): its final usage came before any
    report listed it, so the weights it loaded show in no report yet; its reservation
    stays until a report from after that, or one of another agent run."""

    def apply_node_state(self, state: NodeState, now_ms: int, node_timeout_ms: int) -> bool:
        """Take a newer report of a node; returns False for a stale or reordered one. Once
        the node is silent past the time-out (declared lost or not), any report is its latest: an
        agent that started again after its clock was set back reports an earlier start than
        its dead run, and would otherwise never be heard again (nor declared lost, while it
        says in Redis that it is alive)."""
        node_id = state.node_id
        old = self.nodes.get(node_id)
        heard_lately = now_ms - self.last_seen_ms.get(node_id, now_ms) <= node_timeout_ms
        if old is not None and heard_lately and (
                (state.started_at_ms, state.seq) < (old.started_at_ms, old.seq)):
            return False
        self.nodes[node_id] = state
        self.last_seen_ms[node_id] = now_ms
        if self.first_heard_ms is None:
            self.first_heard_ms = now_ms
        self.lost.discard(node_id)
        if old is None or old.gpus != state.gpus or old.models != state.models:
            self._bump(node_id)  # its solver spec (model sets are in its GPUs' types) changed
        mine = self._by_node.get(node_id)
        if mine:
            for pid in [p for p in state.active_placement_ids if p in mine]:
                self.release(pid)
            # An ended placement's weights show in a report from after its end, or in none
            # of another run: they went with the process that loaded them, and a run's own
            # report shows what it holds. Waiting for a later report time alone held them
            # for as long as a restarted agent's clock, set back, lagged behind the end.
            new_run = old is not None and state.started_at_ms != old.started_at_ms
            for pid in [p for p in mine if p in self._ending]:
                if self._ending[pid] <= state.reported_at_ms:
                    self.release(pid)
                elif new_run:  # its end on another clock: the run's next report shows it
                    self._ending[pid] = state.reported_at_ms + 1
        return True

    def reserve(self, reservation: Reservation) -> None:
        self.release(reservation.placement_id)
        self.reservations[reservation.placement_id] = reservation
        self._by_node.setdefault(reservation.node_id, {})[reservation.placement_id] = reservation
        self._bump(reservation.node_id)

    def reserve_unlisted(self, reservation: Reservation) -> None:
        """Reserve a placement sent earlier (by a previous leader), unless its node's latest
        report already lists it as active (its free memory then includes the placement)."""
        state = self.nodes.get(reservation.node_id)
        if state is None or reservation.placement_id not in state.active_placement_ids:
            self.reserve(reservation)

    def expect(self, node_id: str, now_ms: int) -> None:
        """A node known only from work it runs (inherited from a previous leader), never from
        a report (its record was deleted, or it died before this instance started): counted
        as seen now, so it is declared lost after the time-out unless it reports by then."""
        self.last_seen_ms.setdefault(node_id, now_ms)

    def drop_reservations(self) -> None:
        """Forget every reservation: a new leader reserves again what it inherits (one it
        held before it last stepped down may have been retried elsewhere since)."""
        for placement_id in list(self.reservations):
            self.release(placement_id)

    def decommission(self, node_id: str) -> None:
        """The node's record was deleted (a tombstone): it is offered to no work and counts
        in the fleet no more, and it has been silent since the epoch, so work still placed on
        it is recovered as a lost node's at once (unless its agent says in Redis that it is
        alive)."""
        if self.nodes.pop(node_id, None) is not None:
            self.last_seen_ms[node_id] = min(self.last_seen_ms.get(node_id, 0), 0)
            self._bump(node_id)

    def release_ended(self, placement_id: str, ended_at_ms: int) -> None:
        """Its final usage came: release it, unless no report since its end shows what it
        loaded (it ended before a report listed it). Released at once, the scheduler saw
        the GPU as free as the last report, before the weights: every placement counting on
        that memory until the next report was refused by the agent."""
        r = self.reservations.get(placement_id)
        state = self.nodes.get(r.node_id) if r is not None else None
        if state is None or state.reported_at_ms >= ended_at_ms:
            self.release(placement_id)
        else:
            self._ending[placement_id] = ended_at_ms

    def release(self, placement_id: str) -> None:
        self._ending.pop(placement_id, None)
        r = self.reservations.pop(placement_id, None)
        if r is not None:
            del self._by_node[r.node_id][placement_id]
            self._bump(r.node_id)

    def load_failed(self, node_id: str, now_ms: int) -> frozenset[str]:
        """The models whose load failed on the node lately that it asks not to get at
        `now_ms` (`NodeState.load_failures`). Each end is on the agent's clock, so it is
        compared only with that clock's `reported_at_ms`, as other agent times are: what was
        left of it then runs from when this instance took the report (`last_seen_ms`), late
        by the report's transit at most. Compared with this instance's clock, a node whose
        clock is ahead would have kept the model out for as much longer."""
        state = self.nodes.get(node_id)
        if state is None or not state.load_failures:
            return frozenset()
        taken_ms = self.last_seen_ms.get(node_id, now_ms)
        return frozenset(f.model for f in state.load_failures
                         if taken_ms + f.until_ms - state.reported_at_ms > now_ms)

    def live_nodes(self, now_ms: int, node_timeout_ms: int) -> set[str]:
        return {n for n, seen in self.last_seen_ms.items() if now_ms - seen <= node_timeout_ms
                and (state := self.nodes.get(n)) is not None and state.status != "stopped"}

    def silent(self, now_ms: int, node_timeout_ms: int) -> list[str]:
        """Nodes silent past the time-out and not declared lost yet."""
        return [n for n, seen in self.last_seen_ms.items()
                if now_ms - seen > node_timeout_ms and n not in self.lost]

    def mark_lost(self, node_ids: list[str]) -> None:
        """Declare these silent nodes lost (until they report again): their reservations go."""
        self.lost.update(node_ids)
        for node_id in node_ids:
            for pid in list(self._by_node.get(node_id, ())):
                self.release(pid)

    def node_reservations(self, node_id: str) -> tuple[dict[int, int], dict[int, set[str]]]:
        """One node's reserved MiB per GPU index, and the models its placements already sent
        will load per GPU index (they count as loaded for affinity)."""
        mib: dict[int, int] = {}
        models: dict[int, set[str]] = {}
        held: set[tuple[int, str]] = set()
        relied: dict[tuple[int, str], int] = {}
        for r in self._by_node.get(node_id, {}).values():
            for g in r.gpu_indices:
                mib[g] = mib.get(g, 0) + r.memory_mib_per_gpu
                models.setdefault(g, set()).add(r.weights)
                if r.relies_mib:
                    relied[g, r.weights] = max(relied.get((g, r.weights), 0), r.relies_mib)
                else:
                    held.add((g, r.weights))
        if relied:
            state = self.nodes.get(node_id)
            shown = {(gpu.index, m) for gpu in state.gpus for m in gpu.loaded_models} \
                if state is not None else set()
            for (g, weights), extra in relied.items():
                if (g, weights) not in held and (g, weights) not in shown:
                    mib[g] = mib.get(g, 0) + extra
        return mib, models

    def gpu_states(self, live: set[str]) -> dict[tuple[str, str], int]:
        """How many GPUs per (GPU type, state), for operators: `unreachable` on a node not in
        `live`, else `unhealthy`; `serving` with requests running on it or placements sent
        to it; `loaded` with models in memory and nothing serving; else `empty`."""
        counts: dict[tuple[str, str], int] = {}
        for node_id, state in self.nodes.items():
            _, sent = self.node_reservations(node_id)
            for gpu in state.gpus:
                if node_id not in live:
                    what = "unreachable"
                elif not gpu.healthy:
                    what = "unhealthy"
                elif gpu.running_requests or gpu.index in sent:
                    what = "serving"
                else:
                    what = "loaded" if gpu.loaded_models else "empty"
                counts[gpu.gpu_type, what] = counts.get((gpu.gpu_type, what), 0) + 1
        return counts

    def _bump(self, node_id: str) -> None:
        self.version[node_id] = self.version.get(node_id, 0) + 1
