"""Router service: wires HTTP routes, the Kafka broker, Redis and telemetry together."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, Literal, get_args

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from faststream import AckPolicy
from faststream.kafka.annotations import KafkaMessage
from opentelemetry import trace
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gpusched_common import topics
from gpusched_common.broker import RAW_BATCH, make_broker
from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.consumer_lag import ConsumerLag
from gpusched_common.contracts import (
    PRIORITY_CLASSES,
    RESULT_EVENT,
    Cancel,
    InferenceRequest,
    Rejection,
    RequestResult,
    TokenChunk,
)
from gpusched_common.kafka_records import WallClockMs, wall_clock_ms
from gpusched_common.redis_client import make_redis
from gpusched_common.redis_keys import (
    BUDGET_EXHAUSTED_KEY,
    CANCELLED_KEY,
    CANCELLED_TTL_S,
    budget_reason,
)
from gpusched_common.tasks import cancelled
from gpusched_common.telemetry import make_tracer_provider, request_attributes, trace_id_hex
from gpusched_common.web import (
    RETRY_SHORTLY_S,
    add_ops_routes,
    broker_lifespan,
    get_and_head,
    on_stop,
    retry_shortly,
    unavailable_without_redis,
)
from gpusched_router.adapters.idempotency import IdempotencyKeys
from gpusched_router.adapters.results import ResultsHub, Waited, status_span
from gpusched_router.adapters.server_spans import ServerSpans
from gpusched_router.domain.idempotency import (
    FirstUse,
    check_key,
    passes_later,
    request_digest,
    reused,
)
from gpusched_router.domain.openai_api import (
    IDEMPOTENCY_HEADER,
    ApiError,
    ParsedRequest,
    decode_body,
    parse_chat,
    parse_completion,
    repeated_header,
)
from gpusched_router.settings import RouterSettings

SERVICE = "router"
STATUS_GROUP = "gpusched-router-status"
SEEN_GROUP = "gpusched-router-requests"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
DOOR_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH})
"""Where requests come in: gpusched_router_requests_total counts the answers given there."""
STATUS_POLL_S = 0.5
"""How often a retry with a used Idempotency-Key re-reads its first use's status."""
CONTEXT_EXCEEDED = re.compile(
    r"maximum context length"  # vLLM's API server, and OpenAI's own words
    r"|longer than the maximum model length"  # vLLM's engine ("The decoder prompt ...")
    r"|longer than the model's context length"  # SGLang
    r"|tokens \+ `?max_new_tokens`? must be <="  # TGI's 422s
    r"|`?inputs`? must have less than \d+ tokens"
    r"|exceeds the available context size",  # llama.cpp's server
    re.IGNORECASE)
"""An inference engine's refusal that says the prompt and completion exceed the model's
context: the router answers it as OpenAI does, `context_length_exceeded`."""
SHUTTING_DOWN = "router_shutting_down"
"""The code of the 503 a client still waiting is answered once its router has stopped and
the drain time-out passed: its request goes on."""
NOT_TAKING = "router_not_taking_requests"
"""A stopping router's 503 for a request it did not send (its body came after the drain):
nothing runs, send it again."""
WaitOutcome = Callable[[float, asyncio.Future[None]], Awaitable[Waited | None]]
Answered = Literal["completed", "over_quota", "unschedulable", "queue_time_exceeded",
                   "rejected", "engine_refused", "failed", "started_over", "cancelled",
                   "timed_out", "router_stopped", "client_gone"]
"""How a request taken in ended for the client waiting on it (the `outcome` of
gpusched_router_answers_total): its result (200); the scheduler's refusal, over_quota (429:
a quota, tokens per minute, a spent budget), unschedulable (422: fits no node),
queue_time_exceeded (503) or rejected (its other 4xx); its engine's 4xx (engine_refused);
failed on its node (502), or started_over there (502: a stream its node was lost under);
cancelled (409); the router's own end of the wait, timed_out (504) or router_stopped (503:
the request goes on); client_gone (499: the client left first)."""
ANSWERED: tuple[Answered, ...] = get_args(Answered)
log = logging.getLogger(__name__)


