"""The GPU agent against the real Kafka and Redis: duplicate and stale placements, commands
sent from a new node's first report on (none skipped, across a restart too), work a
killed agent left ended by its next run (and final records it had filed published), a
placement the scheduler fenced, an unreadable control record (one dead letter), a client
that cuts its stream mid-generation (cancelled and billed exactly for what was produced),
SIGTERM drain with work in flight, and an inference engine that crashes mid-stream (the
request goes on elsewhere, billed once; the node is out of service until the engine is
back)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import replace

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from redis.asyncio import Redis
from served_app import ServedApp
from stack_helpers import ADMIN, TopicWatch, eventually, read_topic

from gpusched_agent.adapters.ledger import Claim, RedisLedger
from gpusched_common import outbox, topics
from gpusched_common.contracts import (
    DEAD_LETTER,
    NODE_STATE,
    REQUEST,
    RESULT_EVENT,
    USAGE,
    Cancel,
    InferenceRequest,
    Placement,
    Preempt,
    RequestResult,
    UsageRecord,
)
from gpusched_common.redis_keys import NODE_CLAIMS_KEY
from gpusched_ops.stack import ServiceSpec
from gpusched_scheduler.adapters.redis_state import Filed, RunningStore
from gpusched_scheduler.domain.running import RunningPlacement

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "qwen2.5-1.5b"
FIRST_AGENT_PORT = 28090 + int(os.environ.get("GPUSCHED_TEST_PORT_OFFSET", "0"))
"""node-1's HTTP port in the test stack (tests/conftest.py)."""


async def leader_epoch(stack) -> int:
    redis = Redis.from_url(stack.endpoints.redis_url)
    try:
        raw = await eventually(lambda: redis.get("gpusched:scheduler:epoch"),
                               what="a scheduler leader's fencing token in Redis")
        return int(raw)
    finally:
        await redis.aclose()


async def send_placements(stack, placements: list[Placement | Preempt | Cancel]) -> None:
    """Placements and preempts to the placements topic (keyed by node), cancels to control."""
    producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap)
    await producer.start()
    try:
        for p in placements:
            if isinstance(p, Cancel):
                await producer.send_and_wait(topics.CONTROL.name, p.to_bytes(),
                                             key=p.request_id.encode())
            else:
                await producer.send_and_wait(topics.PLACEMENTS.name, p.to_bytes(),
                                             key=p.node_id.encode())
    finally:
        await producer.stop()


def placement(node: str, rid: str, epoch: int, max_tokens: int = 6, tenant: str = "globex",
              model: str = MODEL) -> Placement:
    req = InferenceRequest(request_id=rid, tenant=tenant, model=model, prompt="agent test",
                           max_tokens=max_tokens, created_at_ms=int(time.time() * 1000))
    return Placement(placement_id=f"{rid}#0", node_id=node, gpu_indices=(0,), kv_cache_mib=64,
                     scheduler_epoch=epoch, placed_at_ms=req.created_at_ms, request=req)


def for_request(rid: str, marker: bytes):
    return lambda key, value: key == rid.encode() and marker in value


