"""One scheduling cycle's decisions: turn the cluster view and the ordered pending work into
solver arrays, solve the ordered chunks (strict priority), and plan preemptions for work that
fits nowhere. Pure: no I/O, time passed in."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from gpusched_common.catalog import ModelCatalog, ModelSpec, weights_name
from gpusched_common.contracts import InferenceRequest
from gpusched_scheduler.domain.cluster import ClusterView
from gpusched_scheduler.domain.ordering import Chunk
from gpusched_scheduler.domain.queue import Pending
from gpusched_scheduler.domain.running import RunningPlacement
from gpusched_scheduler.domain.solver import (
    MAX_GPU_TYPES,
    ClusterState,
    GpuSpec,
    NodeSpec,
    Placed,
    Reason,
    RunningWork,
    ShapeDistribution,
    SolveResult,
    Unschedulable,
    WorkBatch,
    get_policy,
    plan_preemption,
    solve,
    unload_model,
)

NODE_CAPACITY = 10**12
"""Inference placements ask nothing of a node's CPU and memory; only GPUs bind."""
GPU_SHARE_MILLI = 1
"""Requests share a GPU by memory (continuous batching); compute share is not reserved."""
CLASS_PRIORITY = {"interactive": 3, "standard": 2, "batch": 1}
MODELS_MARK = "|"
"""In the solver's GPU type names only: a node that runs some catalog models alone (its
`NodeState.models`) has its GPUs typed `<GPU type>|<model>,<model>...`, and each unit is
allowed the types that run its model (catalog names hold neither `|` nor `,`). With no
node restricted, types and units are as they were: the solver's input is unchanged."""

FleetNode = tuple[tuple[int, ...], frozenset[str] | None]
"""A node's GPU memory sizes (MiB) and the catalog models it runs (None: every one)."""


def request_tokens(request: InferenceRequest) -> int:
    return request.prompt_token_count + request.max_tokens


def memory_per_gpu(request: InferenceRequest, model: ModelSpec) -> tuple[int, int]:
    """(KV cache MiB, weights MiB) on each GPU of the request's gang (split evenly); the KV
    cache of a resumed request is sized by its prompt as its engine counted it."""
    return gang_memory_per_gpu(model, request.context_tokens(model.context_limit_tokens),
                               request.num_gpus)