def create_app(settings: RouterSettings, clock: WallClockMs = wall_clock_ms) -> FastAPI:
    catalog = load_models(settings.config_dir)
    tenants = load_tenants(settings.config_dir)
    registry = CollectorRegistry()
    provider = make_tracer_provider(SERVICE, settings.telemetry)
    tracer = provider.get_tracer(SERVICE)
    broker = make_broker(settings.kafka, SERVICE, provider, registry)
    redis = make_redis(settings.redis)
    hub = ResultsHub(redis, settings.status_ttl_s)
    idempotency = IdempotencyKeys(redis, settings.status_ttl_s)
    accepted = Counter("gpusched_router_requests_total",
                       "Requests at the door: accepted (Kafka took it in), replayed (a retry "
                       "with an Idempotency-Key, answered with its first use's outcome) or "
                       "http_<status> (refused before it was taken in).",
                       ["priority_class", "outcome"], registry=registry)
    answers = Counter("gpusched_router_answers_total",
                      "How each request taken in (accepted or replayed) ended for its client: "
                      "completed, over_quota (429), unschedulable (422), queue_time_exceeded "
                      "(503), rejected (the scheduler's other 4xx), engine_refused (the "
                      "engine's 4xx), failed (502), started_over (502), cancelled (409), "
                      "timed_out (504), router_stopped (503), client_gone (499).",
                      ["priority_class", "outcome"], registry=registry)
    for priority_class in PRIORITY_CLASSES:  # at 0: a first 504 is an increase() to alert on
        for answered in ANSWERED:
            answers.labels(priority_class, answered)
    latency = Histogram("gpusched_router_request_seconds", "Accept to terminal result.",
                        ["priority_class"], registry=registry,  # up to the request time-out:
                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
                                 3600))  # the default's 10 s capped the latency panel
    cancels: set[asyncio.Task[bool]] = set()

    # Every router reads every result as it comes, for the clients waiting on it...
    @broker.subscriber(topics.RESULTS.name, batch=True, group_id=None,
                       auto_offset_reset="latest", batch_timeout_ms=10, max_records=500,
                       **RAW_BATCH)
    async def on_results(msg: KafkaMessage) -> None:
        hub.dispatch(msg.raw_message)

    # ...and the routers share, as one consumer group, storing each request's outcome:
    # offsets commit once it is in Redis, so an outcome that comes while every router is
    # down, or while Redis is, is stored once one is back. Its lag is outcomes not stored
    # yet: GET /v1/requests and Idempotency-Key retries see them late.
    finished = broker.subscriber(topics.RESULTS.name, batch=True, group_id=STATUS_GROUP,
                                 auto_offset_reset="earliest",
                                 ack_policy=AckPolicy.NACK_ON_ERROR, batch_timeout_ms=50,
                                 max_records=2000, **RAW_BATCH)
    lag = ConsumerLag(SERVICE, registry)
    lag.watch(STATUS_GROUP, lambda: finished.consumer)

    @finished
    async def on_finished(msg: KafkaMessage) -> None:
        await hub.store_finished(msg.raw_message)

    # ...and, as another group, a queued status for each request read on the request
    # topics that has none: those produced straight to Kafka are then known to GET and
    # cancel while they wait or run, not only once they have ended. Its lag is such
    # requests not known yet.
    seen = broker.subscriber(*(spec.name for spec in topics.REQUESTS.values()), batch=True,
                             group_id=SEEN_GROUP, auto_offset_reset="earliest",
                             ack_policy=AckPolicy.NACK_ON_ERROR, batch_timeout_ms=50,
                             max_records=2000, **RAW_BATCH)
    lag.watch(SEEN_GROUP, lambda: seen.consumer)

    @seen
    async def on_requests(msg: KafkaMessage) -> None:
        await hub.store_seen(msg.raw_message, clock())

    measuring: list[asyncio.Task[None]] = []
    """The consumers' lag measure."""

    async def start_measuring() -> None:
        measuring.append(asyncio.create_task(lag.run(), name="consumer-lag"))

    async def stop_measuring() -> None:
        await cancelled(*measuring)

    lifespan, ready = broker_lifespan(settings.kafka, broker, provider, [redis.aclose],
                                      starting=[start_measuring], stopping=[stop_measuring])
    app = FastAPI(title="gpusched router", version="0.1.0", lifespan=lifespan)
    app.add_middleware(ServerSpans, tracer=tracer, routes=DOOR_PATHS)
    add_ops_routes(app, registry, ready)

    def drain() -> None:
        """Stopped (a rollout), the router takes no new request; those its clients wait on
        get the drain time-out to end, then each client still waiting is answered (its
        request goes on), before the grace period's SIGKILL cuts them off with nothing."""
        def answer_the_rest() -> None:
            if waiting := hub.stop(_shutting_down):
                log.warning("stopping: %d client(s) still waiting after %g s are answered "
                            "503 (their requests go on)", waiting, settings.router_drain_s)

        asyncio.get_running_loop().call_later(settings.router_drain_s, answer_the_rest)

    on_stop(app, drain)

    def redis_away(request: Request, reason: str) -> dict[str, Any]:
        if request.url.path in DOOR_PATHS:  # as every 5xx at the door: alerts read it
            accepted.labels("unknown", "http_503").inc()
        return ApiError(503, reason).body()

    unavailable_without_redis(app, redis_away, headers=lambda request: {
        "x-request-id": _request_id_of(request)} if request.url.path in DOOR_PATHS else {})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers (unknown path, wrong method) in OpenAI's error shape
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        failed = ApiError(500, f"internal error ({type(exc).__name__}); the router's log has "
                          "the details")
        return refused(failed, _request_id_of(request)) if request.url.path in DOOR_PATHS \
            else error(failed)

    def error(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code, headers=headers)

    def refused(err: ApiError, request_id: str, priority_class: str = "unknown",
                headers: dict[str, str] | None = None) -> JSONResponse:
        """An error answered at the door, counted by its status: a request refused before it
        was taken in, or a 500 (which may come after it was). A status read, a cancel or a
        model lookup is no request at the door: their 404s and 503s counted there inflated
        the server-errors alert's ratio. It names the request (`x-request-id`, the openai
        SDK's `e.request_id`): the one a 503 from Kafka was cancelled under."""
        accepted.labels(priority_class, f"http_{err.status_code}").inc()
        return error(err, {"x-request-id": request_id, **(headers or {})})

    async def authenticate(request: Request) -> Any:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return ApiError(401, "missing API key: send 'Authorization: Bearer <key>'")
        key = key.strip()
        tenant = tenants.by_api_key(key)
        if tenant is None and key in tenants.admin_api_keys:
            return ApiError(403, "an admin key reads usage from accounting; send requests "
                            "with a tenant's key")
        if tenant is None:
            return ApiError(401, "unknown API key")
        return tenant

    async def read_json(request: Request) -> Any:
        too_big = ApiError(413, f"request body is over the limit of {settings.max_body_bytes} "
                           "bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_body_bytes:
            return too_big  # refused before reading it
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > settings.max_body_bytes:
                    return too_big
        except ClientDisconnect:  # it hung up mid-upload: a client's time-out, no 500
            return ApiError(499, "the client disconnected before its request body was read")
        return decode_body(body)

    def send_cancel(request_id: str, reason: str, request_span: trace.Span
                    ) -> asyncio.Task[bool]:
        """Cancel a request wherever it waits or runs: the scheduler ends it if it waits,
        the agent running it stops it; agents remember cancels that come before the
        placement, and one that was down when this went out finds it in Redis. Runs on its
        own (the caller may be answering already); the task says whether Kafka took it.
        It goes out under a `cancel` span naming the request and why, a child of
        `request_span` (the request's server span, or the one its status names), so that
        the request's trace shows what ended it and the spans the cancel makes downstream
        (every agent reads it); an invalid one (no trace known) begins a trace of its own."""
        cancel = Cancel(request_id=request_id, reason=reason, at_ms=clock())

        async def publish() -> bool:
            try:
                await redis.set(CANCELLED_KEY.format(request_id), reason, ex=CANCELLED_TTL_S)
            except RedisError as exc:  # the agents running now still read it from Kafka
                log.warning("cancel of request %s not kept in Redis: %r", request_id, exc)
            with tracer.start_as_current_span(
                    "cancel", context=trace.set_span_in_context(request_span), attributes={
                        "gpusched.request_id": request_id, "gpusched.cancel_reason": reason},
                    record_exception=False, set_status_on_exception=False) as span:
                try:
                    await broker.publish(cancel.to_bytes(), topics.CONTROL.name,
                                         key=request_id.encode(),
                                         headers={"content-type": "application/json"})
                except Exception as exc:  # noqa: BLE001 - nobody may await it: say so in the log
                    span.record_exception(exc)
                    span.set_status(StatusCode.ERROR, f"not sent: {exc!r}")
                    log.exception("cancel of request %s (%s) not sent", request_id, reason)
                    return False
            return True

        task = asyncio.create_task(publish())
        cancels.add(task)
        task.add_done_callback(cancels.discard)
        return task

    async def handle(request: Request, parse: Any, kind: str) -> Response:
        # made first, so that every answer names the request: a refusal too, and a 500
        request_id = request.state.request_id = _new_request_id()
        span = trace.get_current_span()  # the request's server span (ServerSpans)
        span.set_attribute("gpusched.request_id", request_id)
        tenant = await authenticate(request)
        if isinstance(tenant, ApiError):
            return refused(tenant, request_id)
        span.set_attribute("gpusched.tenant", tenant.name)
        if (twice := repeated_header(request.headers.getlist)) is not None:
            return refused(twice, request_id)
        body = await read_json(request)
        if isinstance(body, ApiError):
            return refused(body, request_id)
        parsed = parse(body, tenant, request.headers, catalog, request_id, clock())
        if isinstance(parsed, ApiError):
            return refused(parsed, request_id)
        req = parsed.request
        span.set_attributes(request_attributes(req))
        key = request.headers.get(IDEMPOTENCY_HEADER)
        use: FirstUse | None = None
        if key is not None:
            if (bad := check_key(key)) is not None:
                return refused(bad, request_id, req.priority_class)
            use = FirstUse(request_id, request_digest(request.url.path, body), clock())
            holder = await idempotency.claim(tenant.name, key, use)
            if holder is not None:
                if holder.digest != use.digest:
                    return refused(reused(key), request_id, req.priority_class)
                stored = (await hub.status(holder.request_id) or {}).get("result")
                if stored is None or not passes_later(stored) or \
                        not await idempotency.take_over(tenant.name, key, holder, use):
                    return await replay(request, parsed, kind, tenant.name, key, holder)
                # its first use was refused for now (429, queue limit): this one runs

        async def free_key() -> None:
            """The request was not taken in: a retry with its key must run."""
            if key is not None and use is not None:
                with contextlib.suppress(RedisError):  # it expires with the status TTL
                    await idempotency.release(tenant.name, key, use)

        budget_key = BUDGET_EXHAUSTED_KEY.format(tenant.name)
        try:
            spent = await redis.get(budget_key)
            left_ms = await redis.pttl(budget_key) if spent is not None else 0
        except RedisError:  # nothing was taken in: a retry with the key must run at once
            await free_key()
            raise
        if spent is not None:  # checked after the replay: a spent budget stops new work only
            await free_key()
            # No retry fits before the period ends (the flag's expiry): the openai SDK's own
            # retries, seconds apart, would only be refused again.
            headers = {"x-should-retry": "false"}
            if left_ms > 0:
                headers["retry-after"] = str(-(-left_ms // 1000))
            return refused(_budget_error(spent), request_id, req.priority_class, headers)
        if hub.stopped:  # its body came in after the drain: it would run, its client told 503
            await free_key()
            return refused(_not_sent(), request_id, req.priority_class, retry_shortly())
        queue = hub.open(request_id)
        try:
            trace_id = await take_in(req)
        except (TimeoutError, KafkaError):  # aiokafka gives up on its own after 40 s
            # The producer may still deliver the record once Kafka is back; its cancel,
            # queued behind it, then reaches the scheduler and the agents first, so the
            # request ends unrun and a client's retry is not run twice.
            hub.close(request_id, queue)
            send_cancel(request_id, "the router answered 503: Kafka did not take it in time",
                        span)
            await free_key()
            return refused(_not_taken_in(f"request {request_id}", settings.publish_timeout_s,
                                         "it is cancelled, send it again"), request_id,
                           req.priority_class, retry_shortly())
        except Exception:
            hub.close(request_id, queue)
            await free_key()
            raise
        accepted.labels(req.priority_class, "accepted").inc()

        def abandoned(why: str = "client disconnected") -> None:
            # The client hung up before the end: tell the agent running it to stop (it bills
            # what was produced), so a client's retry does not run it twice. With a key, the
            # retry gets this request's outcome instead: it runs on.
            if key is None:
                send_cancel(request_id, why, span)

        return await answer(request, parsed, kind, queue, lambda: trace_id, abandoned)

    async def take_in(req: InferenceRequest) -> str:
        """Publish `req` to its priority class's topic, in the trace of the current span
        (the server span of the request that brings it in), and store its queued status,
        which names that span (a cancel from any router goes in its trace); the trace's id.
        Raises TimeoutError when Kafka did not take it within the publish time-out
        (KafkaError when aiokafka gave up first)."""
        span = trace.get_current_span()
        trace_id = trace_id_hex(span) or ""  # unsampled: Jaeger never gets the trace
        async with asyncio.timeout(settings.publish_timeout_s):
            await broker.publish(req.to_bytes(), topics.REQUESTS[req.priority_class].name,
                                 key=req.request_id.encode(),
                                 headers={"content-type": "application/json"})
        try:
            await hub.accepted(req, span)
        except RedisError as exc:  # published: the request runs, and the routers' group on
            # the request topics stores its status once Redis is back
            log.warning("request %s accepted, its queued status not stored yet: %r",
                        req.request_id, exc)
        return trace_id

    async def replay(request: Request, parsed: ParsedRequest, kind: str, tenant: str,
                     key: str, holder: FirstUse) -> Response:
        """Answer a retry with an Idempotency-Key already used for the same request: the
        first use's outcome, once it has one; nothing runs again. If the first use's request
        was never taken in (its router died first), the retry sends it, under its id."""
        request_id = request.state.request_id = holder.request_id  # what a 500 names too
        trace.get_current_span().set_attribute("gpusched.request_id", request_id)
        queue = hub.open(request_id)  # before reading the status: no outcome falls between
        try:
            status = await hub.status(request_id) or {}
        except BaseException:
            hub.close(request_id, queue)
            raise
        original = parsed.request.model_copy(update={
            "request_id": request_id,
            "created_at_ms": int(status.get("created_at_ms", parsed.request.created_at_ms))})
        trace_id = status.get("trace_id") or ""  # the first use's, or this retry's own
        refused: ApiError | None = None
        """This retry's 503 where its request was not taken in (its first use refused,
        Kafka away, this router stopping): counted at the door as the other such 503s, for
        the server-errors alert, not as replayed."""

        async def taken_in() -> ApiError | None:
            """With no status stored yet: None while the first use may still be on its way
            in (or once this retry has sent it, its router having died before it was taken
            in); a 503 if it was refused (its key freed or held by another request)."""
            nonlocal trace_id
            if hub.stopped:  # before taking the key over: a retry elsewhere must get it
                return _not_sent()
            now_ms = clock()
            current = await idempotency.holder(tenant, key)
            if current is None or current.request_id != request_id:
                return ApiError(503, f"request {request_id}, the first use of this "
                                "Idempotency-Key, was refused before it ran; send it again")
            if not current.abandoned(now_ms, settings.publish_timeout_s) or \
                    not await idempotency.take_over(tenant, key, current, FirstUse(
                        current.request_id, current.digest, now_ms)):
                return None
            log.warning("request %s (Idempotency-Key) has no status %.0f s after its first "
                        "use: its router died before Kafka took it in; a retry sends it "
                        "again (a copy Kafka did take is skipped as a redelivery)", request_id,
                        (now_ms - current.claimed_at_ms) / 1000)
            try:
                trace_id = await take_in(original)
            except (TimeoutError, KafkaError):
                return _not_taken_in(f"request {request_id}", settings.publish_timeout_s,
                                     "send it again")
            return None

        async def outcome(deadline_s: float, gone: asyncio.Future[None]
                          ) -> Waited | None:
            # Its outcome may have passed this router before the queue opened, and be
            # stored a moment later: read the status again every STATUS_POLL_S.
            nonlocal trace_id, refused
            loop = asyncio.get_running_loop()
            stored = status
            while "result" not in stored:
                if not stored and (refused := await taken_in()) is not None:
                    return refused
                try:
                    event = await _next_terminal(
                        queue, min(deadline_s, loop.time() + STATUS_POLL_S), gone,
                        stop_at_chunk=False)
                except TimeoutError:
                    if loop.time() >= deadline_s:
                        raise
                    stored = await hub.status(request_id) or {}
                    trace_id = trace_id or stored.get("trace_id") or ""
                    continue
                if not trace_id and event is not None:  # it was on its way in: stored since
                    with contextlib.suppress(RedisError):  # the reply goes out without it
                        trace_id = (await hub.status(request_id) or {}).get("trace_id") or ""
                return event
            return RESULT_EVENT.validate_python(stored["result"])

        reply = await answer(request, replace(parsed, request=original), kind, queue,
                             lambda: trace_id, abandoned=None, wait=outcome,
                             was_taken_in=lambda: refused is None)
        accepted.labels(original.priority_class, "replayed" if refused is None
                        else f"http_{refused.status_code}").inc()
        return reply

    async def answer(request: Request, parsed: ParsedRequest, kind: str,
                     queue: asyncio.Queue[Waited], trace_id: Callable[[], str],
                     abandoned: Callable[..., None] | None,
                     wait: WaitOutcome | None = None,
                     was_taken_in: Callable[[], bool] = lambda: True) -> Response:
        """The reply to a request taken in: wait for its first event (`wait(deadline_s,
        gone)` instead, where given), then answer with it or stream from it. `abandoned()`
        runs when the client leaves before the end; `trace_id()` is read once the wait is
        over (a retry may have sent the request itself meanwhile), and `was_taken_in()`:
        False where `wait` answered that the request was not taken in (a replay's 503,
        which its caller counts at the door), no answer to count."""
        req = parsed.request
        started_s = time.monotonic()
        deadline_s = asyncio.get_running_loop().time() + settings.request_timeout_s
        span = trace.get_current_span()  # the request's server span (ServerSpans)

        def observe(outcome: Answered | None) -> None:
            """The wait is over: count how it ended (None: nothing to count here, a
            replay's 503 counted at the door or a fault the 500 handler counts), and say it
            on the request's server span (`gpusched.outcome`)."""
            hub.close(req.request_id, queue)
            if outcome is not None:
                latency.labels(req.priority_class).observe(time.monotonic() - started_s)
                answers.labels(req.priority_class, outcome).inc()
                span.set_attribute("gpusched.outcome", outcome)

        # Wait for the first event before answering, streamed or not: a rejection (429 over
        # quota, 422 fits nowhere) or a failure is then an HTTP status the client acts on.
        # A replay waits for the outcome: the chunks before it went to the first client.
        gone = asyncio.ensure_future(_disconnected(request))
        first: Waited | None
        try:
            first = await (wait(deadline_s, gone) if wait is not None else _next_terminal(
                queue, deadline_s, gone, stop_at_chunk=parsed.stream))
        except TimeoutError:
            first = _timed_out(req.request_id)
        except BaseException:
            observe(None)
            raise
        finally:
            gone.cancel()
        headers = {"x-request-id": req.request_id, "x-trace-id": trace_id()}
        if first is None:
            observe("client_gone")
            if abandoned is not None:
                abandoned()
            return Response(status_code=499, headers=headers)  # nobody reads it
        failed = _error_of(first)
        if failed is not None:
            observe(_answered(first) if was_taken_in() else None)
            if isinstance(first, Rejection) and (wait_s := _retry_after_s(first)) is not None:
                headers["retry-after"] = str(wait_s)  # the openai SDK waits it
            elif isinstance(first, ApiError) and first.status_code == 503:
                # a replay's (Kafka away, or its first use refused), or the router stopping
                headers |= retry_shortly()
            if not _worth_retrying(failed, keyed=IDEMPOTENCY_HEADER in request.headers):
                headers["x-should-retry"] = "false"  # the openai SDK retries 409 and 5xx
            return JSONResponse(failed.body(), status_code=failed.status_code, headers=headers)
        if parsed.stream:  # its first token, or its whole (empty) completion
            return _ClosingStream(
                _sse(parsed, kind, queue, deadline_s, observe, abandoned, first),
                media_type="text/event-stream", headers=headers)
        observe("completed")
        return JSONResponse(_full_response(parsed, kind, first), headers=headers)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await handle(request, parse_completion, "completions")

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await handle(request, parse_chat, "chat/completions")

    @get_and_head(app, "/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "gpusched",
             "parameters_b": m.parameters_b, "weight_memory_mib": m.weight_memory_mib,
             "kv_cache_bytes_per_token": m.kv_cache_bytes_per_token,
             "context_limit_tokens": m.context_limit_tokens}
            for m in catalog.models]}

    @get_and_head(app, "/v1/models/{name:path}")
    async def get_model(name: str) -> Response:
        m = catalog.get(name)
        if m is None:
            return error(ApiError(404, f"model '{name}' does not exist; available models: "
                                  f"{', '.join(catalog.names)}", code="model_not_found"))
        return JSONResponse({"id": m.name, "object": "model", "created": 0,
                             "owned_by": "gpusched"})

    @get_and_head(app, "/v1/requests/{request_id}")
    async def request_status(request_id: str, request: Request) -> Response:
        tenant = await authenticate(request)
        if isinstance(tenant, ApiError):
            return error(tenant)
        status = await hub.status(request_id)
        if status is None or status.get("tenant") != tenant.name:  # none known: nobody's
            return error(ApiError(404, f"request '{request_id}' is unknown (or expired)"))
        return JSONResponse(status)

    @app.post("/v1/requests/{request_id}/cancel")
    async def cancel_request(request_id: str, request: Request) -> Response:
        """Cancel one of the tenant's requests that has not ended: 202 once Kafka has the
        cancel. A waiting request ends unplaced; a running one stops, billed for what it
        produced; either ends 'cancelled' (its waiting client gets 409)."""
        tenant = await authenticate(request)
        if isinstance(tenant, ApiError):
            return error(tenant)
        status = await hub.status(request_id)
        if status is None or status.get("tenant") != tenant.name:
            return error(ApiError(404, f"request '{request_id}' is unknown (or expired)"))
        if "result" in status:
            return error(ApiError(409, f"request '{request_id}' has ended already: "
                                  f"{status['status']}", code="request_ended"))
        sent = send_cancel(request_id, "cancelled by its client", status_span(status))
        done, _ = await asyncio.wait({sent}, timeout=settings.publish_timeout_s)
        if not done or not sent.result():
            return error(_not_taken_in(f"the cancel of request '{request_id}'",
                                       settings.publish_timeout_s, "send it again"),
                         headers=retry_shortly())
        return JSONResponse({**status, "status": "cancelling"}, status_code=202)

    app.state.broker = broker
    app.state.hub = hub
    return app


def _new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def _request_id_of(request: Request) -> str:
    """The id `handle` made for a request at the door; a fresh one where it made none."""
    return getattr(request.state, "request_id", None) or _new_request_id()


def _budget_error(flag: bytes) -> ApiError:
    """429 for a tenant whose budget is spent, with accounting's reason."""
    return ApiError(429, budget_reason(flag), code="insufficient_quota")


async def _disconnected(request: Request) -> None:
    """Returns once the client has hung up (the request body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_terminal(queue: asyncio.Queue[Waited], deadline_s: float,
                         gone: asyncio.Future[None], stop_at_chunk: bool) -> Waited | None:
    """The request's terminal event, or with `stop_at_chunk` its first token chunk if that
    comes first; None once `gone` is done (the client left). Raises TimeoutError at
    `deadline_s` (event loop time)."""
    async with asyncio.timeout_at(deadline_s):
        while True:
            getter = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait((getter, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                taken = getter.done()
                if not taken:  # the client left, or the deadline passed
                    getter.cancel()
            if not taken:
                return None
            event = getter.result()
            if not isinstance(event, TokenChunk) or stop_at_chunk:
                return event


def _retry_after_s(rejection: Rejection) -> int | None:
    """A rejection's Retry-After in seconds: the scheduler's, where it can tell (a
    tokens-per-minute window); for a 429 that names none (the tenant's requests in flight
    are at its limit: room comes when one ends, which nobody can tell) RETRY_SHORTLY_S;
    None for the rest."""
    if rejection.retry_after_s is None and rejection.status_code == 429:
        return RETRY_SHORTLY_S
    return rejection.retry_after_s


def _worth_retrying(failed: ApiError, keyed: bool) -> bool:
    """False where a retry would run the request again for nothing: a 4xx but 408 and 429
    (refused as sent, as an inference engine refuses a prompt longer than its model's
    context, or cancelled: 409), and one still running that the router stopped waiting for
    (504 timed out, 503 shutting down), unless it has an Idempotency-Key (its retry then
    waits for the same request); and where an automatic one only adds load: a request that
    waited past its queue time limit, on a fleet that is full, and one the scheduler
    refused for a spent budget (refused again until the period ends)."""
    return not ((400 <= failed.status_code < 500 and failed.status_code not in (408, 429))
                or failed.code in ("queue_time_exceeded", "insufficient_quota")
                or ((failed.status_code == 504 or failed.code == SHUTTING_DOWN)
                    and not keyed))


def _not_taken_in(what: str, publish_timeout_s: float, what_now: str) -> ApiError:
    return ApiError(503, f"Kafka did not take {what} within {publish_timeout_s:g} s (is Kafka "
                    f"up?); {what_now}")


def _timed_out(request_id: str) -> ApiError:
    return ApiError(504, "no result within the router's wait (GPUSCHED_REQUEST_TIMEOUT_S); "
                    + _runs_on(request_id))


def _shutting_down(request_id: str) -> ApiError:
    return ApiError(503, "this router is shutting down and waits for no more results; "
                    + _runs_on(request_id), code=SHUTTING_DOWN)


def _not_sent() -> ApiError:
    return ApiError(503, "this router is shutting down and takes no new request in; nothing "
                    "was sent, send it again", code=NOT_TAKING)


def _runs_on(request_id: str) -> str:
    """The advice of an answer given while the request still runs: where its outcome is."""
    return f"request {request_id} still runs or waits: poll GET /v1/requests/{request_id}"


def _error_of(event: Waited) -> ApiError | None:
    """A terminal event that is not a completion, as the error a client acts on: the
    rejection's own status, 502 for a request that failed on its node (the executor or its
    engine broke) and the engine's 4xx for one its engine refused as sent, 409 for a
    cancelled one, the router's own answer as it is; None for a completion or a token
    chunk."""
    if isinstance(event, ApiError):
        return event
    if isinstance(event, Rejection):
        return ApiError(event.status_code, event.reason, code=event.code)
    if isinstance(event, RequestResult):
        return _failure(event)
    return None


def _answered(event: Waited | None) -> Answered:
    """How a request ended for its client (`Answered`), by the terminal event it was
    answered with, the router's own answer among them (504 its wait ran out, 503 it
    stopped); None: the client left first."""
    if event is None:
        return "client_gone"
    if isinstance(event, ApiError):
        return "timed_out" if event.status_code == 504 else "router_stopped"
    if isinstance(event, Rejection):
        if event.code == "queue_time_exceeded":
            return "queue_time_exceeded"
        return "over_quota" if event.status_code == 429 else \
            "unschedulable" if event.status_code == 422 else "rejected"
    if isinstance(event, RequestResult) and event.status == "failed":
        return "failed" if event.engine_status_code is None else "engine_refused"
    if isinstance(event, RequestResult) and event.status == "cancelled":
        return "cancelled"
    return "completed"


def _failure(result: RequestResult) -> ApiError | None:
    if result.status == "failed":
        message = (f"request {result.request_id} failed on node {result.node_id}: "
                   f"{result.finish_reason}")
        if result.engine_status_code is None:  # the executor or its engine broke
            return ApiError(502, message)
        # refused as sent: the engine's 4xx, and the code OpenAI clients trim a conversation
        # on where the engine's words say the context ran out
        context = CONTEXT_EXCEEDED.search(result.finish_reason) is not None
        return ApiError(result.engine_status_code, message,
                        code="context_length_exceeded" if context else "engine_refused_request")
    if result.status == "cancelled":  # its reason reads "cancelled: <why>" or "cancelled before"
        return ApiError(409, f"request {result.request_id} was {result.finish_reason}",
                        code="request_cancelled")
    return None


def _usage(result: RequestResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _reply_id(kind: str, request_id: str) -> str:
    """The reply's `id` as OpenAI prefixes it: `cmpl-` for completions, `chatcmpl-` for
    chat."""
    return f"{'cmpl' if kind == 'completions' else 'chatcmpl'}-{request_id}"


def _full_response(parsed: ParsedRequest, kind: str, result: RequestResult) -> dict[str, Any]:
    req = parsed.request
    common = {"id": _reply_id(kind, req.request_id), "created": req.created_at_ms // 1000,
              "model": req.model, "usage": _usage(result)}
    if kind == "completions":
        return {**common, "object": "text_completion", "choices": [
            {"index": 0, "text": result.text, "logprobs": None,
             "finish_reason": result.finish_reason}]}
    return {**common, "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": result.text},
         "logprobs": None, "finish_reason": result.finish_reason}]}


async def _sse(parsed: ParsedRequest, kind: str, queue: asyncio.Queue[Waited],
               deadline_s: float, done: Callable[[Answered], None], abandoned: Any = None,
               first: TokenChunk | RequestResult | None = None) -> AsyncIterator[bytes]:
    """OpenAI's streaming format: one `data:` event per token chunk, then `[DONE]`. `first`
    is the request's first event if the caller took it already; `deadline_s` (event loop
    time) ends the wait with a 504 error event, as the router's stop does with its 503
    (`ResultsHub.stop`). `done(outcome)` runs as the stream ends, with how it ended;
    `abandoned()` when the client leaves before the request's terminal event."""
    ended = False
    outcome: Answered = "client_gone"
    req = parsed.request
    base = {"id": _reply_id(kind, req.request_id), "created": req.created_at_ms // 1000,
            "model": req.model}
    chat = kind != "completions"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(text: str | None, finish: str | None, opening: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if opening else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        payload = {**base, "object": obj, "choices": [choice]}
        if parsed.include_usage:  # as OpenAI: null on every chunk but the last
            payload["usage"] = None
        return _data(payload)

    taken = [first] if first is not None else []

    async def next_event() -> Waited:
        """The deadline bounds only this wait: a timeout scope held across the stream's
        yields would cancel a send that a client slow to read holds up, cutting the stream
        off with no error event and leaving this generator to be closed by the GC."""
        if taken:
            return taken.pop()
        async with asyncio.timeout_at(deadline_s):
            return await queue.get()

    next_stream = 0  # the seq of the next chunk to stream
    streamed: list[str] = []
    seen: dict[int, str] = {}  # seq -> text of every chunk come
    started_over = False
    try:
        if chat:
            yield event("", None, opening=True)
        while True:
            ev = await next_event()
            if isinstance(ev, TokenChunk) and ev.seq in seen:
                if seen[ev.seq] == ev.text:
                    continue  # a copy: an agent sends a record again when Kafka's answer was lost
                # Started over: its node was lost mid-run, and what was streamed is not
                # what the new attempt generates (a preempted one goes on instead). Not
                # ended: the new attempt is cancelled.
                started_over, outcome = True, "started_over"
                yield _error_event(_started_over(req.request_id))
                break
            if isinstance(ev, TokenChunk):
                # Chunks are sent without waiting for Kafka's answer (the request's end
                # is not): one Kafka dropped in an outage leaves a hole in the sequence,
                # and what comes after it waits (for a late chunk, or the result's text).
                seen[ev.seq] = ev.text
                while next_stream in seen:
                    streamed.append(seen[next_stream])
                    yield event(seen[next_stream], None)
                    next_stream += 1
                continue
            ended = True  # the terminal event
            outcome = _answered(ev)
            err = _error_of(ev)
            if err is not None:
                yield _error_event(err)
                break
            sent = "".join(streamed)  # ev is a completed RequestResult from here
            if not ev.text.startswith(sent):
                # a start-over whose chunks Kafka dropped, or that began with the same first
                # chunk: what was streamed is not this text
                outcome = "started_over"
                yield _error_event(_started_over(req.request_id))
                break
            if len(ev.text) > len(sent):
                yield event(ev.text[len(sent):], None)  # what lost chunks held
            yield event(None if chat else "", ev.finish_reason)
            if parsed.include_usage:
                yield _data({**base, "object": obj, "choices": [], "usage": _usage(ev)})
            break
        yield b"data: [DONE]\n\n"
    except TimeoutError:  # the request runs on: its client is told to poll for it
        ended, outcome = True, "timed_out"
        yield _error_event(_timed_out(req.request_id))
        yield b"data: [DONE]\n\n"
    finally:
        done(outcome)
        if not ended and abandoned is not None:
            abandoned("its stream started over: the client was told to send it again"
                      if started_over else "client disconnected")


class _ClosingStream(StreamingResponse):
    """A streamed answer that closes its stream as it ends, however it ends: its client
    gone included, whose leaving interrupts the send (the stream's generator then waits,
    unclosed, at its yield, until the garbage collector closes it). What the stream does
    at its end (say how the request ended, cancel it) thus runs before the request's
    server span ends, and in its trace."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # our _sse


def _error_event(err: ApiError) -> bytes:
    """A stream's error event, its last before [DONE]. A server error (5xx) sets the status
    of the current span ERROR, as an answer with its status would have (ServerSpans): the
    stream is sent under the request's server span, whose 200 went out first."""
    if err.status_code >= 500:
        trace.get_current_span().set_status(StatusCode.ERROR, err.message)
    return _data(err.body())


def _started_over(request_id: str) -> ApiError:
    return ApiError(502, f"request {request_id} started over after its node was lost; the "
                    "text streamed so far is void: send the request again")


def _data(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n".encode()
