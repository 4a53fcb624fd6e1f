"""The scheduling cycle: admit requests from Kafka records, solve pending work against a
snapshot of the cluster, publish the cycle's placements, preemptions and rejections
together (with the leader's fencing token), then commit the records decided (at-least-once:
an offset is committed only after its decision is published)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError

from gpusched_common import topics
from gpusched_common.catalog import GPU_TYPES, ModelCatalog, TenantDirectory
from gpusched_common.contracts import (
    CANCEL,
    LAST_ATTEMPT,
    MAX_HANDBACK_BYTES,
    MAX_REQUEST_BYTES,
    MAX_RETRY_AFTER_S,
    NODE_STATE,
    PRIORITY_CLASSES,
    REQUEST,
    USAGE,
    DeadLetter,
    InferenceRequest,
    NodeState,
    Placement,
    Preempt,
    Rejection,
    RequestResult,
    ScalingSignal,
    cut_reason,
    invalid_fields,
)
from gpusched_common.kafka_records import WallClockMs, dead_letter, request_payload
from gpusched_common.recent import Recent
from gpusched_common.telemetry import (
    carried_span,
    carrier_of,
    record_carrier,
    request_attributes,
    untraced,
)
from gpusched_scheduler.adapters.decisions import Outgoing
from gpusched_scheduler.adapters.offsets import AnsweredRecords, Commit, OffsetBook
from gpusched_scheduler.adapters.redis_state import Filed, Position, RunningStore, SpentBudget
from gpusched_scheduler.domain.cluster import ClusterView, Reservation
from gpusched_scheduler.domain.ordering import Chunk, FairShare, is_aged, order_pending
from gpusched_scheduler.domain.planner import (
    FleetNode,
    NodeSpecCache,
    Room,
    estimate_gpu_s,
    fleet_gpu_mib,
    memory_per_gpu,
    out_of_reach,
    plan_cycle,
    request_tokens,
    request_weights,
    snapshot,
)
from gpusched_scheduler.domain.queue import Pending, PendingQueue
from gpusched_scheduler.domain.quotas import OverQuota, QuotaBook
from gpusched_scheduler.domain.running import ClaimState, RunningPlacement, RunningSet
from gpusched_scheduler.domain.scaling import (
    ModelLoad,
    gang_concurrency,
    gpu_memory_mib,
    gpus_wanted,
)
from gpusched_scheduler.domain.solver import MAX_GPU_TYPES

log = logging.getLogger(__name__)
SERVICE = "scheduler"
RECENT_DECISIONS = 20_000
"""Decided requests remembered to skip redeliveries: far more than one fetch per class
(what a rebalance or a new leader can redeliver), and a few MiB at most."""

Send = Callable[[list[Outgoing]], Awaitable[asyncio.Future]]
"""Hand records to Kafka together, in order; the future returned completes once Kafka
acknowledged all of them (and fails if any failed)."""
RETRY_IN_TRANSIT_MS = 60_000
"""How long a retry sent through Kafka counts in flight for its tenant before it is read back
(`_in_transit`); one read later was taken by another leader, or its topic is far behind."""
MAX_CYCLES_IN_FLIGHT = 4
"""Cycles whose records Kafka has not acknowledged yet; the next one waits for the oldest."""
SAVE_RETRY_S = 0.5
"""Pause between tries to save a cycle's placements while Redis is away."""
UNTAKEN_CHECK_MS = 1_000
"""How often placements nodes have not taken are looked for (`_recover_untaken`); an answer
from Kafka slower than this restarts a placement's untaken time-out."""
MAX_CLOCK_AHEAD_MS = 300_000
"""How far a new request's `created_at_ms` may be ahead of this scheduler's clock (producers'
clocks drift); later, the waits counted from it (queue time limit, latency) are nonsense."""
RE_READ_SKEW_MS = 30_000
"""A first attempt's record written (by its producer's clock) up to this long after this
instance took the lead may have been written before it: `_read_ledger` looks it up in the
agents' ledger. Longer, every new request that long was looked up."""
MAX_CLOCK_BEHIND_MS = 365 * 86_400_000
"""How far behind it may be: a backlog, but no Kafka keeps a year of one. Epoch seconds sent
as milliseconds land in January 1970, 56 years behind."""
ALIVE_READ_INTERVAL_MS = 1000
"""How often Redis is asked whether silent nodes are alive: as often as agents say so, not
every cycle (a node whose reports do not reach this instance stays silent for a long time)."""
BUDGET_READ_INTERVAL_MS = 1000
"""How often a tenant's budget flag is read (`_budget_flag`): once a second, not for every
request (a round trip on the admission path); work of a tenant flagged meanwhile may be
admitted for up to that long, within the usage batch's delay that sets the flag."""
BUDGET_WARN_INTERVAL_MS = 60_000
"""How often a failing read of the budget flags is logged (it is tried at each read)."""
RetryWhy = Literal["node_lost", "untaken", "takeover"]
RETRY_WHY: dict[RetryWhy, str] = {
    "node_lost": "lost",
    "untaken": "never took its placement",
    "takeover": "had a placement fenced by the previous leader",
}
"""Why placed work is retried (the `why` label of gpusched_scheduler_retries_total, and of
gpusched_scheduler_attempts_exhausted_total for work on its last attempt: only node_lost
means a node stopped reporting), and what the log and a last attempt's finish reason say
of its node. takeover: fenced by a leader that did not get to retry it, for either of the
other reasons."""


Standing = Literal["new", "ran", "done"]
"""How a request that does not wait here is taken in, by what is known of its placements
(`_standing`): `new` work is judged by its tenant's budget and quotas, and charged, and a
later attempt judged so is queued as a first attempt (`Pending.retry`); work that `ran` (a
retry of an attempt an agent claimed, or a first attempt an agent holds) is neither, as it
was taken in once already, and a retry that ran keeps a retry's place in line; `done`, a
first attempt whose placement ended or went on as a retry, is decided at once."""


@dataclass(frozen=True)
class Admitted:
    request: InferenceRequest
    carrier: dict[str, str]


@dataclass(frozen=True)
class Refused:
    dead_letter: DeadLetter
    rejection: Rejection | None
    """Sent to the results topic when the record names a request id a client may wait on."""
    request: InferenceRequest | None = None
    """The request refused, where the record parsed as one."""
    attempt: int = 0
    """The attempt the record says it is: its request's, else that of its `attempt` field
    where it has `requeued` too (a retry that did not parse), else 0."""


@dataclass(frozen=True)
class Estimated:
    """The fair-share estimate charged for one placement, that its measured usage has not
    replaced yet."""

    placement: int
    """`id()` of the RunningPlacement charged (not a later placement under its id); the
    object itself is not kept, its request may hold a large prompt."""
    placed_at_ms: int
    left_gpu_s: float


@dataclass(frozen=True)
class EngineConfig:
    policy: str = "gpusched"
    cycle_window_ms: float = 2.0
    node_timeout_ms: int = 10_000
    class_target_ms: tuple[tuple[str, float], ...] = (
        ("interactive", 1_000.0), ("standard", 10_000.0), ("batch", 60_000.0))
    class_max_queue_ms: tuple[tuple[str, float], ...] = ()
    """The classes whose requests end unrun (503) when not placed this long after they were
    created; the others wait as long as it takes."""
    aging_factor: float = 5.0
    fair_half_life_s: float = 60.0
    preemption_timeout_ms: int = 15_000
    max_units_per_cycle: int = 1024
    """Keeps one cycle short (the lease is renewed on the same event loop); the rest waits
    for the next cycle, which follows at once."""
    max_pending_per_class: int = 256
    """Backpressure: admitting a class's batch waits while this many of its requests are
    pending."""
    commit_interval_ms: float = 100.0
    """Offsets of decided records are committed at most this often (each commit is a write
    to Kafka; a redelivery after a failover is recognised by the placements in flight)."""
    scaling_period_s: float = 5.0
    untaken_timeout_ms: int = 30_000
    """A placement its node never took (never listed as active, no final usage) while the
    node kept reporting this long after it was sent is fenced and retried elsewhere."""
    fleet_known_after_ms: int = 0
    """How long after it reads its first node state this instance rejects nothing as
    fitting no node of the fleet (`_fleet`): the service sets its node time-out, within
    which every live node reports; 0 (tests, benchmarks): at once."""
    stopped_grace_ms: int = 600_000
    """How long a node that reported `stopped` still counts in the fleet (`fleet_gpu_mib`)."""


def parse_request_record(
    record: ConsumerRecord, catalog: ModelCatalog, tenants: TenantDirectory, now_ms: int,
) -> Admitted | Refused:
    """Turn one record of a request topic into a request, or a dead letter with a reason.

    Missing `request_id` defaults to `kafka-<topic>-<partition>-<offset>` (stable across
    redeliveries); missing `created_at_ms` to the record's timestamp; missing
    `priority_class` to the topic's class; missing `num_gpus` to its model's.
    """
    topic_class = topics.request_topic_class(record.topic)

    parsed: InferenceRequest | None = None

    def refuse(reason: str, request_id: str | None = None, status: int = 400,
               tenant: str | None = None, code: str | None = None) -> Refused:
        rejection = None
        if request_id is not None:
            rejection = Rejection(request_id=request_id, tenant=tenant, status_code=status,
                                  reason=reason, code=code)
        return Refused(dead_letter(record, reason, SERVICE, now_ms), rejection, parsed,
                       parsed.attempt if parsed is not None else claimed)

    claimed = 0

    try:
        payload = request_payload(record)
    except ValueError as exc:
        return refuse(str(exc))
    model = payload.get("model")
    if isinstance(model, str) and (spec := catalog.get(model)) is not None:
        payload.setdefault("num_gpus", spec.num_gpus)
    try:
        request = REQUEST.validate_python(payload)
    except ValidationError as exc:
        # The client learns of it only if its request id itself is valid (the rejection
        # carries it); any field may come first among the errors.
        rid, named = payload.get("request_id"), payload.get("tenant")
        # a retry (gpusched's own, maybe a newer release's) says so in both fields
        if type(attempt := payload.get("attempt")) is int and 0 <= attempt <= LAST_ATTEMPT \
                and isinstance(payload.get("requeued"), str):
            claimed = attempt
        bad_fields = {e["loc"][0] for e in exc.errors() if e["loc"]}
        valid_id = isinstance(rid, str) and "request_id" not in bad_fields
        # a tenant it names rightly reads the rejection's status at the router
        of_tenant = named if isinstance(named, str) and "tenant" not in bad_fields \
            and tenants.get(named) is not None else None
        return refuse(f"invalid request: {invalid_fields(exc)}", rid if valid_id else None,
                      tenant=of_tenant)
    parsed = request
    rid, tenant = request.request_id, request.tenant
    if request.priority_class != topic_class and topic_class in PRIORITY_CLASSES:
        return refuse(f"priority_class '{request.priority_class}' does not match topic "
                      f"{record.topic}; produce to gpusched.requests.{request.priority_class}",
                      rid, tenant=tenant)
    known = tenants.get(tenant)
    if known is None:
        return refuse(f"unknown tenant '{tenant}'; tenants are listed in tenants.yaml", rid, 403,
                      tenant)
    spec = catalog.get(request.model)
    if spec is None:
        return refuse(f"model '{request.model}' does not exist; available models: "
                      f"{', '.join(catalog.names)}", rid, 404, tenant)
    if request_tokens(request) > spec.context_limit_tokens:
        return refuse(f"prompt plus max_tokens ({request_tokens(request)} tokens) exceeds "
                      f"{spec.name}'s context limit of {spec.context_limit_tokens}", rid, 400,
                      tenant)
    # A first attempt must leave room to be handed back with its tokens; a later one must
    # still fit a placement (a record under half the limit cannot reach it as gpusched
    # writes it: not measured)
    limit = MAX_REQUEST_BYTES if request.attempt == 0 else MAX_HANDBACK_BYTES
    if len(record.value or b"") > limit // 2 and (size := len(request.to_bytes())) > limit:
        return refuse(f"the request is {size} bytes as gpusched writes it, over the limit of "
                      f"{limit} (it must still fit one Kafka record once handed back with its "
                      "tokens): shorten the prompt or messages", rid, 413, tenant,
                      "request_too_large")
    ahead_ms = request.created_at_ms - now_ms
    if request.attempt == 0 and ahead_ms > MAX_CLOCK_AHEAD_MS:  # a retry keeps its first's
        return refuse(f"created_at_ms {request.created_at_ms} is {_duration(ahead_ms)} ahead of "
                      f"this scheduler's clock ({now_ms}), more than "
                      f"{_duration(MAX_CLOCK_AHEAD_MS)}: send the producer's current time in "
                      "epoch milliseconds, or leave it out for the record's timestamp", rid, 400,
                      tenant)
    behind_ms = -ahead_ms
    if request.attempt == 0 and behind_ms > MAX_CLOCK_BEHIND_MS:
        return refuse(f"created_at_ms {request.created_at_ms} is {behind_ms // 86_400_000} days "
                      f"behind this scheduler's clock ({now_ms}), more than a year: if it is "
                      "epoch seconds, send milliseconds, or leave it out for the record's "
                      "timestamp", rid, 400, tenant)
    return Admitted(request, record_carrier(record.headers))


