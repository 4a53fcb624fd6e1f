"""One request end to end over the real Kafka, Redis and Jaeger: through the router (with
the official openai client) or straight to Kafka, placed, executed, streamed, billed and
traced; bad input gets a clear error and never a silent loss."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import uuid

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from openai import AsyncOpenAI, AuthenticationError, BadRequestError, NotFoundError
from redis.asyncio import Redis
from stack_helpers import (
    SERVICE_TEST_ENV,
    TEST_SERVICE_PORTS,
    end_offsets,
    eventually,
    needs_local_infra,
    read_topic,
)
from typer.testing import CliRunner

from gpusched_common import topics
from gpusched_common.contracts import DEAD_LETTER, RESULT_EVENT, USAGE, RequestResult
from gpusched_ops.cli import app
from gpusched_ops.services import service_specs
from gpusched_router.adapters.idempotency import KEY as IDEMPOTENCY_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "qwen2.5-1.5b"


def client(stack, key: str = "sk-acme-demo") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key=key, max_retries=0)


async def produce(stack, topic: str, value: bytes, key: bytes | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


async def result_of(stack, request_id: str, timeout_s: float = 20) -> RequestResult:
    def mine(key: bytes | None, value: bytes) -> bool:
        return key == request_id.encode() and b'"request_result"' in value

    records = await read_topic(stack.endpoints.kafka_bootstrap, topics.RESULTS.name, mine,
                               timeout_s)
    assert records, f"no result for {request_id} on {topics.RESULTS.name}"
    assert len(records) == 1, f"{len(records)} results for {request_id}"
    return RESULT_EVENT.validate_json(records[-1][1])


async def billed_usage(stack, request_id: str) -> dict | None:
    """Accounting's totals for one of acme's requests once its final usage is in."""
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get(f"/v1/usage/requests/{request_id}",
                           headers={"Authorization": "Bearer sk-acme-demo"})
    return r.json() if r.status_code == 200 and r.json().get("final") else None


async def test_openai_client_streams_a_completion_through_the_router(stack) -> None:
    stream = await client(stack).completions.create(model=MODEL, prompt="Say hi", max_tokens=20,
                                                    stream=True)
    pieces, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    assert len("".join(pieces).split()) == 20
    assert finish == "length"


async def test_openai_chat_completion_non_streaming(stack) -> None:
    reply = await client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=7)
    assert reply.choices[0].message.role == "assistant"
    assert len(reply.choices[0].message.content.split()) == 7
    assert reply.usage.completion_tokens == 7


async def test_a_stop_string_ends_the_streamed_text_before_it(stack) -> None:
    full = await client(stack).completions.create(model=MODEL, prompt="Say hi", max_tokens=40,
                                                  seed=11)
    text = full.choices[0].text
    words = text.split()
    stop = f"{words[5][1:]} {words[6][:2]}"  # spans two tokens
    stream = await client(stack).completions.create(
        model=MODEL, prompt="Say hi", max_tokens=40, seed=11, stop=[stop, "never said"],
        stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == text[:text.find(stop)]
    assert finish == "stop" and usage.completion_tokens < 40


async def test_request_produced_straight_to_kafka_completes(stack) -> None:
    request_id = f"kcat-{uuid.uuid4().hex[:8]}"
    # The documented shape, as `kcat -P -t gpusched.requests.batch -k <id>` would send it:
    # plain JSON, no headers, no created_at_ms (the record timestamp is used).
    payload = {"request_id": request_id, "tenant": "globex", "model": MODEL,
               "prompt": "from kafka", "max_tokens": 5}
    await produce(stack, topics.REQUESTS["batch"].name, json.dumps(payload).encode(),
                  request_id.encode())
    result = await result_of(stack, request_id)
    assert result.status == "completed" and result.completion_tokens == 5
    # the router saw it too, so its status is queryable over HTTP
    async with httpx.AsyncClient(base_url=stack.router_url) as http:
        async def status():
            r = await http.get(f"/v1/requests/{request_id}",
                               headers={"Authorization": "Bearer sk-globex-demo"})
            return r.json() if r.status_code == 200 and "result" in r.json() else None
        body = await eventually(status, what="request outcome stored")
    assert body["status"] == "completed"


async def test_a_stream_cut_by_a_killed_router_ends_in_a_status_its_client_can_read(
        stack) -> None:
    """The router dies mid-stream and the request finishes before it is back: the client
    reads the request's id from the stream's headers, and once a router is up again GET
    /v1/requests/{id} gives the whole result (before, it said `queued` for ever: routers
    stored statuses only while they ran). The request ran once and was billed once."""
    [spec] = [s for s in service_specs(stack.endpoints, TEST_SERVICE_PORTS, SERVICE_TEST_ENV)
              if s.name == "router"]
    headers = {"Authorization": "Bearer sk-acme-demo"}
    async with httpx.AsyncClient(base_url=stack.router_url, timeout=60) as http:
        try:
            async with http.stream("POST", "/v1/completions", headers=headers, json={
                    "model": "llama-3.1-8b", "prompt": "router dies", "max_tokens": 4000,
                    "stream": True}) as reply:
                request_id = reply.headers["x-request-id"]
                stack.processes.kill_service("router")
                with pytest.raises(httpx.HTTPError):  # the stream is cut
                    async for _ in reply.aiter_bytes():
                        pass
            result = await result_of(stack, request_id, timeout_s=60)  # ran on, unheard
        finally:
            await asyncio.to_thread(stack.processes.start_service, spec)
        assert result.status == "completed" and result.completion_tokens == 4000

        async def finished():  # `running` passes while the new router reads the backlog
            r = await http.get(f"/v1/requests/{request_id}", headers=headers)
            return r.json() if r.json().get("status") not in ("queued", "running") else None
        status = await eventually(finished, timeout_s=30, what="the status of the request")
    assert status["status"] == "completed"
    assert status["result"]["text"] == result.text and status["tenant"] == "acme"
    assert isinstance(status["created_at_ms"], int)  # a number, as in the request's JSON
    billed = await eventually(lambda: billed_usage(stack, request_id), what="billed")
    assert (billed["requests"], billed["completion_tokens"]) == (1, 4000)


async def requests_for(stack, marker: str) -> list[str]:
    """The request id of each record with `marker` in its prompt on the request topics."""
    found = []
    for topic in topics.REQUESTS.values():
        found += [json.loads(value)["request_id"] for _, value in await read_topic(
            stack.endpoints.kafka_bootstrap, topic.name, lambda _k, v: marker.encode() in v,
            timeout_s=2)]
    return found


async def test_retries_with_one_idempotency_key_run_once_and_get_the_same_reply(stack) -> None:
    """Three at once with one key (the openai SDK's way of sending it), then one after the
    end: one request runs and is billed, all four get its reply. The key with another body,
    or a malformed key, is a 400 that says so."""
    marker, key = uuid.uuid4().hex, str(uuid.uuid4())
    sdk = client(stack)

    async def send():
        return await sdk.completions.with_raw_response.create(
            model="llama-3.1-8b", prompt=f"idempotent {marker}", max_tokens=2000,
            extra_headers={"Idempotency-Key": key})

    replies = await asyncio.gather(*(send() for _ in range(3)))
    replies.append(await send())
    bodies = [r.parse() for r in replies]
    request_id = replies[0].headers["x-request-id"]
    assert {r.headers["x-request-id"] for r in replies} == {request_id}
    # the replies that waited while the first use was still on its way in name its trace too
    [trace_id] = {r.headers["x-trace-id"] for r in replies}
    assert len(trace_id) == 32
    assert {b.choices[0].text for b in bodies} == {bodies[0].choices[0].text}
    assert bodies[0].usage.completion_tokens == 2000
    assert len(await requests_for(stack, marker)) == 1
    await result_of(stack, request_id)  # exactly one result
    billed = await eventually(lambda: billed_usage(stack, request_id), what="billed")
    assert (billed["requests"], billed["completion_tokens"]) == (1, 2000)

    with pytest.raises(BadRequestError) as reused:
        await sdk.completions.create(model="llama-3.1-8b", prompt=f"other {marker}",
                                     max_tokens=2000, extra_headers={"Idempotency-Key": key})
    assert reused.value.code == "idempotency_key_reused"
    with pytest.raises(BadRequestError) as malformed:
        await sdk.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                     extra_headers={"Idempotency-Key": "k" * 256})
    assert "Idempotency-Key must be 1 to 255" in malformed.value.message


async def test_a_retry_with_its_key_gets_the_reply_after_its_router_died_or_its_client_left(
        stack) -> None:
    """The router dies mid-request (a client that did not stream never learns the request's
    id); another request's client hangs up, which with a key does not cancel it. Each
    retry, streamed, gets the whole reply of its request's one run, billed once."""
    [spec] = [s for s in service_specs(stack.endpoints, TEST_SERVICE_PORTS, SERVICE_TEST_ENV)
              if s.name == "router"]

    async def retried(http: httpx.AsyncClient, headers: dict, body: dict, marker: str) -> None:
        async with http.stream("POST", "/v1/completions", headers=headers, json=body) as retry:
            assert retry.status_code == 200
            events = [json.loads(line[6:]) async for line in retry.aiter_lines()
                      if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert len(text.split()) == 4000 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(await requests_for(stack, marker)) == 1
        request_id = retry.headers["x-request-id"]
        assert (await result_of(stack, request_id)).text == text
        billed = await eventually(lambda: billed_usage(stack, request_id), what="billed")
        assert (billed["requests"], billed["completion_tokens"]) == (1, 4000)

    def request(marker: str) -> tuple[dict, dict]:
        return ({"Authorization": "Bearer sk-acme-demo", "Idempotency-Key": uuid.uuid4().hex},
                {"model": "llama-3.1-8b", "prompt": f"retried {marker}", "max_tokens": 4000,
                 "stream": True})

    async with httpx.AsyncClient(base_url=stack.router_url, timeout=60) as http:
        died, left = uuid.uuid4().hex, uuid.uuid4().hex
        headers, body = request(died)
        try:
            with pytest.raises(httpx.HTTPError):
                async with http.stream("POST", "/v1/completions", headers=headers,
                                       json=body) as cut:
                    async for _ in cut.aiter_bytes():
                        stack.processes.kill_service("router")
        finally:
            await asyncio.to_thread(stack.processes.start_service, spec)
        await retried(http, headers, body, died)

        headers, body = request(left)
        async with http.stream("POST", "/v1/completions", headers=headers, json=body) as first:
            async for _ in first.aiter_bytes():
                break  # about 5 s of work left: the client hangs up
        await retried(http, headers, body, left)


async def test_a_keys_retry_runs_the_request_its_first_use_never_got_into_kafka(stack) -> None:
    """Kafka is down. Two sends with one key: the first gets the router's 503 and frees the
    key, the second, waiting on the first, a 503 as well (it waited for the router's time-out
    before, 5 minutes, and got a 504 that said not to retry). A third send's router dies
    before Kafka takes it in, leaving the key claimed for a request that never ran (its
    retries waited on it and got 504s, for a day). Once all is back, each key's retry runs
    its request once, billed once: the third under its first use's id."""
    needs_local_infra(stack)
    [spec] = [s for s in service_specs(stack.endpoints, TEST_SERVICE_PORTS, SERVICE_TEST_ENV)
              if s.name == "router"]
    refused, stranded = uuid.uuid4().hex, uuid.uuid4().hex
    prompts = {refused: f"refused {uuid.uuid4().hex}", stranded: f"stranded {uuid.uuid4().hex}"}

    async def send(http: httpx.AsyncClient, key: str) -> httpx.Response:
        return await http.post("/v1/completions", json={
            "model": MODEL, "prompt": prompts[key], "max_tokens": 20},
            headers={"Authorization": "Bearer sk-acme-demo", "Idempotency-Key": key})

    redis = Redis.from_url(stack.endpoints.redis_url)
    claim = IDEMPOTENCY_KEY.format("acme", hashlib.sha256(stranded.encode()).hexdigest())
    killed = False
    stack.processes.stop_component("kafka")
    try:
        async with httpx.AsyncClient(base_url=stack.router_url, timeout=60) as http:
            first = asyncio.create_task(send(http, refused))
            await asyncio.sleep(1.0)  # holds the key, waiting for Kafka
            second = await send(http, refused)
            for reply in (await first, second):
                assert reply.status_code == 503, reply.text
                assert "send it again" in reply.json()["error"]["message"]
            cut = asyncio.create_task(send(http, stranded))
            await eventually(lambda: redis.exists(claim), what="the key claimed")
            stack.processes.kill_service("router")
            killed = True
            with pytest.raises(httpx.HTTPError):
                await cut
    finally:
        stack.processes.start_component("kafka")
        if killed:
            await asyncio.to_thread(stack.processes.start_service, spec)
        await redis.aclose()
    sdk = client(stack).with_options(timeout=60)
    for key in (refused, stranded):
        reply = await sdk.completions.with_raw_response.create(
            model=MODEL, prompt=prompts[key], max_tokens=20,
            extra_headers={"Idempotency-Key": key})
        assert reply.parse().usage.completion_tokens == 20
        request_id = reply.headers["x-request-id"]
        # the trace of the copy that ran (the stranded key's retry sent it: it was empty)
        assert len(reply.headers["x-trace-id"]) == 32, key
        await result_of(stack, request_id)  # exactly one result
        billed = await eventually(lambda rid=request_id: billed_usage(stack, rid),
                                  what="billed")
        assert (billed["requests"], billed["completion_tokens"]) == (1, 20)
    # the stranded request ran under its first use's id: nothing else with its prompt did
    assert set(await requests_for(stack, prompts[stranded])) == {request_id}


async def test_accounting_returns_exactly_the_tokens_used(stack) -> None:
    headers = {"Authorization": "Bearer sk-initech-demo"}
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        async def totals() -> dict:
            r = await http.get("/v1/usage", params={"tenant": "initech"}, headers=headers)
            return r.json()["tenants"][0]["totals"]

        before = await totals()
        replies = [await client(stack, "sk-initech-demo").completions.create(
            model=MODEL, prompt="tok " * n, max_tokens=n) for n in (3, 11, 30)]
        want_prompt = before["prompt_tokens"] + sum(r.usage.prompt_tokens for r in replies)
        want_completion = before["completion_tokens"] + sum(
            r.usage.completion_tokens for r in replies)

        async def settled():
            now = await totals()
            return now if now["completion_tokens"] >= want_completion else None

        after = await eventually(settled, what="usage to reach accounting")
        time.sleep(1.0)  # anything counted twice would show up by now
        again = await totals()
    assert (after["prompt_tokens"], after["completion_tokens"]) == (want_prompt, want_completion)
    assert again == after
    assert after["requests"] == before["requests"] + 3
    assert after["gpu_seconds"] > before["gpu_seconds"]


async def test_one_trace_spans_router_scheduler_agent_and_accounting(stack) -> None:
    raw = await client(stack).completions.with_raw_response.create(
        model=MODEL, prompt="trace me", max_tokens=4)
    trace_id = raw.headers["x-trace-id"]
    assert len(trace_id) == 32
    want = {"router", "scheduler", "gpu-agent", "accounting"}
    async with httpx.AsyncClient(base_url=stack.endpoints.jaeger_query_url) as http:
        async def services():
            r = await http.get(f"/api/traces/{trace_id}")
            if r.status_code != 200 or not r.json().get("data"):
                return None
            [trace] = r.json()["data"]
            names = {p["serviceName"] for p in trace["processes"].values()}
            return names if want <= names else None
        found = await eventually(services, timeout_s=30, what=f"trace {trace_id} in Jaeger")
    assert want <= found


@pytest.mark.parametrize("key,body,status", [
    ("sk-acme-demo", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400),
    ("sk-acme-demo", {"model": MODEL}, 400),
    ("sk-acme-demo", "not json at all", 400),
    ("sk-wrong", {"model": MODEL, "prompt": "x"}, 401),
    (None, {"model": MODEL, "prompt": "x"}, 401),
    ("sk-acme-demo", {"model": "gpt-17", "prompt": "x"}, 404),
    ("sk-acme-demo", {"model": MODEL, "prompt": "tok " * 40_000}, 400),
])
async def test_bad_requests_get_4xx_and_nothing_reaches_kafka(stack, key, body, status) -> None:
    names = [t.name for t in topics.REQUESTS.values()]
    before = await end_offsets(stack.endpoints.kafka_bootstrap, names)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=stack.router_url) as http:
        resp = await http.post("/v1/completions", content=content, headers=headers)
    assert resp.status_code == status
    assert resp.json()["error"]["message"]  # a reason, not an empty error
    after = await end_offsets(stack.endpoints.kafka_bootstrap, names)
    assert after == before


async def test_openai_client_raises_typed_errors(stack) -> None:
    with pytest.raises(NotFoundError, match="available models") as unknown:
        await client(stack).completions.create(model="gpt-17", prompt="x")
    assert unknown.value.code == "model_not_found"  # the SDK reads error.code as a string
    with pytest.raises(AuthenticationError):
        await client(stack, "sk-wrong").completions.create(model=MODEL, prompt="x")
    with pytest.raises(BadRequestError, match="maximum context length") as refused:
        await client(stack).completions.create(model="llama-3.1-8b", prompt="x",
                                                max_tokens=8_192)
    assert refused.value.code == "context_length_exceeded"


async def test_a_client_that_hangs_up_before_its_reply_cancels_the_request(stack) -> None:
    """Before, the request ran on to the end, so a client retrying after its own time-out (the
    openai SDK does, twice by default) ran and paid for it up to three times."""
    marker = f"hang-up-{uuid.uuid4().hex}"
    async with httpx.AsyncClient(base_url=stack.router_url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", headers={"Authorization": "Bearer sk-acme-demo"},
                            json={"model": "llama-3.1-8b", "prompt": marker, "max_tokens": 4000})
    [(key, _)] = await read_topic(stack.endpoints.kafka_bootstrap,
                                  topics.REQUESTS["interactive"].name,
                                  lambda _k, value: marker.encode() in value)
    result = await result_of(stack, key.decode(), timeout_s=30)
    assert result.status == "cancelled" and result.completion_tokens < 4000, result


async def test_a_body_declared_over_the_limit_is_refused_unread(stack) -> None:
    """A client announcing a 1 GB body gets its 413 before sending it (before, the router
    read the whole body first)."""
    url = httpx.URL(stack.router_url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nAuthorization: Bearer "
                 b"sk-acme-demo\r\nContent-Type: application/json\r\nContent-Length: "
                 b"1000000000\r\n\r\n{")
    await writer.drain()
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.read(4096)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"over the limit" in body


async def test_malformed_record_is_dead_lettered_and_the_next_request_completes(stack) -> None:
    marker = uuid.uuid4().hex
    await produce(stack, topics.REQUESTS["standard"].name,
                  f'{{"tenant": "acme", "oops": "{marker}"'.encode())

    def ours(_key: bytes | None, value: bytes) -> bool:
        return marker.encode() in value

    [(_, raw)] = await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name, ours)
    dead = DEAD_LETTER.validate_json(raw)
    assert dead.source_topic == topics.REQUESTS["standard"].name
    assert "not valid JSON" in dead.reason and dead.service == "scheduler"
    shown = await asyncio.to_thread(CliRunner().invoke, app, [
        "dead-letters", "--json", "--last", "20", "--kafka", stack.endpoints.kafka_bootstrap])
    assert shown.exit_code == 0, shown.output
    assert dead.model_dump() in json.loads(shown.output)  # what an operator sees: the same

    request_id = f"after-{marker[:8]}"
    await produce(stack, topics.REQUESTS["standard"].name,
                  json.dumps({"request_id": request_id, "tenant": "acme", "model": MODEL,
                              "prompt": "still alive", "max_tokens": 3}).encode(),
                  request_id.encode())
    assert (await result_of(stack, request_id)).status == "completed"