async def test_duplicate_placement_runs_once_and_a_stale_one_is_rejected(stack) -> None:
    """A placement delivered twice runs once; one of a deposed scheduler is dead-lettered;
    so is another request placed under the same id (a scheduler that forgot the first:
    before, the agent ignored it as a duplicate and nothing ever answered it)."""
    bootstrap = stack.endpoints.kafka_bootstrap
    epoch = await leader_epoch(stack)
    rid, stale_rid = f"dup-{uuid.uuid4().hex[:8]}", f"stale-{uuid.uuid4().hex[:8]}"
    fresh = placement("node-1", rid, epoch)
    await send_placements(stack, [fresh, fresh, placement("node-1", stale_rid, epoch - 1)])
    reused = placement("node-1", rid, epoch, max_tokens=4)  # another request, the same id
    results = await read_topic(bootstrap, topics.RESULTS.name,
                               for_request(rid, b'"request_result"'))
    await asyncio.sleep(1.0)  # a second run would have finished by now
    results = await read_topic(bootstrap, topics.RESULTS.name,
                               for_request(rid, b'"request_result"'))
    assert len(results) == 1 and RESULT_EVENT.validate_json(results[0][1]).status == "completed"
    usage = await read_topic(bootstrap, topics.USAGE.name,
                             lambda k, v: f'"{rid}#0:final"'.encode() in v)
    assert len(usage) == 1
    await send_placements(stack, [reused])
    [(_, raw)] = await read_topic(bootstrap, topics.DEAD_LETTERS.name,
                                  lambda k, v: rid.encode() in v)
    assert f"request_id '{rid}' (it asked for something else" in \
        DEAD_LETTER.validate_json(raw).reason
    assert len(await read_topic(bootstrap, topics.RESULTS.name,
                                for_request(rid, b'"request_result"'), timeout_s=1)) == 1

    [(_, raw)] = await read_topic(bootstrap, topics.DEAD_LETTERS.name,
                                  lambda k, v: stale_rid.encode() in v)
    dead = DEAD_LETTER.validate_json(raw)
    assert dead.service == "gpu-agent" and f"epoch {epoch - 1} is older" in dead.reason
    assert await read_topic(bootstrap, topics.RESULTS.name, for_request(stale_rid, b""),
                            timeout_s=1) == []
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{FIRST_AGENT_PORT}/metrics")).text
    assert 'gpusched_agent_commands_total{command="placement",outcome="stale"}' in metrics


async def test_an_unreadable_control_record_is_dead_lettered_once_not_once_per_agent(
        stack) -> None:
    """Every agent reads every control record; one of them reports one it cannot read."""
    marker = f"not-a-cancel-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topics.CONTROL.name, json.dumps(
            {"type": "cancel", "reason": marker}).encode(), key=marker.encode())
    finally:
        await producer.stop()
    await asyncio.sleep(2.0)  # every agent (two here) has read it by now
    letters = await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name,
                               lambda k, v: marker.encode() in v)
    assert len(letters) == 1, letters
    dead = DEAD_LETTER.validate_json(letters[0][1])
    assert dead.source_topic == topics.CONTROL.name and dead.service == "gpu-agent"
    assert dead.reason == "not a cancel: request_id: Field required; at_ms: Field required"


async def usage_totals(stack, tenant: str) -> dict:
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get("/v1/usage", params={"tenant": tenant, "start": "0"}, headers=ADMIN)
        r.raise_for_status()
        return r.json()["tenants"][0]["totals"]


