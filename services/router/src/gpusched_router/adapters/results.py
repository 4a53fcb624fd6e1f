"""Fan-in of the results topic: hands each event to the HTTP request waiting for it, and
stores every request's progress (its first tokens out) and terminal outcome in Redis for
GET /v1/requests/{id}; and the queued status of requests produced straight to Kafka."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiokafka.structs import ConsumerRecord
from opentelemetry import trace
from redis.asyncio import Redis

from gpusched_common.contracts import (
    REQUEST,
    RESULT_EVENT,
    InferenceRequest,
    Rejection,
    RequestResult,
    ResultEvent,
    TokenChunk,
)
from gpusched_common.kafka_records import request_payload
from gpusched_common.telemetry import carried, carrier_of, record_carrier, trace_id_hex
from gpusched_router.domain.openai_api import ApiError

STATUS_KEY = "gpusched:request:{}"
Waited = ResultEvent | ApiError
"""What a client's queue holds: its request's events, then, once the router stops, maybe
the router's own answer (`ResultsHub.stop`)."""
_STARTED = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'running')
elseif not status then
  redis.call('HSET', KEYS[1], 'status', 'running')
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
"""
"""queued (or none yet) -> running, and nothing else: a terminal status stays. A request
whose queued status is not stored yet (produced straight to Kafka, its record not read yet
by the routers' requests group) is running all the same; that group adds its tenant and the
rest (ARGV: the TTL)."""
_FINISHED = """
if redis.call('HEXISTS', KEYS[1], 'result') == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""
"""The first terminal outcome stays (ARGV: the TTL, then field, value, ...): it is the one
every router's clients got, since all read the partition in the same order; a request run
twice (its node cut off, then back) or rejected after its result keeps it."""
_SEEN = """
local created = redis.call('EXISTS', KEYS[1]) == 0
for i = 2, #ARGV, 2 do
  redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
end
if created then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
"""
"""A request read on its topic gets each field of a queued status it has not (ARGV as
_FINISHED's): what a router stored as it took the request in, running, or an outcome
stored first stays; a status that lacks the tenant (running, or a rejection that named
none) gets it."""


class ResultsHub:
    """Routes result events to waiting clients by request id; one per router process."""

    def __init__(self, redis: Redis, status_ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = status_ttl_s
        self._started = redis.register_script(_STARTED)
        self._finished = redis.register_script(_FINISHED)
        self._seen = redis.register_script(_SEEN)
        # request id -> the queue of each client waiting on it here (a retry with the same
        # Idempotency-Key waits beside the first)
        self._waiters: dict[str, list[asyncio.Queue[Waited]]] = {}
        self._stopped: Callable[[str], ApiError] | None = None

    def open(self, request_id: str) -> asyncio.Queue[Waited]:
        """Register before publishing the request, so no event can be missed. Once `stop`
        has run, the queue holds its answer already."""
        queue: asyncio.Queue[Waited] = asyncio.Queue()
        self._waiters.setdefault(request_id, []).append(queue)
        if self._stopped is not None:
            queue.put_nowait(self._stopped(request_id))
        return queue

    @property
    def stopped(self) -> bool:
        """Whether `stop` has run: the router waits for no more results."""
        return self._stopped is not None

    def stop(self, answer: Callable[[str], ApiError]) -> int:
        """End the waits of this router's clients: each queue, and each opened from now on,
        gets `answer(request_id)` behind the events come so far, the last a client reads
        (the request itself goes on). Returns how many clients were waiting."""
        self._stopped = answer
        waiting = 0
        for request_id, queues in self._waiters.items():
            for queue in queues:
                queue.put_nowait(answer(request_id))
                waiting += 1
        return waiting

    def close(self, request_id: str, queue: asyncio.Queue[Waited]) -> None:
        queues = self._waiters.get(request_id, [])
        if queue in queues:
            queues.remove(queue)
        if not queues:
            self._waiters.pop(request_id, None)

    async def accepted(self, request: InferenceRequest, span: trace.Span) -> None:
        """Store the queued status of `request`, taken in under `span` (its server span)."""
        key = STATUS_KEY.format(request.request_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=_queued_fields(request, span))
            pipe.hsetnx(key, "status", "queued")  # a result stored first stays
            pipe.expire(key, self._ttl_s)
            await pipe.execute()

    async def store_seen(self, records: list[ConsumerRecord], now_ms: int) -> None:
        """Store a queued status for each request among `records` (read on the request
        topics) that has none, or the fields a status lacks (a running one whose first chunk
        came first): a request produced straight to Kafka, or one whose router could not
        store its status. A record older than the status TTL is left out: its status, stored
        or not, would have expired by now. Records that are not requests (the scheduler
        dead-letters them) are skipped. Raises RedisError, so that the caller's batch is
        delivered again."""
        fresh = [r for r in records if now_ms - r.timestamp <= self._ttl_s * 1000]
        # Most records are the routers' own, whose status names its tenant already: known by
        # their key (the request id, as every producer is told to key them, and as the
        # record says: a key that is another request's id, say a session's first, does not
        # pass), they are not parsed (a prompt may be 640 KiB).
        keyed = [r for r in fresh if isinstance(r.key, bytes)
                 and b'"request_id":"' + r.key + b'"' in (r.value or b"")]
        if keyed:
            async with self._redis.pipeline(transaction=False) as pipe:
                for record in keyed:
                    pipe.hexists(STATUS_KEY.format(record.key.decode(errors="replace")),
                                 "tenant")
                known = {id(r) for r, has in zip(keyed, await pipe.execute()) if has}
            fresh = [r for r in fresh if id(r) not in known]
        seen = []
        for record in fresh:
            try:  # read as the scheduler reads it: the same defaults, the same id
                request = REQUEST.validate_python(request_payload(record))
            except ValueError:
                continue
            span = carried(record_carrier(record.headers))  # its producer's, if it says
            fields = {**_queued_fields(request, span), "status": "queued"}
            seen.append((request.request_id, _flat(fields)))
        if not seen:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, fields in seen:
                await self._seen(keys=[STATUS_KEY.format(request_id)],
                                 args=[self._ttl_s, *fields], client=pipe)
            await pipe.execute()

    def dispatch(self, records: list[ConsumerRecord]) -> None:
        """Hand every event to the client waiting for it on this router, if any."""
        for record in records:
            try:
                event = RESULT_EVENT.validate_json(record.value)
            except ValueError:
                continue  # results are written by our agents and scheduler only
            for queue in self._waiters.get(event.request_id, ()):
                queue.put_nowait(event)

    async def store_finished(self, records: list[ConsumerRecord]) -> None:
        """Store the first terminal outcome of each request among `records`, and mark
        `running` the requests with token chunks among them (one pipelined round trip).
        Idempotent, in any order (a terminal status is never marked running); raises
        RedisError, so that the caller's batch is delivered again."""
        finals, started = [], set()
        for record in records:
            value = record.value or b""
            if b'"request_result"' not in value and b'"rejection"' not in value:
                # most records are token chunks, not worth parsing: their key (the request
                # id, as agents publish them) is enough, whichever chunk Kafka dropped
                if b'"token_chunk"' in value and isinstance(record.key, bytes):
                    started.add(record.key.decode(errors="replace"))
                continue
            try:
                event = RESULT_EVENT.validate_json(value)
            except ValueError:
                continue
            if isinstance(event, RequestResult | Rejection):
                finals.append(event)
            elif isinstance(event, TokenChunk):  # whose text names a terminal event
                started.add(event.request_id)
        if not finals and not started:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in started:
                await self._started(keys=[STATUS_KEY.format(request_id)], args=[self._ttl_s],
                                    client=pipe)
            for event in finals:
                fields = _flat(_status_fields(event))
                await self._finished(keys=[STATUS_KEY.format(event.request_id)],
                                     args=[self._ttl_s, *fields], client=pipe)
            await pipe.execute()

    async def status(self, request_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hgetall(STATUS_KEY.format(request_id))
        if not raw:
            return None
        out: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        if "result" in out:
            out["result"] = json.loads(out["result"])
        if "created_at_ms" in out:  # Redis keeps strings; a client reads a number
            out["created_at_ms"] = int(out["created_at_ms"])
        out["request_id"] = request_id
        return out


def _flat(fields: dict[str, Any]) -> list[Any]:
    """`fields` as a script's ARGV takes them: field, value, field, value, ..."""
    return [x for pair in fields.items() for x in pair]


def _queued_fields(request: InferenceRequest, span: trace.Span) -> dict[str, str | int]:
    """What a request's status tells of it before its outcome; `span` is the one it came in
    under (an invalid one where none is known: a record produced without a trace context).
    `trace_id` names its trace for Jaeger (empty: unsampled, or unknown); `traceparent`
    is the span's W3C context, sampled or not (empty: unknown), which its cancel goes out
    under (`status_span`)."""
    return {"tenant": request.tenant, "model": request.model,
            "priority_class": request.priority_class,
            "created_at_ms": request.created_at_ms, "trace_id": trace_id_hex(span) or "",
            "traceparent": carrier_of(span).get("traceparent", "")}


def status_span(status: dict[str, Any]) -> trace.Span:
    """The span a request's status names (`_queued_fields`), as a parent; an invalid one
    where it names none (stored by a release before, or unknown)."""
    return carried({"traceparent": status.get("traceparent") or ""})


def _status_fields(event: RequestResult | Rejection) -> dict[str, str]:
    """The outcome's fields; its JSON as on Kafka, without the optional fields that are
    unset: a router one release behind, replaying it to a retry with an Idempotency-Key,
    refuses fields it does not know."""
    if isinstance(event, Rejection):  # its tenant, when known, keeps other tenants out
        tenant = {} if event.tenant is None else {"tenant": event.tenant}
        return {"status": "rejected", **tenant, "result": event.to_bytes().decode()}
    return {"status": event.status, "tenant": event.tenant, "model": event.model,
            "result": event.to_bytes().decode()}
