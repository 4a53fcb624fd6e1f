"""The scheduling cycle: admit requests from Kafka records, solve pending work against a
snapshot of the cluster, publish the cycle's placements together, then release the
records for commit (at-least-once: an offset is committed only after its placement)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiokafka.structs import ConsumerRecord
from opentelemetry import trace
from opentelemetry.propagate import extract
from pydantic import ValidationError

from gpusched_common import topics
from gpusched_common.catalog import ModelCatalog, TenantDirectory
from gpusched_common.contracts import (
    NODE_STATE,
    PRIORITY_CLASSES,
    REQUEST,
    USAGE,
    DeadLetter,
    InferenceRequest,
    Message,
    Placement,
    Rejection,
    count_prompt_tokens,
    decode_json_object,
)
from gpusched_common.kafka_records import WallClockMs, dead_letter
from gpusched_common.telemetry import record_carrier
from gpusched_scheduler.domain.cluster import ClusterView, FreeGpu, Reservation
from gpusched_scheduler.domain.placement import Placed, Unschedulable, place_one
from gpusched_scheduler.domain.queue import Pending, PendingQueue

log = logging.getLogger(__name__)
SERVICE = "scheduler"

Publish = Callable[[Message, str, str], Awaitable[None]]
"""publish(message, topic, key) in the current trace context."""


@dataclass(frozen=True)
class Admitted:
    request: InferenceRequest
    carrier: dict[str, str]


@dataclass(frozen=True)
class Refused:
    dead_letter: DeadLetter
    rejection: Rejection | None
    """Sent to the results topic when the record names a request id a client may wait on."""


def parse_request_record(
    record: ConsumerRecord, catalog: ModelCatalog, tenants: TenantDirectory, now_ms: int,
) -> Admitted | Refused:
    """Turn one record of a request topic into a request, or a dead letter with a reason.

    Missing `request_id` defaults to `kafka-<topic>-<partition>-<offset>` (stable across
    redeliveries); missing `created_at_ms` to the record's timestamp; missing
    `priority_class` to the topic's class.
    """
    topic_class = record.topic.rsplit(".", 1)[-1]

    def refuse(reason: str, request_id: str | None = None, status: int = 400,
               tenant: str | None = None) -> Refused:
        rejection = None
        if request_id is not None:
            rejection = Rejection(request_id=request_id, tenant=tenant, status_code=status,
                                  reason=reason)
        return Refused(dead_letter(record, reason, SERVICE, now_ms), rejection)

    try:
        payload = decode_json_object(record.value or b"")
    except ValueError as exc:
        return refuse(str(exc))
    payload.setdefault("request_id", f"kafka-{record.topic}-{record.partition}-{record.offset}")
    payload.setdefault("created_at_ms", record.timestamp)
    payload.setdefault("priority_class", topic_class)
    try:
        request = REQUEST.validate_python(payload)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())
        rid = payload.get("request_id")
        valid_id = isinstance(rid, str) and "request_id" not in reasons.split(":")[0]
        return refuse(f"invalid request: {reasons}", rid if valid_id else None)
    rid, tenant = request.request_id, request.tenant
    if request.priority_class != topic_class and topic_class in PRIORITY_CLASSES:
        return refuse(f"priority_class '{request.priority_class}' does not match topic "
                      f"{record.topic}; produce to gpusched.requests.{request.priority_class}",
                      rid, tenant=tenant)
    if tenants.get(tenant) is None:
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
    return Admitted(request, record_carrier(record.headers))


def request_tokens(request: InferenceRequest) -> int:
    return (request.prompt_tokens or count_prompt_tokens(request.prompt)) + request.max_tokens


class SchedulingEngine:
    """Owns the pending queue and the cluster view; all mutation happens on one event loop."""

    def __init__(
        self, catalog: ModelCatalog, tenants: TenantDirectory, publish: Publish,
        clock: WallClockMs, tracer: trace.Tracer, *, epoch: int, cycle_window_ms: float,
        node_timeout_ms: int, on_cycle: Callable[[int, float], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.tenants = tenants
        self.view = ClusterView()
        self.queue = PendingQueue()
        self._publish = publish
        self._clock = clock
        self._tracer = tracer
        self._epoch = epoch
        self._window_s = cycle_window_ms / 1000
        self._node_timeout_ms = node_timeout_ms
        self._wake = asyncio.Event()
        self._placed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._on_cycle = on_cycle

    # --- inputs -------------------------------------------------------------------------
    async def admit(self, records: list[ConsumerRecord]) -> None:
        """Queue the valid requests of `records`, refuse the rest; returns once every one is
        placed or refused (so the caller may then commit their offsets)."""
        now = self._clock()
        waits: list[asyncio.Future[None]] = []
        for record in records:
            outcome = parse_request_record(record, self.catalog, self.tenants, now)
            if isinstance(outcome, Refused):
                await self._refuse(outcome)
                continue
            key = (outcome.request.request_id, outcome.request.attempt)
            if key in self._placed:
                continue  # redelivered after its placement was published: nothing to do
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self.queue.push(Pending(outcome.request, outcome.carrier, now, done)):
                waits.append(done)
        if waits:
            self._wake.set()
            await asyncio.gather(*waits)

    def node_states(self, records: list[ConsumerRecord]) -> None:
        now = self._clock()
        for record in records:
            if record.value is None:
                continue  # tombstone of a decommissioned node
            try:
                state = NODE_STATE.validate_json(record.value)
            except ValidationError:
                log.warning("ignoring invalid node state at %s:%s", record.partition,
                            record.offset)
                continue
            self.view.apply_node_state(state, now)
        self._wake.set()

    def usage(self, records: list[ConsumerRecord]) -> None:
        released = False
        for record in records:
            try:
                usage = USAGE.validate_json(record.value)
            except ValidationError:
                continue
            if usage.final:
                self.view.release(usage.placement_id)
                released = True
        if released:
            self._wake.set()

    # --- the cycle ----------------------------------------------------------------------
    async def run(self) -> None:
        """Cycle whenever woken (new work, node state, released memory), at most once per
        micro-batch window, and at least once a second (node time-outs)."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except TimeoutError:
                pass
            if self._window_s:
                await asyncio.sleep(self._window_s)
            self._wake.clear()
            try:
                await self.cycle()
            except Exception:  # a fault in one cycle must not stop scheduling
                log.exception("scheduling cycle failed; retrying")
                await asyncio.sleep(0.5)
                self._wake.set()

    async def cycle(self) -> int:
        """One pass over pending work in priority order; returns placements published."""
        if not len(self.queue):
            return 0
        started = asyncio.get_running_loop().time()
        now = self._clock()
        gpus = self.view.schedulable_gpus(now, self._node_timeout_ms)
        decided: list[tuple[Pending, Placement | Rejection]] = []
        for item in self.queue.in_order():
            request = item.request
            spec = self.catalog.get(request.model)
            assert spec is not None  # checked at admission
            outcome = place_one(request_tokens(request), spec, gpus)
            if isinstance(outcome, Placed):
                placement = Placement(
                    placement_id=f"{request.request_id}#{request.attempt}",
                    node_id=outcome.node_id, gpu_indices=(outcome.gpu_index,),
                    kv_cache_mib=outcome.kv_cache_mib, scheduler_epoch=self._epoch,
                    placed_at_ms=now, request=request)
                self.view.reserve(Reservation(placement.placement_id, outcome.node_id,
                                              outcome.gpu_index, outcome.memory_mib, spec.name))
                gpus = _after(gpus, outcome, spec.name)
                decided.append((item, placement))
            elif isinstance(outcome, Unschedulable) and outcome.permanent:
                decided.append((item, Rejection(request_id=request.request_id,
                                                tenant=request.tenant, status_code=422,
                                                reason=outcome.reason)))
        for item, _ in decided:
            self.queue.remove(item)
        await asyncio.gather(*(self._emit(item, msg) for item, msg in decided))
        for item, _ in decided:
            self._placed[(item.request.request_id, item.request.attempt)] = None
            if len(self._placed) > 200_000:
                self._placed.popitem(last=False)
            if not item.token.done():
                item.token.set_result(None)
        if self._on_cycle is not None:
            self._on_cycle(len(decided), asyncio.get_running_loop().time() - started)
        return len(decided)

    async def _emit(self, item: Pending, message: Placement | Rejection) -> None:
        """Publish one decision as a child span of the request's own trace."""
        request = item.request
        with self._tracer.start_as_current_span(
            "schedule", context=extract(item.trace_carrier),
            attributes={"gpusched.request_id": request.request_id,
                        "gpusched.priority_class": request.priority_class,
                        "gpusched.queued_ms": self._clock() - item.enqueued_ms},
        ) as span:
            if isinstance(message, Placement):
                span.set_attribute("gpusched.node_id", message.node_id)
                span.set_attribute("gpusched.gpu_indices", list(message.gpu_indices))
                await self._publish(message, topics.PLACEMENTS.name, message.node_id)
            else:
                span.set_attribute("gpusched.rejected", message.reason)
                await self._publish(message, topics.RESULTS.name, message.request_id)

    async def _refuse(self, refused: Refused) -> None:
        await self._publish(refused.dead_letter, topics.DEAD_LETTERS.name,
                            refused.dead_letter.source_topic)
        if refused.rejection is not None:
            await self._publish(refused.rejection, topics.RESULTS.name,
                                refused.rejection.request_id)


def _after(gpus: list[FreeGpu], placed: Placed, model: str) -> list[FreeGpu]:
    return [
        FreeGpu(g.node_id, g.gpu, g.free_mib - placed.memory_mib, g.models | {model})
        if (g.node_id, g.gpu.index) == (placed.node_id, placed.gpu_index) else g
        for g in gpus
    ]