def gang_memory_per_gpu(model: ModelSpec, tokens: int, num_gpus: int) -> tuple[int, int]:
    """(KV cache MiB of `tokens` tokens, weights MiB) on each GPU of a `num_gpus` gang
    (split evenly, rounded up)."""
    return -(-model.kv_cache_mib(tokens) // num_gpus), -(-model.weight_memory_mib // num_gpus)


def estimate_gpu_s(request: InferenceRequest, model: ModelSpec) -> float:
    """A rough cost used for fairness until the measured usage arrives: decode-bound time of
    ~1 ms per billion parameters per token, shared over ~8 requests per GPU."""
    return request.max_tokens * model.parameters_b * 1e-3 / 8 * request.num_gpus


EARLIER_ATTEMPT_GPU_S = 30.0
"""What each earlier attempt of a victim's request (any requeue: preempted, its node lost or
drained, handed back) adds to the progress a preemption plan loses by stopping it, in
GPU-seconds: a rough price of one more restart (the prompt and the tokens so far prefilled
again, maybe a model load, the queue). Only a retry the scheduler confirmed is priced so
(`RunningPlacement.retry`): a record that only says `"attempt": 99` was the last victim any
plan picked. By progress alone, a borrower's hand-back was the cheapest victim of a tenant
reclaiming its guarantee again and again; docs/ARCHITECTURE.md (Preemption) gives the
simulation's numbers and the trade-off."""

Evictable = tuple[tuple[int, int, frozenset[str]], ...]
"""A node's GPUs with idle models: (GPU index, MiB its agent would free by unloading them,
those models)."""


@dataclass(frozen=True)
class Snapshot:
    """The schedulable fleet as solver arrays, with the mapping back to node ids, and what
    unloading idle models would free on each node that has any (`evictable`)."""

    state: ClusterState
    node_index: dict[str, int]
    evictable: dict[str, Evictable]
    crowded: tuple[str, ...] = ()
    """Ready, live nodes left out: their GPU type and model set would be one more distinct
    solver type than its 64-bit type mask holds (`MAX_GPU_TYPES`)."""


SpecKey = tuple[int, frozenset[str]]
"""What a node's spec is built from: the view's version of the node, and the models whose
load failed there that it asks not to get now (`ClusterView.load_failed`)."""


class NodeSpecCache:
    """The last snapshot and each node's spec (and idle memory) with what it was built from
    (`SpecKey`). Between two cycles most nodes keep their GPUs and reservations: their specs
    are reused, and only the GPUs whose spec changed are rewritten in the solver arrays."""

    def __init__(self) -> None:
        self.specs: dict[str, tuple[SpecKey, NodeSpec, Evictable]] = {}
        self.last: Snapshot | None = None


def snapshot(view: ClusterView, live: set[str], cache: NodeSpecCache | None = None, *,
             now_ms: int | None = None, catalog: ModelCatalog | None = None) -> Snapshot:
    """Ready, live nodes with every GPU (unhealthy ones marked, so indices stay the node's
    own); free memory is net of reservations the agents have not reported yet. With a
    cache, a node whose GPUs and reservations did not change since the last call keeps its
    spec, and the last snapshot's arrays are copied with only the changed GPUs rewritten.

    At `now_ms` (None: load failures are not looked at), a node takes no work of the
    models whose load failed there lately (`ClusterView.load_failed`): its GPUs are typed
    as running the others (of the `catalog`, where it names none), so that work goes to
    other nodes or waits, as it does for a node that is away, until the node's cooldown
    ends. `fleet_gpu_mib`, which decides what is rejected, still counts the node as
    running them: a cooldown never makes a request unschedulable."""
    nodes = view.nodes
    specs: list[NodeSpec] = []
    kept: dict[str, tuple[SpecKey, NodeSpec, Evictable]] = {}
    evictable: dict[str, Evictable] = {}
    # node index -> (its new spec, the spec the last snapshot was built from)
    changed: dict[int, tuple[NodeSpec, NodeSpec | None]] = {}
    types: set[str] = set()
    crowded: list[str] = []
    ready = sorted(n for n in nodes if n in live and nodes[n].status == "ready")
    cooling = _cooling(view, ready, now_ms, catalog) if now_ms is not None else {}
    for node_id in ready:
        key = (view.version.get(node_id, 0), cooling.get(node_id, frozenset()))
        hit = cache.specs.get(node_id) if cache is not None else None
        if hit is not None and hit[0] == key:
            _, spec, idle = hit
        else:
            spec, idle = _node_spec(view, node_id, _taking(nodes[node_id].models, key[1],
                                                           catalog))
        new = {g.type_name for g in spec.gpus} - types  # not a copy of `types` per node
        if len(types) + len(new) > MAX_GPU_TYPES:
            crowded.append(node_id)
            continue
        types |= new
        if hit is None or hit[0] != key:
            changed[len(specs)] = (spec, hit[1] if hit is not None else None)
        kept[node_id] = (key, spec, idle)
        specs.append(spec)
        if idle:
            evictable[node_id] = idle
    node_index = {s.node_id: i for i, s in enumerate(specs)}
    if cache is None:
        return Snapshot(ClusterState.from_nodes(specs), node_index, evictable, tuple(crowded))
    cache.specs = kept
    last = cache.last
    cluster = None
    if last is not None and last.node_index == node_index:
        gpus = _changed_gpus(last.state, changed)
        if gpus is not None:
            cluster = last.state.with_gpus(gpus) if gpus else last.state
    cache.last = Snapshot(cluster or ClusterState.from_nodes(specs), node_index, evictable,
                          tuple(crowded))
    return cache.last


def _cooling(view: ClusterView, ready: list[str], now_ms: int,
             catalog: ModelCatalog | None) -> dict[str, frozenset[str]]:
    """Per node of `ready`, the models it serves whose load failed there lately and that
    it asks not to get now (`ClusterView.load_failed`; a model it does not serve, or one
    the catalog lacks, changes nothing). None at all where the types they give the nodes'
    GPUs (`_taking`) would be more than the solver holds (`MAX_GPU_TYPES`): a cooldown is
    the node's request, not worth another node's every placement."""
    cooling: dict[str, frozenset[str]] = {}
    for node_id in ready:
        failed = view.load_failed(node_id, now_ms)
        if failed:
            served = view.nodes[node_id].models
            assert catalog is not None, "load failures are judged against the catalog"
            failed &= frozenset(catalog.names if served is None else served)
            if failed:
                cooling[node_id] = failed
    if not cooling:
        return cooling

    def types(node_id: str, models: Collection[str] | None) -> set[str]:
        return {_solver_type(g.gpu_type, models) for g in view.nodes[node_id].gpus}

    kinds = set().union(*(types(n, view.nodes[n].models) for n in ready), *(
        types(n, _taking(view.nodes[n].models, failed, catalog))
        for n, failed in cooling.items()))
    return cooling if len(kinds) <= MAX_GPU_TYPES else {}


def _taking(models: Collection[str] | None, failed: frozenset[str],
            catalog: ModelCatalog | None) -> Collection[str] | None:
    """The models a node that runs `models` (None: every one of the `catalog`) takes work
    of now: all but those whose load `failed` there lately (`_cooling`)."""
    if not failed:
        return models
    if models is None:
        assert catalog is not None, "a node running every model needs the catalog"
        models = catalog.names
    return frozenset(models) - failed


def _node_spec(view: ClusterView, node_id: str, models: Collection[str] | None
               ) -> tuple[NodeSpec, Evictable]:
    """The node's solver spec, its GPUs typed as running `models` (None: every one; see
    `_taking`), with free memory net of reservations the agent has not reported (models
    those placements load count as loaded), and what unloading its idle models would free
    per GPU, net of the same reservations (they may rely on it). A GPU where such a
    placement uses one of its idle models has none (that model is busy)."""
    reserved, loading = view.node_reservations(node_id)
    gpus = sorted(view.nodes[node_id].gpus, key=lambda g: g.index)
    spec = NodeSpec(node_id, NODE_CAPACITY, NODE_CAPACITY, tuple(
        GpuSpec(_solver_type(g.gpu_type, models), 1000 - min(999, g.running_requests),
                max(0, g.memory_free_mib - reserved.get(g.index, 0)), g.memory_total_mib,
                g.healthy, g.loaded_models if g.index not in loading
                else tuple(set(g.loaded_models) | loading[g.index]))
        for g in gpus))
    idle: list[tuple[int, int, frozenset[str]]] = []
    for g in gpus:
        if not g.idle_models or g.kv_cache_free_mib is None:
            continue
        unused = frozenset(g.idle_models)
        if unused & loading.get(g.index, set()):
            continue
        free = g.memory_free_mib - reserved.get(g.index, 0)
        # the spec's free memory is max(0, free); with the idle models unloaded, free + theirs
        gain = free + (g.kv_cache_free_mib - g.memory_free_mib) - max(0, free)
        if gain > 0:
            idle.append((g.index, gain, unused))
    return spec, tuple(idle)


def _changed_gpus(state: ClusterState, changed: dict[int, tuple[NodeSpec, NodeSpec | None]]
                  ) -> dict[int, GpuSpec] | None:
    """The GPU rows whose spec differs from the one `state` was built from, or None when a
    node's GPU count or its own CPU or memory changed (built afresh then)."""
    rows: dict[int, GpuSpec] = {}
    for n, (spec, old) in changed.items():
        if old is None or len(old.gpus) != len(spec.gpus) or _node_own(old) != _node_own(spec):
            return None
        start = int(state.node_gpu_start[n])
        rows.update((start + j, g) for j, (g, was) in enumerate(zip(spec.gpus, old.gpus))
                    if g != was)
    return rows


def _node_own(spec: NodeSpec) -> tuple:
    return spec.cpu_milli, spec.memory_mib, spec.cpu_total_milli, spec.memory_total_mib


@dataclass(frozen=True)
class Place:
    item: Pending
    node_id: str
    gpu_indices: tuple[int, ...]
    kv_cache_mib: int
    memory_mib_per_gpu: int


@dataclass(frozen=True)
class Reject:
    item: Pending
    reason: str


@dataclass(frozen=True)
class Room:
    """The GPUs of one node a preempting request's plan runs it on once its victims have
    stopped: kept for it until it is placed or the preemption times out."""

    node_id: str
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class Preemption:
    item: Pending
    node_id: str
    victims: tuple[RunningPlacement, ...]
    gpu_seconds_lost: float
    room: Room | None = None
    """Where the plan runs its request once the victims have stopped: every GPU it counts
    on, those without a victim too (a gang's)."""
    unloads: tuple[tuple[int, str, int], ...] = ()
    """(GPU index, weights, MiB) on its node that the plan counts on unloading: every user
    of those weights there is a victim, so they go idle once the victims stop, and the
    agent unloads idle models to admit the request (as for `Snapshot.evictable`)."""
    proven_optimal: bool = True
    """False where the solver's search ran out of steps (`SEARCH_BUDGET`): the cheapest
    plan it found, maybe not the cheapest there is."""


@dataclass(frozen=True)
class CycleDecisions:
    placed: list[Place]
    rejected: list[Reject]
    waiting: list[Pending]
    preemptions: list[Preemption]


def fleet_gpu_mib(view: ClusterView, now_ms: int, stopped_grace_ms: int) -> list[FleetNode]:
    """The memory of each GPU, and the models it runs, of every node that has not stopped,
    or whose `stopped` report this instance read within `stopped_grace_ms` of `now_ms`
    (an agent restarting is back within it; a node stopped for good counts no more after
    it, and work only it could hold gets its 422): live, silent past the time-out or
    draining, healthy or not. What can run on it one day decides whether a request that
    fits nowhere now waits or is rejected: a node that went quiet (Kafka restarting, a
    network blip) or an agent restarting does not make work impossible (a graceful restart
    reports `stopped`: the work it handed back, and new work only it could hold, got a 422
    until it was back, where a crash made it wait)."""
    return [(tuple(g.memory_total_mib for g in state.gpus),
             None if state.models is None else frozenset(state.models))
            for node_id, state in view.nodes.items() if state.status != "stopped"
            or now_ms - view.last_seen_ms.get(node_id, now_ms) <= stopped_grace_ms]


def plan_cycle(snap: Snapshot, chunks: list[Chunk], catalog: ModelCatalog, policy: str,
               running: Collection[RunningPlacement], now_ms: int,
               may_preempt: dict[str, int], *,
               fleet: Callable[[], Collection[FleetNode]],
               max_preemptions: int = 4, reclaiming: Collection[str] = (),
               borrowing: Collection[str] = (), borrowed: Collection[str] = (),
               guarded: Collection[str] = (), rooms: Mapping[str, Room] | None = None,
               stopping: Collection[RunningPlacement] = ()) -> CycleDecisions:
    """Solve the chunks in order, each on the state the previous left; after a chunk with
    work that has to wait for room to free up, later chunks wait too (they would take that
    room). Work that no live, healthy node could hold even empty (its GPUs are away or
    sick) waits without holding later chunks back: nothing they take would make it fit.
    `may_preempt` maps a request id to the highest victim priority it may preempt (1: batch
    and borrowed work, 0: borrowed work only); `borrowed` holds the running work beyond
    its tenant's guarantee (placement ids, judged this cycle); `reclaiming` the requests
    that stay inside their tenant's guarantee once placed, which alone may preempt
    borrowed work placed as aged. `borrowing` holds those that would be borrowed once
    placed: they may not preempt `guarded` work (placement ids: handed back it stays inside
    its tenant's guarantee), whose hand-back would reclaim its room from them, and so on
    forever; nor another tenant's borrowed work of their own class or above
    (`_victim_priority`). Work that fits nowhere now waits, unless it is invalid or no GPU
    of `fleet()` (`fleet_gpu_mib`, read once, when first needed) could ever hold it: then
    it is rejected with the reason.

    `rooms` maps a request whose preemption is under way to its room (the GPUs its plan
    runs it on once its victims stop): it is solved first, and while it waits the memory it
    needs in its room is out of reach of the rest (which no longer waits behind it), and so
    are the models it counts on there (no eviction unloads them). Before, the victims'
    hand-backs (first in their class, and aged) or any other work took that room as it
    freed, and the preemptor waited out the time-out to preempt again. `stopping` are the
    victims still running that were told to stop: later plans count their memory as coming
    free (less what the waiting preemptors need), so a request that fits in what is left
    waits for it instead of stopping other work.

    Work that fits nowhere while idle models hold GPU memory is solved once more on the
    state with that memory free (`Snapshot.evictable`): the agent unloads them to admit it.
    Only then, so that work of a loaded model still goes where it is loaded, and idle models
    stay for their next request until the room is needed.

    The solver places units online, in order, so the chunks go to it as one batch (one call
    per cycle: the call's fixed cost exceeds a few units' work). Only when a chunk before the
    last has work that waits is the batch solved again, up to that chunk, for the state its
    later chunks must not have touched. Fragmentation-aware policies measure against the
    whole cycle's shapes either way."""
    placed: list[Place] = []
    rejected: list[Reject] = []
    waiting: list[Pending] = []
    preemptions: list[Preemption] = []
    state = snap.state
    holder: Pending | None = None  # the aged unit that waits with GPUs kept for it
    kept_rows: list[int] = []  # those GPUs, kept from the plans after it too
    items = [item for chunk in chunks for item in chunk.items]
    blocked: list[int] = []  # units of the first chunk with work that waits, that fit nowhere
    kept = Kept()
    shapes: ShapeDistribution | None = None
    if items:
        batch = _batch([i.request for i in items], catalog, state.type_names)
        shapes = ShapeDistribution.from_batch(batch) if get_policy(policy).uses_shapes \
            else None
        if rooms and any(i.request.request_id in rooms for i in items):
            chunks, state, kept = _solve_preemptors(state, snap, chunks, rooms, catalog,
                                                    policy, shapes, placed, waiting)
            items = [item for chunk in chunks for item in chunk.items]
            batch = _batch([i.request for i in items], catalog, state.type_names)
        result = solve(state, batch, policy, shapes=shapes)
        # (MiB per GPU, GPUs, model): the same all cycle
        never_fits: dict[tuple[int, int, str], bool] = {}
        known: Collection[FleetNode] | None = None  # fleet(), read at first need
        fits_live: dict[tuple[int, int, str], bool] = {}  # on a live, healthy node, were it empty
        live: list[FleetNode] | None = None  # _live_gpu_mib, read at first need
        holding = False  # an earlier chunk has work waiting for room that can free up
        # (first unit, its solve, the GPU rows kept from it) past an aged unit that waits
        aged_kept: tuple[int, SolveResult, list[int]] | None = None
        end = 0
        for chunk in chunks:
            end += len(chunk.items)
            if holding:
                waiting += chunk.items
                continue
            for u in range(end - len(chunk.items), end):
                item = items[u]
                outcome = result.outcome(u) if aged_kept is None else \
                    aged_kept[1].outcome(u - aged_kept[0])
                if hasattr(outcome, "gpu_indices"):
                    placed.append(_place(snap, batch, u, item, outcome))
                    continue
                kv, weight = int(batch.gpu_mem_mib[u]), int(batch.model_weight_mib[u])
                size = (kv + weight, item.request.num_gpus, item.request.model)
                if size not in never_fits:
                    known = fleet() if known is None else known
                    never_fits[size] = _never_fits(known, *size)
                if outcome.reason == Reason.INVALID_REQUEST:
                    rejected.append(Reject(item, outcome.message))
                elif never_fits[size]:
                    known = fleet() if known is None else known
                    rejected.append(Reject(item, _never_reason(item.request, kv, weight,
                                                               known)))
                else:
                    waiting.append(item)
                    blocked.append(u)
                    if size not in fits_live:
                        live = _live_gpu_mib(snap.state) if live is None else live
                        fits_live[size] = not _never_fits(live, *size)
                    holding |= fits_live[size]
                    if chunk.name == "aged" and fits_live[size] and aged_kept is None \
                            and u + 1 < len(items):
                        aged_kept = _keep_node_for(state, batch, u, end, policy, shapes,
                                                   *size[:2])
            if holding and aged_kept is None and end < len(items):
                result = solve(state, batch.take(slice(0, end)), policy, shapes=shapes)
        state = result.state if aged_kept is None else aged_kept[1].state
        room = _evicting(state, snap, placed, kept.models) if blocked and snap.evictable \
            else None
        if room is not None:
            # the aged units after one that keeps GPUs are kept from them, unless it fits now
            first = aged_kept[0] if aged_kept is not None else len(items)
            head, tail = [u for u in blocked if u < first], [u for u in blocked if u >= first]
            evicting = solve(room, batch.take(np.array(head, np.int64)), policy, shapes=shapes)
            outcomes = {u: evicting.outcome(j) for j, u in enumerate(head)}
            if tail:
                assert aged_kept is not None
                evicting = _solve_keeping(
                    evicting.state, batch.take(np.array(tail, np.int64)), policy, shapes,
                    [] if hasattr(outcomes[first - 1], "gpu_indices") else aged_kept[2])
                outcomes.update((u, evicting.outcome(j)) for j, u in enumerate(tail))
            now_placed: set[int] = set()  # ids of their items
            for u in blocked:
                outcome = outcomes[u]
                if hasattr(outcome, "gpu_indices"):
                    placed.append(_place(snap, batch, u, items[u], outcome))
                    now_placed.add(id(items[u]))
            waiting = [item for item in waiting if id(item) not in now_placed]
            state = evicting.state
        if aged_kept is not None and any(w is items[aged_kept[0] - 1] for w in waiting):
            holder, kept_rows = items[aged_kept[0] - 1], aged_kept[2]
    if running and may_preempt:
        eligible = [i for i in waiting if may_preempt.get(i.request.request_id) is not None]
        # The GPUs kept for the aged unit that waits are out of reach of the plans too: work
        # that fit only there planned nothing (it "fit already") and waited for the aged
        # unit, and a plan's room there was solved first next cycle, taking the kept memory.
        # Not where that unit plans one itself, nor a tenant reclaiming its guarantee (its
        # borrowed victims may run only there): those plans see every GPU, so this cycle's
        # do, in order
        plan_state = state
        if kept_rows and not any(i is holder or i.request.request_id in reclaiming
                                 for i in eligible):
            plan_state = _hiding(state, kept_rows)
        preemptions += _plan_preemptions(
            eligible, plan_state, snap, catalog, policy, shapes, running, now_ms, may_preempt,
            reclaiming, borrowing, borrowed, guarded, max_preemptions,
            # the state once the victims stopping already have stopped and their
            # preemptors run
            _coming_free(plan_state, snap, stopping, kept) if stopping or kept.debt else None,
            _weights_users([*running, *stopping]), _counted_on(placed, kept.models))
    return CycleDecisions(_weights_once(placed), rejected, waiting, preemptions)


def _plan_preemptions(eligible: list[Pending], state: ClusterState, snap: Snapshot,
                      catalog: ModelCatalog, policy: str, shapes: ShapeDistribution | None,
                      running: Collection[RunningPlacement], now_ms: int,
                      may_preempt: dict[str, int], reclaiming: Collection[str],
                      borrowing: Collection[str], borrowed: Collection[str],
                      guarded: Collection[str], most: int,
                      freed: ClusterState | None, users: Mapping[WeightsAt, set[str]],
                      busy: dict[tuple[str, int], set[str]]) -> list[Preemption]:
    """Plans for `eligible` (waiting work that may preempt), in order. `freed` is the state
    once what is being stopped has stopped (None: nothing is): work that fits in what is
    left of it waits for it, and a plan needs only the victims that room lacks; each plan
    made adds its own. Work is tried in runs: one solve of all the rest finds the leading
    ones that fit (they wait, their share taken), and the first that does not is planned
    on what is left before them; a plan that fails takes nothing, so that solve holds for
    the rest until a plan succeeds. A solve per waiting request, every cycle while a victim
    stopped, made cycles 5x longer; one for all of them let later requests take the room
    an earlier one needed before it was planned. `users` and `busy` are as `_plan` takes
    them; each plan made adds the weights its request counts on in its room to `busy`."""
    out: list[Preemption] = []
    taken: set[str] = set()
    i = 0
    trial: tuple[int, SolveResult] | None = None  # (first unit, its solve on `freed`)
    while i < len(eligible) and len(out) < most:
        if freed is not None:
            if trial is None:
                trial = i, solve(freed, _batch([e.request for e in eligible[i:]], catalog,
                                               freed.type_names), policy, shapes=shapes)
            first, result = trial
            j = i
            while j < len(eligible) and hasattr(result.outcome(j - first), "gpu_indices"):
                j += 1
            if j > i:  # they wait for room coming free: their share of it is taken, and
                # the weights they count on there stay (a later plan unloads none of them)
                waits = solve(freed, _batch([e.request for e in eligible[i:j]], catalog,
                                            freed.type_names), policy, shapes=shapes)
                for k, e in enumerate(eligible[i:j]):
                    if isinstance(outcome := waits.outcome(k), Placed):
                        _count_on(busy, outcome.node_id, outcome.gpu_indices, e.request)
                freed, i = waits.state, j
                continue
        item = eligible[i]
        i += 1
        request_id = item.request.request_id
        plan = _plan(freed or state, snap, item, catalog, running, now_ms,
                     may_preempt[request_id], taken, request_id in reclaiming,
                     request_id in borrowing, borrowed, guarded, users, busy)
        if plan is not None:
            taken |= {v.placement_id for v in plan.victims}
            freed, room = _stopped(freed or state, snap, plan,
                                   _batch([item.request], catalog, state.type_names), policy,
                                   shapes)
            # a later plan unloads none of the weights its room counts on
            _count_on(busy, room.node_id, room.gpu_indices, item.request)
            out.append(replace(plan, room=room))
            trial = None  # the rest is tried again on what this plan frees
    return out


@dataclass
class Kept:
    """What the preemptors still waiting for their rooms hold there: per GPU row, the
    memory they need beyond what is free now (`debt`: it comes free as their victims stop),
    and per (node id, GPU index) the weights they count on being loaded (`models`)."""

    debt: dict[int, int] = field(default_factory=dict)
    models: dict[tuple[str, int], set[str]] = field(default_factory=dict)


def _solve_preemptors(state: ClusterState, snap: Snapshot, chunks: list[Chunk],
                      rooms: Mapping[str, Room], catalog: ModelCatalog, policy: str,
                      shapes: ShapeDistribution | None, placed: list[Place],
                      waiting: list[Pending]) -> tuple[list[Chunk], ClusterState, Kept]:
    """Place the work with a room first (into `placed`, or `waiting` with its room kept);
    returns the other chunks, the state they are solved on, where each GPU of the room of
    one that waits has the memory it needs there taken off (the rest of the GPU, and other
    victims on it, stay for other work and other preemptions), and what those hold."""
    first = [i for chunk in chunks for i in chunk.items if i.request.request_id in rooms]
    batch = _batch([i.request for i in first], catalog, state.type_names)
    result = solve(state, batch, policy, shapes=shapes)
    out = result.state
    outcomes = [result.outcome(u) for u in range(len(first))]
    _place_evicting(out, snap, batch, outcomes, policy, shapes, [
        _place(snap, batch, u, first[u], o) for u, o in enumerate(outcomes)
        if hasattr(o, "gpu_indices")])
    kept = Kept()
    for u, item in enumerate(first):
        outcome = outcomes[u]
        if hasattr(outcome, "gpu_indices"):
            placed.append(_place(snap, batch, u, item, outcome))
            continue
        waiting.append(item)
        room = rooms[item.request.request_id]
        n = snap.node_index.get(room.node_id)
        if n is None:
            continue  # its node is away: the room is gone with it
        start, end = int(out.node_gpu_start[n]), int(out.node_gpu_start[n + 1])
        kv, weight = int(batch.gpu_mem_mib[u]), int(batch.model_weight_mib[u])
        weights = _loads(item.request)
        idle = _idle_models(snap, room.node_id)
        for g in room.gpu_indices:
            if start + g >= end:
                continue
            row = start + g
            need = kv + (0 if _loaded_on_row(out, row, weights) else weight)
            free = int(out.gpu_mem_free_mib[row])
            out.gpu_mem_free_mib[row] = max(0, free - need)
            if need > free:
                kept.debt[row] = kept.debt.get(row, 0) + need - free
            # its weights, and the idle models there: its plan may count on their memory
            kept.models.setdefault((room.node_id, g), set()).update(
                {weights} | idle.get(g, frozenset()))
    ids = {id(i) for i in first}
    rest = [Chunk(c.name, [i for i in c.items if id(i) not in ids]) for c in chunks]
    return [c for c in rest if c.items], out, kept


def _place_evicting(state: ClusterState, snap: Snapshot, batch: WorkBatch,
                    outcomes: list[Placed | Unschedulable], policy: str,
                    shapes: ShapeDistribution | None, placed: list[Place]) -> None:
    """The units of `batch` that `outcomes` leaves unplaced, solved again with idle models
    unloaded (a preemption is planned on that state, so its plan may count on it) but those
    `placed` work uses; each that fits now gets its outcome, and `state` its GPUs as they
    are then (idle models there unloaded, its memory taken)."""
    unplaced = [u for u, o in enumerate(outcomes) if not hasattr(o, "gpu_indices")]
    evicted = _evicting(state, snap, placed, {}) if unplaced and snap.evictable else None
    if evicted is None:
        return
    again = solve(evicted, batch.take(np.array(unplaced, np.int64)), policy, shapes=shapes)
    for j, u in enumerate(unplaced):
        outcome = again.outcome(j)
        if not hasattr(outcome, "gpu_indices"):
            continue
        outcomes[u] = outcome
        start = int(state.node_gpu_start[snap.node_index[outcome.node_id]])
        idle = _idle_models(snap, outcome.node_id)
        for g in outcome.gpu_indices:
            row = start + g
            if not np.array_equal(evicted.gpu_models[row], state.gpu_models[row]):
                for model in idle.get(g, ()):  # unloaded there (not kept for placed work)
                    unload_model(state, row, model, 0, inplace=True)
            state.gpu_mem_free_mib[row] = again.state.gpu_mem_free_mib[row]


def _stopped(state: ClusterState, snap: Snapshot, plan: Preemption, unit: WorkBatch,
             policy: str, shapes: ShapeDistribution | None) -> tuple[ClusterState, Room]:
    """`state` once `plan`'s victims have freed their KV caches (and the weights it counts
    on unloading) and its request runs, and the GPUs it runs on there."""
    stopped = _with_stopped(state, snap, plan.victims)
    if plan.unloads:
        start = int(stopped.node_gpu_start[snap.node_index[plan.node_id]])
        for g, weights, mib in plan.unloads:
            unload_model(stopped, start + g, weights, mib, inplace=True)
    result = solve(stopped, unit, policy, shapes=shapes)
    outcome = result.outcome(0)
    if hasattr(outcome, "gpu_indices"):
        return result.state, Room(outcome.node_id, outcome.gpu_indices)
    # not expected (the plan made it fit): keep at least the victims' GPUs
    return result.state, Room(plan.node_id, tuple(sorted({g for v in plan.victims
                                                           for g in v.gpu_indices})))


def _with_stopped(state: ClusterState, snap: Snapshot,
                  victims: Collection[RunningPlacement]) -> ClusterState:
    """A copy of `state` with the KV caches of `victims` free (their models stay loaded)."""
    out = state.copy()
    for victim in victims:
        n = snap.node_index.get(victim.node_id)
        if n is None:
            continue
        start, end = int(out.node_gpu_start[n]), int(out.node_gpu_start[n + 1])
        for g in victim.gpu_indices:
            if start + g < end:  # a report of fewer GPUs than it runs on
                out.gpu_mem_free_mib[start + g] += victim.kv_cache_mib
    return out


def _coming_free(state: ClusterState, snap: Snapshot, stopping: Collection[RunningPlacement],
                 kept: Kept) -> ClusterState:
    """`state` once the victims told to stop have stopped and the preemptors waiting for
    them run: their needs were taken off `state` only down to nothing (`kept.debt` holds
    the rest), so a victim's memory coming free goes to them first."""
    out = _with_stopped(state, snap, stopping)
    for row, debt in kept.debt.items():
        out.gpu_mem_free_mib[row] = max(0, int(out.gpu_mem_free_mib[row]) - debt)
    return out


def _place(snap: Snapshot, batch: WorkBatch, u: int, item: Pending, outcome: Placed) -> Place:
    """Unit `u` placed: it reserves its KV cache, and its weights where they are not loaded."""
    kv, weight = int(batch.gpu_mem_mib[u]), int(batch.model_weight_mib[u])
    loaded = _loaded_on(snap, outcome.node_id, outcome.gpu_indices, _loads(item.request))
    return Place(item, outcome.node_id, outcome.gpu_indices, kv, kv + (0 if loaded else weight))


def _weights_once(placed: list[Place]) -> list[Place]:
    """`placed` (in the order they were solved) with each one's weights reserved once: a
    placement on the GPUs where an earlier one of this cycle loads the same weights (a
    gang's shards: on the same GPUs) reserves its KV cache alone, as the solver and the
    agent load them once. Before, each reserved them, and its RunningPlacement kept them
    for life: the next cycles saw the GPU fuller than it was, and the tenant held more
    than it did (its work could be marked borrowed)."""
    loading: set[tuple[str, tuple[int, ...], str]] = set()
    out: list[Place] = []
    for p in placed:
        key = (p.node_id, tuple(sorted(p.gpu_indices)), _loads(p.item.request))
        if key in loading and p.memory_mib_per_gpu != p.kv_cache_mib:
            p = replace(p, memory_mib_per_gpu=p.kv_cache_mib)
        loading.add(key)
        out.append(p)
    return out


def _keep_node_for(state: ClusterState, batch: WorkBatch, u: int, end: int, policy: str,
                   shapes: ShapeDistribution | None, mib_per_gpu: int, num_gpus: int
                   ) -> tuple[int, SolveResult, list[int]]:
    """Aged unit `u` waits for room: keep the GPUs closest to holding it (of the live nodes
    that could, empty: the `num_gpus` such GPUs of one node with the most memory free now)
    out of reach of the later aged units `u + 1 .. end - 1`, which are solved again on the
    rest, the node's other GPUs included, and of the preemptions planned for the work
    after it (`plan_cycle`; kept whenever work follows it, aged or not). Before, they took
    each GPU that freed there, and an aged gang of an overloaded class never saw two free
    at once (a probe: never placed in 600 s). Returns (u + 1, their solve, whose state
    holds those GPUs as they are, the GPU rows kept): the idle-model eviction pass keeps
    them from those units too."""
    head = solve(state, batch.take(slice(0, u + 1)), policy, shapes=shapes)
    at = head.state
    t = int(batch.type_set[u])  # the GPU types that run its model
    mask = at.type_mask(None if t < 0 else batch.type_sets[t])
    best: list[int] = []  # GPU rows
    best_free = -1
    starts = at.node_gpu_start.tolist()
    for a, b in zip(starts, starts[1:]):
        rows = sorted((g for g in range(a, b)
                       if at.gpu_healthy[g] and at.gpu_mem_total_mib[g] >= mib_per_gpu
                       and (mask >> int(at.gpu_type[g])) & 1),
                      key=lambda g: -int(at.gpu_mem_free_mib[g]))[:num_gpus]
        free = sum(int(at.gpu_mem_free_mib[g]) for g in rows)
        if len(rows) == num_gpus and free > best_free:
            best, best_free = rows, free
    if u + 1 == end:  # no aged unit after it: kept from the plans alone (solved already)
        return u + 1, head, best
    return u + 1, _solve_keeping(at, batch.take(slice(u + 1, end)), policy, shapes, best), best


def _solve_keeping(state: ClusterState, batch: WorkBatch, policy: str,
                   shapes: ShapeDistribution | None, rows: list[int]) -> SolveResult:
    """`batch` solved on `state` with the GPU `rows` out of its reach; the result's state
    has them as `state` has."""
    if not rows:
        return solve(state, batch, policy, shapes=shapes)
    out = solve(_hiding(state, rows), batch, policy, shapes=shapes)
    out.state.gpu_healthy[rows] = state.gpu_healthy[rows]
    return out


def _hiding(state: ClusterState, rows: list[int]) -> ClusterState:
    """A copy of `state` where the GPU `rows` take no work (unhealthy)."""
    hidden = state.copy()
    hidden.gpu_healthy[rows] = False
    return hidden


def _evicting(state: ClusterState, snap: Snapshot, placed: list[Place],
              kept: Mapping[tuple[str, int], set[str]]) -> ClusterState | None:
    """`state` with the memory of idle models free and those models no longer loaded (a
    unit of one of them is charged its weights again, against memory that holds them), or
    None when no GPU has any. GPUs where this cycle placed work of one of their idle models,
    or where a waiting preemptor counts on one (`kept`), are left as they are."""
    busy = _counted_on(placed, kept)
    room: ClusterState | None = None
    for node_id, gpus in snap.evictable.items():
        start = int(state.node_gpu_start[snap.node_index[node_id]])
        for index, gain, idle in gpus:
            if idle & busy.get((node_id, index), set()) or not any(
                    _loaded_on_row(state, start + index, m) for m in idle):
                continue  # kept, or unloaded already (its memory counted free then)
            room = room if room is not None else state.copy()
            for model in idle:  # their weights are in `gain`, net of reservations
                unload_model(room, start + index, model, 0, inplace=True)
            room.gpu_mem_free_mib[start + index] += gain
    return room


def _counted_on(placed: list[Place], kept: Mapping[tuple[str, int], set[str]]
                ) -> dict[tuple[str, int], set[str]]:
    """(node id, GPU index) -> the weights this cycle's placements there, and the waiting
    preemptors whose room it is (`kept`), count on staying loaded: none is unloaded."""
    busy: dict[tuple[str, int], set[str]] = {k: set(v) for k, v in kept.items()}
    for p in placed:
        _count_on(busy, p.node_id, p.gpu_indices, p.item.request)
    return busy


def _count_on(busy: dict[tuple[str, int], set[str]], node_id: str, gpus: tuple[int, ...],
              request: InferenceRequest) -> None:
    """Note in `busy` (see `_counted_on`) that `request` counts on its weights on `gpus`."""
    for g in gpus:
        busy.setdefault((node_id, g), set()).add(request_weights(request))


def _batch(requests: list[InferenceRequest], catalog: ModelCatalog, types: tuple[str, ...],
           priority: list[int] | None = None) -> WorkBatch:
    """The solver units of `requests` on a state with the GPU type names `types`: each
    allowed only the types that run its model, where some node runs only some models."""
    sizes = [memory_per_gpu(r, catalog.get(r.model)) for r in requests]
    allowed = None
    if any(MODELS_MARK in t for t in types):
        serving = {m: frozenset(t for t in types if _type_serves(t, m))
                   for m in {r.model for r in requests}}
        allowed = [serving[r.model] for r in requests]
    return WorkBatch.from_units(
        num_gpu=[r.num_gpus for r in requests], gpu_milli=[GPU_SHARE_MILLI] * len(requests),
        cpu_milli=[0] * len(requests), mem_mib=[0] * len(requests),
        gpu_mem_mib=[kv for kv, _ in sizes], allowed_gpu_types=allowed,
        model_id=[_loads(r) for r in requests],
        model_weight_mib=[w for _, w in sizes],
        priority=priority or [CLASS_PRIORITY[r.priority_class] for r in requests],
        tenant=[r.tenant for r in requests], unit_ids=[r.request_id for r in requests])


def _solver_type(gpu_type: str, models: Collection[str] | None) -> str:
    """The solver's type name of a GPU of a node that runs `models` (None: every one)."""
    return gpu_type if models is None else \
        f"{gpu_type}{MODELS_MARK}{','.join(sorted(models))}"


def _type_models(type_name: str) -> frozenset[str] | None:
    """The models the GPUs of a solver type name run (None: every one)."""
    _, mark, models = type_name.partition(MODELS_MARK)
    return frozenset(models.split(",")) - {""} if mark else None


def _type_serves(type_name: str, model: str) -> bool:
    return _runs(_type_models(type_name), model)


def _runs(models: Collection[str] | None, model: str) -> bool:
    """Whether a node that runs `models` (None: every one) runs `model`."""
    return models is None or model in models


def request_weights(request: InferenceRequest) -> str:
    """The weights a request runs on: its model whole, or its gang size's shards of it.
    Only GPUs that hold those count as having its model loaded (a shard of another gang
    size is of no use to it)."""
    return weights_name(request.model, request.num_gpus)


def _loads(request: InferenceRequest) -> str:
    """The weights a placement of `request` counts as loaded where GPUs hold them. A gang
    an agent refused before counts on none: agents report a gang's shards without the GPUs
    they belong together with, so the shards of two other gangs on a pair of GPUs looked
    like its own, the agent (which needs its own) refused it there, and the next cycle chose
    the same pair until the request failed."""
    weights = request_weights(request)
    return f"{weights}@own" if request.num_gpus > 1 and request.refused else weights


def _loaded_on(snap: Snapshot, node_id: str, gpus: tuple[int, ...], weights: str) -> bool:
    start = int(snap.state.node_gpu_start[snap.node_index[node_id]])
    return all(_loaded_on_row(snap.state, start + g, weights) for g in gpus)


def out_of_reach(snap: Snapshot, fleet: Collection[FleetNode], catalog: ModelCatalog
                 ) -> Callable[[InferenceRequest], bool]:
    """A test of whether a request waits for nodes that are away: no live, healthy node of
    `snap` could hold it even empty, while one of `fleet` could (so it is not rejected
    either). A cycle can do nothing for it."""
    live = _live_gpu_mib(snap.state)
    known: dict[tuple[int, int, str], bool] = {}

    def away(request: InferenceRequest) -> bool:
        kv, weight = memory_per_gpu(request, catalog.get(request.model))
        size = (kv + weight, request.num_gpus, request.model)
        if size not in known:
            known[size] = _never_fits(live, *size) and not _never_fits(fleet, *size)
        return known[size]
    return away


def _idle_models(snap: Snapshot, node_id: str) -> dict[int, frozenset[str]]:
    """The idle models on each GPU of a node that has any (GPU index -> models)."""
    return {index: models for index, _, models in snap.evictable.get(node_id, ())}


def _loaded_on_row(state: ClusterState, row: int, weights: str) -> bool:
    return weights in state.model_names and \
        state.model_names.index(weights) in state.gpu_models[row]


def _live_gpu_mib(state: ClusterState) -> list[FleetNode]:
    """The memory of each healthy GPU, and the models it runs, of every node in the
    snapshot (the live ones)."""
    starts = state.node_gpu_start.tolist()
    total, healthy = state.gpu_mem_total_mib.tolist(), state.gpu_healthy.tolist()
    types = state.gpu_type.tolist()
    return [(tuple(m for m, ok in zip(total[a:b], healthy[a:b]) if ok),
             _type_models(state.type_names[types[a]]) if b > a else None)
            for a, b in zip(starts, starts[1:])]


def _never_fits(fleet: Collection[FleetNode], mib_per_gpu: int, num_gpus: int, model: str
                ) -> bool:
    """True when no node of the fleet that runs `model` has `num_gpus` GPUs with that much
    memory in total. An empty fleet (no agent reported yet) rejects nothing: work waits for
    agents."""
    return bool(fleet) and not any(
        _runs(models, model) and sum(mib >= mib_per_gpu for mib in gpus)
        >= num_gpus for gpus, models in fleet)


def _never_reason(request: InferenceRequest, kv: int, weight: int,
                  fleet: Collection[FleetNode]) -> str:
    if not any(_runs(models, request.model) for _, models in fleet):
        return (f"no node of the fleet serves {request.model}: each node's agent runs only "
                "the models of its GPUSCHED_MODELS (or that its inference server lists), "
                f"and none names {request.model}; ask for a model a node serves, or have "
                "an operator serve this one")
    n = request.num_gpus
    which = "no node of the fleet" if all(models is None for _, models in fleet) else \
        f"no node of the fleet that serves {request.model}"
    return (f"{request.model} needs {kv + weight} MiB on each of {n} GPU(s) of one node "
            f"(weights {weight} + KV cache {kv} per GPU) and {which} has {n} "
            "GPU(s) with that much memory: run it on more GPUs (num_gpus on a Kafka record, "
            "or the model's num_gpus in models.yaml), or use a smaller model or fewer tokens")


WeightsAt = tuple[str, int, str]
"""(node id, GPU index, weights): a whole model loaded on one GPU of a node."""


@dataclass(frozen=True)
class _Victim:
    """What a plan may stop: one placement (its KV cache comes free), or every user of
    weights on a GPU together (their KV caches and, once they are idle, the weights)."""

    members: tuple[RunningPlacement, ...]
    priority: int
    memory_mib: int
    """Per GPU of the members' own."""
    unload: tuple[int, str, int] | None = None
    """(GPU index, weights, MiB) that go idle once the members stop."""


def _plan(state: ClusterState, snap: Snapshot, item: Pending, catalog: ModelCatalog,
          running: Collection[RunningPlacement], now_ms: int, ceiling: int, taken: set[str],
          reclaims: bool, borrows: bool, borrowed: Collection[str],
          guarded: Collection[str], users: Mapping[WeightsAt, set[str]],
          busy: Mapping[tuple[str, int], set[str]]) -> Preemption | None:
    """Victims: running work on live nodes with priority <= ceiling (`_victim_priority`:
    borrowed = 0, batch = 1), not already being preempted, not `guarded` from a preemptor
    that `borrows` (would be borrowed once placed), and not placed as aged work unless
    `borrowed` and taken back by work that `reclaims` its tenant's guarantee; cost =
    GPU-seconds of progress lost, `EARLIER_ATTEMPT_GPU_S` more per earlier attempt of a
    confirmed retry (`RunningPlacement.retry`; any other is priced as a first attempt).

    Stopping a victim frees its KV cache; its model stays loaded. Only when that finds no
    plan is it planned again with the weights too: where every user of a whole model on a
    GPU (`users`: the placements running or stopping there) is a victim, and no work of
    this cycle or waiting preemptor counts on that model there (`busy`), they go as one
    victim whose weights go idle once they stop, and the agent unloads idle models to
    admit the request. Before, a 70B gang waited behind batch 8B work for as long as it ran.
    Gangs are never such a victim: agents report each gang's shards alike, so whose shards
    a GPU holds is unknown."""
    tenant = item.request.tenant
    ranked = [(r, priority) for r in running if r.node_id in snap.node_index
              and r.placement_id not in taken
              and (not borrows or r.placement_id not in guarded or r.request.tenant == tenant)
              and (priority := _victim_priority(r, item.request, borrows, borrowed))
              <= ceiling
              and (not r.aged or (reclaims and r.placement_id in borrowed))]
    if not ranked:
        return None
    unit = _batch([item.request], catalog, state.type_names, [ceiling + 1])
    alone = [_Victim((r,), p, r.kv_cache_mib) for r, p in ranked]
    plan = _cheapest(state, snap, catalog, unit, alone, now_ms)
    if plan is None:
        groups = _idle_once_stopped(state, snap, catalog, ranked, users, busy,
                                    request_weights(item.request))
        if groups:
            grouped = {id(m) for v in groups for m in v.members}
            plan = _cheapest(state, snap, catalog, unit, groups + [
                v for v in alone if id(v.members[0]) not in grouped], now_ms)
            if plan is not None:
                plan = _fewest_stopped(state, snap, catalog, unit, plan, alone, now_ms)
    if plan is None:
        return None
    node, chosen, lost, proven = plan
    return Preemption(item, state.node_ids[node], tuple(m for v in chosen for m in v.members),
                      lost, unloads=tuple(v.unload for v in chosen if v.unload is not None),
                      proven_optimal=proven)


Plan = tuple[int, list[_Victim], float, bool]
"""A preemption plan as `_cheapest` finds it: node row, victims, GPU-seconds lost, and
whether the solver's search finished."""


def _fewest_stopped(state: ClusterState, snap: Snapshot, catalog: ModelCatalog,
                   unit: WorkBatch, plan: Plan, alone: list[_Victim], now_ms: int) -> Plan:
    """`plan` with each group it chose planned again as its members alone: where the
    group's GPU needs only some of their KV caches (another GPU of the plan needed an
    unload), those stop and the model stays. Before, every user of it there stopped."""
    single = {id(v.members[0]): v for v in alone}
    for group in [v for v in plan[1] if v.unload is not None]:
        trial = _cheapest(state, snap, catalog, unit, [v for v in plan[1] if v is not group]
                          + [single[id(m)] for m in group.members], now_ms)
        if trial is not None:
            plan = trial
    return plan


def _cheapest(state: ClusterState, snap: Snapshot, catalog: ModelCatalog, unit: WorkBatch,
              candidates: list[_Victim], now_ms: int) -> Plan | None:
    """The solver's plan among `candidates` for `unit`: (node row, victims, GPU-seconds
    lost, whether its search finished), or None when there is none or the unit fits
    already (held behind work that waits for room)."""
    gpus = np.full((len(candidates), 8), -1, np.int64)
    for i, v in enumerate(candidates):
        r = v.members[0]
        start = int(state.node_gpu_start[snap.node_index[r.node_id]])
        gpus[i, :len(r.gpu_indices)] = [start + g for g in r.gpu_indices]
    victims = _batch([v.members[0].request for v in candidates], catalog, state.type_names,
                     [v.priority for v in candidates])
    victims.gpu_mem_mib[:] = [v.memory_mib for v in candidates]
    victims.gpu_milli[:] = [GPU_SHARE_MILLI * len(v.members) for v in candidates]
    victims.model_weight_mib[:] = 0
    lost = np.array([sum(max(0.0, now_ms - r.placed_at_ms) / 1000 * len(r.gpu_indices)
                         for r in v.members) for v in candidates], np.float64)
    attempts = np.array([sum(r.request.attempt for r in v.members if r.retry)
                         for v in candidates], np.float64)
    work = RunningWork(
        batch=victims, node=np.array([snap.node_index[v.members[0].node_id]
                                      for v in candidates], np.int64), gpus=gpus,
        gpu_seconds_lost=lost + attempts * EARLIER_ATTEMPT_GPU_S)
    plan = plan_preemption(state, work, unit)
    if not plan.feasible or not len(plan.victims):
        return None
    return plan.node, [candidates[v] for v in plan.victims], float(
        lost[list(plan.victims)].sum()), plan.proven_optimal


def _weights_at(r: RunningPlacement) -> WeightsAt | None:
    """The whole model `r` runs on, and where; None for a gang (its shards are not told
    apart from other gangs')."""
    if len(r.gpu_indices) != 1:
        return None
    return r.node_id, r.gpu_indices[0], request_weights(r.request)


def _weights_users(placements: Collection[RunningPlacement]) -> dict[WeightsAt, set[str]]:
    """The placement ids running on each whole model loaded on a GPU (gangs left out)."""
    users: dict[WeightsAt, set[str]] = {}
    for r in placements:
        if (at := _weights_at(r)) is not None:
            users.setdefault(at, set()).add(r.placement_id)
    return users


def _idle_once_stopped(state: ClusterState, snap: Snapshot, catalog: ModelCatalog,
                       ranked: list[tuple[RunningPlacement, int]],
                       users: Mapping[WeightsAt, set[str]],
                       busy: Mapping[tuple[str, int], set[str]], own: str) -> list[_Victim]:
    """Per GPU and whole model on it (not `own`, the preemptor's, which it would use) whose
    users are all among the `ranked` candidates, and which nothing of this cycle counts on
    (`busy`): those users as one victim that frees their KV caches and the weights."""
    found: dict[WeightsAt, list[tuple[RunningPlacement, int]]] = {}
    for r, priority in ranked:
        if (at := _weights_at(r)) is not None and at[2] != own:
            found.setdefault(at, []).append((r, priority))
    out: list[_Victim] = []
    for (node_id, g, weights), members in found.items():
        start = int(state.node_gpu_start[snap.node_index[node_id]])
        if {r.placement_id for r, _ in members} != users.get((node_id, g, weights)) \
                or weights in busy.get((node_id, g), ()) \
                or start + g >= int(state.node_gpu_start[snap.node_index[node_id] + 1]) \
                or not _loaded_on_row(state, start + g, weights):
            continue
        mib = memory_per_gpu(members[0][0].request, catalog.get(members[0][0].request.model))[1]
        out.append(_Victim(tuple(r for r, _ in members), max(p for _, p in members),
                           sum(r.kv_cache_mib for r, _ in members) + mib,
                           (g, weights, mib)))
    return out


def _victim_priority(r: RunningPlacement, preemptor: InferenceRequest, borrows: bool,
                     borrowed: Collection[str]) -> int:
    """0 for `borrowed` work of another tenant than the preemptor's, unless the preemptor
    `borrows` (will be borrowed itself) and the work is of its class or above; else by
    class (batch 1, the rest above every ceiling). Its own tenant gains nothing by its
    borrowed work (its hand-back preempted a sibling in turn, every preemption time-out),
    and a loan traded for a loan of the same class gains the fleet nothing: two tenants
    past their guarantees (0, say) stopped each other's interactive work, hand-back for
    hand-back, until the hand-backs aged. A borrowing interactive request may still take
    borrowed standard work: its hand-back reclaims the room at most once (where its tenant
    is inside its guarantee by then), and is then guarded from the interactive one's."""
    if r.request.tenant != preemptor.tenant and r.placement_id in borrowed and (
            not borrows or CLASS_PRIORITY[r.request.priority_class]
            < CLASS_PRIORITY[preemptor.priority_class]):
        return 0
    return 1 if r.request.priority_class == "batch" else CLASS_PRIORITY["interactive"] + 1


def warm_up(policy: str) -> None:
    """Compile (or load from cache) every solver kernel a cycle may call, placement and
    preemption planning, before taking traffic: a first compile takes seconds."""
    state = ClusterState.from_nodes([NodeSpec("warm-up", 1, 1, (GpuSpec("any", 1000, 2),))])

    def unit(priority: int) -> WorkBatch:
        return WorkBatch.from_units([1], [1], [0], [0], gpu_mem_mib=[2], model_id=["m"],
                                    model_weight_mib=[0], priority=[priority], tenant=["t"])

    result = solve(state, unit(1), policy)
    gpus = np.full((1, 8), -1, np.int64)
    gpus[0, 0] = 0
    plan_preemption(result.state, RunningWork(unit(1), np.array([0], np.int64), gpus,
                                              np.array([1.0])), unit(3))