async def test_valid_json_with_bad_fields_is_dead_lettered_with_the_field(stack) -> None:
    request_id = f"bad-{uuid.uuid4().hex[:8]}"
    await produce(stack, topics.REQUESTS["interactive"].name,
                  json.dumps({"request_id": request_id, "tenant": "acme", "model": MODEL,
                              "prompt": "x", "max_tokens": "many"}).encode())

    def ours(_key: bytes | None, value: bytes) -> bool:
        return request_id.encode() in value

    [(_, raw)] = await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name, ours)
    assert "max_tokens" in DEAD_LETTER.validate_json(raw).reason
    rejection = await read_topic(stack.endpoints.kafka_bootstrap, topics.RESULTS.name,
                                 lambda k, v: request_id.encode() in v)
    assert rejection and b'"rejection"' in rejection[-1][1]


async def test_without_redis_router_and_accounting_answer_503_with_the_reason(stack) -> None:
    """Then, with Redis back, the next request completes: nothing stays broken."""
    needs_local_infra(stack)
    stack.processes.stop_component("redis")
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{stack.router_url}/v1/completions",
                                headers={"Authorization": "Bearer sk-acme-demo"},
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "Redis is unavailable" in r.json()["error"]["message"]
            r = await http.get(f"{stack.accounting_url}/v1/usage",
                               headers={"Authorization": "Bearer sk-acme-demo"})
            assert r.status_code == 503 and "Redis is unavailable" in r.json()["detail"]
    finally:
        stack.processes.start_component("redis")
    reply = await client(stack).completions.create(model=MODEL, prompt="back", max_tokens=3)
    assert reply.usage.completion_tokens == 3


