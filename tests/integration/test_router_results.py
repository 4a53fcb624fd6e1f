"""The router's store of request outcomes (`ResultsHub.store_finished`), against the real
Redis: what `GET /v1/requests/{id}` and an Idempotency-Key replay read."""

from __future__ import annotations

import json
import time
import uuid

import httpx
from aiokafka.structs import ConsumerRecord
from opentelemetry import trace

from gpusched_common import topics
from gpusched_common.contracts import (
    InferenceRequest,
    Message,
    Rejection,
    RequestResult,
    TokenChunk,
)
from gpusched_common.redis_client import make_redis
from gpusched_common.settings import RedisSettings
from gpusched_common.telemetry import carried
from gpusched_router.adapters.idempotency import IdempotencyKeys
from gpusched_router.adapters.results import ResultsHub
from gpusched_router.domain.idempotency import FirstUse, request_digest


def records(*messages: Message) -> list[ConsumerRecord]:
    """Result records as agents publish them: keyed by their request id."""
    return [ConsumerRecord(topics.RESULTS.name, 0, offset, 0, 0, m.request_id.encode(),
                           m.to_bytes(), None, 0, 0, ()) for offset, m in enumerate(messages)]


def result(request_id: str, text: str) -> RequestResult:
    return RequestResult(request_id=request_id, tenant="acme", model="qwen2.5-1.5b",
                         status="completed", finish_reason="stop", text=text, prompt_tokens=3,
                         completion_tokens=len(text.split()), queued_ms=1, total_ms=9)


async def test_the_first_outcome_stays_and_any_chunk_marks_a_request_running(stack) -> None:
    """Before, the last outcome overwrote the first: a request run twice (its node cut off,
    then back) or rejected after its result showed a text and usage other than the ones
    its client got; and only a chunk with seq 0 (which Kafka may drop) marked it running."""
    redis = make_redis(RedisSettings(url=stack.endpoints.redis_url))
    hub = ResultsHub(redis, status_ttl_s=60)
    first, second = (f"res-{uuid.uuid4().hex[:8]}" for _ in range(2))
    try:
        for rid in (first, second):
            await hub.accepted(InferenceRequest(request_id=rid, tenant="acme",
                                                model="qwen2.5-1.5b", prompt="hi",
                                                created_at_ms=1), trace.INVALID_SPAN)
        await hub.store_finished(records(
            TokenChunk(request_id=first, seq=3, text=" late", token_count=1)))
        assert (await hub.status(first))["status"] == "running"
        await hub.store_finished(records(  # a chunk whose text names a terminal event
            TokenChunk(request_id=second, seq=1, text="rejection", token_count=1)))
        assert (await hub.status(second))["status"] == "running"
        await hub.store_finished(records(result(first, "the answer"),
                                         result(first, "another run's answer")))
        await hub.store_finished(records(Rejection(request_id=first, tenant="acme",
                                                   status_code=429, reason="over quota")))
        stored = await hub.status(first)
        assert stored["status"] == "completed" and stored["result"]["text"] == "the answer"
        assert "engine_status_code" not in stored["result"]  # unset: an older router replays it
        await hub.store_finished(records(Rejection(request_id=second, tenant="acme",
                                                   status_code=422, reason="fits nowhere")))
        assert (await hub.status(second))["status"] == "rejected"
        assert 0 < await redis.ttl(f"gpusched:request:{second}") <= 60
    finally:
        await redis.delete(f"gpusched:request:{first}", f"gpusched:request:{second}")
        await redis.aclose()


async def test_a_keys_retry_runs_past_a_refusal_that_may_pass_later(stack) -> None:
    """A key's first use was refused over quota (429, or not placed within its queue limit,
    503): nothing ran. Its retries, with the key, got that refusal back for a day (and its
    stale Retry-After) instead of running once the quota had room; a refusal that stays
    (422: it fits no GPU) is still what the key answers."""
    redis = make_redis(RedisSettings(url=stack.endpoints.redis_url))
    hub, keys = ResultsHub(redis, status_ttl_s=60), IdempotencyKeys(redis, ttl_s=60)
    body = {"model": "qwen2.5-1.5b", "prompt": f"passes later {uuid.uuid4().hex}",
            "max_tokens": 5}
    refused = {status: f"req-refused-{uuid.uuid4().hex[:8]}" for status in (429, 422)}
    key = {status: uuid.uuid4().hex for status in refused}
    try:
        for status, rid in refused.items():
            assert await keys.claim("acme", key[status], FirstUse(
                rid, request_digest("/v1/completions", body), int(time.time() * 1000))) is None
            await hub.accepted(InferenceRequest(request_id=rid, tenant="acme",
                                                model="qwen2.5-1.5b", prompt="x",
                                                created_at_ms=1), trace.INVALID_SPAN)
            await hub.store_finished(records(Rejection(
                request_id=rid, tenant="acme", status_code=status, reason="refused",
                retry_after_s=1 if status == 429 else None)))
        async with httpx.AsyncClient(base_url=stack.router_url, timeout=60) as http:
            async def send(status: int) -> httpx.Response:
                return await http.post("/v1/completions", json=body, headers={
                    "Authorization": "Bearer sk-acme-demo", "Idempotency-Key": key[status]})
            ran = await send(429)
            assert ran.status_code == 200, ran.text
            assert ran.headers["x-request-id"] != refused[429]
            # kept a day from the take-over (the router's status TTL), not the first use's
            # 60 s: it stands for a request that started now
            assert await redis.ttl(IdempotencyKeys._name("acme", key[429])) > 3600
            again = await send(429)  # the key now stands for the request that ran
            assert again.headers["x-request-id"] == ran.headers["x-request-id"]
            assert again.json()["choices"][0]["text"] == ran.json()["choices"][0]["text"]
            stays = await send(422)
            assert stays.status_code == 422
            assert stays.headers["x-request-id"] == refused[422]
    finally:
        await redis.delete(*(f"gpusched:request:{rid}" for rid in refused.values()))
        await redis.aclose()


