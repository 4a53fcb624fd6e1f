"""The agent at work: takes placement, preempt and cancel commands, runs placements on the
executor, streams chunks, meters usage (periodic partial deltas plus one final record), and
reports node state on start, on change and as a heartbeat.

Invariants: a placement runs at most once per node (claimed in the ledger before it starts);
commands from a deposed scheduler (stale fencing epoch) never run; every started placement
ends with exactly one final usage record, and with either a `request_result` or the request
handed back to its class topic (preempted, drained), never both and never neither. These
final records are filed in the ledger before they are published (`outbox`), so a crash
while they go out ends with them published again (consumers apply them once), never with
the request run a second time or left without a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from gpusched_agent.adapters.executor import (
    EngineFinished,
    Executor,
    ExecutorLacksModel,
    ExecutorRefused,
    ExecutorTurnedAway,
    ExecutorUnavailable,
    Job,
    PromptTokens,
)
from gpusched_agent.adapters.ledger import PlacementLedger, Taken
from gpusched_agent.domain.fencing import stale_reason
from gpusched_agent.domain.inventory import GpuInfo
from gpusched_agent.domain.node import Admitted, NodeModel, Refused, executor_gpu
from gpusched_agent.domain.stop_strings import StopScan
from gpusched_common import outbox, topics
from gpusched_common.catalog import GPU_TYPES, ModelCatalog, ModelSpec, model_of
from gpusched_common.contracts import (
    LAST_ATTEMPT,
    MAX_HANDBACK_BYTES,
    MAX_RECORD_BYTES,
    MAX_USAGE_GPU_SECONDS,
    PLACEMENT,
    Cancel,
    InferenceRequest,
    LoadFailure,
    Message,
    NodeState,
    Placement,
    Preempt,
    RequestResult,
    Resume,
    TokenChunk,
    UsageRecord,
    asks_differ,
    cut_reason,
)
from gpusched_common.kafka_records import WallClockMs
from gpusched_common.recent import Recent
from gpusched_common.redis_keys import CLAIM_TTL_S, NODE_ALIVE_TTL_S
from gpusched_common.tasks import cancelled
from gpusched_common.telemetry import (
    carrier_of,
    context_from,
    in_trace,
    mark_failure,
    request_attributes,
    untraced,
)

log = logging.getLogger(__name__)

Publish = Callable[..., Awaitable[None]]
"""publish(message, topic, key, wait=True); wait=False pipelines the send (token chunks:
same key, same partition, so they stay in order before the final result)."""
ReadInventory = Callable[[], Awaitable[Sequence[GpuInfo]]]
MAX_ATTEMPTS = 5
FENCE_AFTER_S = NODE_ALIVE_TTL_S - 3
"""Cut off from Kafka and Redis this long, the agent stops its work (looked at every second):
the scheduler retries a node's work once it has heard no report for its node time-out (10 s
by default, keep it at least NODE_ALIVE_TTL_S) and the node's alive mark has expired
(NODE_ALIVE_TTL_S after the last one Redis took). While Redis refuses the mark, each second
asks for a report, so Kafka alone keeps the work running whatever the heartbeat."""
ALIVE_WAIT_S = 0.5
PUBLISH_RETRY_MAX_S = 5.0
"""Longest pause between tries of a final record Kafka refused (it is away)."""
REMEMBERED_CANCELS = 10_000
INVENTORY_STUCK_S = 30.0
"""A GPU read (NVML) not answered for this long marks the node's GPUs unhealthy."""


@dataclass(frozen=True)
class Started:
    placement_id: str


@dataclass(frozen=True)
class Ignored:
    """Not for this node, a duplicate, or nothing to act on; `reason` says which."""

    reason: str


@dataclass(frozen=True)
class Stale:
    """Rejected: sent by a deposed scheduler. The caller dead-letters it with `reason`."""

    reason: str


@dataclass(frozen=True)
class Stopping:
    placement_id: str


@dataclass(frozen=True)
class Reused:
    """Rejected: a placement under the id of one claimed for another request (the request
    id used twice). The caller dead-letters it with `reason`."""

    reason: str


Outcome = Started | Ignored | Stale | Reused | Stopping