async def test_a_stream_cut_by_the_client_is_billed_for_the_tokens_produced(stack) -> None:
    tenant, bootstrap = "initech", stack.endpoints.kafka_bootstrap
    before = await usage_totals(stack, tenant)
    body = {"model": "llama-3.1-8b", "prompt": "tell me a long story", "max_tokens": 6000,
            "stream": True}
    received = 0
    async with httpx.AsyncClient(base_url=stack.router_url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"Authorization": "Bearer sk-initech-demo"}) as resp:
            assert resp.status_code == 200
            rid = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    received += len(json.loads(line[6:])["choices"][0]["text"].split())
                    if received >= 24:
                        break  # the client goes away mid-generation
    result = RESULT_EVENT.validate_json((await read_topic(
        bootstrap, topics.RESULTS.name, for_request(rid, b'"request_result"')))[-1][1])
    assert isinstance(result, RequestResult) and result.status == "cancelled"
    records = [USAGE.validate_json(v) for _, v in await read_topic(
        bootstrap, topics.USAGE.name, lambda k, v: f'"request_id":"{rid}"'.encode() in v)]
    assert sum(r.final for r in records) == 1
    prompt = sum(r.prompt_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    assert completion >= received > 0 and completion < 6000  # stopped, not run to the end
    assert completion == result.completion_tokens

    async def billed() -> dict | None:
        now = await usage_totals(stack, tenant)
        return now if now["completion_tokens"] >= before["completion_tokens"] + completion \
            else None

    after = await eventually(billed, what="the cut request's usage in accounting")
    await asyncio.sleep(1.0)
    assert await usage_totals(stack, tenant) == after  # nothing else, nothing twice
    assert after["completion_tokens"] - before["completion_tokens"] == completion
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt


def extra_agent(stack, node: str, port: int) -> ServiceSpec:
    """An agent of one simulated L4 beside the test stack's own, on its own HTTP port."""
    e = stack.endpoints
    return ServiceSpec(
        name=f"agent-{node}", module="gpusched_agent",
        env={"GPUSCHED_KAFKA_BOOTSTRAP": e.kafka_bootstrap, "GPUSCHED_REDIS_URL": e.redis_url,
             "GPUSCHED_OTLP_ENDPOINT": e.otlp_http_endpoint, "GPUSCHED_HTTP_PORT": str(port),
             "GPUSCHED_NODE_ID": node, "GPUSCHED_SIMULATE": "1xL4-24GB",
             "GPUSCHED_TIME_SCALE": "1", "GPUSCHED_DRAIN_TIMEOUT_S": "1",
             "GPUSCHED_USAGE_INTERVAL_S": "0.5"},
        health_url=f"http://127.0.0.1:{port}/healthz")


async def test_no_command_is_skipped_from_a_new_nodes_first_report_on(stack) -> None:
    """A node's placements topic position is fixed before it first reports: a command sent at
    that first report runs, and so does one sent while the node restarts before it ever
    consumed anything (its first run must not leave the second to start at `latest`)."""
    e = stack.endpoints
    epoch = await leader_epoch(stack)
    first, restarted = f"first-{uuid.uuid4().hex[:6]}", f"again-{uuid.uuid4().hex[:6]}"
    states = await TopicWatch(e.kafka_bootstrap, topics.NODE_STATE.name).start()
    spec = extra_agent(stack, first, FIRST_AGENT_PORT + 10)
    await asyncio.to_thread(stack.processes.start_service, spec)
    try:
        await states.until(lambda recs: any(k == first.encode() for k, _, _ in recs), 30,
                           f"{first}'s first report")
        rid = f"first-{uuid.uuid4().hex[:8]}"
        await send_placements(stack, [placement(first, rid, epoch)])
        assert await read_topic(e.kafka_bootstrap, topics.RESULTS.name,
                                for_request(rid, b'"request_result"'), timeout_s=30)
    finally:
        await states.stop()
        await asyncio.to_thread(stack.processes.stop_service, spec.name)

    spec = extra_agent(stack, restarted, FIRST_AGENT_PORT + 11)
    await asyncio.to_thread(stack.processes.start_service, spec)
    await asyncio.to_thread(stack.processes.stop_service, spec.name)
    rid = f"again-{uuid.uuid4().hex[:8]}"
    await send_placements(stack, [placement(restarted, rid, epoch)])
    await asyncio.to_thread(stack.processes.start_service, spec)
    try:
        assert await read_topic(e.kafka_bootstrap, topics.RESULTS.name,
                                for_request(rid, b'"request_result"'), timeout_s=30)
    finally:
        await asyncio.to_thread(stack.processes.stop_service, spec.name)


async def test_a_killed_agent_ends_what_it_left_when_it_starts_again(stack) -> None:
    """SIGKILL mid-generation, then a restart: the new run finds the placement its
    predecessor claimed and never ended and ends it with a final usage record. This one was
    sent by the test, not by the scheduler, so nobody counts it as running and it is not
    handed back (test_scheduler.py has the hand-back of the scheduler's own placements)."""
    e = stack.endpoints
    node = f"crash-{uuid.uuid4().hex[:6]}"
    spec = extra_agent(stack, node, FIRST_AGENT_PORT + 12)
    await asyncio.to_thread(stack.processes.start_service, spec)
    rid = f"crash-{uuid.uuid4().hex[:8]}"
    try:
        await send_placements(stack, [placement(node, rid, await leader_epoch(stack),
                                                max_tokens=2000, tenant="acme")])
        await read_topic(e.kafka_bootstrap, topics.RESULTS.name,
                         for_request(rid, b'"token_chunk"'))
        stack.processes.kill_service(spec.name)
        await asyncio.to_thread(stack.processes.start_service, spec)
        usage = [USAGE.validate_json(v) for _, v in await read_topic(
            e.kafka_bootstrap, topics.USAGE.name, lambda k, v: f'"{rid}#0:final"'.encode() in v)]
    finally:
        await asyncio.to_thread(stack.processes.stop_service, spec.name)
    assert [(u.final, u.completion_tokens) for u in usage] == [(True, 0)]
    for topic, marker in ((topics.REQUESTS["standard"].name, b'"attempt":1'),
                          (topics.RESULTS.name, b'"request_result"')):
        assert not await read_topic(e.kafka_bootstrap, topic, for_request(rid, marker),
                                    timeout_s=2)


async def test_final_records_a_killed_agent_had_filed_are_published_by_its_next_run(
        stack) -> None:
    """A run killed after filing a placement's final records (its outbox) and before
    releasing the claim, as it left them in Redis: the next run publishes them (the same
    final usage event, the completed result), hands nothing back and releases the claim."""
    e = stack.endpoints
    node = f"outbox-{uuid.uuid4().hex[:6]}"
    rid = f"outbox-{uuid.uuid4().hex[:8]}"
    now = int(time.time() * 1000)
    usage = UsageRecord(event_id=f"{rid}#0:final", request_id=rid, placement_id=f"{rid}#0",
                        tenant="acme", model=MODEL, priority_class="standard", node_id=node,
                        gpu_type="L4-24GB", prompt_tokens=3, completion_tokens=6,
                        gpu_seconds=0.25, started_at_ms=now - 500, ended_at_ms=now)
    result = RequestResult(request_id=rid, tenant="acme", model=MODEL, status="completed",
                           finish_reason="length", text="one two three four five six",
                           prompt_tokens=3, completion_tokens=6, node_id=node, queued_ms=1,
                           total_ms=500)
    claims = NODE_CLAIMS_KEY.format(node)
    redis = Redis.from_url(e.redis_url)
    spec = extra_agent(stack, node, FIRST_AGENT_PORT + 13)
    try:
        await redis.hset(claims, f"{rid}#0", b"%d %s" % (now - 60_000, outbox.encode(
            [(usage, topics.USAGE.name, "acme"), (result, topics.RESULTS.name, rid)])))
        await asyncio.to_thread(stack.processes.start_service, spec)
        published = [USAGE.validate_json(v) for _, v in await read_topic(
            e.kafka_bootstrap, topics.USAGE.name, lambda k, v: f'"{rid}#0:final"'.encode() in v)]
        results = [RESULT_EVENT.validate_json(v) for _, v in await read_topic(
            e.kafka_bootstrap, topics.RESULTS.name, for_request(rid, b'"request_result"'))]
        assert not await read_topic(e.kafka_bootstrap, topics.REQUESTS["standard"].name,
                                    for_request(rid, b'"attempt":1'), timeout_s=2)
        assert await redis.hgetall(claims) == {}
    finally:
        await asyncio.to_thread(stack.processes.stop_service, spec.name)
        await redis.aclose()
    assert published == [usage]
    assert results == [result]


async def test_the_scheduler_reads_the_final_records_an_agent_filed(stack) -> None:
    """What a lost node's agent filed in the ledger (real Redis), as the scheduler reads it:
    the outbox of `done`, nothing for `running` (its claim holds the placement itself)."""
    redis = Redis.from_url(stack.endpoints.redis_url)
    node = f"ledger-{uuid.uuid4().hex[:6]}"
    done, running = (placement(node, f"{n}-{uuid.uuid4().hex[:6]}", 1) for n in ("done", "run"))
    result = RequestResult(request_id=done.request.request_id, tenant="globex", model=MODEL,
                           status="completed", finish_reason="length", prompt_tokens=2,
                           completion_tokens=6, queued_ms=1, total_ms=9)
    ledger, store = RedisLedger(redis), RunningStore(redis)
    try:
        for p in (done, running):
            assert isinstance(await ledger.claim(p.placement_id, node, 7, p.to_bytes(),
                                                 p.request.request_id,
                                                 p.request.asks_digest()), Claim)
        await ledger.finishing(done.placement_id, node, 7, outbox.encode(
            [(result, topics.RESULTS.name, result.request_id)]))
        filed = await store.filed_finals([node, "no-such-node"])
        assert filed == [Filed(node, done.placement_id,
                               [(result, topics.RESULTS.name, result.request_id)])]
        await store.release_claims(filed)
        assert [held.placement_id for held in await ledger.left_over(node, 8)] == [
            running.placement_id]
        # a placement sent again to another node (the first send had failed after all) is
        # judged by the node that claimed it: still held there, not ended
        elsewhere = RunningPlacement(
            placement_id=running.placement_id, node_id="another-node", gpu_indices=(0,),
            memory_mib_per_gpu=1, kv_cache_mib=1, estimate_gpu_s=1.0,
            placed_at_ms=0, request=running.request)
        assert await store.claims([elsewhere]) == {running.placement_id: "held"}
    finally:
        await redis.delete(NODE_CLAIMS_KEY.format(node))
        await redis.aclose()


async def test_a_placement_the_scheduler_fenced_is_never_run(stack) -> None:
    """The scheduler fences a placement it retries elsewhere by claiming it in the agents'
    ledger: a late delivery of the command is then a duplicate to the agent."""
    redis = Redis.from_url(stack.endpoints.redis_url)
    rid = f"fenced-{uuid.uuid4().hex[:8]}"
    try:
        assert await RunningStore(redis).fence([f"{rid}#0"]) == [True]
        await send_placements(stack, [placement("node-1", rid, await leader_epoch(stack))])
        assert not await read_topic(stack.endpoints.kafka_bootstrap, topics.RESULTS.name,
                                    for_request(rid, b""), timeout_s=5)
        assert await RunningStore(redis).fence([f"{rid}#0"]) == [False]
    finally:
        await redis.aclose()


async def test_sigterm_drains_hands_back_work_in_flight_and_reports_stopped(stack) -> None:
    node = f"drain-{uuid.uuid4().hex[:6]}"
    e = stack.endpoints
    stack.processes.start_service(extra_agent(stack, node, FIRST_AGENT_PORT + 9))
    try:
        rid = f"drain-{uuid.uuid4().hex[:8]}"
        await send_placements(stack, [placement(node, rid, await leader_epoch(stack),
                                                max_tokens=2000, tenant="acme")])
        await read_topic(e.kafka_bootstrap, topics.RESULTS.name,
                         for_request(rid, b'"token_chunk"'))
    finally:
        await asyncio.to_thread(stack.processes.stop_service, f"agent-{node}")
    usage = [USAGE.validate_json(v) for _, v in await read_topic(
        e.kafka_bootstrap, topics.USAGE.name, lambda k, v: f'"{rid}#0:'.encode() in v)]
    assert sum(u.final for u in usage) == 1 and sum(u.completion_tokens for u in usage) > 0
    again = [REQUEST.validate_json(v) for _, v in await read_topic(
        e.kafka_bootstrap, topics.REQUESTS["standard"].name, for_request(rid, b""))]
    # handed back in front of its class, so the scheduler places the next attempt elsewhere
    assert [(r.attempt, r.requeued) for r in again][0] == (1, "node_lost")
    states = [NODE_STATE.validate_json(v) for _, v in await read_topic(
        e.kafka_bootstrap, topics.NODE_STATE.name, lambda k, v: k == node.encode())]
    assert states[-1].status == "stopped" and "draining" in {s.status for s in states}


async def test_a_preempted_placement_is_billed_so_far_and_handed_back_in_front(stack) -> None:
    bootstrap = stack.endpoints.kafka_bootstrap
    epoch = await leader_epoch(stack)
    rid = f"pre-{uuid.uuid4().hex[:8]}"
    # long enough that the preempt (a few seconds later on a busy machine) finds it running
    await send_placements(stack, [placement("node-1", rid, epoch, max_tokens=30_000)])
    await read_topic(bootstrap, topics.RESULTS.name, for_request(rid, b'"token_chunk"'))
    await send_placements(stack, [Preempt(placement_id=f"{rid}#0", request_id=rid,
                                          node_id="node-1", scheduler_epoch=epoch,
                                          reason="interactive work needs the GPU")])
    usage = [USAGE.validate_json(v) for _, v in await read_topic(
        bootstrap, topics.USAGE.name, lambda k, v: f'"{rid}#0:'.encode() in v)]
    completion = sum(u.completion_tokens for u in usage)
    assert sum(u.final for u in usage) == 1 and 0 < completion < 30_000
    again = [REQUEST.validate_json(v) for _, v in await read_topic(
        bootstrap, topics.REQUESTS["standard"].name, for_request(rid, b""))]
    assert [(r.attempt, r.requeued) for r in again][0] == (1, "preempted")
    first_results = [RESULT_EVENT.validate_json(v) for _, v in await read_topic(
        bootstrap, topics.RESULTS.name, for_request(rid, b'"request_result"'), timeout_s=0.5)]
    # no result for the stopped attempt (only, later, for the next one, which runs in full)
    assert all(r.completion_tokens == 30_000 for r in first_results)
    # the scheduler runs the next attempt: cut it short, it is not this test's business
    await send_placements(stack, [Cancel(request_id=rid, reason="test over", at_ms=0)])


class CrashingEngine(ServedApp):
    """An OpenAI-compatible inference server in the test's process: streams " e<i>" deltas,
    and after `crash_after` of them drops the connection and, like an engine restarting,
    answers 503 everywhere until `crashed` is cleared."""

    def __init__(self, port: int, crash_after: int) -> None:
        self.crash_after, self.crashed = crash_after, False
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": []},
                                status_code=503 if self.crashed else 200)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            if self.crashed:
                return JSONResponse({"error": "restarting"}, status_code=503)
            left = (await request.json())["max_tokens"]

            async def events():  # noqa: ANN202
                for i in range(left):
                    if i == self.crash_after:
                        self.crashed = True
                        raise RuntimeError("the engine crashed")  # the connection drops
                    yield f"data: {json.dumps({'choices': [{'text': f' e{i}'}]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        super().__init__(app, port, log_level="critical")  # the crash is on purpose