async def test_a_stalled_redis_gets_a_503_after_one_time_out_not_a_hang(stack) -> None:
    """Redis paused (SIGSTOP: it keeps its socket but answers nothing, as when it swaps or
    the network partitions): the router answers 503 once one command timed out (5 s).
    Before, each command was tried six times, and the client waited 32 s for the 503."""
    needs_local_infra(stack)
    [redis] = [p for p in stack.processes.status() if p.name == "redis"]
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        async with httpx.AsyncClient(timeout=12) as http:  # past it: the router hung
            r = await http.post(f"{stack.router_url}/v1/completions",
                                headers={"Authorization": "Bearer sk-acme-demo"},
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "Redis is unavailable" in r.json()["error"]["message"]
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    reply = await client(stack).completions.create(model=MODEL, prompt="back", max_tokens=3)
    assert reply.usage.completion_tokens == 3


async def test_requests_sent_while_redis_is_away_complete_once_it_is_back(stack) -> None:
    """Kafka takes requests while Redis is down: the scheduler may place them and then lose
    its lease (it lives in Redis) before it saved them. Once Redis is back each completes,
    once."""
    needs_local_infra(stack)
    ids = [f"redis-gap-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    stack.processes.stop_component("redis")
    try:
        await asyncio.sleep(1)
        for request_id in ids:
            payload = {"request_id": request_id, "tenant": "acme", "model": MODEL,
                       "prompt": "while Redis is away", "max_tokens": 4}
            await produce(stack, topics.REQUESTS["standard"].name,
                          json.dumps(payload).encode(), request_id.encode())
        await asyncio.sleep(6)  # past the 3 s lease
    finally:
        stack.processes.start_component("redis")
    for request_id in ids:
        result = await result_of(stack, request_id, timeout_s=60)
        assert result.status == "completed" and result.completion_tokens == 4


async def test_without_kafka_the_router_answers_503_and_the_stack_recovers(stack) -> None:
    """Kafka stops: a request gets 503 with the reason after the publish timeout, not a hang.
    Kafka comes back: new requests complete (every service reconnects by itself), and the
    503'd one never runs, even where the producer delivers it late (its cancel goes first),
    so a client that sends it again is not served twice."""
    needs_local_infra(stack)
    headers = {"Authorization": "Bearer sk-acme-demo"}
    stack.processes.stop_component("kafka")
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{stack.router_url}/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "Kafka did not take request" in message and "send it again" in message
        refused_id = message.split("request ", 1)[1].split(" ", 1)[0]
    finally:
        stack.processes.start_component("kafka")
    async with httpx.AsyncClient(base_url=stack.router_url, timeout=30) as http:
        async def completes():
            r = await http.post("/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": "back", "max_tokens": 3})
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        await eventually(completes, timeout_s=120, interval_s=1, what="a new request")

        async def status() -> str:
            r = await http.get(f"/v1/requests/{refused_id}", headers=headers)
            return "unknown" if r.status_code == 404 else r.json()["status"]
        for _ in range(10):  # long enough for a late delivery to have run by now
            # delivered late, it is read as queued (the routers store that) until the
            # scheduler ends it by its cancel: it never runs
            assert await status() in ("unknown", "queued", "cancelled")
            await asyncio.sleep(0.5)

        async def settled() -> bool:
            return await status() in ("unknown", "cancelled")
        await eventually(settled, timeout_s=30, what="the late delivery ended by its cancel")


@pytest.mark.parametrize("outage_s", [8, 50])
async def test_work_running_through_a_kafka_outage_runs_once(stack, outage_s: int) -> None:
    """Kafka stops while requests run: each runs once, has one result and is billed once,
    and new requests complete once it is back.
    8 s is twice the node time-out here: agents say in Redis that they are alive, so a
    scheduler that cannot hear them keeps their work with them instead of retrying it.
    50 s outlasts aiokafka's 40 s request time-out: a batch it dropped can leave a producer
    that Kafka refuses as out of order, which every service now replaces (before, the agent
    that met it published nothing more until restarted and its requests never ended)."""
    needs_local_infra(stack)
    headers = {"Authorization": "Bearer sk-acme-demo"}
    async with httpx.AsyncClient(base_url=stack.router_url, timeout=180) as http:
        calls = [asyncio.create_task(http.post(
            "/v1/completions", headers=headers,
            json={"model": "llama-3.1-8b", "prompt": f"outage-{uuid.uuid4().hex}",
                  "max_tokens": 4000})) for _ in range(3)]
        # streamed: chunks Kafka drops in the outage come from the result's text instead
        streamed = asyncio.create_task(client(stack).completions.create(
            model="llama-3.1-8b", prompt="outage, streamed", max_tokens=4000, stream=True))
        await asyncio.sleep(1.0)  # placed and running (about 5 s of work)
        stack.processes.stop_component("kafka")
        try:
            await asyncio.sleep(outage_s)
        finally:
            stack.processes.start_component("kafka")
        replies = await asyncio.gather(*calls)
        text = "".join([c.choices[0].text async for c in await streamed if c.choices])
        assert len(text.split()) == 4000
        after = await http.post("/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": "after", "max_tokens": 3})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4000
        request_id = reply.headers["x-request-id"]
        await result_of(stack, request_id)  # exactly one result
        usage = await read_topic(stack.endpoints.kafka_bootstrap, topics.USAGE.name,
                                 lambda _k, value, rid=request_id: rid.encode() in value)
        runs = {USAGE.validate_json(value).placement_id for _, value in usage}
        assert runs == {f"{request_id}#0"}  # one run, no retry
        billed = await eventually(lambda rid=request_id: billed_usage(stack, rid),
                                  what=f"{request_id} billed")
        assert (billed["requests"], billed["completion_tokens"]) == (1, 4000)