def node_state_problem(state: NodeState, key: bytes | None) -> str | None:
    """What makes a report the scheduler cannot take, beyond its schema: a Kafka key other
    than its node id, or none (the compacted topic keeps a node's latest report under its
    key, and the node's tombstone, keyed by its id, deletes only what is under that key: a
    report under another key outlived it, and every scheduler started later brought the
    node back); GPUs numbered other than 0..n-1 (placements name GPUs by index), of a type
    not in the catalog (agents report catalog types; the solver packs each type's GPUs as
    one kind, 62 at most), or with more memory free than they have."""
    if not key:
        return (f"the record has no key: key it by its node_id ({state.node_id!r}), which "
                "the node's tombstone is keyed by")
    if (keyed := key.decode(errors="replace")) != state.node_id:
        return (f"keyed {keyed!r}, not by its node_id {state.node_id!r}: the node's "
                "tombstone (keyed by its node_id) would not delete it; key it by its node_id")
    indices = sorted(g.index for g in state.gpus)
    if indices != list(range(len(indices))):
        return f"GPU indices {indices} are not 0..{len(indices) - 1}, each once"
    unknown = sorted({g.gpu_type for g in state.gpus} - GPU_TYPES.keys())
    if unknown:
        return (f"GPU type(s) {', '.join(unknown[:5])} not in the catalog "
                f"({', '.join(GPU_TYPES)})")
    for g in state.gpus:  # the solver would place work on memory the GPU does not have
        free = max(g.memory_free_mib, g.kv_cache_free_mib or 0)
        if free > g.memory_total_mib:
            return (f"GPU {g.index} reports {free} MiB free of {g.memory_total_mib} MiB "
                    "total")
    return None


