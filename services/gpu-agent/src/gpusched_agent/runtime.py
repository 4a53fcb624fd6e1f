"""The agent at work: admits placements, runs them on the executor, streams chunks, meters
usage, and reports node state on change and as a heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.node import Admitted, NodeModel, Refused
from gpusched_common import topics
from gpusched_common.catalog import GPU_TYPES, ModelCatalog
from gpusched_common.contracts import (
    Placement,
    RequestResult,
    TokenChunk,
    UsageRecord,
    count_prompt_tokens,
)
from gpusched_common.kafka_records import WallClockMs

log = logging.getLogger(__name__)

Publish = Callable[..., Awaitable[None]]
"""publish(message, topic, key, wait=True); wait=False pipelines the send (token chunks:
same key, same partition, so they stay in order before the final result)."""
PLACEMENT_KEY = "gpusched:agent:placement:{}"
MAX_ATTEMPTS = 5


class AgentRuntime:
    def __init__(self, node_id: str, node: NodeModel, catalog: ModelCatalog,
                 executor: SimulatedExecutor, publish: Publish, redis: Redis,
                 clock: WallClockMs, *, chunk_tokens: int, heartbeat_s: float,
                 monotonic: Callable[[], float] = time.monotonic, time_scale: float = 1.0) -> None:
        self.node_id = node_id
        self.node = node
        self.catalog = catalog
        self._executor = executor
        self._publish = publish
        self._redis = redis
        self._clock = clock
        self._mono = monotonic
        self._scale = time_scale
        self._chunk_tokens = chunk_tokens
        self._heartbeat_s = heartbeat_s
        self._started_at_ms = clock()
        self._seq = 0
        self.status = "ready"
        self._dirty = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._kv_tokens: dict[str, tuple[int, int]] = {}
        """Placement id -> (GPU index, tokens in its KV cache now)."""

    # --- node state ----------------------------------------------------------------------
    async def report_forever(self) -> None:
        """Publish node state at start, on every change (at most every 50 ms), and as a
        heartbeat every `heartbeat_s`."""
        while True:
            await self.report()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self._heartbeat_s)
            self._dirty.clear()
            await asyncio.sleep(0.05)

    async def report(self) -> None:
        self._seq += 1
        state = self.node.state(self.node_id, self._seq, self._started_at_ms, self._clock(),
                                self.status)
        await self._publish(state, topics.NODE_STATE.name, self.node_id)

    # --- placements ----------------------------------------------------------------------
    async def accept(self, placement: Placement) -> None:
        """Start a placement unless this node already took it (idempotent across
        redeliveries and restarts: the first delivery claims it in Redis)."""
        if placement.node_id != self.node_id:
            return
        claimed = await self._redis.set(PLACEMENT_KEY.format(placement.placement_id),
                                        self.node_id, nx=True, ex=7 * 86_400)
        if not claimed:
            log.info("placement %s already taken; ignoring the duplicate", placement.placement_id)
            return
        task = asyncio.create_task(self._run(placement), name=placement.placement_id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking work, let running requests finish for up to `timeout_s`."""
        self.status = "draining"
        await self.report()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        self.status = "stopped"
        await self.report()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def _run(self, placement: Placement) -> None:
        request = placement.request
        model = self.catalog.get(request.model)
        if model is None:
            await self._handback(placement, f"model '{request.model}' unknown to this agent")
            return
        admitted = self.node.admit(placement, model) if self.status == "ready" else \
            Refused(f"node is {self.status}")
        if isinstance(admitted, Refused):
            await self._handback(placement, admitted.reason)
            return
        slot = self.node.gpus[placement.gpu_indices[0]]  # the gang's GPUs run in lockstep
        gpu_type = GPU_TYPES[slot.info.gpu_type]
        prompt_tokens = request.prompt_tokens or count_prompt_tokens(request.prompt)
        pid = placement.placement_id
        self._dirty.set()
        started_ms = self._clock()
        slot.meter.start(pid, self._mono())
        self._kv_tokens[pid] = (slot.info.index, prompt_tokens)
        pieces: list[str] = []
        chunk: list[str] = []
        seq = 0
        ttft_ms: float | None = None
        status, finish_reason = "completed", "length"
        try:
            if isinstance(admitted, Admitted) and admitted.needs_load:
                await self._executor.load(model)
            async for token in self._executor.generate(
                    request, prompt_tokens, model, gpu_type,
                    lambda gi=slot.info.index: self._batch_kv_tokens(gi)):
                if ttft_ms is None:
                    ttft_ms = self._clock() - request.created_at_ms
                pieces.append(token)
                chunk.append(token)
                self._kv_tokens[pid] = (slot.info.index, prompt_tokens + len(pieces))
                if len(chunk) >= self._chunk_tokens:
                    await self._publish(TokenChunk(request_id=request.request_id, seq=seq,
                                                       text="".join(chunk), token_count=len(chunk)),
                                        topics.RESULTS.name, request.request_id, wait=False)
                    seq, chunk = seq + 1, []
            if chunk:
                await self._publish(TokenChunk(request_id=request.request_id, seq=seq,
                                               text="".join(chunk), token_count=len(chunk)),
                                    topics.RESULTS.name, request.request_id)
        except asyncio.CancelledError:
            status, finish_reason = "cancelled", "cancelled"
        except Exception as exc:  # an executor fault ends this request, not the agent
            log.exception("placement %s failed", pid)
            status, finish_reason = "failed", f"executor error: {exc}"
        finally:
            gpu_seconds = slot.meter.stop(pid, self._mono()) / self._scale
            self._kv_tokens.pop(pid, None)
            self.node.finish(placement)
            self._dirty.set()
        ended_ms = self._clock()
        await self._publish(UsageRecord(
            event_id=f"{pid}:final", request_id=request.request_id, placement_id=pid,
            tenant=request.tenant, model=model.name, priority_class=request.priority_class,
            node_id=self.node_id, gpu_type=gpu_type.name, prompt_tokens=prompt_tokens,
            completion_tokens=len(pieces), gpu_seconds=round(gpu_seconds, 6), final=True,
            started_at_ms=started_ms, ended_at_ms=ended_ms), topics.USAGE.name, request.tenant)
        await self._publish(RequestResult(
            request_id=request.request_id, tenant=request.tenant, model=model.name,
            status=status, finish_reason=finish_reason, text="".join(pieces),  # type: ignore[arg-type]
            prompt_tokens=prompt_tokens, completion_tokens=len(pieces), node_id=self.node_id,
            gpu_indices=placement.gpu_indices,
            queued_ms=max(0.0, started_ms - request.created_at_ms),
            total_ms=max(0.0, ended_ms - request.created_at_ms), ttft_ms=ttft_ms),
            topics.RESULTS.name, request.request_id)

    def _batch_kv_tokens(self, gpu_index: int) -> int:
        return sum(t for g, t in self._kv_tokens.values() if g == gpu_index)

    async def _handback(self, placement: Placement, reason: str) -> None:
        """Return a placement this node cannot run to the scheduler as a new attempt; after
        MAX_ATTEMPTS it ends with a failed result instead of bouncing forever."""
        request = placement.request
        log.warning("handing back %s: %s", placement.placement_id, reason)
        if request.attempt + 1 >= MAX_ATTEMPTS:
            await self._publish(RequestResult(
                request_id=request.request_id, tenant=request.tenant, model=request.model,
                status="failed", finish_reason=f"not runnable after {MAX_ATTEMPTS} attempts: "
                f"{reason}", prompt_tokens=0, completion_tokens=0, queued_ms=0, total_ms=0),
                topics.RESULTS.name, request.request_id)
            return
        retry = request.model_copy(update={"attempt": request.attempt + 1})
        await self._publish(retry, topics.REQUESTS[request.priority_class].name,
                            request.request_id)
        # The scheduler reserved memory for this placement: a zero final usage releases it.
        await self._publish(UsageRecord(
            event_id=f"{placement.placement_id}:final", request_id=request.request_id,
            placement_id=placement.placement_id, tenant=request.tenant, model=request.model,
            priority_class=request.priority_class, node_id=self.node_id, gpu_type="none",
            prompt_tokens=0, completion_tokens=0, gpu_seconds=0.0, final=True,
            started_at_ms=self._clock(), ended_at_ms=self._clock()),
            topics.USAGE.name, request.tenant)