async def test_an_engine_crash_mid_stream_hands_the_request_on_billed_once(stack) -> None:
    """The openai executor's engine drops the stream after 3 tokens and answers 503 while
    it restarts: the request goes back in front of its class with those tokens, the
    scheduler runs the rest on the stack's own node, every token and the prompt are billed
    once, and the node reports its GPU unhealthy until the engine answers again."""
    e = stack.endpoints
    node, rid = f"engine-{uuid.uuid4().hex[:6]}", f"crash-{uuid.uuid4().hex[:8]}"
    mine = lambda recs: [NODE_STATE.validate_json(v) for k, v, _ in recs  # noqa: E731
                         if k == node.encode()]
    states = await TopicWatch(e.kafka_bootstrap, topics.NODE_STATE.name).start()
    async with CrashingEngine(FIRST_AGENT_PORT + 15, crash_after=3) as engine:
        spec = extra_agent(stack, node, FIRST_AGENT_PORT + 14)
        spec = replace(spec, env=spec.env | {"GPUSCHED_EXECUTOR": "openai",
                                             "GPUSCHED_OPENAI_BASE_URL": engine.url})
        await asyncio.to_thread(stack.processes.start_service, spec)
        try:
            await states.until(lambda recs: bool(mine(recs)), 30, f"{node}'s first report")
            request = placement(node, rid, await leader_epoch(stack), max_tokens=8)
            await send_placements(stack, [request])
            await states.until(lambda recs: any(not s.gpus[0].healthy for s in mine(recs)),
                               30, f"{node} reporting its engine down")
            [result] = [RESULT_EVENT.validate_json(v) for _, v in await read_topic(
                e.kafka_bootstrap, topics.RESULTS.name,
                for_request(rid, b'"request_result"'), timeout_s=60)]
            engine.crashed = False
            await states.until(lambda recs: mine(recs)[-1].gpus[0].healthy, 30,
                               f"{node} reporting its engine back")
        finally:
            await states.stop()
            await asyncio.to_thread(stack.processes.stop_service, spec.name)
    down = next(s.gpus[0] for s in mine(states.records) if not s.gpus[0].healthy)
    assert "503" in down.unhealthy_reason or "dropped the stream" in down.unhealthy_reason
    again = [REQUEST.validate_json(v) for _, v in await read_topic(
        e.kafka_bootstrap, topics.REQUESTS["standard"].name, for_request(rid, b""))]
    assert (again[0].attempt, again[0].requeued) == (1, "node_lost")
    assert again[0].resume.tokens == (" e0", " e1", " e2")
    assert isinstance(result, RequestResult) and result.status == "completed"
    assert result.completion_tokens == 8 and result.text.startswith(" e0 e1 e2")
    usage = {u.event_id: u for u in (USAGE.validate_json(v) for _, v in await read_topic(
        e.kafka_bootstrap, topics.USAGE.name,
        lambda k, v: f'"request_id":"{rid}"'.encode() in v))}.values()  # each billed once
    assert sum(u.completion_tokens for u in usage) == 8
    assert sum(u.prompt_tokens for u in usage) == request.request.prompt_token_count