@dataclass
class _Running:
    placement: Placement
    carrier: dict[str, str] = field(default_factory=dict)
    """The W3C trace headers of the placement's trace (the agent's span of its command),
    filed with its claim: its `run` span, and what a later run publishes for it after a
    crash (`recover`), stay in its request's trace."""
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    """'cancelled', 'preempted' or 'drained' once asked to stop."""
    detail: str = ""
    interruptible: bool = False
    """True while it loads or generates: a stop cancels its task only then. Before, `_run`
    sees `stop_reason` when it starts; after, its final records must not be interrupted."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    billed_prompt: int = 0
    billed_completion: int = 0
    partials: int = 0
    chunks_sent: int = 0
    """Token chunks of this attempt handed to Kafka. They go out untraced (a span or two
    each made thousands in a long reply's trace): its `run` span says how many."""
    unsent: list[outbox.Final] = field(default_factory=list)
    """Partial usage records Kafka refused: sent (and filed) with the final ones."""
    last_billed_ms: int = 0
    started_ms: int = 0
    gpu_type: str = "none"
    gpu_slots: tuple[int, ...] = field(default_factory=tuple)
    unbilled_gpu_s: float | None = None
    """GPU time since the last record, taken when the work left its GPUs (its meters
    stopped there: waiting on Kafka for its last records is no GPU time)."""
    ended: Message | None = None
    """What its final records end it with: its result, or its request handed back."""
    fault: BaseException | None = None
    """The executor's or the agent's error that ended the run, if one did: its `run` span
    records it where the run ends failed."""


@dataclass(frozen=True)
class _Cooldown:
    """A model kept off this node (`AgentRuntime._cool_down`)."""

    until: float
    """`monotonic` seconds. Not on the wall clock: set back (an NTP step), it lengthened the
    cooldown by as much."""
    load_ends_it: bool
    """Whether a load of the model here that succeeds ends it: only where loads failed."""


class _LoadFailed(Exception):
    """The executor could not load a placement's model (CUDA out of memory, say): the
    engine's fault, not the request's. Its cause is the executor's error."""


def _failed(task: asyncio.Task[None] | None) -> bool:
    """Whether `task` ended without doing its work (its error counts as seen)."""
    return task is not None and task.done() and (
        task.cancelled() or task.exception() is not None)


class AgentRuntime:
    def __init__(self, node_id: str, node: NodeModel, catalog: ModelCatalog,
                 executor: Executor, publish: Publish, ledger: PlacementLedger,
                 clock: WallClockMs, *, chunk_tokens: int, heartbeat_s: float,
                 usage_interval_s: float = 5.0, read_inventory: ReadInventory | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 models: tuple[str, ...] | None = None,
                 refused: Callable[[str, int], None] = lambda model, status: None,
                 load_failure_cooldown_s: float = 60.0,
                 load_failed: Callable[[str], None] = lambda model: None,
                 tracer: trace.Tracer = trace.NoOpTracer()) -> None:
        self.node_id = node_id
        self.node = node
        self.catalog = catalog
        self.executor = executor
        self._models = models
        """GPUSCHED_MODELS (None: unset; see `served_models`)."""
        self._refused = refused
        """Told (model, status code) of each request the engine refused as invalid: its
        client gets the 4xx, and operators a count, since a steady rate on one node says its
        engine's limits are below the catalog's (its --max-model-len, say)."""
        self._load_failure_cooldown_s = load_failure_cooldown_s
        self._load_failed = load_failed
        """Told the model of each load that failed here with the engine up (`_cool_down`)."""
        self._cooling: dict[str, _Cooldown] = {}
        """Model -> the cooldown during which the node asks not to get its work: its load
        failed here lately, or its engine lacked it (`load_failures`)."""
        self._unmatched: frozenset[str] | None = None
        """The engine's list of models last warned about as naming no catalog model."""
        self._publish = publish
        self._tracer = tracer
        self._ledger = ledger
        self._clock = clock
        self._mono = monotonic
        self._chunk_tokens = chunk_tokens
        self._heartbeat_s = heartbeat_s
        self._usage_interval_s = usage_interval_s
        self._read_inventory = read_inventory
        self._started_at_ms = clock()
        self._seq = 0
        self.status = "ready"
        self.highest_epoch = 0
        self._dirty = asyncio.Event()
        self._running: dict[str, _Running] = {}
        """Placement id -> its run, from claim to its final usage record."""
        self._cancelled = Recent(REMEMBERED_CANCELS)
        """Request ids cancelled lately (a placement may arrive after its cancel)."""
        self._loads: dict[tuple[int, str], asyncio.Task[None]] = {}
        """(GPU index, model) -> the task that readies it there, running or done (`_prepare`)."""
        self._downs = 0
        """How many times the executor was found unavailable: a health check asked before
        the latest of them cannot clear it."""
        self._reading: asyncio.Task[Sequence[GpuInfo]] | None = None
        """The GPU read in progress (`_reread_inventory`), and since when."""
        self._reading_since = 0.0
        self._heard_at = self._mono()
        """When Kafka (a node state) or Redis (the alive mark) last took something from this
        agent: the scheduler can tell it is alive only by those (`_fence_if_cut_off`)."""
        self._reporter: asyncio.Task[None] | None = None
        self._alive: asyncio.Task[None] | None = None
        """The reporter's own task saying in Redis that the agent is alive."""
        """`report_forever` from `start_reporting` until the end of `drain`."""

    # --- node state ----------------------------------------------------------------------
    def start_reporting(self) -> None:
        """Run `report_forever` in a task of its own (unless it runs): heartbeats and the
        alive mark, until `drain` has published the final state."""
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.create_task(self.report_forever(), name="node-state")

    async def report_forever(self) -> None:
        """Publish node state at start, on every change (at most every 50 ms), and as a
        heartbeat every `heartbeat_s`, re-reading GPU telemetry and health each time; and,
        in a task of its own, every second in Redis that the agent is alive (a report to a
        Kafka that is away can block for the producer's 40 s time-out)."""
        alive = self._alive = asyncio.create_task(self._say_alive_forever(), name="alive")
        try:
            await self._report_forever()
        finally:
            alive.cancel()  # once: `drain` makes sure it ended (`cancelled`)
            if self._reading is not None:  # a reporter started again asks for a read of its own
                self._reading.cancel()
                self._reading = None

    async def _say_alive_forever(self) -> None:
        """The scheduler does not retry the work of a node it cannot hear while this holds.
        Each mark waits ALIVE_WAIT_S at most (Redis cut off answers nothing, for its client's
        whole time-out), so the fence below is looked at every second."""
        while True:
            sent = self._mono()  # the mark's TTL runs from about then
            try:
                async with asyncio.timeout(ALIVE_WAIT_S):
                    await self._ledger.alive(self.node_id)
                self._heard_at = max(self._heard_at, sent)
            except Exception:
                log.warning("could not say in Redis that this node is alive", exc_info=True)
                self._dirty.set()  # is Kafka there? A report now tells, whatever the heartbeat
            self._fence_if_cut_off()
            await asyncio.sleep(max(0.0, 1.0 - (self._mono() - sent)))  # one a second

    def _fence_if_cut_off(self) -> None:
        """Neither Kafka nor Redis has taken anything from this agent for FENCE_AFTER_S (a
        network partition): the scheduler, hearing no report and finding no alive mark, is
        about to retry this node's work elsewhere. The work stops here first, so it does not
        run twice: each request goes back as its next attempt with its tokens (published,
        and billed for what it used, once Kafka takes it; the scheduler's own retry of the
        same attempt is the same record to it)."""
        cut_off_s = self._mono() - self._heard_at
        if cut_off_s < FENCE_AFTER_S:
            return
        for pid, run in list(self._running.items()):
            if run.stop_reason is None:
                log.error("stopping %s: this node has reached neither Kafka nor Redis for "
                          "%.0f s, and the scheduler retries its work elsewhere", pid, cut_off_s)
                self._stop(pid, "drained", f"the node was cut off from Kafka and Redis for "
                           f"{cut_off_s:.0f} s")

    async def _report_forever(self) -> None:
        # the engine asked before the first report: it tells whether the engine is up and
        # which models it serves (an openai node reported every model, and healthy, until
        # its first check)
        await self._check_engine()
        while True:
            try:
                await self.report()
            except Exception:  # Kafka away: the next heartbeat tries again
                log.warning("node state not published; trying again in %g s",
                            self._heartbeat_s, exc_info=True)
            # not wait_for: on Python 3.11 it swallows a cancel that comes as the event is
            # set (a drain's last placement ending), and this loop never stopped
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_s):
                    await self._dirty.wait()
            self._dirty.clear()
            if self._read_inventory is not None:
                await self._reread_inventory()
            await self._check_engine()
            await asyncio.sleep(0.05)

    async def _reread_inventory(self) -> None:
        """Take fresh GPU readings (health, telemetry) into the node model. A read that has
        not answered for INVENTORY_STUCK_S (NVML on a GPU fallen off the bus) is not
        waited for: the heartbeat goes on, the GPUs are reported unhealthy with the reason,
        and the next read is asked for once that one answers. A read that fails reports
        every GPU unhealthy with its error, until one succeeds."""
        assert self._read_inventory is not None
        if self._reading is None:
            self._reading, self._reading_since = (asyncio.create_task(self._read_inventory()),
                                                  self._mono())
        done, _ = await asyncio.wait({self._reading}, timeout=1.0)
        if not done:
            stuck_s = self._mono() - self._reading_since
            if stuck_s >= INVENTORY_STUCK_S and any(g.info.healthy for g in self.node.gpus):
                log.error("reading the GPUs has not answered for %.0f s", stuck_s)
                self.node.refresh([replace(g.info, healthy=False, unhealthy_reason=(
                    f"reading the GPUs (NVML) has not answered for {stuck_s:.0f} s"))
                    for g in self.node.gpus])
            return
        reading, self._reading = self._reading, None
        if reading.cancelled():
            return
        try:
            gpus = reading.result()
        except Exception as exc:  # a failed read must not stop the heartbeat
            log.exception("re-reading the GPU inventory failed")
            gpus = [replace(g.info, healthy=False, unhealthy_reason=(
                f"reading the GPUs (NVML) failed: {exc!r}"[:500])) for g in self.node.gpus]
        if self.node.refresh(gpus):
            log.warning("GPU health changed: %s", [
                (g.info.index, g.info.unhealthy_reason) for g in self.node.gpus])

    async def _check_engine(self) -> None:
        """Ask the executor whether its engine can run work; while it cannot, the node
        reports its GPUs unhealthy with the reason and admits nothing."""
        downs, served = self._downs, self.served_models()
        try:
            problem = await self.executor.health()
        except Exception as exc:  # a failed check must not stop the heartbeat
            problem = f"executor health check failed: {exc!r}"
        if (now_served := self.served_models()) != served:
            log.warning("the node now serves the models %s", now_served)
            self._dirty.set()  # the scheduler stops placing the others here at once
        if problem is not None:
            self._engine_down(problem)
        elif self.node.down is not None and self._downs == downs:  # not asked before a fault
            log.warning("executor is back: the node takes work again")
            self.node.down = None

    def _engine_down(self, reason: str) -> None:
        self._downs += 1
        reason = reason[:500]
        if self.node.down is None:
            log.warning("executor unavailable, the node takes no work until it is back: %s",
                        reason)
            self._dirty.set()  # report it now, not at the next heartbeat
        self.node.down = reason

    def served_models(self) -> tuple[str, ...] | None:
        """The catalog models this node runs, which its node state reports (the scheduler
        places no other here): GPUSCHED_MODELS, else the catalog's among those its engine
        lists (a server fronting only some), else None: every catalog model."""
        if self._models is not None:
            return self._models
        listed = self.executor.served_models()
        served = None if listed is None else tuple(m for m in self.catalog.names if m in listed)
        if served == ():  # TGI, llama.cpp: their own id, whatever `model` asks
            if listed != self._unmatched:
                self._unmatched = listed
                log.warning("the inference server lists none of the catalog's models (it lists "
                            "%s): this node takes every model, each sent under its catalog "
                            "name; set GPUSCHED_MODELS to those it serves",
                            ", ".join(sorted(listed or ())) or "none")
            return None
        return served

    def load_failures(self) -> tuple[LoadFailure, ...] | None:
        """The models whose load failed here within the cooldown, each with its end, which
        the node reports (None: none)."""
        now, now_ms = self._mono(), self._clock()
        self._cooling = {m: c for m, c in self._cooling.items() if c.until > now}
        return tuple(LoadFailure(model=m, until_ms=now_ms + math.ceil((c.until - now) * 1000))
                     for m, c in sorted(self._cooling.items())) or None

    def node_state(self, seq: int = 0) -> NodeState:
        """This node's state as reported (`report`; /v1/node shows it with no seq)."""
        return self.node.state(self.node_id, seq, self._started_at_ms, self._clock(),
                               self.status, self.executor.name, self.served_models(),
                               self.load_failures())

    async def report(self) -> None:
        self._seq += 1
        state = self.node_state(self._seq)
        sent = self._mono()
        with untraced():  # a trace per heartbeat crowded requests' traces out of Jaeger
            await self._publish(state, topics.NODE_STATE.name, self.node_id)
        self._heard_at = max(self._heard_at, sent)

    def now_ms(self) -> int:
        return self._clock()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    # --- commands ------------------------------------------------------------------------
    async def command(self, cmd: Placement | Preempt) -> Outcome:
        """Act on a command from the placements topic. Idempotent: a placement delivered
        twice runs once; a stale one (deposed scheduler) is returned as `Stale`."""
        if cmd.node_id != self.node_id:
            return Ignored(f"for node {cmd.node_id}")
        leader_epoch = await self._ledger.leader_epoch()
        reason = stale_reason(cmd.scheduler_epoch, leader_epoch, self.highest_epoch)
        if reason is not None:
            return Stale(reason)
        if leader_epoch is not None:  # then equal to the command's: a leader's for sure.
            # Without one in Redis, any Kafka client could send an epoch: taking it would
            # fence the agent off from the real leader until it restarts.
            self.highest_epoch = leader_epoch
        if isinstance(cmd, Preempt):
            return self._stop(cmd.placement_id, "preempted", cmd.reason)
        asks = cmd.request.asks_digest()
        carrier = carrier_of(trace.get_current_span())  # the command's (FastStream's span)
        running = self._running.get(cmd.placement_id)
        claim = Taken(running.placement.request.asks_digest()) if running is not None \
            else await self._ledger.claim(
                cmd.placement_id, self.node_id, self._started_at_ms, cmd.to_bytes(),
                cmd.request.request_id, asks, carrier)
        if isinstance(claim, Taken):
            if claim.asks is not None and asks_differ(claim.asks, asks):
                # a scheduler that had forgotten the first request (past its memory of
                # decisions, or restarted) placed another under the same id: not run, and
                # not answered either, as a rejection would end the other request
                return Reused(f"placement {cmd.placement_id} was claimed within the last "
                              f"{CLAIM_TTL_S // 86_400} days for another request under "
                              f"request_id '{cmd.request.request_id}' (it asked for something "
                              "else: tenant, model, class, prompt, messages, max_tokens, "
                              "num_gpus or sampling); this one is not run: give each request "
                              "its own id")
            log.info("placement %s already taken; ignoring the duplicate", cmd.placement_id)
            return Ignored("duplicate")
        run = self._running[cmd.placement_id] = _Running(cmd, carrier)
        if claim.cancelled is not None:  # a cancel this agent never read: it ends unrun
            # (kept in Redis by a release that did not cut its reason yet)
            run.stop_reason, run.detail = "cancelled", cut_reason(claim.cancelled)
        run.task = asyncio.create_task(self._run(run), name=cmd.placement_id)
        return Started(cmd.placement_id)

    async def first_to_report(self, record_ref: str) -> bool:
        """Whether this agent, of all that read `record_ref` (a control record none can
        read), is the one to dead-letter it."""
        return await self._ledger.first_to_report(record_ref, self.node_id)

    def cancel(self, cancel: Cancel) -> Outcome:
        """Stop the request if it runs here (usage so far is billed; it ends 'cancelled');
        remembered for a while in case its placement arrives later."""
        self._cancelled[cancel.request_id] = cancel.reason
        outcome: Outcome = Ignored("not running here")
        for pid, run in self._running.items():  # all: an attempt still ending can sit
            if run.placement.request.request_id == cancel.request_id:  # beside the next one
                outcome = self._stop(pid, "cancelled", cancel.reason)
        return outcome

    def _stop(self, placement_id: str, why: str, detail: str) -> Outcome:
        run = self._running.get(placement_id)
        if run is None or run.task is None:
            return Ignored(f"placement {placement_id} is not running here")
        if run.stop_reason is None:
            run.stop_reason, run.detail = why, detail
            if run.interruptible:
                run.task.cancel()
        return Stopping(placement_id)

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM: stop taking work, let running requests finish for up to `timeout_s`,
        hand back what still runs (usage so far billed), publish the final state.
        Heartbeats and the alive mark go on meanwhile (started here if they do not run): a
        drain outlasts the scheduler's node time-out, which would otherwise take the node
        for lost and retry its work beside it."""
        self.status = "draining"
        self._dirty.set()  # reported now
        self.start_reporting()
        try:
            tasks = [r.task for r in self._running.values() if r.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_s)
            for pid in list(self._running):
                self._stop(pid, "drained", "the agent is shutting down")
            tasks = [r.task for r in self._running.values() if r.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=10)
        finally:
            assert self._reporter is not None
            # the alive mark's task too: a cancel its Redis write swallowed had the stopped
            # node say it was alive on
            await cancelled(self._reporter, *[t for t in (self._alive,) if t is not None])
        self.status = "stopped"
        await self._report_if_kafka_takes_it()

    async def _report_if_kafka_takes_it(self) -> None:
        """A report the drain, or a failed load, goes on without: Kafka away must not keep
        the work here from being handed back (the heartbeat tries again)."""
        try:
            await self.report()
        except Exception:
            log.warning("node state %s not published; handing work back all the same",
                        self.status, exc_info=True)

    # --- one placement -------------------------------------------------------------------
    async def _run(self, run: _Running) -> None:
        pid = run.placement.placement_id
        with self._run_span(run):
            try:
                try:
                    await self._attempt(run)
                except Exception as exc:  # a fault of the agent's own: the run ends anyway
                    log.exception("placement %s failed in the agent; it ends failed", pid)
                    await self._end_failed(run, exc)
                # not when the loop shuts down mid-run: the next run of this node hands it
                # back (`recover`), as it does when even the last resort failed
                await self._release(pid)
            except Exception:
                log.exception("placement %s could not end; the next run of the agent hands "
                              "it back", pid)
            finally:
                self._running.pop(pid, None)
                self._dirty.set()

    @contextlib.contextmanager
    def _run_span(self, run: _Running) -> Iterator[None]:
        """The `run` span of `run`, from its start to its final records, in its placement's
        trace: current while it lasts (the run's records go out under it, but for its token
        chunks, untraced), and saying at its end how the run ended (`_how_it_ended`) and
        how many token chunks it streamed (`gpusched.token_chunks`); status ERROR, with the
        error behind it, where it ended failed (`telemetry.mark_failure`)."""
        placement, request = run.placement, run.placement.request
        what = {**request_attributes(request), "gpusched.placement_id": placement.placement_id,
                "gpusched.node_id": self.node_id, "gpusched.attempt": request.attempt,
                "gpusched.gpu_indices": placement.gpu_indices}
        with self._tracer.start_as_current_span("run", context=context_from(run.carrier),
                                                attributes=what) as span:
            try:
                yield
            finally:
                span.set_attributes({**_how_it_ended(run.ended),
                                     "gpusched.token_chunks": run.chunks_sent})
                mark_failure(span, run.ended, run.fault)

    async def _attempt(self, run: _Running) -> None:
        placement = run.placement
        request = placement.request
        if run.stop_reason is not None:
            await self._end_unstarted(run, run.stop_reason, run.detail)
            return
        if request.request_id in self._cancelled:
            await self._end_unstarted(run, "cancelled", self._cancelled[request.request_id])
            return
        model = self.catalog.get(request.model)
        admitted: Admitted | Refused
        if model is None:
            admitted = Refused(f"model '{request.model}' unknown to this agent")
        elif self.status != "ready":
            admitted = Refused(f"node is {self.status}")
        elif (served := self.served_models()) is not None and model.name not in served:
            # placed on a view of this node older than its list of models
            admitted = Refused(f"model '{model.name}' is not served on this node (it serves "
                               f"{', '.join(served) or 'none'})")
        else:
            admitted = self.node.admit(placement, model)
        if isinstance(admitted, Refused) or model is None:
            # a node going down hands work back as drained work: no refusal of the request
            # (it failed after MAX_ATTEMPTS of them), first in line as node_lost
            serving = self._serving()
            await self._handback(run, admitted.reason,  # type: ignore[union-attr]
                                 "handback" if serving else "node_lost", refused=serving)
            return
        await self._execute(run, self._prepare(admitted, model, placement.gpu_indices), model)

    async def _release(self, placement_id: str) -> None:
        try:
            await self._ledger.release(placement_id, self.node_id)
        except Exception:  # the claim stays filed: a later run hands the request back again
            log.exception("releasing the claim of %s failed", placement_id)

    async def recover(self) -> int:
        """At start, before the first report: what an earlier run of this node claimed and
        never ended (it crashed) is ended. If that run had filed its final records, they
        are published again (consumers apply each once). Otherwise the placement gets a
        zero final usage, which ends it for the scheduler and for billing, and unless the
        scheduler has already retried it elsewhere (the node was declared lost meanwhile),
        the request goes back to its class as the next attempt. Returns how many it handed
        back."""
        left: list[_Running] = []
        for pid, raw, carrier in await self._ledger.left_over(self.node_id,
                                                              self._started_at_ms):
            try:
                finals = outbox.decode(raw)
                if finals is None:
                    left.append(_Running(PLACEMENT.validate_json(raw), carrier))
                    continue
            except ValueError as exc:  # nothing to act on; must not stop the agent
                log.error("dropping the unreadable claim of %s an earlier run left: %s",
                          pid, exc)
            else:
                log.info("publishing again the final records of %s an earlier run filed", pid)
                with in_trace(carrier):
                    for message, topic, key in finals:  # Kafka away at start: until it is back
                        await self._publish_until_sent(message, topic, key)
            await self._release(pid)
        placed = await self._ledger.still_placed([r.placement.placement_id for r in left])
        for run, still in zip(left, placed, strict=True):
            with in_trace(run.carrier):
                if still:  # a lost node's work: it does not use up the request's `refused`
                    await self._handback(run, "an earlier run of the agent ended without it",
                                         "node_lost", refused=False)
                else:
                    await self._finish(run, [])
            await self._release(run.placement.placement_id)
        self._heard_at = max(self._heard_at, self._mono())  # reporting starts now
        return sum(placed)

    def _holds(self, gpu: int, model_name: str) -> bool:
        """Whether the node model counts weights of `model_name` that the executor keeps
        under (`gpu`, model): whole on `gpu`, or a gang's shard whose first GPU is `gpu`
        (executors run a gang on its first GPU). A shard on a gang's other GPU does not
        count: it kept a single copy on that GPU loaded in the executor after the node
        model had evicted it."""
        return any(model_of(w) == model_name and executor_gpu(w, gpu) == gpu
                   for w in self.node.gpus[gpu].loaded_mib)

    def _prepare(self, admitted: Admitted, model: ModelSpec, gpus: tuple[int, ...]
                 ) -> asyncio.Task[None] | None:
        """What the placement just admitted on `gpus` waits for before it runs: the executor
        freeing what admission evicted and loading `model` on the first (a gang runs there).
        Called at admission with no await in between, because the node model counts the
        weights loaded from then on: a placement admitted later finds the task under
        (GPU, model) and waits for the same load. The task runs on its own, so a request
        cancelled meanwhile does not cut an unload or a load short; one that failed is
        tried again by the next placement."""
        key = (gpus[0], model.name)
        before = self._loads.get(key)
        failed = _failed(before)
        if not (admitted.needs_load or admitted.evicted or failed):
            return before
        task = self._loads[key] = asyncio.create_task(self._make_room_and_load(
            admitted.evicted, model, gpus, admitted.needs_load or failed, before))
        task.add_done_callback(_failed)  # its error is logged there, and its waiters see it
        return task

    async def _make_room_and_load(self, evicted: tuple[tuple[int, str], ...],
                                  model: ModelSpec, gpus: tuple[int, ...], load: bool,
                                  before: asyncio.Task[None] | None) -> None:
        """A failed load raises _LoadFailed: the model's weights then no longer count on
        `gpus` where nothing runs on them, and each placement that waited for them forgets
        them as it ends (`_execute`), so the node does not report them loaded; with the
        engine up, the model's cooldown on this node starts first (`_cool_down`). Any
        failure is logged here (its waiters may all have been stopped)."""
        gpu, at_load = gpus[0], False
        if before is not None and not before.done():  # one load of a model on a GPU at once
            await asyncio.wait([before])
            load = load or _failed(before)
        try:
            for index, weights in evicted:
                name = model_of(weights)  # executors hold models, whatever their gang size
                if self._holds(index, name):
                    continue
                loading = self._loads.pop((index, name), None)
                if loading is not None and not loading.done():  # a cancelled request's load
                    await asyncio.wait([loading])
                    _failed(loading)  # its waiters have seen any error; nobody else will
                if not self._holds(index, name):  # nothing admitted it again meanwhile
                    await self.executor.unload(name, index)
            if load:
                at_load = True
                await self.executor.load(model, gpu)
                if (cooling := self._cooling.get(model.name)) is not None and \
                        cooling.load_ends_it:
                    del self._cooling[model.name]
                    self._dirty.set()  # the scheduler may place it here again
        except Exception as exc:
            log.error("%s %s on GPU %d failed", "loading" if at_load else "making room for",
                      model.name, gpu, exc_info=True)
            if not at_load:
                raise
            if self.node.forget_weights(model.name, gpus):
                self._dirty.set()
            if not isinstance(exc, ExecutorUnavailable):  # else the node takes no work at all
                await self._cool_down(model.name, load_failed=True)
            raise _LoadFailed(f"loading {model.name} on GPU {gpu} failed: {exc}") from exc

    async def _cool_down(self, model: str, *, load_failed: bool) -> None:
        """Loading `model` failed here with the engine up (`load_failed`: a corrupt file on
        this node, memory another process holds, a driver fault), or its engine does not
        serve it under the name it is sent, and would likely fail again: for the cooldown the
        node asks the scheduler not to place it here. Reported before the placements that
        waited for the load (or the one the engine lacked the model for) hand their requests
        back, so that their next attempts go to other nodes, or wait, instead of using up
        their refusals here. A load of it here that succeeds (placed before the scheduler
        knew) ends a failed load's cooldown, not one the engine's lacking the model started:
        the openai executor's load does nothing, so it tells nothing of the names the server
        serves (ending it had the node claim the model again, and each placement sent there
        fail again, as a new incident)."""
        now = self._mono()
        cooling = self._cooling.get(model)
        if cooling is None or cooling.until <= now:  # one incident, however many GPUs failed
            self._load_failed(model)
            cooling = None
        self._cooling[model] = _Cooldown(
            now + self._load_failure_cooldown_s,
            load_failed and (cooling is None or cooling.load_ends_it))
        await self._report_if_kafka_takes_it()

    async def _execute(self, run: _Running, load: asyncio.Task[None] | None,
                       model: ModelSpec) -> None:
        placement, request = run.placement, run.placement.request
        pid = placement.placement_id
        slot = self.node.gpus[placement.gpu_indices[0]]  # the gang's GPUs run in lockstep
        gpu_type = GPU_TYPES[slot.info.gpu_type]
        run.gpu_type, run.gpu_slots = gpu_type.name, placement.gpu_indices
        run.prompt_tokens = request.billed_prompt_tokens
        # A resumed attempt goes on after what the earlier ones generated and billed (the
        # prompt and those tokens), streaming from where they stopped. One stopped before
        # its first token billed the prompt too: it is resumed with no tokens.
        resume = request.resume or Resume()
        limit = request.reply_limit(model.context_limit_tokens)  # the most tokens in all
        pieces: list[str] = list(resume.tokens)
        if request.resume is not None:
            run.billed_prompt = run.prompt_tokens
            run.billed_completion = run.completion_tokens = len(pieces)
        run.started_ms = run.last_billed_ms = self._clock()
        for index in placement.gpu_indices:
            self.node.gpus[index].meter.start(pid, self._mono())
        self._dirty.set()
        chunk = pieces[resume.streamed_tokens:]  # not streamed yet: the end of `pieces`
        streamed_chars = sum(len(t) for t in pieces[:resume.streamed_tokens])
        seq = resume.next_seq
        stops = StopScan(request.stop)
        for token in pieces:
            stops.feed(token)
        ttft_ms = resume.ttft_ms
        status, finish_reason = "completed", "length"
        engine_finish: str | None = None  # why the engine said it ended the reply
        requeue: str | None = None  # handed back as the next attempt, requeued so
        refused = False  # by this node, which could not run it
        engine_status_code: int | None = None  # the engine's 4xx, where it refused the input
        reached = False  # whether the executor gave anything of this attempt (a token, a count)
        unrun = False  # the engine processed none of it: its prompt is not billed
        lacks_model = False  # the engine does not serve it: the model cools down here
        why = ""
        run.interruptible = True
        partials = asyncio.create_task(self._bill_partials(run), name=f"{pid}:usage")
        try:
            if run.stop_reason is not None:  # stopped between its start and now
                raise asyncio.CancelledError
            if load is not None:
                await asyncio.shield(load)
            # a resumed engine continues the text (the prompt is all that came before), and
            # is asked for what is left of the reply
            prefix, left = "".join(pieces), limit - len(pieces)
            asked = request.model_copy(update={
                "prompt": request.prompt + prefix, "resume": None, "max_tokens": left,
            }) if left != request.max_tokens else request
            job = Job(asked, run.prompt_tokens + len(pieces), model, gpu_type,
                      slot.info.index, pid, prefix)
            generated = self.executor.generate(job) if left > 0 else _no_tokens()
            async with contextlib.aclosing(generated) as tokens:
                async for token in tokens:
                    reached = True
                    if isinstance(token, PromptTokens):
                        self._engine_counted_prompt(run, token.count, request, model)
                        continue
                    if isinstance(token, EngineFinished):
                        engine_finish = token.reason
                        continue
                    if len(pieces) >= limit:  # an engine that overran: unasked,
                        break  # so neither kept nor billed (and a hand-back stays valid)
                    if ttft_ms is None and not resume.tokens:
                        ttft_ms = float(self._clock() - request.created_at_ms)
                    token = _writable(token)
                    pieces.append(token)
                    chunk.append(token)
                    run.completion_tokens = len(pieces)
                    if stops.feed(token):  # billed: the engine generated it
                        finish_reason = "stop"
                        break
                    # The first token goes out alone: its arrival is the client's time to
                    # first token. Then chunks of `chunk_tokens`, one Kafka record each.
                    if seq == 0 or len(chunk) >= self._chunk_tokens:
                        streamable = _streamable(chunk, streamed_chars, stops.final_chars)
                        if streamable:
                            text = "".join(chunk[:streamable])
                            try:
                                with untraced():  # counted on the run's span instead
                                    await self._publish(
                                        TokenChunk(request_id=request.request_id, seq=seq,
                                                   text=text, token_count=streamable),
                                        topics.RESULTS.name, request.request_id, wait=False)
                                run.chunks_sent += 1
                            except Exception:  # Kafka away (buffer full, no metadata): as
                                # a chunk it drops, its text goes with the result
                                log.warning("token chunk %d of %s not sent", seq,
                                            request.request_id, exc_info=True)
                            seq, chunk = seq + 1, chunk[streamable:]
                            streamed_chars += len(text)
                    if run.stop_reason is not None:
                        # The cancel may have landed inside a client that swallows it (a
                        # Kafka send): never trust it alone, stop here at the latest.
                        raise asyncio.CancelledError
            if finish_reason != "stop":  # not ended at a stop string found here: the
                # engine's word, else fewer tokens than asked is the model ending its text
                finish_reason = engine_finish or (
                    "stop" if len(pieces) < limit else "length")
        except asyncio.CancelledError:
            if run.stop_reason is None:
                raise  # not ours (the loop is shutting down): let it propagate
            _uncancel()  # we asked for it: later awaits (publishes) must not see it again
            if stops.end_chars is None:  # else it had ended at a stop string, and the stop
                # (come while the engine's stream closed) changes nothing: it completed
                status = "cancelled"
                finish_reason = f"{run.stop_reason}: {run.detail}"  # the why, as sent
        except (ExecutorUnavailable, ExecutorLacksModel, _LoadFailed) as exc:  # the engine's
            problem = str(exc)  # fault (or this node's setup), not the request's
            run.fault = exc
            if isinstance(exc.__cause__ if isinstance(exc, _LoadFailed) else exc,
                          ExecutorUnavailable):
                self._engine_down(problem)
                problem = f"executor unavailable: {exc}"
            elif isinstance(exc, ExecutorLacksModel):
                log.error("placement %s: %s", pid, exc)
                lacks_model = True
            unrun = not reached  # refused at the door, down, or its model not loaded
            # no refusal of the request where the node is going down (its engine stopping
            # beside it in a rolling restart), as for work that reaches a draining node
            refused = self._serving()
            if (last := _last_try(request, refused=refused)) is None:
                requeue, why = "node_lost", str(exc)
            else:  # it ends here instead of bouncing between nodes forever
                status, finish_reason = "failed", f"{last}: {problem}"
        except Exception as exc:  # an executor fault ends this request, not the agent
            run.fault = exc
            if isinstance(exc, ExecutorRefused):  # its own fault: every engine refuses it
                log.info("placement %s refused by the engine: %s", pid, exc)
                self._refused(model.name, exc.status_code)
                finish_reason, engine_status_code = str(exc), exc.status_code
            else:
                log.exception("placement %s failed", pid)
                finish_reason = f"executor error: {exc}"
            status = "failed"
            unrun = isinstance(exc, ExecutorTurnedAway)
        finally:
            run.interruptible = False
            partials.cancel()  # before the final record: none comes after it. Once
            # cancelled it makes no record (it sleeps, or sends the one it made), so the
            # run leaves its GPUs now, not once a send the client would not cut short ends
            try:
                self.node.finish(placement)
                if load is not None and load.done() and not load.cancelled() \
                        and isinstance(load.exception(), _LoadFailed):
                    # the last placement on weights that never loaded forgets them, whatever
                    # ended it (a stop that came as the load failed included)
                    if self.node.forget_weights(model.name, placement.gpu_indices):
                        self._dirty.set()
                run.unbilled_gpu_s = self._gpu_seconds(run, final=True)
            finally:
                await asyncio.wait([partials])
        if engine_finish is not None and (status, requeue) != ("completed", None):
            # The engine had said why the reply ended: it is whole, and billed. Whatever
            # ended the run after that (the connection dropped or the stream ended before
            # [DONE], a preempt, a drain, a cancel) takes nothing from it, and another node
            # would go on past the model's own end. A cancel too: its client may be gone,
            # but the reply it asked for is the one it was billed for.
            log.warning("placement %s completed (the engine had finished it) before: %s",
                        pid, why if requeue is not None else finish_reason)
            status, finish_reason, requeue = "completed", engine_finish, None
        if unrun:  # its prompt is not billed, unless a partial record did before it ended
            run.prompt_tokens = run.billed_prompt
        if lacks_model:  # here, no longer interruptible: a stop must not cut the report short
            await self._cool_down(model.name, load_failed=False)
        # A stop that came after the last token changes nothing: the request completed.
        if status == "cancelled" and run.stop_reason in ("preempted", "drained"):
            requeue = "preempted" if run.stop_reason == "preempted" else "node_lost"
            why = f"{run.stop_reason}: {run.detail}"
            if (last := _last_try(request, refused=False)) is not None:  # it ends here
                requeue, status, finish_reason = None, "failed", f"{why}; {last}"
        if requeue is not None:  # the next attempt goes on after these tokens, elsewhere
            if not run.prompt_tokens:  # unrun, and nothing billed it: it goes back as it came,
                # and the attempt that runs it bills its prompt, as its engine counts it
                retry = _retry(request, requeue, refused=refused)
            else:  # the request as it asked (the scheduler knows it by that), and in its
                # resume what ran of it: the next attempt's reply is bounded by the room the
                # engine's count of the prompt leaves (`InferenceRequest.reply_limit`)
                retry = _retry(request, requeue, Resume(
                    tokens=tuple(pieces), streamed_tokens=len(pieces) - len(chunk),
                    next_seq=seq, ttft_ms=ttft_ms, prompt_tokens=None if
                    run.prompt_tokens == request.prompt_token_count else run.prompt_tokens),
                    refused=refused)
            if (size := len(retry[0].to_bytes())) <= MAX_HANDBACK_BYTES:
                log.info("placement %s handed back after %d tokens: %s", pid, len(pieces), why)
                await self._finish(run, [retry])
                return
            # Kafka would refuse it, and the agent would try again forever: it ends here
            status, finish_reason = "failed", (
                f"{why}; with the {len(pieces)} tokens it has, it is too large to hand back "
                f"as one Kafka record ({size} bytes)")
        text = "".join(pieces)[:stops.end_chars]  # without the stop string and what followed
        last = TokenChunk(request_id=request.request_id, seq=seq, text=text[streamed_chars:],
                          token_count=len(chunk))
        if chunk and len(last.to_bytes()) <= MAX_RECORD_BYTES:  # else Kafka refuses it for
            # ever; the result is too large then too, and ends failed (below)
            with untraced():
                await self._publish_until_sent(last, topics.RESULTS.name, request.request_id)
            run.chunks_sent += 1
        ended_ms = self._clock()
        result = RequestResult(
            request_id=request.request_id, tenant=request.tenant, model=model.name,
            status=status, finish_reason=finish_reason, text=text,  # type: ignore[arg-type]
            prompt_tokens=run.prompt_tokens, completion_tokens=len(pieces),
            node_id=self.node_id, gpu_indices=placement.gpu_indices,
            queued_ms=max(0.0, run.started_ms - request.created_at_ms),
            total_ms=max(0.0, ended_ms - request.created_at_ms), ttft_ms=ttft_ms,
            engine_status_code=engine_status_code)
        if (size := len(result.to_bytes())) > MAX_RECORD_BYTES:
            # Kafka would refuse it, and the agent would try again forever (after a
            # restart too: its final records are filed): it ends without its text
            result = result.model_copy(update={"status": "failed", "text": "", "finish_reason": (
                f"the reply is too large for one Kafka record ({size} bytes, at most "
                f"{MAX_RECORD_BYTES}): its {len(pieces)} tokens were streamed and billed")})
        await self._finish(run, [(result, topics.RESULTS.name, request.request_id)])

    @staticmethod
    def _engine_counted_prompt(run: _Running, count: int, request: InferenceRequest,
                               model: ModelSpec) -> None:
        """Bill the prompt as the engine counted it, instead of the estimate: on a run that
        bills the prompt only, the request's first or one after attempts no engine took (a
        resumed one's prompt was billed by then, and the engine's count holds the earlier
        tokens too), never below what a partial record already billed, and
        never beyond the model's context (no engine runs a longer prompt: such a count is
        not one to bill, nor to size the request by). A hand-back carries the count on in
        its resume (`Resume.prompt_tokens`)."""
        if request.resume is None and run.billed_prompt <= count <= model.context_limit_tokens:
            run.prompt_tokens = count
        elif count > model.context_limit_tokens:
            log.warning("engine counted %d prompt tokens for %s, beyond %s's context of %d: "
                        "billed as estimated", count, request.request_id, model.name,
                        model.context_limit_tokens)

    async def _finish(self, run: _Running, then: list[outbox.Final]) -> None:
        """End `run`: its final usage, then `then` (its result or its hand-back), filed in the
        ledger first and then published. If filing fails they are published all the same
        (a crash before the claim's release then hands the request back, as before)."""
        finals = [*run.unsent, self._usage(run, final=True), *then]
        run.ended = then[-1][0] if then else None
        try:
            await self._ledger.finishing(run.placement.placement_id, self.node_id,
                                         self._started_at_ms, outbox.encode(finals),
                                         run.carrier)
        except Exception:
            log.exception("filing the final records of %s failed; publishing them anyway",
                          run.placement.placement_id)
        for message, topic, key in finals:
            await self._publish_until_sent(message, topic, key)

    async def _bill_partials(self, run: _Running) -> None:
        """While `run` loads and generates (`interruptible`), a partial usage record every
        usage interval of what it used since the previous one, tokens or not (loading its
        model, a long prefill), so a crash loses at most one interval. Cancelled before the
        final record is made: a partial the stop or Kafka cut off goes with that one."""
        try:
            while run.interruptible:  # not once ended, though a Kafka client swallowed the
                await asyncio.sleep(self._usage_interval_s)  # cancel of the send below
                partial = self._usage(run, final=False)
                try:
                    await self._publish(*partial)
                except asyncio.CancelledError:  # it may not have gone; an event counts once
                    run.unsent.append(partial)
                    raise
                except Exception:  # its deltas are counted: bill them at the end
                    log.warning("partial usage %s not published; it goes with the final "
                                "records", partial[0].event_id, exc_info=True)
                    run.unsent.append(partial)
        except Exception:  # the final record bills what the partials would have
            log.exception("partial usage records of %s stopped", run.placement.placement_id)

    async def _publish_until_sent(self, message: Message, topic: str, key: str) -> None:
        """Publish a record the request's end needs, trying again while Kafka refuses it: the
        claim is released only after, so a crash meanwhile still replays it from the ledger.
        A try that Kafka took after all is a duplicate its consumers already expect (usage
        is applied once per event id; a request's result ends it once)."""
        pause_s = 0.5
        while True:
            try:
                await self._publish(message, topic, key)
                return
            except Exception:
                log.warning("%s for %s not published; trying again in %g s",
                            type(message).__name__, key, pause_s, exc_info=True)
                await asyncio.sleep(pause_s)
                pause_s = min(2 * pause_s, PUBLISH_RETRY_MAX_S)

    def _usage(self, run: _Running, final: bool) -> outbox.Final:
        """Bill what `run` consumed since its previous record (deltas): the prompt once, new
        completion tokens, and its share of each of its GPUs. Event ids are deterministic
        (`<placement>:<n>`, `<placement>:final`), so a replayed record is applied once."""
        pid = run.placement.placement_id
        now_ms = self._clock()
        gpu_seconds = run.unbilled_gpu_s if final and run.unbilled_gpu_s is not None \
            else self._gpu_seconds(run, final)
        if gpu_seconds > MAX_USAGE_GPU_SECONDS:  # a simulator sped up a millionfold, say
            log.error("%s used %.0f GPU-seconds since its last record, more than a record "
                      "holds: billed as %d", pid, gpu_seconds, MAX_USAGE_GPU_SECONDS)
            gpu_seconds = MAX_USAGE_GPU_SECONDS  # no record could carry it, nor its end
        # what it bills, by position: a request started over elsewhere (its node died)
        # bills the positions its earlier attempts billed again, which accounting drops
        prompt_from, completion_from = run.billed_prompt, run.billed_completion
        prompt = run.prompt_tokens - prompt_from
        completion = run.completion_tokens - completion_from
        run.billed_prompt, run.billed_completion = run.prompt_tokens, run.completion_tokens
        started, run.last_billed_ms = run.last_billed_ms, now_ms
        if final:
            event_id = f"{pid}:final"
        else:
            run.partials += 1
            event_id = f"{pid}:{run.partials}"
        request = run.placement.request
        return (UsageRecord(
            event_id=event_id, request_id=request.request_id, placement_id=pid,
            tenant=request.tenant, model=request.model, priority_class=request.priority_class,
            node_id=self.node_id, gpu_type=run.gpu_type, prompt_tokens=prompt,
            completion_tokens=completion, gpu_seconds=round(gpu_seconds, 6), final=final,
            started_at_ms=started or now_ms, ended_at_ms=now_ms, prompt_from=prompt_from,
            completion_from=completion_from), topics.USAGE.name,
            request.tenant)

    def _gpu_seconds(self, run: _Running, final: bool) -> float:
        """`run`'s share of its GPUs since its previous record; `final` stops its meters."""
        pid, now_s = run.placement.placement_id, self._mono()
        gpu_seconds = 0.0
        for index in run.gpu_slots:
            meter = self.node.gpus[index].meter
            gpu_seconds += (meter.stop(pid, now_s) if final else meter.take(pid, now_s))
        return gpu_seconds / self.executor.time_scale

    async def _end_failed(self, run: _Running, exc: Exception) -> None:
        """The last resort for a fault of the agent's own that `_execute` does not handle as
        the executor's: the request ends failed, billed for what ran (its final usage holds
        what no record has), so the scheduler frees what it reserved and the claim goes."""
        placement, request = run.placement, run.placement.request
        run.fault = exc
        run.interruptible = False
        self.node.finish(placement)
        if run.unbilled_gpu_s is None:
            run.unbilled_gpu_s = self._gpu_seconds(run, final=True)
        ran = bool(run.gpu_slots)  # `_execute` began: its counts hold the earlier attempts'
        so_far = request.so_far()
        now_ms = self._clock()
        await self._finish(run, [(RequestResult(
            request_id=request.request_id, tenant=request.tenant, model=request.model,
            status="failed", finish_reason=f"agent error: {exc!r}"[:500], text="",
            prompt_tokens=run.prompt_tokens if ran else so_far["prompt_tokens"],
            completion_tokens=run.completion_tokens if ran else so_far["completion_tokens"],
            node_id=self.node_id, gpu_indices=placement.gpu_indices,
            queued_ms=max(0.0, run.started_ms - request.created_at_ms) if ran else 0,
            total_ms=max(0.0, now_ms - request.created_at_ms)),
            topics.RESULTS.name, request.request_id)])

    async def _end_unstarted(self, run: _Running, why: str, detail: str) -> None:
        """A placement stopped before it ran: a zero final usage releases the scheduler's
        reservation; then the request ends (cancelled) or goes back (preempted, drained)."""
        request = run.placement.request
        last = None if why == "cancelled" else _last_try(request, refused=False)
        if why != "cancelled" and last is None:
            await self._finish(run, [_retry(request, "preempted" if why == "preempted"
                                            else "node_lost")])
            return
        await self._finish(run, [(RequestResult(
            request_id=request.request_id, tenant=request.tenant, model=request.model,
            status="cancelled" if last is None else "failed",
            finish_reason=f"{why}: {detail}" + ("" if last is None else f"; {last}"),
            **request.so_far(), node_id=self.node_id, queued_ms=0, total_ms=0),
            topics.RESULTS.name, request.request_id)])

    def _serving(self) -> bool:
        """Whether this node takes work: a request it cannot run now counts as refused by it
        (MAX_ATTEMPTS of those fail the request); one it hands back while it drains or has
        stopped does not (drains do not count, as preemptions do not)."""
        return self.status == "ready"

    async def _handback(self, run: _Running, reason: str, why: str, refused: bool = True
                        ) -> None:
        """Return a placement this node cannot run (`refused`; else one it lost: it crashed,
        or it came while the node drains) to the scheduler as a new attempt (its zero final
        usage releases what the scheduler reserved); after MAX_ATTEMPTS that agents could not
        run, or on its last attempt, it ends with a failed result instead of bouncing
        forever."""
        request = run.placement.request
        log.warning("handing back %s: %s", run.placement.placement_id, reason)
        if (last := _last_try(request, refused=refused)) is not None:
            await self._finish(run, [(RequestResult(
                request_id=request.request_id, tenant=request.tenant, model=request.model,
                status="failed", finish_reason=f"{last}: {reason}", **request.so_far(),
                queued_ms=0, total_ms=0), topics.RESULTS.name, request.request_id)])
            return
        await self._finish(run, [_retry(request, why, refused=refused)])


def _how_it_ended(ended: Message | None) -> dict[str, str | int]:
    """A run's end as its span says it, from what its final records end it with: the
    result's status and finish reason, or `handed_back` and why; and the reply's tokens
    then (a resumed attempt's count those before it, as its result does)."""
    if isinstance(ended, RequestResult):
        return {"gpusched.status": ended.status,
                "gpusched.finish_reason": cut_reason(ended.finish_reason),
                "gpusched.completion_tokens": ended.completion_tokens}
    if isinstance(ended, InferenceRequest):
        return {"gpusched.status": "handed_back", "gpusched.finish_reason": ended.requeued or "",
                "gpusched.completion_tokens": len((ended.resume or Resume()).tokens)}
    return {}  # it never got to its final records (the agent is stopping)


def _streamable(chunk: list[str], start_chars: int, final_chars: int) -> int:
    """How many of `chunk`'s tokens (its text starting at character `start_chars`) end by
    `final_chars`: those can be streamed, the rest could still turn into a stop string."""
    ready, end = 0, start_chars
    for token in chunk:
        end += len(token)
        if end > final_chars:
            break
        ready += 1
    return ready


def _last_try(request: InferenceRequest, refused: bool) -> str | None:
    """Why a request may not go back for another attempt: this was the last attempt a
    request may have, or (`refused`: this node could not run it) agents could not run
    MAX_ATTEMPTS of its attempts (preempted or drained ones do not count)."""
    if refused and (request.refused or 0) + 1 >= MAX_ATTEMPTS:
        return f"not runnable after {MAX_ATTEMPTS} attempts"
    if request.attempt >= LAST_ATTEMPT:
        return f"attempt {request.attempt} was its last"
    return None


def _retry(request: InferenceRequest, why: str, resume: Resume | None = None,
           refused: bool = False) -> outbox.Final:
    """The request back on its class topic as the next attempt (going on after `resume`
    when given); `refused` when this node could not run it."""
    update: dict[str, object] = {"attempt": request.attempt + 1, "requeued": why,
                                 "resume": resume or request.resume}
    if refused:
        update["refused"] = (request.refused or 0) + 1
    retry = request.model_copy(update=update)
    return retry, topics.REQUESTS[request.priority_class].name, request.request_id


async def _no_tokens() -> AsyncGenerator[str, None]:
    """What is left to generate for a resumed request that had all its tokens: nothing."""
    for token in ():
        yield token


def _writable(token: str) -> str:
    """`token` as UTF-8 can carry it: a lone surrogate (an executor's fault) becomes '?'.
    Records holding one cannot be written, and their request would never end. Anything but
    text (bytes, say) is an executor's fault too: TypeError, which fails the request."""
    if not isinstance(token, str):
        raise TypeError(f"the executor yielded {type(token).__name__}, not text")
    if token.isascii():
        return token
    try:
        token.encode()
    except UnicodeEncodeError:
        return token.encode(errors="replace").decode()
    return token


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