async def test_a_request_read_on_its_topic_is_queued_unless_it_has_a_status(stack) -> None:
    """Before, the routers knew a request produced straight to Kafka only once it had ended:
    GET and cancel answered 404 while it waited or ran. The routers' group on the request
    topics stores its queued status, with the producer's trace and the defaults the
    scheduler fills in (the id of a record without one); a status stored first stays (one
    running since its first chunk came first gets its tenant), and a record older than the
    status TTL or no request at all stores nothing."""
    redis = make_redis(RedisSettings(url=stack.endpoints.redis_url))
    hub = ResultsHub(redis, status_ttl_s=60)
    now_ms = int(time.time() * 1000)
    produced, taken_in, ended, old, started, miskeyed = (f"seen-{uuid.uuid4().hex[:8]}"
                                                         for _ in range(6))
    offset = 1_000_000 + uuid.uuid4().int % 1_000_000  # an id nobody else's record has
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01".encode()

    def record(payload: dict, at_ms: int = now_ms, headers: tuple = (),
               key: str | None = None) -> ConsumerRecord:
        rid = payload.get("request_id")  # keyed by it, as producers are told
        key = key or (rid if isinstance(rid, str) else None)
        return ConsumerRecord(topics.REQUESTS["batch"].name, 2, offset, at_ms, 0,
                              key and key.encode(), json.dumps(payload, separators=(",", ":"))
                              .encode(), None, 0, 0, headers)

    def asked(request_id: str | None = None) -> dict:
        return {"tenant": "globex", "model": "qwen2.5-1.5b", "prompt": "hi",
                **({} if request_id is None else {"request_id": request_id})}
    unnamed = f"kafka-{topics.REQUESTS['batch'].name}-2-{offset}"
    keys = [f"gpusched:request:{rid}"
            for rid in (produced, taken_in, ended, old, started, miskeyed, unnamed)]
    try:
        await hub.accepted(InferenceRequest(request_id=taken_in, tenant="globex",
                                            model="qwen2.5-1.5b", prompt="hi",
                                            created_at_ms=5),
                          carried({"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}))
        await hub.store_finished(records(result(ended, "done")))
        # its first chunk stored before its record was read: running, then its tenant added
        await hub.store_finished(records(TokenChunk(request_id=started, seq=0, text="a",
                                                    token_count=1)))
        await hub.store_seen([
            record(asked(produced), headers=(("traceparent", traceparent),)),
            record(asked(started)),
            record(asked(miskeyed), key=taken_in),  # keyed by another request's id
            record(asked()), record(asked(taken_in)), record(asked(ended)),
            record(asked(old), at_ms=now_ms - 61_000),
            record({"tenant": "globex"}), record({"request_id": 5}),
        ], now_ms)
        status = await hub.status(produced)
        assert status == {"request_id": produced, "status": "queued", "tenant": "globex",
                          "model": "qwen2.5-1.5b", "priority_class": "batch",
                          "created_at_ms": now_ms, "trace_id": trace_id,
                          "traceparent": traceparent.decode()}
        assert 0 < await redis.ttl(f"gpusched:request:{produced}") <= 60
        assert (await hub.status(unnamed))["status"] == "queued"
        kept = await hub.status(taken_in)
        assert kept["trace_id"] == "a" * 32 and kept["created_at_ms"] == 5
        assert kept["traceparent"] == f"00-{'a' * 32}-{'b' * 16}-01"  # its cancel's parent
        assert (await hub.status(ended))["status"] == "completed"
        assert await hub.status(old) is None
        assert (await hub.status(miskeyed))["status"] == "queued"
        running = await hub.status(started)
        assert running["status"] == "running" and running["tenant"] == "globex"
        assert 0 < await redis.ttl(f"gpusched:request:{started}") <= 60
    finally:
        await redis.delete(*keys)
        await redis.aclose()