class SchedulingEngine:
    """Owns the pending queue, the cluster view and the placements in flight; all mutation
    happens on one event loop. Cycles run only while `epoch` is set (this instance leads)."""

    def __init__(
        self, catalog: ModelCatalog, tenants: TenantDirectory, send: Send,
        clock: WallClockMs, tracer: trace.Tracer, config: EngineConfig = EngineConfig(),
        store: RunningStore | None = None, registry: CollectorRegistry | None = None,
    ) -> None:
        self.catalog = catalog
        self.tenants = tenants
        self.config = config
        self.view = ClusterView()
        self.queue = PendingQueue()
        self.running = RunningSet()
        self.fair = FairShare(config.fair_half_life_s)
        self.quotas = QuotaBook()
        self.epoch: int | None = None
        self._send = send
        self._clock = clock
        self._tracer = tracer
        self._store = store
        self._targets = dict(config.class_target_ms)
        self._max_queue_ms = dict(config.class_max_queue_ms)
        self._weights = {t.name: t.weight for t in tenants.tenants}
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        """Set when pending work left the queue (or leadership ended): admissions waiting for
        room re-check."""
        self.offsets = OffsetBook()
        self._committing: asyncio.Task[None] | None = None
        self._in_flight: list[asyncio.Task[None]] = []
        """Cycles published but not yet acknowledged, oldest first (see `_settle`)."""
        self._placed = Recent(RECENT_DECISIONS)
        """Recently decided (request id, attempt) -> its request's `_identity`, to skip
        redeliveries and refuse other requests under the same id; bounded by
        RECENT_DECISIONS (placements still running are recognised by `running` too)."""
        self._refused = Recent(RECENT_DECISIONS)
        """Request id -> the attempt its record claimed, of the records rejected lately
        (`_note_refused`): a later record under the id, at any attempt, is refused as
        taking it; one at that attempt again (the record read again) is rejected again."""
        self._cancelled = Recent(RECENT_DECISIONS)
        """Request id -> reason of the cancels read lately (their requests, queued here or
        admitted later, end cancelled unplaced)."""
        self._to_cancel: set[str] = set()
        """Cancelled request ids the next cycle takes out of the queue."""
        self._ended = Recent(RECENT_DECISIONS)
        """Placements whose final usage came, so that a copy of it (published again from an
        outbox after a crash) is not charged twice; bounded by RECENT_DECISIONS."""
        self._moved_on = Recent(RECENT_DECISIONS)
        """Placements retried (their node lost, never taken) or found ended in the agents'
        ledger: with `_ended`, what a cycle settled or undone late must not place again."""
        self._retried: dict[str, tuple[str, int]] = {}
        """Request id -> (tenant, when) of a retry this instance sent (`_retry`) and has not
        read back: still in flight for its tenant's max_inflight_requests until then, at
        most RETRY_IN_TRANSIT_MS (before, a tenant at its limit whose node was lost was
        admitted as many new requests as it had retries in Kafka)."""
        self._in_cycle: dict[tuple[str, int], Pending] = {}
        """(request id, attempt) -> its item, decided in a cycle whose answer from Kafka has
        not come yet: a record of it read again commits once that decision stands."""
        self._led_with: int | None = None
        """The token of the latest term this instance led (`epoch` is None between)."""
        self._led_at_ms = 0
        """When this instance last took the lead: records written before may have been read,
        and placed, by a leader before it (`_read_ledger`)."""
        self._over_quota_records = AnsweredRecords()
        """The request records answered 429: read again (the consumer seeks back when a
        batch's admission fails, or a new leader reads from an offset an earlier request
        held back), one is not judged again. Kept in Redis too, for the next leader (`lead`),
        until their partition's commit passes them (`_forget_passed_429s`). A client's retry
        is a new record."""
        self._reading: dict[TopicPartition, int] = {}
        """Per partition, the first offset of the request batch being admitted, or whose
        admission failed (the consumer reads it again from there): 429s from there on are
        kept, even past a commit made meanwhile."""
        self._estimated = Recent(RECENT_DECISIONS)
        """Placement id -> the fair-share estimate charged at its placement (`Estimated`)."""
        self._preempting: dict[str, tuple[int, Room]] = {}
        """Request id -> (ms until which its preemption is in progress, not planned again;
        its room, the GPUs its plan runs it on once the victims stop, kept for it
        meanwhile)."""
        self._victims: dict[str, tuple[int, RunningPlacement]] = {}
        """Placement id -> (until when, the victim): running work a preempt was sent for (not
        chosen as a victim again meanwhile, by another request that would then wait for its
        room). Kept after its final usage while its node still lists it (`_stopping`)."""
        self._told: set[str] = set()
        """The victims whose preempt Kafka took: they stop, and count no more in what their
        tenant holds (`_holdings`). One whose preempt Kafka refused runs on, and counted as
        gone its tenant reclaimed from others while over its guarantee."""
        self._node_specs = NodeSpecCache()
        self._crowded: tuple[str, ...] = ()
        """Nodes the last snapshot left out (`Snapshot.crowded`), logged when they change."""
        self._untaken_checked_ms = 0
        self._handed_at: dict[str, int] = {}
        """Placement id -> when a placement was last sent again (`_resend`) or, where Kafka
        was slow to take it, when Kafka took it: the untaken time-out runs from then, not
        from `placed_at_ms` (it fenced and retried as "untaken" placements Kafka had not
        taken during an outage). One whose cycle Kafka has not answered is not untaken."""
        self._inherited: dict[str, ClaimState] = {}
        """Claim states of the placements taken over on becoming leader, until settled."""
        self._unpublished: list[Filed] = []
        """Final records of lost nodes' agents that Kafka refused; published again each cycle
        (their work is never retried: it has finished)."""
        self._silent_alive: set[str] = set()
        """Nodes silent on Kafka past the time-out whose agents are alive in Redis."""
        self._alive_read_ms = -ALIVE_READ_INTERVAL_MS
        """When Redis was last asked whether silent nodes are alive."""
        self._budgets_warned_ms = -BUDGET_WARN_INTERVAL_MS
        """When a failed read of the budget flags was last logged."""
        self._flags: dict[str, tuple[int, SpentBudget | None]] = {}
        """Tenant -> (when read, its budget flag or None): read again once older than
        BUDGET_READ_INTERVAL_MS (`_budget_flag`)."""
        self._retries: list[tuple[str, Outgoing]] = []
        """(placement id, its request's next attempt) Kafka has not taken yet; published
        again each cycle, and the placements leave Redis only once it has."""
        self._resend: list[tuple[Pending, RunningPlacement, int]] = []
        """Placements of cycles Kafka refused, each with its work and the token it went with:
        sent again unchanged with the next cycle of that term, held meanwhile (running,
        reserved, charged). One may have reached Kafka all the same (another record of the
        cycle failed, or the answer timed out after the write), its agent claiming and
        running it: planned again, it could go to another node, whose agent ignores it as a
        duplicate while this scheduler counts it as running there."""
        self._decide_when_retried: dict[str, Pending] = {}
        """Placement id -> the work of a cycle whose placement was retried before Kafka
        answered it (its node was lost meanwhile), taken or refused: decided once Kafka has
        taken the retry (`_mark_decided`)."""
        self._unremoved: list[str] = []
        """Ended placements Redis did not take out of its running hash; tried each cycle
        (left there, a leader after the agents' claims expired would run them again)."""
        self._arrivals: dict[str, float] = {}
        self._service_s: dict[str, float] = {}
        self._gpu_s_per_token: dict[str, float] = {}
        self._last_scaling_s = 0.0
        self._shutting_down = False
        """Set by `stop`: the cycle loop ends after the cycle under way."""
        registry = registry or CollectorRegistry()
        self._metrics = _Metrics(registry, self.queue)
        registry.register(_FleetGpus(self.view, clock, config.node_timeout_ms))

    # --- leadership ---------------------------------------------------------------------
    def lead(self, epoch: int, running: list[RunningPlacement],
             claims: dict[str, ClaimState] | None = None,
             over_quota: Iterable[tuple[Position, int]] = ()) -> None:
        """Start leading with fencing token `epoch`, taking over the placements in flight;
        `claims` says where each stands in the agents' ledger (its first cycle settles them,
        see `_take_over`); `over_quota`, the request records answered 429 that Redis keeps
        (by any leader: read again, they stay refused)."""
        for (topic, partition, offset), timestamp_ms in sorted(over_quota):  # offset order
            self._over_quota_records.add(TopicPartition(topic, partition), offset, timestamp_ms)
        self._reading.clear()  # the consumers start again, from the last commit
        if epoch != self._led_with:
            # what a term under another token decided: a cycle of it still in flight is
            # undone (its records read again must be placed again), and `running` knows
            # what runs; under the same token its cycles settle as this term's. Its work
            # in a cycle is no longer this term's to wait for: a record read again that
            # `running` knows (a refused placement saved for this term) waited on an item
            # the earlier term's undo never decided, and its partition committed no more
            self._placed.clear()
            self._in_cycle.clear()
        self.epoch = self._led_with = epoch
        self._led_at_ms = self._clock()
        self.running = RunningSet(running)
        self.view.drop_reservations()  # `_take_over` reserves what is inherited
        self._inherited = dict(claims or {})
        # `_unpublished` stays: their node is lost to this instance already (`view.lost`
        # outlives a term), so it would not find them filed again; published twice (another
        # leader did meanwhile), each is applied once
        self._retries = []  # still running in Redis: a leader finds them fenced, retries them
        self._wake.set()

    def step_down(self) -> None:
        """Stop leading: pending work is dropped uncommitted (the next leader reads it again)
        and batches waiting for room are let go unqueued."""
        self.epoch = None
        for item in list(self.queue.in_order()):
            self.queue.remove(item)
            self._refund(item)  # read and charged again by whichever instance leads next
        resend, self._resend = self._resend, []
        if resend:  # the next term decides their work afresh
            self._undo([item for item, _, _ in resend], [r for _, r, _ in resend],
                       requeue=False)
        self.offsets.clear()
        self._decide_when_retried.clear()
        self._retried.clear()  # the next leader reads them as queued work
        self._preempting.clear()  # a next term plans again: its preempts go under its token
        self._victims.clear()
        self._told.clear()
        self._metrics.gpus_wanted.clear()  # a standby's last demand would outlive the leader's
        self._room.set()

    # --- inputs -------------------------------------------------------------------------
    async def admit(self, records: list[ConsumerRecord], commit: Commit | None = None) -> None:
        """Queue the valid requests of `records` (all of one request topic) and refuse the
        rest. Waits first while their class holds `max_pending_per_class` (backpressure: the
        caller fetches no more meanwhile); returns once they are queued. Their offsets are
        committed through `commit` as their decisions are published. Records that arrive
        or wait while this instance does not lead are left alone (uncommitted: the next
        leader reads them)."""
        reading: dict[TopicPartition, int] = {}
        for record in records:
            reading.setdefault(TopicPartition(record.topic, record.partition), record.offset)
        self._reading.update(reading)
        if not await self._wait_for_room(records):
            return
        now = self._clock()
        epoch = self.epoch
        outcomes = [None if self._over_quota_records.answered(record) else
                    self._parse(record, now) for record in records]
        claims = await self._read_ledger(records, outcomes)
        if self.epoch != epoch:
            return  # stepped down meanwhile: this batch is the next leader's
        for record, outcome, claim in zip(records, outcomes, claims, strict=True):
            if outcome is None:  # answered 429
                self.offsets.track(record, None, commit)  # read again: its 429 went out
                continue
            if isinstance(outcome, Refused):
                await self._refuse_request(outcome, record)
                if self.epoch != epoch:
                    return  # stepped down meanwhile: this batch is the next leader's
                self.offsets.track(record, None, commit)
                continue
            request = outcome.request
            key = (request.request_id, request.attempt)
            known = self._known(key)
            refused = request.request_id in self._refused
            # that attempt (`known`, looked up once: every record passes here), else the
            # latest earlier one (a retry of another request?)
            taken = None if refused else known if known is not None or not request.attempt \
                else self._known_as(request.request_id, request.attempt - 1)
            if refused or taken is not None and taken[0] != _identity(request):
                # a dead letter only: a rejection would end the other request
                await self._refuse(Refused(dead_letter(
                    record, _REFUSED_BEFORE.format(request.request_id) if refused else
                    f"request_id '{request.request_id}' is taken by another request "
                    "(it asks for something else: tenant, model, class, prompt, messages, "
                    "max_tokens, num_gpus or sampling) this scheduler has taken in; this "
                    "record is ignored: give each request its own id", SERVICE, now), None),
                    record)
                if self.epoch != epoch:
                    return
                self.offsets.track(record, None, commit)
                continue
            waiting = known[1] if known is not None else None
            if known is not None and waiting is None:
                # redelivered after its placement was published: nothing to do, but wait
                # for its cycle's answer (Kafka may refuse it) before committing past it
                self.offsets.track(record, self._in_cycle.get(key) or
                                   self._decide_when_retried.get(_placement_id(*key)), commit)
                continue
            standing: Standing = "ran"  # a redelivery of waiting work keeps its item
            if waiting is None:
                carrier = self._own_trace(outcome.carrier, record,
                                          functools.partial(request_attributes, request))
                standing = self._standing(request, claim)
            if standing == "done":
                # its work went on without it (ended, or retried) under an earlier leader: a
                # copy of its record read later is skipped as a redelivery
                self._placed[key] = _identity(request)
                self.offsets.track(record, None, commit)
                continue
            tenant = self.tenants.get(request.tenant)  # known: the record parsed
            never = None if standing != "new" or tenant is None else \
                tenant.never_admitted(request_tokens(request))
            if never is not None:  # refused for good: a 429 would ask for a retry in vain
                rejection = Rejection(request_id=request.request_id, tenant=request.tenant,
                                      status_code=400, reason=never,
                                      code="tokens_per_minute_exceeded")
                await self._refuse_request(Refused(dead_letter(record, never, SERVICE, now),
                                                   rejection, request, request.attempt), record)
                if self.epoch != epoch:
                    return
                self.offsets.track(record, None, commit)
                continue
            # not one that waited in Kafka past its queue time limit: it ends at the next
            # cycle, unrun, and the retry its 503 asks for must fit
            charged = standing == "new" and not _past(self.queue_limit(request)[0], request, now)
            if charged:
                # a spent budget (accounting's flag), then the tenant's hard quotas: refused
                # for good, and so again when the record is read again (`_over_quota_records`)
                refusal: tuple[str, str, str | None, int | None] | None = None
                spent = None if request.request_id in self._cancelled else \
                    await self._budget_flag(request.tenant, now)  # a cancel ends it anyway
                if self.epoch != epoch:
                    return  # stepped down meanwhile: this batch is the next leader's
                # the clock read again after the waits: older, `now` was behind what another
                # class's batch admitted meanwhile, which the window took for a clock stepped
                # back and dropped (the tenant went past its limit)
                now = self._clock()
                if spent is not None:
                    refusal = ("budget_spent", spent.reason, "insufficient_quota",
                               MAX_RETRY_AFTER_S if spent.left_ms is None else
                               -(-spent.left_ms // 1000))
                elif (over := self._over_quota(request, now)) is not None:
                    refusal = ("quota", over.reason, None, over.retry_after_s)
                if refusal is not None:
                    why, reason, code, retry_after_s = refusal
                    self._metrics.rejected.labels(why).inc()
                    # shielded together: a step-down cancels this loop, and a 429 in the
                    # producer's batch goes out; unnoted, the next leader ran its request
                    await asyncio.shield(self._answer_429(record, Outgoing(
                        Rejection(request_id=request.request_id, tenant=request.tenant,
                                  status_code=429, code=code, reason=reason,
                                  retry_after_s=_within_contract(retry_after_s)),
                        topics.RESULTS.name, request.request_id, carrier)))
                    if self.epoch != epoch:
                        return
                    self.offsets.track(record, None, commit)
                    continue
                self.quotas.admit(request.tenant, request_tokens(request), now)
                self._arrivals[request.model] = self._arrivals.get(request.model, 0) + 1
            if request.attempt:
                self._retried.pop(request.request_id, None)  # queued now: counted there
            item = waiting  # a redelivery of work still pending keeps its item
            if item is None:
                # a later attempt judged new keeps none of a retry's privileges: its record
                # only says it is one
                item = Pending(request, carrier, now, charged=charged,
                               retry=bool(request.attempt) and standing == "ran")
                self.queue.push(item)
            if request.request_id in self._cancelled:  # its cancel came first
                self._to_cancel.add(request.request_id)
            self.offsets.track(record, item, commit)
        for tp in reading:
            self._reading.pop(tp, None)
        self._wake.set()
        self._commit_decided()

    def _parse(self, record: ConsumerRecord, now_ms: int) -> Admitted | Refused:
        """`parse_request_record`, a record it fails on refused with the error."""
        try:
            return parse_request_record(record, self.catalog, self.tenants, now_ms)
        except Exception as exc:  # noqa: BLE001 - one record must never block its topic
            log.exception("request record %s-%d@%d unreadable", record.topic,
                          record.partition, record.offset)
            return Refused(dead_letter(record, f"unreadable request record: {exc!r}",
                                       SERVICE, now_ms), None)

    def _own_trace(self, carrier: dict[str, str], record: ConsumerRecord,
                   attributes: Callable[[], Mapping[str, str]]) -> dict[str, str]:
        """`carrier`, the trace context of a request record, where it names a trace (the
        router's, or that of the attempt before); else that of a new trace of the request's
        own, begun by an `admit` span with `attributes()` (Jaeger finds it by its request
        id; built only then: most records carry the router's context).
        Before, the records of a request produced straight to Kafka went in the trace of the
        cycle that decided it, with every other such request of that cycle, and those sent
        later for it (a retry, its rejection) in a new trace each."""
        if carried_span(carrier).is_valid:
            return carrier
        span = self._tracer.start_span(
            "admit", context=Context(), kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.destination.name": record.topic, **attributes()})
        span.end()
        return carrier_of(span)

    async def _answer_429(self, record: ConsumerRecord, answer: Outgoing) -> None:
        await self._publish([answer])
        await self._remember_over_quota(record)

    async def _remember_over_quota(self, record: ConsumerRecord) -> None:
        """Note that `record` was answered 429 (Kafka took the answer), here and in Redis for
        a next leader."""
        position = (record.topic, record.partition, record.offset)
        self._over_quota_records.add(TopicPartition(record.topic, record.partition),
                                     record.offset, record.timestamp)
        if self._store is None:
            return
        try:  # shielded: a step-down stops the consumer mid-batch, and the 429 went out
            await asyncio.shield(self._store.note_over_quota(position, record.timestamp))
        except Exception:  # this instance still knows; a next leader may judge it again
            log.warning("the 429 of request record %s-%d@%d not kept in Redis", *position,
                        exc_info=True)

    async def cancels(self, records: list[ConsumerRecord]) -> None:
        """Note the cancels among control records: the next cycle ends their requests that
        wait here, unplaced, and so does a cycle after one is admitted later. Every instance
        also keeps them in Redis, for an agent that was down when they went out. (Agents
        stop those that run, and dead-letter records that are not cancels.)"""
        read: dict[str, str] = {}
        for record in records:
            try:
                cancel = CANCEL.validate_json(record.value or b"")
            except ValidationError:
                continue
            read[cancel.request_id] = cancel.reason
            self._cancelled[cancel.request_id] = cancel.reason
            if self.epoch is not None:  # a new leader reads its queue again: `admit` checks
                self._to_cancel.add(cancel.request_id)
        if self._to_cancel:
            self._wake.set()
        if read and self._store is not None:
            try:
                await self._store.keep_cancels(read)
            except Exception:  # the agents up now still read them on Kafka
                log.exception("cancels of %d request(s) not kept in Redis", len(read))

    async def _wait_for_room(self, records: list[ConsumerRecord]) -> bool:
        """True once the records' class has room for them; False when not leading."""
        if not records:
            return self.epoch is not None
        cls = topics.request_topic_class(records[0].topic)
        # the class's dict looked up each time: a hand-back put first in line replaces it
        while self.epoch is not None and (queue := self.queue.by_class.get(cls)) \
                and len(queue) + len(records) > self.config.max_pending_per_class:
            self._room.clear()
            await self._room.wait()
        return self.epoch is not None

    def _commit_decided(self) -> None:
        """Commit, in the background, the offsets of every record decided so far."""
        self.offsets.advance()
        if self.offsets.due and (self._committing is None or self._committing.done()):
            self._committing = asyncio.create_task(self._commit(), name="commit-requests")

    async def _commit(self) -> None:
        # one commit at a time, at most one per interval; what was decided meanwhile goes
        # in the next round
        while self.offsets.due and await self.offsets.commit():
            await self._forget_passed_429s()
            await asyncio.sleep(self.config.commit_interval_ms / 1000)
            self.offsets.advance()

    async def _forget_passed_429s(self) -> None:
        """Forget the 429s of records no reader comes back to, here and in Redis: those below
        their partition's commit (a next leader reads from there), and below the batch being
        admitted (where this consumer reads again if its admission fails)."""
        passed = self._over_quota_records.forget_below({
            tp: min(offset, self._reading.get(tp, offset))
            for tp, offset in self.offsets.committed.items()})
        if not passed or self._store is None:
            return
        try:
            await self._store.forget_over_quota(passed)
        except Exception:  # left below the commit, harmless: gone with the partition's next
            log.warning("forgetting the 429s of committed request records in Redis failed",
                        exc_info=True)

    async def node_states(self, records: list[ConsumerRecord]) -> None:
        """Apply node states to the view. An invalid one is skipped; the leader dead-letters
        it with the reason (the standbys read the same records), so the operator of an
        agent whose reports this scheduler cannot read (its node then looks silent, then
        lost) learns why."""
        now = self._clock()
        dead: list[Outgoing] = []
        for record in records:
            if record.value is None:  # a decommissioned node's tombstone
                if record.key:
                    self.view.decommission(record.key.decode(errors="replace"))
                continue
            try:
                state = NODE_STATE.validate_json(record.value)
                if (problem := node_state_problem(state, record.key)) is not None:
                    raise ValueError(problem)
            except ValueError as exc:  # pydantic's ValidationError is one
                reason = (f"invalid node state: {invalid_fields(exc)}"
                          if isinstance(exc, ValidationError) else f"invalid node state: {exc}")
                log.warning("ignoring node state at %s:%s: %s", record.partition,
                            record.offset, reason)
                if self.epoch is not None:
                    letter = dead_letter(record, reason, SERVICE, now)
                    dead.append(Outgoing(letter, topics.DEAD_LETTERS.name, record.topic, {}))
                continue
            self.view.apply_node_state(state, now, self.config.node_timeout_ms)
        self._wake.set()
        if dead:
            # counted where the other dead letters are, which GpuschedRecordsDeadLettered reads
            self._metrics.rejected.labels("invalid").inc(len(dead))
            try:
                await self._publish(dead)
            except Exception:  # the view is up to date; only the notice is missing
                log.exception("dead-lettering %d invalid node states failed", len(dead))

    async def usage(self, records: list[ConsumerRecord]) -> None:
        """Measured usage: charge fair share; a final record ends its placement (its copies
        are skipped)."""
        now_s = self._clock() / 1000
        ended: list[str] = []
        for record in records:
            try:
                usage = USAGE.validate_json(record.value)
            except ValidationError:
                continue
            if usage.final:
                if usage.placement_id in self._ended:
                    continue  # a copy: applied once already
                self._ended[usage.placement_id] = None
            self.fair.charge(usage.tenant, usage.gpu_seconds - self._estimate_used(
                usage.placement_id, usage.gpu_seconds, usage.final, now_s), now_s)
            if not usage.final:
                continue
            self.view.release_ended(usage.placement_id, usage.ended_at_ms)
            done = self.running.pop(usage.placement_id, None)
            if usage.completion_tokens > 0:
                per_token = usage.gpu_seconds / _weighted_tokens(usage.prompt_tokens,
                                                                 usage.completion_tokens)
                old = self._gpu_s_per_token.get(usage.model, per_token)
                self._gpu_s_per_token[usage.model] = 0.9 * old + 0.1 * per_token
            if done is not None:
                seconds = max(0.0, (usage.ended_at_ms - usage.started_at_ms) / 1000)
                old = self._service_s.get(usage.model, seconds)
                self._service_s[usage.model] = 0.8 * old + 0.2 * seconds
                ended.append(usage.placement_id)
        if ended:
            self._wake.set()
            if self.epoch is not None:
                await self._remove(ended)

    def _estimate_used(self, placement_id: str, gpu_seconds: float, final: bool,
                       now_s: float) -> float:
        """How much of its placement's estimate, as fair share counts it now (decayed since
        placement), measured usage of `gpu_seconds` replaces: as much of what stands, all
        of it once final. Before, partial usage was charged on top of the estimate, and the
        final record took back the whole estimate, long decayed: a tenant counted double
        while its job ran had its use wiped out when it ended."""
        charged = self._estimated.get(placement_id)
        if charged is None or not charged.left_gpu_s:
            return 0.0  # not charged by this instance (placed by an earlier leader)
        used = charged.left_gpu_s if final else min(charged.left_gpu_s, gpu_seconds)
        self._estimated[placement_id] = replace(charged, left_gpu_s=charged.left_gpu_s - used)
        return used * self.fair.decay(now_s - charged.placed_at_ms / 1000)

    def _give_back_estimate(self, placement_id: str, tenant: str, now_s: float) -> None:
        """Give back what is left of the fair-share estimate charged for `placement_id`: a
        placement of it that will not run."""
        self.fair.charge(tenant, -self._estimate_used(placement_id, 0.0, True, now_s), now_s)

    # --- the cycle ----------------------------------------------------------------------
    async def run(self) -> None:
        """Cycle whenever woken (new work, node state, released memory), at most once per
        micro-batch window, and at least once a second (node time-outs, aging), until
        `stop`; then return once the cycles sent have settled (`settle_in_flight`)."""
        while not self._shutting_down:
            # not wait_for: on Python 3.11 it swallows a cancel (shutting down) that comes
            # as the event is set, and this loop would run on
            try:
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self.config.cycle_window_ms:
                await asyncio.sleep(self.config.cycle_window_ms / 1000)
            self._wake.clear()
            if self.epoch is None or self._shutting_down:
                continue
            try:
                await self.cycle()
                await self._maybe_signal_scaling()
            except Exception:  # a fault in one cycle must not stop scheduling
                self._metrics.cycle_failures.inc()  # GpuschedSchedulingCyclesFail reads it
                log.exception("scheduling cycle failed; retrying")
                await asyncio.sleep(0.5)
                self._wake.set()
        await self.settle_in_flight()

    def stop(self) -> None:
        """Shutting down: let `run` end after the cycle under way, not in it. A cycle
        cancelled while the producer took its records (waiting for room in a batch, or for
        metadata: Kafka slow) left those it had taken to go out with no settle, so an agent
        ran placements that were saved nowhere, and a next leader that did not know them
        placed their requests again, maybe on other nodes."""
        self._shutting_down = True
        self._wake.set()

    async def cycle(self) -> int:
        """One pass: recover work of lost nodes, then place pending work in order; returns
        how many decisions (placements, rejections, preemptions) it published."""
        if self.epoch is None:
            return 0
        now = self._clock()
        await self._take_over()
        await self._remove([])
        await self._recover_lost_nodes(now)
        await self._recover_untaken(now)
        epoch = self.epoch  # the token this cycle's commands go with (the awaits are behind)
        if epoch is None:
            return 0  # stepped down meanwhile
        resent = self._take_resends(epoch)
        try:
            return await self._decide(now, epoch, resent)
        finally:  # not handed to a settle (the cycle failed first): sent with the next one
            self._resend[:0] = [(item, r, epoch) for item, r in resent]

    async def _decide(self, now: int, epoch: int,
                      resent: list[tuple[Pending, RunningPlacement]]) -> int:
        """The cycle's decisions, sent with the placements `resent` (emptied once a settle
        owns them)."""
        cfg = self.config
        ended = self._take_cancelled(now) + self._take_expired(now)
        if not len(self.queue) and not ended and not resent:
            return 0
        started = time.perf_counter()
        live = self.view.live_nodes(now, cfg.node_timeout_ms)
        snap = snapshot(self.view, live, self._node_specs, now_ms=now, catalog=self.catalog)
        if snap.crowded != self._crowded:
            self._crowded = snap.crowded
            if snap.crowded:
                log.error("nodes left out of placement: their GPU types and model sets are "
                          "more distinct kinds than the solver tells apart (%d): %s",
                          MAX_GPU_TYPES, ", ".join(snap.crowded))
        # before ordering: a preemption timed out, or whose room's node is gone (lost or
        # draining), no longer puts its request first, and it may plan another
        self._preempting = {r: p for r, p in self._preempting.items()
                            if p[0] > now and p[1].node_id in snap.node_index}
        self._victims = {p: v for p, v in self._victims.items() if v[0] > now
                         and (p in self.running or self._listed(v[1]))}
        self._told &= self._victims.keys()
        ordered = self._ordered(now)
        # each read at most once a cycle, and only where needed
        fleet = functools.cache(lambda: self._fleet(now))
        away = functools.cache(lambda: out_of_reach(snap, fleet(), self.catalog))
        if len(self.queue) > cfg.max_units_per_cycle:
            # More waits than a cycle takes: work only nodes that are away could hold is
            # left out, or a flood of it ahead kept every later unit out of every cycle
            ordered = [Chunk(c.name, [i for i in c.items if not away()(i.request)])
                       for c in ordered]
        chunks = _first(ordered, cfg.max_units_per_cycle)
        solve_started = time.perf_counter()
        # Inline: at most max_units_per_cycle units keep it short enough for the event loop;
        # work told to stop already is no victim to choose again (its room is promised)
        may_preempt, reclaiming, borrowing = self._preemption_rights(chunks, away)
        decisions = plan_cycle(
            snap, chunks, self.catalog, cfg.policy,
            [r for r in self.running.values() if r.placement_id not in self._victims],
            now, may_preempt, fleet=fleet, reclaiming=reclaiming,
            borrowing=borrowing, borrowed=self.borrowed() if may_preempt else (),
            guarded=self._guarded() if borrowing else (),
            rooms={r: room for r, (_, room) in self._preempting.items()},
            stopping=self._stopping())
        self._metrics.solver_seconds.observe(time.perf_counter() - solve_started)

        # placements sent again go first: a preempt of one this cycle follows it to its node
        messages: list[tuple[Pending, Outgoing]] = [
            (item, self._placement(r, epoch)) for item, r in resent]
        messages += ended
        new_running = [r for _, r in resent]
        for place in decisions.placed:
            request = place.item.request
            pid = _placement_id(request.request_id, request.attempt)
            running = RunningPlacement(
                placement_id=pid, node_id=place.node_id, gpu_indices=place.gpu_indices,
                memory_mib_per_gpu=place.memory_mib_per_gpu, kv_cache_mib=place.kv_cache_mib,
                estimate_gpu_s=self._estimate_request(request), placed_at_ms=now,
                request=request, aged=True if self._aged(place.item, now) else None,
                retry=True if place.item.retry else None,
                trace_carrier=place.item.trace_carrier)
            self.view.reserve(self._reservation(running))
            self.running[pid] = running
            new_running.append(running)
            # an earlier term's placement of it, in a cycle Kafka has not answered, will not
            # run (agents refuse its token): one charge stands
            self._give_back_estimate(pid, request.tenant, now / 1000)
            self.fair.charge(request.tenant, running.estimate_gpu_s, now / 1000)
            self._estimated[pid] = Estimated(id(running), now, running.estimate_gpu_s)
            messages.append((place.item, self._placement(running, epoch)))
            self._metrics.placement_latency[request.priority_class].observe(
                max(0.0, now - request.created_at_ms) / 1000)
        for reject in decisions.rejected:
            request = reject.item.request
            self._refund(reject.item)  # it ends unrun: its tokens count no more
            self._metrics.rejected.labels("unschedulable").inc()
            messages.append((reject.item, Outgoing(Rejection(
                request_id=request.request_id, tenant=request.tenant, status_code=422,
                reason=reject.reason), topics.RESULTS.name, request.request_id,
                reject.item.trace_carrier)))
        for pre in decisions.preemptions:
            assert pre.room is not None  # plan_cycle gives every plan its room
            self._metrics.preemption_plans.labels(
                "exact" if pre.proven_optimal else "cut_short").inc()
            self._preempting[pre.item.request.request_id] = (
                now + cfg.preemption_timeout_ms, pre.room)
            for victim in pre.victims:
                self._victims[victim.placement_id] = (now + cfg.preemption_timeout_ms, victim)
                self._metrics.preemptions.inc()
                messages.append((pre.item, Outgoing(Preempt(
                    placement_id=victim.placement_id, request_id=victim.request.request_id,
                    node_id=victim.node_id, scheduler_epoch=epoch,
                    reason=f"preempted for {pre.item.request.priority_class} request "
                    f"{pre.item.request.request_id} of tenant {pre.item.request.tenant}"),
                    topics.PLACEMENTS.name, victim.node_id, pre.item.trace_carrier,
                    preemptor=pre.item.request)))

        # Not the current span: each record goes in its own request's trace, never the
        # cycle's (those of requests produced straight to Kafka all did). A cycle that
        # sends nothing (work waits and nothing fits, woken by each node's report) records
        # none: a root span each, at least one a second, crowded requests' traces out of
        # Jaeger's store, as heartbeats did
        cycle_span = trace.INVALID_SPAN if not messages else self._tracer.start_span(
            "scheduling cycle",
            # one link per request (a preempting one sends a record per victim)
            links=[trace.Link(carried_span(item.trace_carrier))
                   for item in {id(item): item for item, _ in messages}.values()],
            attributes={"gpusched.epoch": epoch, "gpusched.placed": len(decisions.placed),
                        "gpusched.waiting": len(decisions.waiting),
                        "gpusched.preemptions": len(decisions.preemptions)})
        try:
            acked = await self._send([out for _, out in messages])
        except Exception as exc:  # the producer refused them at once (a partition's batch
            # that could not drain, a producer retired): settled as Kafka's refusal, or this
            # cycle's placements stayed running while their work waited again, to be
            # planned again under the same ids, maybe on other nodes
            acked = asyncio.get_running_loop().create_future()
            acked.set_exception(exc)
        finally:
            cycle_span.end()
        finished = [item for item, _ in resent] + [p.item for p in decisions.placed] \
            + [r.item for r in decisions.rejected] + [item for item, _ in ended]
        stops = [v.placement_id for pre in decisions.preemptions for v in pre.victims]
        # led again under another token during the send: nothing is noted, that term
        # decides its records read again afresh. A note made now would pass for its own:
        # a decision, or a cycle to wait for, whose later-term undo decides nothing (a
        # record read again of a placement it inherited waited on it for good, and its
        # partition committed nothing more that term)
        stale = self._led_with != epoch
        for item in finished:
            self.queue.remove(item)
            if not stale:
                self._in_cycle[item.key] = item
                self._placed[(item.request.request_id, item.request.attempt)] = \
                    _identity(item.request)
        if finished:
            self._room.set()
        self._in_flight = [t for t in self._in_flight if not t.done()]
        self._in_flight.append(asyncio.create_task(
            self._settle(acked, finished, new_running, epoch, stops), name="settle-cycle"))
        resent.clear()  # the settle owns them now
        if len(self._in_flight) > MAX_CYCLES_IN_FLIGHT:
            # shielded: the cycle loop cancelled (shutting down) cancelled the settle it
            # waited for, whose placements were then saved nowhere (`settle_in_flight`)
            await asyncio.shield(self._in_flight[0])
        if len(self.queue) > sum(len(c.items) for c in chunks) and decisions.placed:
            self._wake.set()  # more was pending than this cycle took
        self._metrics.cycle_seconds.observe(time.perf_counter() - started)
        self._metrics.decisions.inc(len(messages))
        return len(messages)

    async def settle_in_flight(self) -> None:
        """Wait for the cycles Kafka has not answered yet to settle: a leader shutting down
        saves their placements under the token they went out with (an agent may run them
        already) and lets their offsets commit, before it steps down and a standby takes a
        newer token, which refuses that save."""
        in_flight = [t for t in self._in_flight if not t.done()]
        if in_flight:
            await asyncio.wait(in_flight)

    async def _settle(self, acked: asyncio.Future, finished: list[Pending],
                      new_running: list[RunningPlacement], epoch: int | None,
                      stops: list[str]) -> None:
        """Once Kafka acknowledged a cycle's records: save its placements, mark its work
        decided and commit the offsets that frees. If publishing failed, its placements are
        sent again unchanged while this term leads (`_send_again`) and the rest of its work
        waits again; under another term, or none, the cycle is undone. `epoch` is the token
        the cycle sent them with (this task may first run after a change of leadership);
        `stops` the placements it sent preempts for (`_told` once Kafka took them)."""
        try:
            await acked
        except Exception:
            if self.epoch is not None and self.epoch == epoch:
                log.exception("publishing a cycle's decisions failed; sending its placements "
                              "again, planning the rest of its work again")
                await self._send_again(finished, new_running, epoch)
                return
            log.exception("publishing a cycle's decisions failed; planning its work again")
            self._undo(finished, new_running, requeue=self.epoch is not None,
                       later_term=self.epoch is not None)
            return
        if self.epoch == epoch:
            self._told.update(p for p in stops if p in self._victims)
        if self.epoch is None and self._store is not None:
            # Stepped down meanwhile (shutting down, a lease check failed): while no newer
            # token is taken, agents run these placements, and a next leader that did not
            # know them placed their requests afresh, maybe on other nodes whose agents
            # ignored them as duplicates (counted there, never retried when theirs failed).
            # Saved once under their token (Redis refuses it once a newer one was taken),
            # a next leader inherits them and settles them by the agents' claims
            await self._save(new_running, epoch)
        if self.epoch != epoch:
            # Stepped down, or led again with a new token, meanwhile: agents refuse what went
            # out under the old one as a deposed leader's (once they see a newer one), and no
            # term counts it as running here; its placed work is read (or queued) again (a
            # next leader that inherited a placement saved above counts it as taken), while
            # the results it published (rejections, ends) stand
            sent = {r.placement_id for r in new_running}
            for item in finished:
                item.decided |= _placement_id(*item.key) not in sent
                self._out_of_cycle(item)
            self._undo([i for i in finished if not i.decided], new_running,
                       requeue=self.epoch is not None, later_term=self.epoch is not None)
            return
        # those that ended or were retried meanwhile (the agent was quicker than the ack,
        # the node was lost) are not running
        new_running = [r for r in new_running if not self._gone(r.placement_id)]
        taken_ms = self._clock()
        for r in new_running:
            self._hold(r)
            sent = self._handed_at.get(r.placement_id, r.placed_at_ms)
            if taken_ms - sent > UNTAKEN_CHECK_MS:  # Kafka was slow: untaken from now on
                self._handed_at[r.placement_id] = taken_ms
        if self._store is not None and new_running and not await self._save(new_running,
                                                                            epoch):
            # Deposed before they were saved, a next leader would not know these
            # placements, and agents refuse them as stale: their requests stay uncommitted,
            # so it reads and places them again under its own token.
            log.warning("deposed before %d placements in flight were saved; the next "
                        "leader places their requests again", len(new_running))
            self._undo(finished, new_running, requeue=False)
            return
        self._mark_decided(finished)
        for item in finished:
            self._out_of_cycle(item)
            # its preemption is over once Kafka took its placement: one sent again keeps
            # its room meanwhile, a cycle undone keeps it first in line, with its room
            self._preempting.pop(item.request.request_id, None)
        self._commit_decided()

    async def _save(self, new_running: list[RunningPlacement], epoch: int | None) -> bool:
        """Save placements in flight for a next leader, retrying (Redis away) while this
        instance leads under `epoch`, the token they were sent with (tried once where it
        no longer does); False once it does not, or Redis says a newer token was taken
        (their offsets must then stay uncommitted). The token is checked in Redis, with the
        write: this instance may not know yet that it was deposed, and the next leader may
        have read the hash already."""
        while epoch is not None:
            # ended or retried during a retry: saved again, a next leader would inherit it
            new_running = [r for r in new_running if not self._gone(r.placement_id)]
            if not new_running:
                return True
            try:
                saved = await self._store.save(new_running, epoch)  # type: ignore[union-attr]
            except Exception:
                log.exception("saving %d placements in flight to Redis failed",
                              len(new_running))
            else:
                if saved and self.epoch == epoch:
                    # led again under that token during the save: `lead` took Redis's
                    # list from before it, and their node's loss would retry nothing
                    for r in new_running:
                        if not self._gone(r.placement_id):
                            self._hold(r)
                return saved
            if self.epoch != epoch:
                return False
            await asyncio.sleep(SAVE_RETRY_S)
        return False

    def _hold(self, r: RunningPlacement) -> None:
        """Count placement `r`, sent under the token leading now, as running here: led again
        under that token since, `lead` took Redis's list, which it is not in yet."""
        if r.placement_id not in self.running:
            self.running[r.placement_id] = r
            self.view.reserve_unlisted(self._reservation(r))

    async def _send_again(self, finished: list[Pending], new_running: list[RunningPlacement],
                          epoch: int) -> None:
        """A cycle Kafka refused under the token leading now: its placements that have not
        ended or moved on stand as decided, held here and sent again, unchanged, with the
        next cycle (`_resend`) until Kafka takes them; the rest of its work (rejections,
        ends) is planned again. A placement delivered twice runs once: agents claim its id.
        They are saved for a next leader at once (the save checks the token): one may run
        already, and a next term that did not know it planned its request afresh, maybe on
        another node, whose agent ignored it as a duplicate; knowing it, that term settles
        it by the agents' claims (`_take_over`)."""
        again = {r.placement_id: r for r in new_running if not self._gone(r.placement_id)}
        for r in again.values():
            self._hold(r)
        self._resend += [(item, again[pid], epoch) for item in finished
                         if (pid := _placement_id(*item.key)) in again]
        self._undo([item for item in finished if _placement_id(*item.key) not in again],
                   [r for r in new_running if r.placement_id not in again], requeue=True)
        if self._store is not None and again:
            await self._save(list(again.values()), epoch)  # False: deposed, step_down undoes

    def _take_resends(self, epoch: int) -> list[tuple[Pending, RunningPlacement]]:
        """The placements Kafka refused that go out again with this cycle, each with its
        work: those sent under `epoch` that have not ended or moved on. The others are
        undone: ended or retried meanwhile, their work went on without them; sent under an
        earlier token (led again under another without stepping down), agents refuse them
        and this term decides their work afresh."""
        resend, self._resend = self._resend, []
        again = []
        for item, r, token in resend:
            if token == epoch and not self._gone(r.placement_id):
                again.append((item, r))
                self._handed_at[r.placement_id] = self._clock()
            else:
                self._undo([item], [r], requeue=True, later_term=token != epoch)
        return again

    def _placement(self, r: RunningPlacement, epoch: int) -> Outgoing:
        """The command that sends placement `r` to its node under token `epoch`: the same
        record each time it is sent."""
        return Outgoing(Placement(
            placement_id=r.placement_id, node_id=r.node_id, gpu_indices=r.gpu_indices,
            kv_cache_mib=r.kv_cache_mib, scheduler_epoch=epoch, placed_at_ms=r.placed_at_ms,
            request=r.request), topics.PLACEMENTS.name, r.node_id, r.trace_carrier)

    def _undo(self, finished: list[Pending], new_running: list[RunningPlacement],
              requeue: bool, later_term: bool = False) -> None:
        """Forget a cycle's placements; with `requeue` its work waits again here, else the
        next leader reads it again (its offsets are not committed). With `later_term` (the
        cycle went out under an earlier token), work the term leading now has taken in
        again (placed, decided or waiting) is left to it, and the earlier charge refunded."""
        sent = {r.placement_id for r in new_running}
        # Ended (its final usage came) or retried (its node was lost) since it was sent: the
        # work went on without this cycle, and placing it again would run it beside its retry
        moved_on = {pid for pid in sent if self._gone(pid)}
        for item in finished:
            self._out_of_cycle(item)
        now_s = self._clock() / 1000
        for r in new_running:
            charged = self._estimated.get(r.placement_id)
            if charged is not None and charged.placement == id(r):  # (`lead` may have
                # replaced `running` since): placed again, it is charged again
                self._give_back_estimate(r.placement_id, r.request.tenant, now_s)
            if self.running.get(r.placement_id) is r:  # not a later term's placement of it
                self.running.pop(r.placement_id)
                self.view.release(r.placement_id)
        self._mark_decided([item for item in finished if _placement_id(*item.key) in moved_on])
        for item in finished:
            pid = _placement_id(*item.key)
            if pid in moved_on:
                continue
            if later_term and self._known(item.key) is not None:
                self._refund(item)  # its record, read again, was charged again
                continue
            self._placed.pop((item.request.request_id, item.request.attempt), None)
            item.placed_once |= pid in sent
            if requeue:
                if item.refunded:  # it ended (rejected, cancelled, expired) in this cycle
                    item.refunded = False
                    self.quotas.restore(item.request.tenant, request_tokens(item.request),
                                        item.enqueued_ms)
                self.queue.push(item)
                if item.request.request_id in self._cancelled:
                    self._to_cancel.add(item.request.request_id)
            else:  # read and charged again by whichever instance leads next
                self._refund(item)
        self._commit_decided()
        self._wake.set()

    def _mark_decided(self, items: list[Pending]) -> None:
        """Mark a cycle's work decided (its records may commit); where its placement was
        retried and Kafka has not taken the retry yet (`_retries`), only once it has
        (`_decide_when_retried`). Committed before, the request lived on in this instance's
        memory alone (a retried placement leaves Redis, and no record of it is read again):
        a step-down or a crash before Kafka took the retry lost it."""
        retrying = {pid for pid, _ in self._retries}
        for item in items:
            if (pid := _placement_id(*item.key)) in retrying:
                self._decide_when_retried[pid] = item
            else:
                item.decided = True

    # --- helpers ------------------------------------------------------------------------
    def _take_cancelled(self, now_ms: int) -> list[tuple[Pending, Outgoing]]:
        """The cancelled requests waiting here, out of the queue, each with its terminal
        result (nothing ran, nothing is billed, its quota charge is given back) to publish
        with this cycle's decisions."""
        out = []
        for request_id in self._to_cancel:
            for item in self.queue.of_request(request_id):
                self.queue.remove(item)
                request = item.request
                self._refund(item)
                waited_ms = max(0, now_ms - request.created_at_ms)
                out.append((item, Outgoing(RequestResult(
                    request_id=request_id, tenant=request.tenant, model=request.model,
                    status="cancelled", finish_reason="cancelled before it was placed: "
                    f"{self._cancelled.get(request_id, 'no reason given')}",
                    **request.so_far(), queued_ms=waited_ms, total_ms=waited_ms),
                    topics.RESULTS.name, request_id, item.trace_carrier)))
        self._to_cancel.clear()
        return out

    def _out_of_cycle(self, item: Pending) -> None:
        """`item`'s cycle has its answer from Kafka (a later cycle's item of it stays)."""
        if self._in_cycle.get(item.key) is item:
            del self._in_cycle[item.key]

    def _stopping(self) -> list[RunningPlacement]:
        """The victims told to stop that their node still lists as running: what they hold
        there comes free soon, their final usage read or not (it usually comes before the
        node's next report, and a victim counted only while running left its memory used
        in the view until then: a second preemptor stopped other work for room already
        free). Once a report no longer lists one, that report counts its memory free."""
        return [victim for _, victim in self._victims.values() if self._listed(victim)]

    def _listed(self, placement: RunningPlacement) -> bool:
        """Whether the latest report of the placement's node lists it as active."""
        node = self.view.nodes.get(placement.node_id)
        return node is not None and placement.placement_id in node.active_placement_ids

    def _aged(self, item: Pending, now_ms: int) -> bool:
        return is_aged(item, now_ms, self._targets, self.config.aging_factor)

    def _ordered(self, now_ms: int) -> list[Chunk]:
        return order_pending(self.queue.in_order(), now_ms, self.fair, self._weights,
                             self._targets, self.config.aging_factor, self._estimate,
                             preempting=self._preempting)

    def in_line(self, now_ms: int) -> list[tuple[str, Pending]]:
        """The work waiting here in the order a cycle now would consider it, each with its
        chunk: 'preempting' (its victims are stopping), 'aged' (waited past the aging
        threshold) or its class."""
        return [(chunk.name, item) for chunk in self._ordered(now_ms) for item in chunk.items]

    async def _budget_flag(self, tenant: str, now_ms: int) -> SpentBudget | None:
        """`tenant`'s budget flag, as accounting set it when the budget was spent; read at
        most once per BUDGET_READ_INTERVAL_MS (a round trip on the admission path). Redis
        away: none (logged at most once a minute), so admission goes on; the work admitted
        meanwhile is billed as any other."""
        read = self._flags.get(tenant)
        if read is not None and abs(now_ms - read[0]) < BUDGET_READ_INTERVAL_MS:
            return read[1]  # abs: a clock stepped back must not keep an old read for long
        flag = None
        if self._store is not None:
            try:
                flag = (await self._store.spent_budgets([tenant])).get(tenant)
            except Exception:
                if abs(now_ms - self._budgets_warned_ms) >= BUDGET_WARN_INTERVAL_MS:
                    self._budgets_warned_ms = now_ms
                    log.warning("reading the budget flags failed; admitting work as if no "
                                "budget were spent", exc_info=True)
        self._flags[tenant] = (now_ms, flag)
        return flag

    async def _read_ledger(self, records: list[ConsumerRecord],
                           outcomes: list[Admitted | Refused | None]
                           ) -> list[ClaimState | None]:
        """For each of a batch's `records` (parsed as `outcomes`), where the placement its
        request is judged by (`_standing`) stands in the agents' ledger; None where it is
        not looked up, or the ledger cannot tell.

        Looked up: a retry's previous attempt, and a first attempt whose record was written
        before this instance took the lead (within RE_READ_SKEW_MS of producers' clock
        skew; one written since would be known here). All at once, one call to the store
        for the batch (two Redis round trips where an agent claimed any): one for each
        record made admitting a backlog of 10,000 read again after a fail-over 3 s longer
        on loopback (4.1 s, now 0.9 s). Not asked:
        a placement that ended or was retried here, answered `ended` (what `_standing`
        makes of either, should this instance forget it before the record's turn). Where
        the ledger cannot tell (Redis away; no Redis: tests, benchmarks), every record is
        taken as it says: with Redis away, the batch waits for its client's time-out once,
        not once for each record until the lease lapsed."""
        claims: list[ClaimState | None] = [None] * len(records)
        if self._store is None:
            return claims
        asked: dict[int, str] = {}
        """Index of a record -> the placement looked up for it."""
        for i, (record, outcome) in enumerate(zip(records, outcomes, strict=True)):
            if not isinstance(outcome, Admitted) or not outcome.request.attempt and \
                    record.timestamp - self._led_at_ms > RE_READ_SKEW_MS:
                continue
            request = outcome.request
            placement_id = _placement_id(request.request_id, max(0, request.attempt - 1))
            if self._gone(placement_id):
                claims[i] = "ended"
            else:
                asked[i] = placement_id
        if not asked:
            return claims
        try:
            states = await self._store.claim_states(list(dict.fromkeys(asked.values())))
        except Exception:
            return [None] * len(records)
        for i, placement_id in asked.items():
            claims[i] = states[placement_id]
        return claims

    def _standing(self, request: InferenceRequest, claim: ClaimState | None) -> Standing:
        """How `request`, which does not wait here, is taken in (`Standing`), by what this
        instance knows of its placements and `claim`, where the agents' ledger has the one
        it is judged by (`_read_ledger`; None: not looked up, or the ledger cannot tell).

        A later attempt is a retry only where its previous attempt was claimed by an agent
        (which hands it back) or fenced by a scheduler (which retries it): a record produced
        straight to Kafka that only says it is a retry skipped its tenant's budget, its
        requests in flight and its tokens per minute, and, judged new but queued by its own
        fields, still waited from its `created_at_ms` (aged at once), went to the front of
        its class, never expired and was priced by its `attempt` as a victim. A first
        attempt read again (an earlier record held its offset back) may have been placed by
        a leader before: ended, it was charged again, counted in flight and placed again for
        nothing. Without a claim, a record is taken as it says: a first attempt as new, a
        retry as one."""
        attempt = request.attempt
        placement_id = _placement_id(request.request_id, max(0, attempt - 1))
        if self._gone(placement_id):  # it ended, or was retried, here (maybe during the batch)
            return "ran" if attempt else "done"
        if claim is None:
            return "ran" if attempt else "new"
        if attempt:
            return "new" if claim == "untaken" else "ran"
        return "new" if claim == "untaken" else "ran" if claim == "held" else "done"

    def _take_expired(self, now_ms: int) -> list[tuple[Pending, Outgoing]]:
        """The requests still waiting for their first placement past their queue time limit
        (their own `max_queue_ms` or their class's, the lower), out of the queue, each with
        its terminal 503 rejection (nothing ran, nothing is billed). Confirmed retries
        (`Pending.retry`) never expire: they ran once already; a later attempt judged new
        work expires as a first attempt does."""
        out: list[tuple[Pending, Outgoing]] = []
        if not self._max_queue_ms and not self.queue.limited:
            return out  # no limit applies to anything waiting
        for item in list(self.queue.in_order()):
            request = item.request
            limit_ms, source = self.queue_limit(request)
            if item.placed_once or item.retry or not _past(limit_ms, request, now_ms):
                continue
            waited_ms = now_ms - request.created_at_ms
            self.queue.remove(item)
            self._refund(item)
            self._metrics.rejected.labels("expired").inc()
            out.append((item, Outgoing(Rejection(
                request_id=request.request_id, tenant=request.tenant, status_code=503,
                code="queue_time_exceeded", reason=f"request {request.request_id} waited "
                f"{_duration(waited_ms)} for a GPU in the {request.priority_class} queue, past "
                f"its limit of {_duration(limit_ms)} ({source}); it ends unrun: send it again "
                "later"),
                topics.RESULTS.name, request.request_id, item.trace_carrier)))
        return out

    def _refund(self, item: Pending) -> None:
        """Give back the quota charge of work that ends unrun, if its admission took one."""
        request = item.request
        if item.charged and not item.refunded:
            item.refunded = True  # once: a cycle undone queues it again, to end it again
            self.quotas.refund(request.tenant, request_tokens(request), item.enqueued_ms)

    def _known(self, key: tuple[str, int]) -> tuple[int, Pending | None] | None:
        """What this scheduler knows under `key`, in one look: the `_identity` of its
        request, with its queue item while it waits (None once decided lately, or running);
        None when nothing."""
        if key in self._placed:
            return self._placed[key], None
        running = self.running.get(_placement_id(*key))
        if running is not None:
            return _identity(running.request), None
        waiting = self.queue.get(key)
        return None if waiting is None else (_identity(waiting.request), waiting)

    def _known_as(self, request_id: str, attempt: int) -> tuple[int, Pending | None] | None:
        """What this scheduler knows under the id of a record posing as `attempt` of
        `request_id` (`_known`): that attempt, else the latest earlier one it knows (the
        record is a retry of that request, or another request posing as one)."""
        for earlier in range(attempt, -1, -1):
            if (known := self._known((request_id, earlier))) is not None:
                return known
        return None

    def _unless_taken(self, refused: Refused) -> Refused:
        """`refused` with a dead letter only, no rejection, unless the rejection ends what
        goes by its id here and nothing else: a rejection under the id of a request taken
        in would end that request's wait and its status at the router, while it runs on and
        is billed (a producer's typo under a live id; the same request read again and
        refused now). So it goes out only where every attempt known under the id is an
        earlier one of the same request (the refused record is its retry, or its hand-back
        that did not parse: a later attempt than any known), for a first attempt only where
        no retry of it is on its way, and for an id rejected before only at the attempt
        rejected (the record read again)."""
        rejection = refused.rejection
        if rejection is None:
            return refused
        rid, attempt = rejection.request_id, refused.attempt
        identity = None if refused.request is None else _identity(refused.request)
        rejected = self._refused.get(rid)
        taken = (rejected is not None and rejected != attempt) \
            or (not attempt and rid in self._retried) \
            or any(earlier >= attempt or identity not in (None, known[0])
                   for earlier in range(LAST_ATTEMPT + 1)
                   if (known := self._known((rid, earlier))) is not None)
        if not taken:
            return refused
        letter = refused.dead_letter
        why = _REFUSED_BEFORE.format(rid) if rejected is not None else (
            f"request_id '{rid}' is taken by a request this scheduler has taken in, so no "
            "rejection goes out under it (it would end that request): give each request its "
            "own id")
        # cut as a Reason is when made (a copy is not validated again)
        return Refused(letter.model_copy(update={"reason": cut_reason(f"{letter.reason}; {why}")}),
                       None, refused.request, attempt)

    async def _refuse_request(self, refused: Refused, record: ConsumerRecord) -> None:
        """Dead-letter request `record`, with its rejection unless that would end another
        request (`_unless_taken`). Its id is noted before Kafka answers: a record under it
        read meanwhile (another class's topic) is refused as taking it, not run; kept if the
        publish fails (the rejection may be out), the record read again is rejected again."""
        refused = self._unless_taken(refused)
        self._note_refused(refused)
        await self._refuse(refused, record)

    def _note_refused(self, refused: Refused) -> None:
        """Note the id of a rejection (`_refused`), so a later record under it, the
        producer's corrected one, is refused as taking it, not run after its client was
        told it failed. This instance's memory: a next leader does not know it."""
        if refused.rejection is not None and refused.rejection.request_id not in self._refused:
            self._refused[refused.rejection.request_id] = refused.attempt

    def queue_limit(self, request: InferenceRequest) -> tuple[float | None, str]:
        """The longest `request` may wait for its first placement, and who set it."""
        own = request.max_queue_ms
        of_class = self._max_queue_ms.get(request.priority_class)
        if of_class is not None and (own is None or of_class < own):
            return of_class, f"GPUSCHED_{request.priority_class.upper()}_MAX_QUEUE_S"
        return own, "its max_queue_ms, from the X-Max-Queue-Ms header or the Kafka record"

    def _estimate(self, item: Pending) -> float:
        return self._estimate_request(item.request)

    def _estimate_request(self, request: InferenceRequest) -> float:
        """GPU-seconds a request will probably use: learned per model from measured usage
        (per weighted token), else a rough prior; only fairness between tenants uses it."""
        learned = self._gpu_s_per_token.get(request.model)
        if learned is None:
            return estimate_gpu_s(request, self.catalog.get(request.model))
        prompt = request.prompt_token_count
        return learned * _weighted_tokens(prompt, request.max_tokens)

    def _guarantee(self, tenant: str) -> int | None:
        t = self.tenants.get(tenant)
        return None if t is None else t.quota.guaranteed_gpu_memory_mib

    def _over_quota(self, request: InferenceRequest, now_ms: int) -> OverQuota | None:
        tenant = self.tenants.get(request.tenant)
        if tenant is None or (tenant.quota.max_inflight_requests is None
                              and tenant.quota.tokens_per_minute is None):
            return None
        # counting the hand-backs looks through the queue: only where a limit reads it
        inflight = 0 if tenant.quota.max_inflight_requests is None else (
            self.queue.by_tenant[tenant.name] + self.running.count(tenant.name)
            - self._handed_back_while_running(tenant.name)
            + self._in_transit(tenant.name, now_ms))
        return self.quotas.check(tenant.name, tenant.quota, request_tokens(request), inflight,
                                 now_ms)

    def _in_transit(self, tenant: str, now_ms: int) -> int:
        """Requests of `tenant` retried by this instance and not read back yet (one not read
        within RETRY_IN_TRANSIT_MS is no longer counted: it went to another leader)."""
        if not self._retried:  # the common case: nothing to prune on each admission
            return 0
        # one sent "later" than now (the clock was stepped back) is no longer counted either:
        # kept, it counted for the whole step
        self._retried = {rid: (t, at) for rid, (t, at) in self._retried.items()
                         if 0 <= now_ms - at < RETRY_IN_TRANSIT_MS}
        return sum(1 for t, _ in self._retried.values() if t == tenant)

    def _handed_back_while_running(self, tenant: str) -> int:
        """Requests of `tenant` counted twice in flight: a later attempt queued while an
        earlier one still counts as running (a hand-back read before its final usage)."""
        return sum(1 for keys in self.queue.by_request.values() for rid, attempt in keys
                   if attempt and (item := self.queue.get((rid, attempt))) is not None
                   and item.request.tenant == tenant
                   and any(_placement_id(rid, a) in self.running for a in range(attempt)))

    def _preemption_rights(self, chunks: list[Chunk],
                           away: Callable[[], Callable[[InferenceRequest], bool]]
                           ) -> tuple[dict[str, int], set[str], set[str]]:
        """In one look through this cycle's work, in its order, what each request may
        preempt: its ceiling (interactive work may preempt batch and borrowed work, 1; work
        of a tenant that stays inside its GPU memory guarantee once placed may reclaim
        borrowed work, 0; standard and batch work that would itself be borrowed may not: it
        would trade one loan for another); which requests stay inside their guarantee,
        interactive ones too: they alone may take back borrowed work placed as aged; and
        which interactive requests would be borrowed once placed: they may not take the
        work `_guarded` by its tenant's guarantee (its hand-back would reclaim the room, and
        so on), nor another tenant's borrowed interactive work (`plan_cycle`).

        A request stays inside only if what its tenant holds (`_holdings`), what the
        tenant's earlier requests judged inside need (those whose victims are stopping too)
        and its own need fit the guarantee together: judged each against the holdings
        alone, a tenant just under its guarantee reclaimed room for every request it had
        waiting in one cycle. A request only nodes that are away could hold (`away()`, the
        cycle's `out_of_reach`) claims none: the cycle can do nothing for it, and it kept
        its tenant's next request from reclaiming for as long as those nodes were away."""
        ceilings: dict[str, int] = {}
        reclaiming: set[str] = set()
        borrowing: set[str] = set()
        holdings = self._holdings()
        claimed: dict[str, int] = {}  # tenant -> MiB held and needed by work judged inside
        for chunk in chunks:
            for item in chunk.items:
                request = item.request
                tenant = request.tenant
                guarantee, need = self._guarantee_need(request)
                inside = False
                if guarantee is not None:
                    held = claimed[tenant] if tenant in claimed else holdings(tenant)
                    if inside := held + need <= guarantee:
                        if not away()(request):
                            claimed[tenant] = held + need
                if request.request_id in self._preempting:
                    continue
                if inside:
                    reclaiming.add(request.request_id)
                if request.priority_class == "interactive":
                    ceilings[request.request_id] = 1
                    if not inside and guarantee is not None:
                        borrowing.add(request.request_id)
                elif inside:
                    ceilings[request.request_id] = 0
        return ceilings, reclaiming, borrowing

    def _fleet(self, now_ms: int) -> list[FleetNode]:
        """The fleet that decides whether work that fits nowhere now waits or is rejected
        (`fleet_gpu_mib`): none (nothing is rejected) until `fleet_known_after_ms` after
        this instance read its first node state. Started cold, its first cycles had read
        some nodes' reports and not yet others', and rejected for good (422) work only
        those others could hold; a standby that takes over has read them all long since.
        Timed from the first report, not from the start: a new pod compiling its solver
        (about 20 s) had used up the wait before it read any."""
        heard = self.view.first_heard_ms
        if heard is None or now_ms - heard < self.config.fleet_known_after_ms:
            return []  # an empty view's fleet is none all the same
        return fleet_gpu_mib(self.view, now_ms, self.config.stopped_grace_ms)

    def _reservation(self, r: RunningPlacement) -> Reservation:
        """What the view holds for placement `r` until its node's report shows it; one that
        reserves its KV cache alone counts on its weights loaded there (`relies_mib`)."""
        model = self.catalog.get(r.request.model)
        relies = memory_per_gpu(r.request, model)[1] if model is not None \
            and r.memory_mib_per_gpu == r.kv_cache_mib else 0
        return Reservation(r.placement_id, r.node_id, r.gpu_indices, r.memory_mib_per_gpu,
                           request_weights(r.request), relies)

    def borrowed(self) -> set[str]:
        """The placements in flight beyond their tenant's GPU memory guarantee now
        (`RunningSet.borrowed`), work told to stop left out: reclaimable by preemption."""
        return self.running.borrowed(self._guarantee, leaving=self._told)

    def _holdings(self) -> Callable[[str], int]:
        """What each tenant holds of its guarantee now (MiB), its work told to stop left
        out: counted until it stopped, it made the tenant's newer work borrowed for the
        whole preemption time-out, and another tenant reclaimed that too, taking the tenant
        below its guarantee."""
        return self.running.holdings(self._told)

    def _guarded(self) -> set[str]:
        """The running work a request that would itself be borrowed may not preempt: handed
        back, it stays inside its tenant's guarantee (the guarantee is what a tenant keeps
        under contention, and the hand-back would reclaim its room). No borrowed work is
        guarded (`borrowed`): its tenant's work up to it holds more than the guarantee
        already, and its hand-back needs no less than it holds (weights counted)."""
        out: set[str] = set()
        holdings = self._holdings()
        for r in self.running.values():
            guarantee, need = self._guarantee_need(r.request)
            if guarantee is not None and holdings(r.tenant) - r.memory_mib + need <= guarantee:
                out.add(r.placement_id)
        return out

    def _guarantee_need(self, request: InferenceRequest) -> tuple[int | None, int]:
        """(The GPU memory guarantee of `request`'s tenant, MiB; the MiB it holds of it once
        placed, on all its GPUs, weights counted): a guarantee of None where it has none
        (unlimited: nothing it runs is borrowed) or the request's model left the catalog."""
        guarantee = self._guarantee(request.tenant)
        model = self.catalog.get(request.model)
        if guarantee is None or model is None:
            return None, 0
        return guarantee, sum(memory_per_gpu(request, model)) * request.num_gpus

    async def _take_over(self) -> None:
        """Settle the placements inherited from the previous leader by what the agents'
        ledger says: one its agent ended while no scheduler led (its final usage went by
        unmatched) is no longer running; one the previous leader fenced but did not get to
        retry is retried; the others count as reserved on their node until it lists them as
        active, so a command lost on its way is found by the untaken check. A node this
        instance has never heard from is expected to report within the node time-out, and is
        lost (its work retried) if it does not."""
        if not self._inherited:
            return
        ended, fenced = [], []
        now = self._clock()
        for pid, claim in self._inherited.items():
            r = self.running.get(pid)
            if r is None:
                continue
            self.view.expect(r.node_id, now)
            if claim == "ended" or pid in self._ended:  # its final usage read meanwhile (a
                ended.append(pid)  # standby's, or this leader's before a Redis blip)
            elif claim == "fenced":
                fenced.append(r)
            else:
                self.view.reserve_unlisted(self._reservation(r))
        if ended:
            log.info("taking over: %d placements ended while no scheduler led", len(ended))
            await self._forget(ended)
        await self._retry(fenced, "takeover")
        self._inherited = {}

    async def _recover_lost_nodes(self, now_ms: int) -> None:
        """Work on a node silent past the time-out goes back to its class as a new attempt
        (at the front: requeued='node_lost'); the retry is counted. Its placements are
        fenced first, so that if the agent comes back and reads a command it had not taken
        yet it does not run it beside the retry (one it had taken, its next run ends
        without handing back: the scheduler no longer counts it as running; one it has
        ended already, its final usage not yet here, is not retried; one an agent of another
        node holds is booked there instead, `_book_where_held`). Final records
        its agent had filed and not all published (it died meanwhile) are published on its
        behalf: their work is finished, not run again, and has its result (if Kafka refuses
        them, they are published again next cycle)."""
        if self._unpublished and await self._publish_filed(self._unpublished):
            self._unpublished = []
        await self._publish_retries()
        lost = self.view.silent(now_ms, self.config.node_timeout_ms)
        if lost and self._store is not None:
            # Silent on Kafka is not dead: an agent alive in Redis keeps its work (Kafka is
            # away, or its reports do not reach this instance), so nothing runs twice.
            if now_ms - self._alive_read_ms < ALIVE_READ_INTERVAL_MS:
                return  # judged at the next read, not once per cycle
            self._alive_read_ms = now_ms
            try:
                alive = await self._store.alive(lost)
            except Exception:
                log.exception("reading whether silent node(s) %s are alive failed", lost)
                return  # judged again next cycle
            heard = {n for n, a in zip(lost, alive, strict=True) if a}
            for node_id in heard - self._silent_alive:
                log.warning("node %s is silent past the time-out but alive (Redis): its "
                            "work stays on it", node_id)
            self._silent_alive = heard
            lost = [n for n in lost if n not in heard]
        if not lost:
            return
        self.view.mark_lost(lost)
        gone = [r for r in self.running.values() if r.node_id in lost]
        if self._store is not None:
            try:
                filed = await self._store.filed_finals(lost)
            except Exception:
                log.exception("reading the claims of lost node(s) %s failed", lost)
                filed = []
            if filed and not await self._publish_filed(filed):
                self._unpublished += filed
            finished = {f.placement_id for f in filed}
            gone = [r for r in gone if r.placement_id not in finished]
            try:
                if gone:
                    fenced = await self._store.fence([r.placement_id for r in gone])
                    claims = await self._drop_ended(
                        [r for r, won in zip(gone, fenced, strict=True) if not won])
                    gone = [r for r in gone if claims.get(r.placement_id) != "ended"]
                    # booked here by a leader that did not know where it runs: retried, it
                    # ran twice (and was billed twice) beside the run on a live node
                    elsewhere = await self._book_where_held(
                        [r for r in gone if claims.get(r.placement_id) == "held"], now_ms)
                    gone = [r for r in gone if r.placement_id not in elsewhere]
            except Exception:  # the retry must happen all the same: the node is lost
                log.exception("fencing the placements of lost node(s) %s, or reading where "
                              "those taken run, failed", lost)
        await self._retry(gone, "node_lost")

    async def _publish_filed(self, filed: list[Filed]) -> bool:
        """Publish final records agents filed and take them off their nodes' claims (a
        final usage then ends its placement here, as the agent's would have); False when
        Kafka refused them."""
        assert self._store is not None
        # in the trace of each one's request, where this instance still knows it
        carriers = {f.placement_id: r.trace_carrier for f in filed
                    if (r := self.running.get(f.placement_id)) is not None}
        try:
            await self._publish([Outgoing(message, topic, key, carriers.get(f.placement_id, {}))
                                 for f in filed for message, topic, key in f.records])
        except Exception:
            log.exception("publishing the final records filed for %s failed",
                          [f.placement_id for f in filed])
            return False
        log.warning("published the final records the agents of lost nodes had filed for %s",
                    ", ".join(f.placement_id for f in filed))
        try:
            await self._store.release_claims(filed)
        except Exception:  # left filed: an agent that comes back publishes them once more
            log.exception("releasing the claims of %s failed", [f.placement_id for f in filed])
        return True

    async def _recover_untaken(self, now_ms: int) -> None:
        """A placement still reserved (its node never listed it as active and no final usage
        came) although the node has reported for `untaken_timeout_ms` since it was sent: the
        command was lost on its way. It is fenced first (claimed in the agents' ledger under
        the scheduler's name, so a late delivery is a duplicate the agent ignores); only
        those fenced are retried, the others were taken by the agent meanwhile. One fenced
        before is retried too (a fence whose answer Redis lost, or one of a placement sent
        again after its retry): a retry of the same attempt runs once. Of those taken, one
        its agent has already ended is no longer running: a request redelivered long
        after it was decided (past RECENT_DECISIONS) was placed again under the id of its
        finished placement, which the agent ignores as a duplicate; one an agent of another
        node holds is booked where it runs (`_book_where_held`). Looks at most once a
        second, over the reservations (few: most are taken within a heartbeat)."""
        timeout = self.config.untaken_timeout_ms
        if now_ms - self._untaken_checked_ms < UNTAKEN_CHECK_MS:
            return
        self._untaken_checked_ms = now_ms
        seen = self.view.last_seen_ms
        self._handed_at = {p: at for p, at in self._handed_at.items() if p in self.running}
        waiting = {r.placement_id for _, r, _ in self._resend} | {
            _placement_id(*key) for key in self._in_cycle}  # Kafka has not answered yet
        untaken = [r for pid in self.view.reservations if (r := self.running.get(pid))
                   and pid not in waiting
                   and now_ms - (sent := self._handed_at.get(pid, r.placed_at_ms)) > timeout
                   and seen.get(r.node_id, 0) - sent > timeout]
        if untaken and self._store is not None:
            try:
                fenced = await self._store.fence([r.placement_id for r in untaken])
                taken = [r for r, won in zip(untaken, fenced, strict=True) if not won]
                claims = await self._drop_ended(taken)
                untaken = [r for r, won in zip(untaken, fenced, strict=True)
                           if won or claims[r.placement_id] == "fenced"]
                await self._book_where_held(
                    [r for r in taken if claims[r.placement_id] == "held"], now_ms)
            except Exception:  # Redis away: the cycle places on; looked at again next second
                log.warning("could not fence %d untaken placements, or read where those "
                            "taken run; trying again later", len(untaken), exc_info=True)
                return
        if untaken:
            await self._retry(untaken, "untaken")

    async def _book_where_held(self, held: list[RunningPlacement], now_ms: int) -> set[str]:
        """Book where it runs each placement of `held` that an agent of another node holds
        than the one it is booked on: a leader that did not know an earlier leader's
        placement (claimed by its agent, never saved: that leader crashed) placed its
        request again, and the other node's agent ignored it as a duplicate. Booked there,
        its reservation kept memory free on that node from other work, a preempt went there,
        and the loss of that node retried it while it ran on. The holder's claim gives its
        GPUs and KV cache there (a preemption plan sees it where it is); its memory stays as
        booked (the same request: only whether its weights were loaded may differ), and
        the holder's reports count what it uses. Saved first (a next leader inherits it
        there); a holder lost already, or silent past the node time-out where never heard
        from, has it retried. Returns the ids of those an agent of another node holds
        (booked there, retried, or, this instance deposed meanwhile, left to the next
        leader, which inherits them where they were booked); raises, booking nothing, where
        Redis is away."""
        assert self._store is not None
        if not held:
            return set()
        epoch = self.epoch
        claimed = await self._store.held_as(held)
        elsewhere = [(r, r.model_copy(update={  # placed then: a victim loses progress since
            "node_id": c.node_id, "gpu_indices": c.gpu_indices, "kv_cache_mib": c.kv_cache_mib,
            "placed_at_ms": c.placed_at_ms}))
            for r in held
            if (c := claimed.get(r.placement_id)) is not None and c.node_id != r.node_id]
        held_elsewhere = {booked.placement_id for booked, _ in elsewhere}
        moves = [(booked, moved) for booked, moved in elsewhere
                 if self.running.get(booked.placement_id) is booked]  # not ended or retried
        if not moves or epoch is None or self.epoch != epoch \
                or not await self._store.save([moved for _, moved in moves], epoch):
            return held_elsewhere
        lost: list[RunningPlacement] = []
        for booked, moved in moves:
            if self.epoch != epoch or self.running.get(booked.placement_id) is not booked:
                continue  # stepped down, or it ended or was retried, during the save
            log.warning("placement %s runs on node %s (GPUs %s), not on %s where it was "
                        "booked (its request was placed again by a leader that did not know "
                        "it): booked where it runs", moved.placement_id, moved.node_id,
                        list(moved.gpu_indices), booked.node_id)
            self.view.release(booked.placement_id)
            self.running[moved.placement_id] = moved
            self.view.expect(moved.node_id, now_ms)
            self.view.reserve_unlisted(self._reservation(moved))
            if moved.node_id in self.view.lost:
                lost.append(moved)
        if lost:
            await self._retry(lost, "node_lost")
        return held_elsewhere

    async def _drop_ended(self, taken: list[RunningPlacement]) -> dict[str, ClaimState]:
        """Placements claimed already: those their agent has ended are no longer running.
        Returns every claim's state; raises, changing nothing, when they cannot be read."""
        assert self._store is not None
        if not taken:
            return {}
        claims = await self._store.claims(taken)
        ended = [r.placement_id for r in taken if claims[r.placement_id] == "ended"]
        if ended:
            log.warning("no longer running, their agents ended them: %s", ", ".join(ended))
            await self._forget(ended)
        return claims

    async def _forget(self, ended: list[str]) -> None:
        """Placements their agents ended without their final usage reaching this instance:
        no longer running, here or in Redis."""
        for pid in ended:
            del self.running[pid]
            self.view.release(pid)
            self._moved_on[pid] = None
        await self._remove(ended)

    def _gone(self, placement_id: str) -> bool:
        """Whether the placement ended or was retried since it was sent."""
        return placement_id in self._ended or placement_id in self._moved_on

    async def _remove(self, ended: list[str]) -> None:
        """Take ended placements out of Redis's running hash, with those it refused before
        (tried again each cycle: a leader that found one there after its agent's claim
        expired would take it for never started and run it again)."""
        pending, self._unremoved = self._unremoved + ended, []
        if self._store is None or not pending:
            return
        try:
            await self._store.remove(pending)
        except Exception:
            log.exception("removing ended placements %s from Redis failed; trying again",
                          pending)
            self._unremoved = pending + self._unremoved  # with those ended meanwhile

    async def _retry(self, gone: list[RunningPlacement], why: RetryWhy) -> None:
        """Placements that will not run: each request goes back to its class as the next
        attempt (requeued='node_lost', served first), counted as retried for `why`. One on
        the last attempt a request may have ends failed instead (an attempt after it is no
        request anyone reads), counted as its attempts exhausted for `why`."""
        what = RETRY_WHY[why]
        now_s = self._clock() / 1000
        for r in gone:
            del self.running[r.placement_id]
            self.view.release(r.placement_id)
            self._moved_on[r.placement_id] = None
            # its next attempt is charged when placed: before, the tenant kept both charges
            self._give_back_estimate(r.placement_id, r.request.tenant, now_s)
            request = r.request
            if request.attempt >= LAST_ATTEMPT:
                log.warning("node %s %s: %s ends failed on its last attempt", r.node_id, what,
                            request.request_id)
                self._metrics.attempts_exhausted.labels(why).inc()
                waited_ms = max(0, self._clock() - request.created_at_ms)
                self._retries.append((r.placement_id, Outgoing(RequestResult(
                    request_id=request.request_id, tenant=request.tenant, model=request.model,
                    status="failed", finish_reason=f"its node {what} on attempt "
                    f"{request.attempt}, the last a request may have", **request.so_far(),
                    queued_ms=waited_ms, total_ms=waited_ms), topics.RESULTS.name,
                    request.request_id, r.trace_carrier)))
                continue
            retry = request.model_copy(update={"attempt": request.attempt + 1,
                                               "requeued": "node_lost"})
            self._retried[request.request_id] = (request.tenant, int(now_s * 1000))
            log.warning("node %s %s: retrying %s as attempt %d", r.node_id, what,
                        r.request.request_id, retry.attempt)
            self._metrics.retried.labels(why).inc()
            # in its request's trace: read back, the next attempt goes on in it
            self._retries.append((r.placement_id, Outgoing(
                retry, topics.REQUESTS[retry.priority_class].name, retry.request_id,
                r.trace_carrier)))
        await self._publish_retries()

    async def _publish_retries(self) -> None:
        """Publish the retries Kafka has not taken yet, then take their placements out of
        Redis. A refusal keeps them for the next cycle: a node is reported lost once, so
        a retry dropped here would leave its request waiting forever."""
        if not self._retries:
            return
        retries = list(self._retries)  # kept there until Kafka took them (`_undo` looks)
        try:
            await self._publish([out for _, out in retries])
        except Exception:
            log.exception("publishing %d retries failed; trying again next cycle",
                          len(retries))
            return
        taken = {id(retry) for retry in retries}
        self._retries = [retry for retry in self._retries if id(retry) not in taken]
        for pid, _ in retries:
            if (item := self._decide_when_retried.pop(pid, None)) is not None:
                item.decided = True
        self._commit_decided()
        if self._store is not None:
            try:
                await self._store.remove([pid for pid, _ in retries])
            except Exception:  # a leader finds them fenced and retries them: same attempt
                log.exception("removing retried placements from Redis failed")

    async def _maybe_signal_scaling(self) -> None:
        now_s = self._clock() / 1000
        period = self.config.scaling_period_s
        if now_s - self._last_scaling_s < period:
            return
        elapsed = now_s - self._last_scaling_s if self._last_scaling_s else period
        self._last_scaling_s = now_s
        tightest = min(self._targets.values()) / 1000
        memory = gpu_memory_mib(g.memory_total_mib for s in self.view.nodes.values()
                                for g in s.gpus)
        for spec in self.catalog.models:
            queued = [p for p in self.queue.in_order() if p.request.model == spec.name]
            running = [r for r in self.running.values() if r.request.model == spec.name]
            if not queued and not running and not self._arrivals.get(spec.name):
                continue
            gpus = {(r.node_id, g) for r in running for g in r.gpu_indices}
            load = ModelLoad(
                model=spec.name, arrivals_per_s=self._arrivals.pop(spec.name, 0) / elapsed,
                service_s=self._service_s.get(spec.name, 1.0), queued=len(queued),
                queued_by_class={c: sum(p.request.priority_class == c for p in queued)
                                 for c in PRIORITY_CLASSES},
                gpus_in_use=len(gpus), gang_gpus=spec.num_gpus,
                concurrency_per_gang=gang_concurrency(spec, memory, 2048),
                tightest_target_s=tightest)
            wanted = gpus_wanted(load)
            self._metrics.gpus_wanted.labels(spec.name).set(wanted)
            with untraced():  # a trace per model every 5 s crowded requests out of Jaeger
                await self._publish([Outgoing(ScalingSignal(
                    model=spec.name, gpus_wanted=wanted, gpus_in_use=len(gpus),
                    queue_depth=load.queued_by_class, at_ms=int(now_s * 1000)),
                    topics.EVENTS.name, spec.name, {})])

    async def _refuse(self, refused: Refused, record: ConsumerRecord) -> None:
        """Dead-letter request `record`, and send its rejection where it has one, in the
        trace of the request it is (`_own_trace`)."""
        self._metrics.rejected.labels("invalid").inc()

        def attributes() -> Mapping[str, str]:
            if refused.request is not None:
                return request_attributes(refused.request)
            if refused.rejection is not None:  # invalid, but its request id is valid
                return {"gpusched.request_id": refused.rejection.request_id}
            return {}

        carrier = self._own_trace(record_carrier(record.headers), record, attributes)
        out = [Outgoing(refused.dead_letter, topics.DEAD_LETTERS.name,
                        refused.dead_letter.source_topic, carrier)]
        if refused.rejection is not None:
            out.append(Outgoing(refused.rejection, topics.RESULTS.name,
                                refused.rejection.request_id, carrier))
        await self._publish(out)

    async def _publish(self, out: list[Outgoing]) -> None:
        """Send and wait for Kafka's acknowledgement."""
        await (await self._send(out))


def _first(chunks: list[Chunk], limit: int) -> list[Chunk]:
    """The first `limit` units of the ordered chunks."""
    out: list[Chunk] = []
    for chunk in chunks:
        if limit <= 0:
            break
        out.append(chunk if len(chunk.items) <= limit else Chunk(chunk.name, chunk.items[:limit]))
        limit -= len(chunk.items)
    return out


def _past(limit_ms: float | None, request: InferenceRequest, now_ms: int) -> bool:
    """Whether `request` was created more than `limit_ms` ago (whether a request waiting
    for its first placement is past its queue time limit; a confirmed retry never is)."""
    return limit_ms is not None and now_ms - request.created_at_ms > limit_ms


def _within_contract(retry_after_s: int | None) -> int | None:
    """`retry_after_s` as a rejection may say it (1 s to MAX_RETRY_AFTER_S). Past that it
    failed the contract as the rejection was made: `admit` raised, and the request consumer
    read the same batch again and again, its whole class stalled for every tenant."""
    return None if retry_after_s is None else min(max(1, retry_after_s), MAX_RETRY_AFTER_S)


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f}".removesuffix(".0") + " s"


def _identity(request: InferenceRequest) -> int:
    """What tells a redelivery, or a producer's retry, of a request (equal) from another
    request under the same id (different): everything it asks for, not its times (a
    retried record has a new timestamp). (str hashes are cached: the prompt is hashed
    once.)"""
    return hash(request.asks())


_REFUSED_BEFORE = ("request_id '{}' was refused before (a rejection went out under it): send "
                   "the corrected request under a new request_id")


def _placement_id(request_id: str, attempt: int) -> str:
    return f"{request_id}#{attempt}"


def _weighted_tokens(prompt_tokens: int, completion_tokens: int) -> float:
    """Generated tokens dominate GPU time; a prompt token costs about 1/20 of one."""
    return max(1.0, completion_tokens + prompt_tokens / 20)


class _QueueDepth(Collector):
    """`gpusched_scheduler_queue_depth`, counted from the pending queue when scraped: a
    gauge set on every cycle cost more than ordering the queue (2.2 ms per cycle with 768
    requests of 100 tenants pending), for a value read every few seconds. The scrape runs
    on the engine's event loop, so it sees the queue between cycles."""

    def __init__(self, queue: PendingQueue) -> None:
        self._queue = queue

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("gpusched_scheduler_queue_depth", "Pending requests.",
                                   labels=["priority_class", "tenant"])
        for (cls, tenant), n in sorted(self._queue.depth_by_tenant().items()):
            family.add_metric([cls, tenant], n)
        yield family


class _FleetGpus(Collector):
    """`gpusched_scheduler_gpus`: the fleet's GPUs by type and state (serving, loaded,
    empty, unhealthy, unreachable), counted from the view when scraped, as the queue depth
    is. Every instance reads node states; only the leader counts the placements it sent."""

    def __init__(self, view: ClusterView, clock: Callable[[], int], node_timeout_ms: int
                 ) -> None:
        self._view = view
        self._clock = clock
        self._node_timeout_ms = node_timeout_ms

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("gpusched_scheduler_gpus", "GPUs of the fleet by state.",
                                   labels=["gpu_type", "state"])
        live = self._view.live_nodes(self._clock(), self._node_timeout_ms)
        for (gpu_type, state), n in sorted(self._view.gpu_states(live).items()):
            family.add_metric([gpu_type, state], n)
        yield family


class _Metrics:
    def __init__(self, registry: CollectorRegistry, queue: PendingQueue) -> None:
        registry.register(_QueueDepth(queue))
        self.decisions = Counter("gpusched_scheduler_decisions_total",
                                 "Placements, rejections and preemptions published.",
                                 registry=registry)
        latency = Histogram(
            "gpusched_scheduler_placement_seconds", "Request creation to placement.",
            ["priority_class"], registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.placement_latency = {c: latency.labels(c) for c in PRIORITY_CLASSES}
        """Per class, resolved once (a label lookup per placement showed in profiles)."""
        self.cycle_seconds = Histogram("gpusched_scheduler_cycle_seconds", "One cycle.",
                                       registry=registry)
        self.solver_seconds = Histogram("gpusched_scheduler_solver_seconds",
                                        "Solver time of one cycle.", registry=registry)
        self.preemptions = Counter("gpusched_scheduler_preemptions_total",
                                   "Running placements preempted.", registry=registry)
        self.preemption_plans = Counter(
            "gpusched_scheduler_preemption_plans_total", "Preemption plans sent, by how the "
            "solver's search for the cheapest victims ended: exact, or cut_short at its step "
            "budget (the cheapest plan it found, maybe not the cheapest there is).",
            ["search"], registry=registry)
        for search in ("exact", "cut_short"):
            self.preemption_plans.labels(search)
        self.rejected = Counter("gpusched_scheduler_rejections_total",
                                "Requests refused; invalid: every record dead-lettered "
                                "(requests, node states).", ["reason"], registry=registry)
        for reason in ("quota", "unschedulable", "expired", "budget_spent", "invalid"):
            # at 0 from the start: a series first seen at 1 is no increase() to alert on
            self.rejected.labels(reason)
        self.retried = Counter("gpusched_scheduler_retries_total",
                               "Placements retried: their node was lost (node_lost), a live "
                               "node never took them (untaken), or the previous leader "
                               "fenced them (takeover).", ["why"], registry=registry)
        self.attempts_exhausted = Counter(
            "gpusched_scheduler_attempts_exhausted_total", "Requests ended failed, not "
            "retried: the placement of their last attempt would not run, for the retries' "
            "whys.", ["why"], registry=registry)
        for why in RETRY_WHY:
            self.retried.labels(why)
            self.attempts_exhausted.labels(why)
        self.cycle_failures = Counter("gpusched_scheduler_cycle_failures_total",
                                      "Scheduling cycles that raised (each is tried again "
                                      "0.5 s later); the scheduler's log says why.",
                                      registry=registry)
        self.gpus_wanted = Gauge("gpusched_scheduler_gpus_wanted",
                                 "GPUs wanted per model to meet the latency targets.",
                                 ["model"], registry=registry)
