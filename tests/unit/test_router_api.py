"""OpenAI-compatible parsing: what the router accepts, and the reasons it gives otherwise;
and how a request that failed reaches its client."""

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import httpx
import pytest
from aiokafka.errors import KafkaTimeoutError
from fastapi import FastAPI
from faststream.kafka import TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from redis.exceptions import RedisError

from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.contracts import InferenceRequest, Rejection, RequestResult, TokenChunk
from gpusched_common.redis_keys import BUDGET_EXHAUSTED_KEY
from gpusched_common.settings import RedisSettings, TelemetrySettings
from gpusched_common.topics import CONTROL, REQUESTS
from gpusched_router.adapters.results import STATUS_KEY, ResultsHub
from gpusched_router.domain.idempotency import FirstUse, check_key, request_digest
from gpusched_router.domain.openai_api import (
    MAX_BODY_DEPTH,
    MAX_QUEUE_HEADER,
    PRIORITY_HEADER,
    ApiError,
    ParsedRequest,
    decode_body,
    parse_chat,
    parse_completion,
)
from gpusched_router.main import (
    _error_of,
    _failure,
    _full_response,
    _shutting_down,
    _sse,
    _worth_retrying,
    create_app,
)
from gpusched_router.settings import RouterSettings

CONFIG = Path(__file__).resolve().parents[2] / "config"
CATALOG = load_models(CONFIG)
ACME = load_tenants(CONFIG).get("acme")


@pytest.fixture(scope="module")
def router_app():
    """The router's HTTP app, not started: what it answers before a request reaches Kafka or
    Redis (neither runs here; Redis's address refuses at once, should a request get that far)."""
    return create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                     redis=RedisSettings(url="redis://127.0.0.1:1/0")))


async def post(app, path: str, body: str | bytes, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # a 500 is an answer too
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post(path, content=body, headers={
            "authorization": "Bearer sk-acme-demo", "content-type": "application/json",
            **headers})


class NoBudgetSpent:
    """Redis as a request's way in reads it: no tenant's budget is spent. Nothing is kept:
    a request's queued status is not stored (the router logs that and goes on)."""

    def register_script(self, script: str) -> None:
        return None

    async def get(self, key: str) -> None:
        return None

    def pipeline(self, **options: object) -> NoReturn:
        raise RedisError("nothing is kept in this test")

    async def set(self, key: str, value: str, **options: object) -> NoReturn:
        raise RedisError("nothing is kept in this test")  # a cancel goes by Kafka alone

    async def aclose(self) -> None:
        return None


def answering(monkeypatch,
              outcome: Callable[[InferenceRequest], Rejection | RequestResult | None],
              trace_sample_ratio: float = 1.0, **settings: object
              ) -> tuple[FastAPI, list[InferenceRequest]]:
    """A router whose requests Kafka takes in and that end in `outcome(request)` (None:
    they never end), and whose cancels it takes; and the list of the requests it
    publishes."""
    monkeypatch.setattr("gpusched_router.main.make_redis", lambda settings: NoBudgetSpent())
    app = create_app(RouterSettings(telemetry=TelemetrySettings(
        otlp_endpoint="", trace_sample_ratio=trace_sample_ratio), **settings))
    published: list[InferenceRequest] = []

    async def publish(message: bytes, topic: str, **options: object) -> None:
        if topic == CONTROL.name:
            return  # a cancel: taken
        request = InferenceRequest.model_validate_json(message)
        published.append(request)
        if (event := outcome(request)) is not None:
            app.state.hub.dispatch([SimpleNamespace(value=event.to_bytes())])

    monkeypatch.setattr(app.state.broker, "publish", publish)
    return app, published


async def refused(monkeypatch, **refusal: object) -> httpx.Response:
    """The router's reply to a completion that Kafka takes in and the scheduler refuses with
    a rejection of `refusal`'s fields."""
    app, _ = answering(monkeypatch, lambda request: Rejection(
        request_id=request.request_id, tenant=request.tenant, **refusal))
    return await post(app, "/v1/completions",
                      json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))


@pytest.mark.parametrize("ratio", [1.0, 0.0])
async def test_x_trace_id_names_a_trace_only_where_it_is_sampled(monkeypatch, ratio) -> None:
    """With GPUSCHED_TRACE_SAMPLE_RATIO below 1, a request whose trace was not sampled got
    the id of a trace Jaeger never receives in `x-trace-id`: the user looked for it in
    vain. Now its `x-trace-id` is empty; a sampled one's names its trace."""
    app, _ = answering(monkeypatch, lambda request: Rejection(
        request_id=request.request_id, tenant=request.tenant, status_code=422,
        reason="fits no node"), trace_sample_ratio=ratio)
    reply = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert reply.status_code == 422
    if ratio:
        assert re.fullmatch("[0-9a-f]{32}", reply.headers["x-trace-id"])
    else:
        assert reply.headers["x-trace-id"] == ""


def completion(body: object, priority: str | None = None, **headers: str):
    if priority is not None:
        headers[PRIORITY_HEADER] = priority
    return parse_completion(body, ACME, headers, CATALOG, "req-1", 1000)


def test_valid_completion_becomes_a_request_in_the_tenants_default_class() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 5})
    assert not isinstance(parsed, ApiError)
    assert parsed.request.tenant == "acme"
    assert parsed.request.priority_class == ACME.default_priority_class
    assert parsed.request.max_tokens == 5 and not parsed.stream


def test_a_request_over_http_runs_on_its_models_gang_size() -> None:
    """HTTP has no num_gpus: the 70B's requests get its models.yaml num_gpus (2), the rest 1.
    Before, a 70B request over HTTP asked for one GPU and was refused with a 422."""
    big = completion({"model": "llama-3.1-70b", "prompt": "hi"}).request
    small = completion({"model": "qwen2.5-1.5b", "prompt": "hi"}).request
    assert (big.num_gpus, small.num_gpus) == (2, 1)


def test_max_completion_tokens_sizes_a_completion_as_it_does_a_chat() -> None:
    """Before, /v1/completions ignored it and answered 16 tokens."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "max_completion_tokens": 5})
    assert parsed.request.max_tokens == 5


def test_sampling_settings_travel_with_the_request() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "temperature": 0,
                         "top_p": 0.5})
    assert (parsed.request.temperature, parsed.request.top_p) == (0, 0.5)
    unset = completion({"model": "qwen2.5-1.5b", "prompt": "hi"}).request
    assert (unset.temperature, unset.top_p) == (None, None)  # the executor's own


@pytest.mark.parametrize("stop,expected", [
    ("\n\n", ["\n\n"]), (["END", "user:"], ["END", "user:"]), ([], None), (None, None),
])
def test_stop_strings_travel_with_the_request_as_a_list(stop: object, expected: object) -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stop": stop})
    assert parsed.request.stop == expected
    chat = parse_chat({"model": "qwen2.5-1.5b", "messages": [{"role": "user", "content": "hi"}],
                       "stop": stop}, ACME, {}, CATALOG, "req-2", 1000)
    assert chat.request.stop == expected


def test_null_n_and_stream_mean_their_defaults() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "x", "n": None, "stream": None})
    assert isinstance(parsed, ParsedRequest) and parsed.stream is False


def test_errors_have_openais_shape_with_a_string_code() -> None:
    parsed = completion({"model": "llama-3.1-8b", "prompt": "tok " * 8000, "max_tokens": 500})
    assert parsed.body()["error"] == {
        "message": parsed.message, "type": "invalid_request_error", "param": "max_tokens",
        "code": "context_length_exceeded"}
    assert ApiError(429, "over quota").body()["error"]["code"] == "rate_limit_exceeded"
    assert ApiError(503, "Kafka away").body()["error"]["type"] == "server_error"


def test_priority_header_overrides_default_class() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi"}, priority="batch")
    assert parsed.request.priority_class == "batch"


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "nope", "prompt": "x"}, 404, "available models"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "qwen2.5-1.5b", "prompt": ["a", "b"]}, 400, "exactly one"),
    ({"model": "qwen2.5-1.5b", "prompt": 5}, 400, "prompt"),
    ({"model": "qwen2.5-1.5b", "prompt": [1, 2, 3]}, 400, "token-id prompts are not supported"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "n": 3}, 400, "send 3 requests"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop: Value should have at most 4 items"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "stop": ""}, 400, "stop.0"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "stop": 7}, 400, "a string or a list of up to 4"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "logprobs": 5}, 400, "log-probabilities"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "echo": True}, 400, "echo the prompt"),
    # the legacy count: 0 still asks for the chosen tokens' log-probabilities
    ({"model": "qwen2.5-1.5b", "prompt": "x", "logprobs": 0}, 400, "log-probabilities"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "modalities": ["text", "audio"]}, 400,
     "text only"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "audio": {"voice": "alloy"}}, 400, "text only"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "stream": True,
      "stream_options": {"include_usage": "no"}}, 400, "stream_options.include_usage"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "best_of": 3}, 400, "one sample per request"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "logit_bias": {"50256": -100}}, 400, "bias"),
    ("a string", 400, "JSON object"),
    ({"model": "llama-3.1-8b", "prompt": "tok " * 8000, "max_tokens": 500}, 400,
     "maximum context length is 8192 tokens"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "seed": 2**64}, 400, "seed"),
    # before, lax parsing took "3" as 3 and true as 1, and max_completion_tokens went unread
    ({"model": "qwen2.5-1.5b", "prompt": "x", "max_tokens": "3"}, 400,
     "max_tokens: Input should be a valid integer"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "best_of": "x"}, 400, "not a positive integer"),
    ({"model": "qwen2.5-1.5b", "prompt": "x", "response_format": "json"}, 400,
     "an object is expected"),
])
def test_bad_completions_get_a_status_and_reason(body: object, status: int, needle: str) -> None:
    parsed = completion(body)
    assert isinstance(parsed, ApiError)
    assert parsed.status_code == status
    assert needle in parsed.message


@pytest.mark.parametrize("path,body,param,surrogate", [
    ("/v1/completions", r'{"model":"qwen2.5-1.5b","prompt":"x\udc00","max_tokens":3}',
     "prompt", r"\udc00"),
    ("/v1/completions", r'{"model":"qwen2.5-1.5b","prompt":"x\udc00","stream":true}',
     "prompt", r"\udc00"),
    ("/v1/completions", b'{"model":"qwen2.5-1.5b","prompt":"x\xed\xb0\x80"}', "prompt",
     r"\udc00"),  # the surrogate's own UTF-8 bytes, which json.loads lets through
    ("/v1/chat/completions", r'{"model":"qwen2.5-1.5b","messages":[{"role":"user",'
     r'"content":"a\ud800b"}],"max_tokens":3}', "messages.0.content", r"\ud800"),
    ("/v1/chat/completions", r'{"model":"qwen2.5-1.5b","messages":[{"role":"user",'
     r'"content":[{"type":"text","text":"\udfff"}]}]}', "messages.0.content.0.text",
     r"\udfff"),
    ("/v1/completions", r'{"model":"qwen2.5-1.5b","prompt":"x","user":"\udc00"}', "user",
     r"\udc00"),
    ("/v1/completions", r'{"model":"qwen2.5-1.5b","prompt":"x","metadata":{"\udc00":1}}',
     "metadata", r"\udc00"),
    ("/v1/completions", r'{"model":"q\udc00","prompt":"x"}', "model", r"\udc00"),
    ("/v1/completions", r'{"model":"qwen2.5-1.5b","prompt":"x","stop":["\udc00"]}',
     "stop.0", r"\udc00"),
])
async def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_its_field(
        router_app, path: str, body: str | bytes, param: str, surrogate: str) -> None:
    """Before, one in the prompt or in chat content was a 500 (encoding it for the token
    count, or validating the chat turn, raised); one in `model` or `stop` was a 400 only
    because their length limits make pydantic encode them."""
    reply = await post(router_app, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith("request body is not valid UTF-8 text:")
    assert f"lone surrogate {surrogate}" in error["message"]


@pytest.mark.parametrize("body,needle", [
    ('{"model":"qwen2.5-1.5b","prompt":"x","user":' + "1" * 5000 + "}",
     "not valid JSON: a number has more than 4300 digits"),
    ('{"model":"qwen2.5-1.5b","prompt":"x","user":' + "[" * 10_000 + "]" * 10_000 + "}",
     f"nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"),
    # within Python's recursion limit, yet refused all the same (before the unknown model):
    # json.dumps of the Idempotency-Key's digest hit that limit a level before json.loads
    ('{"model":"nope","prompt":"x","user":' + "[" * MAX_BODY_DEPTH + "]" * MAX_BODY_DEPTH
     + "}", f"nests arrays and objects more than {MAX_BODY_DEPTH} levels deep"),
])
async def test_a_body_python_cannot_read_whole_is_a_400_not_a_500(
        router_app, body: str, needle: str) -> None:
    """Before, a number over Python's 4,300 digits (ValueError) or a body nested beyond its
    recursion limit (RecursionError), even in an ignored field, was a 500."""
    reply = await post(router_app, "/v1/completions", body, **{"idempotency-key": "k-1"})
    assert reply.status_code == 400
    assert needle in reply.json()["error"]["message"]


def test_a_body_nested_to_the_limit_is_read() -> None:
    def nested(levels: int) -> bytes:  # the object itself is the first level
        return ('{"user":' + "[" * (levels - 1) + "]" * (levels - 1) + "}").encode()

    assert not isinstance(decode_body(nested(MAX_BODY_DEPTH)), ApiError)
    assert isinstance(decode_body(nested(MAX_BODY_DEPTH + 1)), ApiError)


class ScriptsRun:
    """Redis as the results hub writes to it: the key of each script run, in order (run in a
    pipeline, which executes nothing more here)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def register_script(self, script: str) -> Callable[..., Awaitable[None]]:
        async def run(keys: list[str], args: list[object], client: object) -> None:
            self.keys.append(keys[0])
        return run

    @contextlib.asynccontextmanager
    async def pipeline(self, **options: object) -> AsyncIterator[SimpleNamespace]:
        async def execute() -> list[object]:
            return []
        yield SimpleNamespace(execute=execute)


def _nested(opening: bytes, levels: int) -> bytes:
    """A JSON object that opens with `opening` and ends in a field `levels` arrays deep."""
    return opening + b',"x":' + b"[" * levels + b"]" * levels + b"}"


async def test_a_record_nested_past_pythons_recursion_limit_stops_none_of_the_hubs_readers(
        ) -> None:
    """Produced straight to a request topic, a 6 KB record so nested raised RecursionError
    out of store_seen, which skipped only a ValueError: its batch was read again forever, and
    every request behind it went without a queued status (GET 404, cancel impossible). It is
    skipped now, as the scheduler dead-letters it. A result record so nested is skipped as
    well (pydantic reads JSON only so deep)."""
    redis = ScriptsRun()
    hub = ResultsHub(redis, status_ttl_s=60)  # type: ignore[arg-type]
    now_ms = int(time.time() * 1000)

    def on_topic(offset: int, value: bytes) -> SimpleNamespace:
        return SimpleNamespace(topic=REQUESTS["batch"].name, partition=0, offset=offset,
                               timestamp=now_ms, key=None, value=value, headers=())

    request = b'{"tenant":"acme","model":"qwen2.5-1.5b","prompt":"hi"'
    deep = _nested(b'{"request_id":"r-deep",' + request[1:], 3000)
    after = json.dumps({"request_id": "r-after", **json.loads(request + b"}")}).encode()
    await hub.store_seen([on_topic(0, deep), on_topic(1, after)], now_ms)
    assert redis.keys == [STATUS_KEY.format("r-after")]

    result = _nested(b'{"type":"rejection","request_id":"r-deep","status_code":400,'
                     b'"reason":"no"', 3000)
    waiting = hub.open("r-deep")
    hub.dispatch([SimpleNamespace(value=result, key=b"r-deep")])
    await hub.store_finished([SimpleNamespace(value=result, key=b"r-deep")])
    assert waiting.empty() and redis.keys == [STATUS_KEY.format("r-after")]


@pytest.mark.parametrize("content", [
    "a" * 200_001, [{"type": "text", "text": "a" * 100_001}] * 2,
])
def test_chat_content_over_the_prompt_limit_is_a_400_naming_its_message(content) -> None:
    """Before, the chat turn's own length check raised out of the parser: a 500, where a
    prompt as long to /v1/completions was a 400."""
    parsed = parse_chat({"model": "qwen2.5-1.5b", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": content}]},
        ACME, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and parsed.status_code == 400
    assert parsed.param == "messages.1.content"
    assert parsed.message == ("messages.1.content: String should have at most 200000 "
                              "characters")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_request_too_large_for_a_kafka_record_is_a_413_not_a_500(router_app, path
                                                                          ) -> None:
    """130,000 control characters fit every other limit (under 1 MiB of body, 200,000
    characters, the model's context), but as a record a chat carries them twice, 6 bytes each
    in JSON: 1.56 MB, which the Kafka producer refused (a 500)."""
    text = "\x01" * 130_000 if path.endswith("chat/completions") else "\x01" * 120_000
    body = {"model": "qwen2.5-1.5b", "max_tokens": 16} | (
        {"messages": [{"role": "user", "content": text}]} if "chat" in path
        else {"prompt": text})
    r = await post(router_app, path, json.dumps(body))
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "bytes as a Kafka record" in error["message"]
    assert error["param"] == ("messages" if "chat" in path else "prompt")
    fits = completion({"model": "qwen2.5-1.5b", "prompt": "\x01" * 100_000, "max_tokens": 16})
    assert not isinstance(fits, ApiError)  # 600 kB as a record


@pytest.mark.parametrize("message,param,needle", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
     "messages.1.tool_calls", "tool calls are not supported"),
    ({"role": "assistant", "content": "", "function_call": {"name": "f"}},
     "messages.1.function_call", "tool calls are not supported"),
    ({"role": "user"}, "messages.1.content", "a user message needs its content"),
    ({"role": "user", "content": None}, "messages.1.content", "needs its content"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.1.content.0.text",
     "a text part needs its text as a string"),
    ({"role": "user", "content": []}, "messages.1.content",
     "the list of content parts is empty; send one text part at least"),
    ({"role": "tool", "content": "22C", "tool_call_id": "c1"}, "messages.1.role",
     "tool calling is not supported"),
], ids=["tool-calls", "function-call", "no-content", "null-content", "text-part-no-text",
        "no-content-parts", "tool-result"])
def test_chat_turns_that_would_lose_something_are_refused(message, param, needle) -> None:
    """Each was taken: the tool call dropped (published as an empty assistant turn), a user
    turn without content, or with an empty list of parts (which OpenAI refuses), rendered
    as 'user: ', and a text part without text was called a part of an unsupported type. A
    tool result was taken without its tool_call_id, and with no tool call before it (those
    are refused): an orphan, which OpenAI answers 400."""
    parsed = parse_chat({"model": "qwen2.5-1.5b", "messages": [
        {"role": "user", "content": "hi"}, message]}, ACME, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and parsed.status_code == 400
    assert parsed.param == param and needle in parsed.message


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": None}, "prompt", "prompt: Input should be a valid string"),
    ({"prompt": "a" * 200_001}, "prompt",
     "prompt: String should have at most 200000 characters"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "messages.0.content: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": "a" * 120_000}] * 2}, "messages",
     "the conversation rendered as a prompt is 240024 characters; the limit is 200000"),
], ids=["null-prompt", "long-prompt", "content-number", "long-conversation"])
def test_an_error_names_the_field_as_sent(body, param, message) -> None:
    """`param` named pydantic's union branch (`prompt.str`), a prompt's length was counted
    in 'items', and a chat too long as a whole was blamed on `prompt`, which it has not."""
    parse = parse_chat if "messages" in body else parse_completion
    parsed = parse({"model": "qwen2.5-1.5b"} | body, ACME, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and (parsed.param, parsed.message) == (param, message)


def test_unknown_priority_class_is_rejected() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "x"}, priority="urgent")
    assert isinstance(parsed, ApiError) and parsed.status_code == 400


def test_a_request_larger_than_the_tenants_tokens_per_minute_is_refused_for_good() -> None:
    hooli = load_tenants(CONFIG).get("hooli")  # 3,000 tokens per minute
    body = {"model": "qwen2.5-1.5b", "prompt": "x", "max_tokens": 3000}
    parsed = parse_completion(body, hooli, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and parsed.status_code == 400
    assert parsed.code == "tokens_per_minute_exceeded" and parsed.param == "max_tokens"
    assert "(3001 tokens) exceeds tenant 'hooli''s limit of 3000 tokens per minute" in \
        parsed.message
    assert not isinstance(parse_completion({**body, "max_tokens": 2999}, hooli, {}, CATALOG,
                                           "r", 1), ApiError)


def test_a_queue_time_limit_travels_with_the_request() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "x"}, **{MAX_QUEUE_HEADER: "2500"})
    assert parsed.request.max_queue_ms == 2500
    assert completion({"model": "qwen2.5-1.5b", "prompt": "x"}).request.max_queue_ms is None


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon", "", "99999999999", "\u00b2"])
def test_a_bad_queue_time_limit_is_refused_with_its_range(value: str) -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "x"}, **{MAX_QUEUE_HEADER: value})
    assert isinstance(parsed, ApiError) and parsed.status_code == 400
    assert parsed.param == "X-Max-Queue-Ms" and "whole number of milliseconds" in parsed.message


def test_a_bad_queue_time_limit_is_quoted_as_it_was_sent() -> None:
    """HTTP carries header bytes, which Starlette reads as Latin-1: before, Arabic digits came
    back as mojibake ('Ù¡Ù Ù ')."""
    sent = "١٠٠".encode().decode("latin-1")  # ١٠٠ as it arrives
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "x"}, **{MAX_QUEUE_HEADER: sent})
    assert "X-Max-Queue-Ms '١٠٠' is not" in parsed.message


async def test_the_admin_key_is_told_it_is_for_accounting(router_app) -> None:
    """Before, the router answered it 401 'unknown API key', a key it knew."""
    reply = await post(router_app, "/v1/completions", '{"model":"qwen2.5-1.5b","prompt":"x"}',
                       authorization="Bearer sk-admin-demo")
    assert reply.status_code == 403 and "tenant's key" in reply.json()["error"]["message"]


def test_a_chat_request_carries_its_conversation_for_the_engines_template() -> None:
    parsed = parse_chat({"model": "qwen2.5-1.5b", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}, ACME, {}, CATALOG, "req-c", 0)
    assert [(t.role, t.content) for t in parsed.request.messages] == [
        ("system", "be brief"), ("user", "a\nb")]


def test_chat_messages_render_to_one_prompt() -> None:
    parsed = parse_chat({"model": "qwen2.5-1.5b", "max_completion_tokens": 3, "stream": True,
                         "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hello"}]},
                        ACME, {}, CATALOG, "req-2", 1)
    assert not isinstance(parsed, ApiError)
    assert parsed.request.prompt == "system: be brief\nuser: hello\nassistant:"
    assert parsed.request.max_tokens == 3 and parsed.stream


def test_chat_without_messages_is_rejected() -> None:
    parsed = parse_chat({"model": "qwen2.5-1.5b", "messages": []}, ACME, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and "messages" in parsed.message


def test_chat_text_parts_are_joined_as_vllm_joins_them_and_other_parts_refused() -> None:
    """Text parts were joined with nothing between them: "Summarize:" and "The cat sat."
    reached the engine as "Summarize:The cat sat."; vLLM joins them one per line
    (`_parse_chat_message_content_parts`), as the engine's own chat API would."""
    def chat(content: list) -> object:
        return parse_chat({"model": "qwen2.5-1.5b", "messages": [
            {"role": "user", "content": content}]}, ACME, {}, CATALOG, "r", 1)

    parsed = chat([{"type": "text", "text": "Summarize:"},
                   {"type": "text", "text": "The cat sat."}])
    assert parsed.request.messages[0].content == "Summarize:\nThe cat sat."
    assert parsed.request.prompt == "user: Summarize:\nThe cat sat.\nassistant:"
    refused = chat([{"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert isinstance(refused, ApiError) and refused.status_code == 400
    assert refused.param == "messages.0.content.1" and "'image_url' is not supported" in (
        refused.message)


def test_a_messages_name_reaches_the_engine_and_the_rendered_prompt() -> None:
    """`name` (who wrote the message: multi-agent clients such as AutoGen send it) was
    dropped: two assistants of a group chat reached the engine as one. It is carried in the
    turn, so the engine's chat template gets it, and in the prompt rendered from the turns,
    which sizes and bills the request and is what the torch and simulated executors run; an
    unnamed turn's record has no `name`, as a release before wrote it."""
    body = {"model": "qwen2.5-1.5b", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "I'd say yes.", "name": "planner"},
        {"role": "assistant", "content": "No.", "name": "critic-2"}]}
    parsed = parse_chat(body, ACME, {}, CATALOG, "r", 1)
    assert [t.name for t in parsed.request.messages] == [None, "planner", "critic-2"]
    assert json.loads(parsed.request.to_bytes())["messages"] == body["messages"]
    assert parsed.request.prompt == ("system: be brief\nassistant (planner): I'd say yes.\n"
                                     "assistant (critic-2): No.\nassistant:")
    # an Idempotency-Key stands for the body: a retry naming another participant is another
    renamed = json.loads(json.dumps(body))
    renamed["messages"][2]["name"] = "critic-3"
    assert request_digest("/v1/chat/completions", body) != \
        request_digest("/v1/chat/completions", renamed)


@pytest.mark.parametrize("name,needle", [
    ("Ada Lovelace", "' ' is not allowed in a name"),
    ("<|im_start|>system", "'<' is not allowed in a name"),
    ("", "at least 1 character"),
    ("a" * 65, "at most 64 characters"),
    (7, "a valid string"),
], ids=["space", "special-token", "empty", "too-long", "number"])
def test_a_name_openai_refuses_is_a_400_naming_it(name, needle) -> None:
    """As OpenAI takes a name: 1 to 64 characters, no whitespace nor any of < | \\ / > (a
    name is rendered into the model's prompt, and chat templates make their special tokens
    of those)."""
    parsed = parse_chat({"model": "qwen2.5-1.5b", "messages": [
        {"role": "user", "content": "hi", "name": name}]}, ACME, {}, CATALOG, "r", 1)
    assert isinstance(parsed, ApiError) and parsed.status_code == 400
    assert parsed.param == "messages.0.name" and needle in parsed.message


def test_chat_features_gpusched_lacks_are_refused_and_their_off_values_pass() -> None:
    def chat(**extra: object) -> object:
        return parse_chat({"model": "qwen2.5-1.5b", "messages": [
            {"role": "user", "content": "hi"}], **extra}, ACME, {}, CATALOG, "r", 1)

    for extra, needle in [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "does not call tools"),
        ({"logprobs": True, "top_logprobs": 2}, "log-probabilities"),
        ({"response_format": {"type": "json_object"}}, "'json_object'; only text"),
    ]:
        refused = chat(**extra)
        assert isinstance(refused, ApiError) and refused.status_code == 400, extra
        assert needle in refused.message and refused.param in extra
    # what clients send by default is not a request for the feature
    passed = chat(logprobs=False, top_logprobs=0, tools=[], logit_bias={}, best_of=1,
                  echo=None, response_format={"type": "text"}, presence_penalty=0.5,
                  modalities=["text"], audio=None, stream_options={"include_usage": False})
    assert not isinstance(chat(modalities=[]), ApiError)
    assert not isinstance(passed, ApiError)
    assert not isinstance(completion({"model": "qwen2.5-1.5b", "prompt": "x", "logprobs": None,
                                      "modalities": ["text"]}), ApiError)


def test_ignored_openai_fields_are_still_checked_and_web_search_is_refused_even_empty(
        ) -> None:
    """A user probe: "presence_penalty": "x" and "user": 5 passed (OpenAI answers 400), and
    web_search_options {} (which turns OpenAI's search on) ran unsearched."""
    def chat(**extra: object) -> object:
        return parse_chat({"model": "qwen2.5-1.5b", "messages": [
            {"role": "user", "content": "hi"}], **extra}, ACME, {}, CATALOG, "r", 1)

    for extra, param in [({"presence_penalty": "x"}, "presence_penalty"),
                         ({"frequency_penalty": 2.5}, "frequency_penalty"),
                         ({"user": 5}, "user"), ({"store": "yes"}, "store"),
                         ({"metadata": {"k": 1}}, "metadata"),
                         ({"web_search_options": {}}, "web_search_options")]:
        refused = chat(**extra)
        assert isinstance(refused, ApiError) and refused.status_code == 400, extra
        assert refused.param is not None and refused.param.startswith(param), refused
    assert not isinstance(chat(presence_penalty=-2, frequency_penalty=1.5, user="u-1",
                               store=False, metadata={"k": "v"}, service_tier="auto",
                               web_search_options=None), ApiError)


@pytest.mark.parametrize("header, written, values", [
    ("idempotency-key", "Idempotency-Key", ["a", "b"]),
    ("x-priority-class", "X-Priority-Class", ["interactive", "batch"]),
    ("x-max-queue-ms", "X-Max-Queue-Ms", ["100", "100", "900"]),
])
async def test_a_one_value_header_sent_twice_is_a_400(router_app, header, written,
                                                      values) -> None:
    """The first of two values was used, silently: which one the client meant is a guess."""
    transport = httpx.ASGITransport(router_app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        reply = await client.post("/v1/completions", content=json.dumps(
            {"model": "qwen2.5-1.5b", "prompt": "hi"}), headers=[
            ("authorization", "Bearer sk-acme-demo"), ("content-type", "application/json"),
            *[(header, value) for value in values]])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == f"{written} was sent {len(values)} times; send it once"
    assert error["param"] == written


def _result(status: str, finish_reason: str, request_id: str = "req-1",
            **fields: object) -> RequestResult:
    return RequestResult(request_id=request_id, tenant="acme", model="qwen2.5-1.5b",
                         status=status, finish_reason=finish_reason, text=" partial",
                         prompt_tokens=2, completion_tokens=1, node_id="node-1", queued_ms=0,
                         total_ms=5, **fields)


VLLM_CONTEXT = ("inference server answered 400: This model's maximum context length is 8192 "
                "tokens. However, you requested 8296 tokens (8196 in the messages, 100 in the "
                "completion). Please reduce the length of the messages or completion.")
"""A request's reason for failing where vLLM refused its prompt, longer by its tokenizer
than the router's estimate."""


def engine_refused(request_id: str = "req-1", status_code: int = 400,
                   reason: str = VLLM_CONTEXT) -> RequestResult:
    return _result("failed", reason, request_id, engine_status_code=status_code)


def test_a_failed_or_cancelled_request_is_an_error_not_a_reply() -> None:
    failed = _failure(_result("failed", "executor error: inference server unreachable"))
    assert failed.status_code == 502
    assert failed.message == ("request req-1 failed on node node-1: executor error: inference "
                              "server unreachable")
    cancelled = _failure(_result("cancelled", "cancelled: by the operator"))
    assert cancelled.status_code == 409
    assert cancelled.message == "request req-1 was cancelled: by the operator"
    assert _failure(_result("cancelled", "cancelled before it was placed: x")).message == \
        "request req-1 was cancelled before it was placed: x"
    assert _failure(_result("cancelled", "cancelled")).message == "request req-1 was cancelled"
    assert _failure(_result("completed", "stop")) is None


@pytest.mark.parametrize("status_code,reason,code", [
    (400, VLLM_CONTEXT, "context_length_exceeded"),
    (400, "inference server answered 400: The decoder prompt (length 9001) is longer than the "
     "maximum model length of 8192. Make sure that `max_model_len` is no smaller than the "
     "number of text tokens.", "context_length_exceeded"),
    (400, "inference server answered 400: The input (9001 tokens) is longer than the model's "
     "context length (8192 tokens).", "context_length_exceeded"),
    (422, "inference server answered 422: Input validation error: `inputs` tokens + "
     "`max_new_tokens` must be <= 8192. Given: 9000 `inputs` tokens and 64 `max_new_tokens`",
     "context_length_exceeded"),
    (422, "inference server answered 422: Input validation error: `inputs` must have less than "
     "8192 tokens. Given: 9000", "context_length_exceeded"),
    (400, "inference server answered 400: the request exceeds the available context size, try "
     "increasing it", "context_length_exceeded"),
    (400, "inference server answered 400: Conversation roles must alternate user/assistant/"
     "user/assistant/...", "engine_refused_request"),
    (422, "inference server answered 422: Input validation error", "engine_refused_request"),
], ids=["context", "vllm-engine", "sglang", "tgi", "tgi-inputs", "llama.cpp", "chat-template",
        "422"])
def test_a_request_its_engine_refused_is_the_engines_4xx_not_a_502(
        status_code: int, reason: str, code: str) -> None:
    """The engine's refusal was a 502 server_error: the openai SDK sent the doomed request
    twice more (each placed and billed), and the client never saw the 400
    `context_length_exceeded` OpenAI clients trim a conversation on."""
    failed = _failure(engine_refused(status_code=status_code, reason=reason))
    assert failed.status_code == status_code
    assert failed.body()["error"] == {
        "message": f"request req-1 failed on node node-1: {reason}",
        "type": "invalid_request_error", "param": None, "code": code}
    assert not _worth_retrying(failed, keyed=False)
    assert not _worth_retrying(failed, keyed=True)


def test_an_engine_4xx_needs_a_failed_request() -> None:
    with pytest.raises(ValueError, match="engine_status_code is for a failed request"):
        _result("completed", "stop", engine_status_code=400)
    with pytest.raises(ValueError, match="less than or equal to 499"):
        engine_refused(status_code=502)


@pytest.mark.parametrize("failure,kind,code", [
    (_result("failed", "executor error: boom"), "server_error", "server_error"),
    (engine_refused(), "invalid_request_error", "context_length_exceeded"),
], ids=["engine-broke", "engine-refused"])
async def test_a_stream_that_fails_ends_with_an_error_event_not_a_finish_reason(
        failure: RequestResult, kind: str, code: str) -> None:
    """After its first token a stream's status is sent: the error event tells the failure
    apart (a resumed attempt the engine refused: its prompt and the text so far too long)."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(TokenChunk(request_id="req-1", seq=0, text=" partial", token_count=1))
    queue.put_nowait(failure)
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None)]
    payloads = [e.decode().removeprefix("data: ").strip() for e in events]
    assert json.loads(payloads[0])["choices"][0]["text"] == " partial"
    error = json.loads(payloads[1])["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert failure.finish_reason in error["message"]
    assert payloads[2:] == ["[DONE]"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_openai_sdk_gets_an_engines_refusal_once_as_a_bad_request(
        monkeypatch, stream: bool) -> None:
    """With its default retries the SDK sent the request three times (three placements,
    three failures) and raised an InternalServerError; now a BadRequestError with the code
    its client acts on, after one."""
    import openai

    app, published = answering(monkeypatch, lambda request: engine_refused(request.request_id))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                             base_url="http://router/v1")
    async with openai.AsyncOpenAI(api_key="sk-acme-demo", base_url="http://router/v1",
                                  http_client=http, max_retries=2) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model="llama-3.1-8b", max_tokens=100, stream=stream,
                messages=[{"role": "user", "content": " ".join(map(str, range(2000, 6000)))}])
    assert raised.value.code == "context_length_exceeded"
    assert "maximum context length is 8192 tokens" in raised.value.message
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert len(published) == 1


async def test_a_stream_that_starts_over_ends_with_an_error_and_cancels_it() -> None:
    """After its node was lost, a request runs again from the start (seq 0): before, the
    client got that text appended to what it already had."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for seq, text in ((0, " The"), (1, " cat"), (0, " A")):
        queue.put_nowait(TokenChunk(request_id="req-1", seq=seq, text=text, token_count=1))
    cancelled = []
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None,
                                    cancelled.append)]
    payloads = [e.decode().removeprefix("data: ").strip() for e in events]
    assert [json.loads(p)["choices"][0]["text"] for p in payloads[:2]] == [" The", " cat"]
    assert "started over" in json.loads(payloads[2])["error"]["message"]
    assert payloads[3:] == ["[DONE]"]
    assert cancelled == ["its stream started over: the client was told to send it again"]


@pytest.mark.parametrize("chunks,text", [
    (((0, "Hello"), (1, " world")), "Goodbye moon"),  # the new attempt's chunks all lost
    (((0, "Hello"), (1, " world")), "Hello"),  # it began with the same first chunk
    (((0, "A"), (1, "B"), (2, "Z")), "XYZ"),  # some of its chunks lost, one got through
], ids=["chunks-lost", "same-first-chunk", "one-chunk-through"])
async def test_a_result_whose_text_is_not_what_was_streamed_ends_with_an_error(
        chunks, text: str) -> None:
    """A start-over the chunks did not show: the stream ended `stop` with a text that was
    not the request's."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for seq, piece in chunks:
        queue.put_nowait(TokenChunk(request_id="req-1", seq=seq, text=piece, token_count=1))
    queue.put_nowait(_result("completed", "stop").model_copy(update={"text": text}))
    cancelled: list = []
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None,
                                    cancelled.append)]
    payloads = [e.decode().removeprefix("data: ").strip() for e in events]
    assert "started over" in json.loads(payloads[-2])["error"]["message"]
    assert payloads[-1] == "[DONE]" and cancelled == []  # it has ended: nothing to cancel
    assert all(json.loads(p)["choices"][0]["finish_reason"] is None for p in payloads[:-2])


async def test_a_chunk_that_comes_late_is_streamed_and_the_stream_goes_on() -> None:
    """Chunks 0, 2, 1, 3: the late chunk 1 was dropped as a copy and nothing more was
    streamed until the result, which then carried the rest in one event."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for seq in (0, 2, 1, 3):
        queue.put_nowait(TokenChunk(request_id="req-1", seq=seq, text=f" w{seq}",
                                    token_count=1))
    queue.put_nowait(_result("completed", "length").model_copy(
        update={"text": " w0 w1 w2 w3"}))
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None)]
    texts = [json.loads(e.decode().removeprefix("data: "))["choices"][0]["text"]
             for e in events[:-1]]
    assert texts == [" w0", " w1", " w2", " w3", ""]


@pytest.mark.parametrize("seqs", [(0, 1, 1), (0, 0, 1), (0, 1, 0, 1)])
async def test_a_chunk_sent_twice_is_streamed_once_not_taken_for_a_start_over(seqs) -> None:
    """An agent sends a record again when Kafka's answer to it was lost: the copy voided
    the stream, cancelled the request and told the client to send it again (a second run,
    billed twice) though it completed."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for seq in seqs:
        queue.put_nowait(TokenChunk(request_id="req-1", seq=seq, text=f" w{seq}",
                                    token_count=1))
    queue.put_nowait(_result("completed", "stop").model_copy(update={"text": " w0 w1"}))
    cancelled: list = []
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None,
                                    cancelled.append)]
    payloads = [json.loads(p) for p in (e.decode().removeprefix("data: ").strip()
                                        for e in events) if p != "[DONE]"]
    assert "".join(p["choices"][0]["text"] for p in payloads) == " w0 w1"
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop" and cancelled == []


async def test_a_stream_past_its_deadline_tells_the_client_to_poll_and_cancels_nothing(
) -> None:
    """The 504 says the request still runs, but the stream's end cancelled it, as if its
    client had gone ('client disconnected'); the reply without streaming cancels nothing."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(TokenChunk(request_id="req-1", seq=0, text=" a", token_count=1))
    cancelled: list = []
    deadline_s = asyncio.get_running_loop().time() + 0.2
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None,
                                    cancelled.append)]
    assert b"GET /v1/requests/" in events[-2] and events[-1] == b"data: [DONE]\n\n"
    assert cancelled == []


async def test_a_client_slow_to_read_at_the_deadline_still_gets_its_whole_stream() -> None:
    """The deadline bounds the wait for the request's next event, not the sending of one:
    here the first send is held up (a client not reading: the server's transport paused)
    past the deadline while the rest has come. Before, the timeout scope spanned the
    stream's yields and cancelled the held-up send: the stream stopped with no error event
    and no [DONE], and the request was cancelled whenever the GC closed the generator."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(TokenChunk(request_id="req-1", seq=0, text=" a", token_count=1))
    queue.put_nowait(TokenChunk(request_id="req-1", seq=1, text=" b", token_count=1))
    queue.put_nowait(_result("completed", "stop").model_copy(update={"text": " a b"}))
    cancelled: list = []
    deadline_s = asyncio.get_running_loop().time() + 0.1
    events = []
    async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None,
                        cancelled.append):
        events.append(e)
        if len(events) == 1:
            await asyncio.sleep(0.3)  # the send waits for the client
    payloads = [json.loads(e.decode().removeprefix("data: ")) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in payloads) == " a b"
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == b"data: [DONE]\n\n" and cancelled == []


async def test_with_include_usage_every_chunk_but_the_last_says_usage_null() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True,
                         "stream_options": {"include_usage": True}})
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(TokenChunk(request_id="req-1", seq=0, text=" partial", token_count=1))
    queue.put_nowait(_result("completed", "length"))
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None)]
    payloads = [json.loads(e.decode().removeprefix("data: ")) for e in events[:-1]]
    assert [p["usage"] for p in payloads[:-1]] == [None, None]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("chunks", [
    ((0, " The"), (2, " sat")),  # chunk 1 (" cat") lost in a Kafka outage
    ((0, " The"),),              # the last chunks lost: the result comes next
])
async def test_a_stream_missing_a_chunk_still_gives_the_whole_text_once(chunks) -> None:
    """Chunks go to Kafka without waiting for its answer; one that Kafka dropped left a hole
    in the streamed text (before: " The sat"). The rest now comes from the result's text."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for seq, text in chunks:
        queue.put_nowait(TokenChunk(request_id="req-1", seq=seq, text=text, token_count=1))
    queue.put_nowait(_result("completed", "length").model_copy(update={"text": " The cat sat"}))
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "completions", queue, deadline_s, lambda _: None)]
    choices = [json.loads(e.decode().removeprefix("data: "))["choices"][0]
               for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == " The cat sat"
    assert [c["finish_reason"] for c in choices][-1] == "length"


@pytest.mark.parametrize("key,ok", [
    ("3f2b9c1e-7d4a-4f1e-9a55-0c8e2f6b1d20", True), ("k", True), ("k" * 255, True),
    ("", False), ("k" * 256, False), ("kéy", False), ("line\nbreak", False),
])
def test_idempotency_keys_are_short_printable_ascii(key: str, ok: bool) -> None:
    refused = check_key(key)
    assert (refused is None) == ok
    if refused is not None:
        assert refused.status_code == 400 and refused.param == "Idempotency-Key"


def test_a_key_stands_for_its_endpoint_and_body_not_their_spelling() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 5}
    same = request_digest("/v1/completions", json.loads(
        '{ "max_tokens": 5, "prompt": "hi", "model": "m" }'))
    assert request_digest("/v1/completions", body) == same
    assert request_digest("/v1/chat/completions", body) != same
    assert request_digest("/v1/completions", {**body, "max_tokens": 6}) != same


def test_a_retry_that_only_switches_streaming_is_the_same_request() -> None:
    """`stream` and `stream_options` say how the reply is delivered, and a retry gets the
    first use's reply in the form it asks for; before, switching them was a 400
    `idempotency_key_reused`."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 5}
    first = request_digest("/v1/completions", body)
    assert request_digest("/v1/completions", {**body, "stream": True, "stream_options": {
        "include_usage": True}}) == first
    assert request_digest("/v1/completions", {**body, "stream": False}) == first
    assert request_digest("/v1/completions", {**body, "stream": True, "seed": 1}) != first


async def test_a_stored_reply_streams_whole_to_a_retry_that_asks_for_a_stream() -> None:
    """What a retry that switches to streaming gets: its chunks went to the first client,
    so the stored result's text comes as one chunk, then its finish and usage."""
    parsed = parse_chat({"model": "qwen2.5-1.5b", "stream": True,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "hi"}]},
                        ACME, {}, CATALOG, "req-1", 1000)
    result = _result("completed", "length").model_copy(update={"text": " The cat sat"})
    deadline_s = asyncio.get_running_loop().time() + 5
    events = [e async for e in _sse(parsed, "chat/completions", asyncio.Queue(), deadline_s,
                                    lambda _: None, None, result)]
    payloads = [json.loads(e.decode().removeprefix("data: ")) for e in events[:-1]]
    deltas = [p["choices"][0]["delta"] for p in payloads[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": " The cat sat"}, {}]
    assert payloads[2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 1 and events[-1] == b"data: [DONE]\n\n"


def test_a_keys_first_use_reads_back_and_is_taken_over_only_after_its_routers_time() -> None:
    use = FirstUse("req-1", "ab12", 1_000_000)
    assert FirstUse.parse(str(use)) == use
    assert FirstUse.parse("req-1 ab12") == FirstUse("req-1", "ab12", 0)  # older routers
    # a live router takes the request in, or frees the key, within its publish time-out
    # (10 s here) plus a Redis time-out; after that the first use is abandoned
    assert not use.abandoned(1_000_000 + 19_000, publish_timeout_s=10)
    assert use.abandoned(1_000_000 + 21_000, publish_timeout_s=10)


@pytest.mark.parametrize("status,keyed,worth", [
    (409, False, False), (409, True, False),   # cancelled: a retry runs it, or replays 409
    (504, False, False), (504, True, True),    # still running: with a key a retry waits on it
    (503, False, True), (502, False, True),
    (400, False, False), (422, True, False),  # refused as sent: it would be again
    (429, False, True),
])
def test_clients_are_told_not_to_retry_where_it_would_run_the_request_again(
        status: int, keyed: bool, worth: bool) -> None:
    assert _worth_retrying(ApiError(status, "x"), keyed=keyed) == worth


def test_a_router_stopping_has_the_sdk_retry_only_a_request_with_an_idempotency_key() -> None:
    """Its request goes on: a retry without the key would run it a second time; with it,
    the retry waits for the same request at another router."""
    stopping = _shutting_down("req-1")
    assert not _worth_retrying(stopping, keyed=False)
    assert _worth_retrying(stopping, keyed=True)


def test_a_request_past_its_queue_time_limit_is_not_retried_by_the_sdk_on_its_own() -> None:
    """The fleet is full: the client decides when to send it again, not the SDK at once."""
    expired = _error_of(Rejection(request_id="r", status_code=503, reason="waited",
                                  code="queue_time_exceeded"))
    assert expired.body()["error"]["code"] == "queue_time_exceeded"
    assert not _worth_retrying(expired, keyed=False)


@pytest.mark.parametrize("refusal,retry_after", [
    ({"status_code": 429, "reason": "tenant 'acme' has 3 requests in flight, its limit is 3; "
      "retry when some have finished"}, "1"),
    ({"status_code": 429, "reason": "tenant 'acme' is over its limit of 1000 tokens per "
      "minute (900 used, this request needs 200); retry in 40 s", "retry_after_s": 40}, "40"),
    ({"status_code": 422, "reason": "no node of the fleet could ever hold it"}, None),
], ids=["requests-in-flight", "tokens-per-minute", "fits-nowhere"])
async def test_every_429_over_a_quota_says_when_to_retry(monkeypatch, refusal: dict,
                                                         retry_after: str | None) -> None:
    """At its limit of requests in flight the scheduler cannot tell when one ends: that 429
    came with no Retry-After, while the tokens-per-minute one, the spent budget's and
    Redis-away's 503 had one. A refusal that no wait lifts still has none."""
    reply = await refused(monkeypatch, **refusal)
    assert reply.status_code == refusal["status_code"]
    assert reply.json()["error"]["message"] == refusal["reason"]
    assert reply.headers.get("retry-after") == retry_after


async def test_a_503_for_kafka_away_says_when_to_retry(monkeypatch) -> None:
    """Kafka did not take a request, or a cancel, in time: those 503s came with no
    Retry-After, while Redis-away's had `Retry-After: 1`; both mean "try again shortly"."""
    monkeypatch.setattr("gpusched_router.main.make_redis", lambda settings: NoBudgetSpent())
    app = create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint="")))

    async def refused(message: bytes, topic: str, **options: object) -> NoReturn:
        raise KafkaTimeoutError  # as aiokafka gives up; the router's own time-out is alike

    async def queued(request_id: str) -> dict:
        return {"status": "queued", "tenant": "acme"}

    monkeypatch.setattr(app.state.broker, "publish", refused)
    monkeypatch.setattr(app.state.hub, "status", queued)
    taken = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    cancel = await post(app, "/v1/requests/r-42/cancel", "")
    for reply in (taken, cancel):
        assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1")
        assert reply.json()["error"]["message"].startswith("Kafka did not take")


class DoorRedis(NoBudgetSpent):
    """Redis as a request's way in reads it, with a budget spent for the tenants in `spent`,
    or away altogether (`away`); a cancel's flag is taken and dropped."""

    def __init__(self) -> None:
        self.spent: set[str] = set()
        self.away = False

    async def get(self, key: str) -> bytes | None:
        if self.away:
            raise RedisError("connection refused")
        spent = key in {BUDGET_EXHAUSTED_KEY.format(t) for t in self.spent}
        return b'{"reason": "tenant acme has spent its day budget"}' if spent else None

    async def pttl(self, key: str) -> int:
        return 60_000

    async def set(self, key: str, value: str, **options: object) -> None:
        return None


async def test_every_answer_at_the_door_names_its_request(monkeypatch) -> None:
    """The answers refused at the door (400, 401, 404, 413, the spent budget's 429, Kafka's
    and Redis's 503, a 500) had no `x-request-id`: the openai SDK's `e.request_id` was None,
    though Kafka's 503 had made a request id and sent its cancel under it. Each names its
    request now: the one it had, else a fresh one."""
    redis = DoorRedis()
    monkeypatch.setattr("gpusched_router.main.make_redis", lambda settings: redis)
    app = create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                    max_body_bytes=2048))
    cancelled: list[str] = []

    async def publish(message: bytes, topic: str, **options: object) -> None:
        if topic != CONTROL.name:
            raise KafkaTimeoutError  # as aiokafka gives up
        cancelled.append(json.loads(message)["request_id"])

    monkeypatch.setattr(app.state.broker, "publish", publish)
    hi = {"model": "qwen2.5-1.5b", "messages": [{"role": "user", "content": "hi"}]}

    async def answer(body: dict | str, status: int, **headers: str) -> str:
        reply = await post(app, "/v1/chat/completions",
                           body if isinstance(body, str) else json.dumps(body), **headers)
        assert reply.status_code == status, reply.text
        assert re.fullmatch(r"req-[0-9a-f]{32}", reply.headers.get("x-request-id", "")), status
        return reply.headers["x-request-id"]

    named = [
        await answer(hi, 401, authorization="Bearer sk-nobody"),
        await answer("{", 400),
        await answer({**hi, "model": "gpt-17"}, 404),
        await answer({**hi, "stop": "x" * 4000}, 413),
    ]
    redis.spent.add("acme")
    named.append(await answer(hi, 429))
    redis.spent.clear()
    redis.away = True
    named.append(await answer(hi, 503))
    redis.away = False
    with monkeypatch.context() as broken:
        broken.setattr("gpusched_router.main.parse_chat", lambda *args: 1 / 0)
        named.append(await answer(hi, 500))
    kafka_away = await answer(hi, 503)
    for _ in range(10):  # the cancel goes out on its own
        await asyncio.sleep(0)
    assert cancelled == [kafka_away]  # the id its cancel went out under
    assert len({*named, kafka_away}) == len(named) + 1


async def test_the_schedulers_429_for_a_spent_budget_is_not_retried_by_the_sdk(
        monkeypatch) -> None:
    """A request produced before its tenant's budget was spent, refused by the scheduler
    once it was: refused again until the period ends, so the openai SDK must not send it
    again on its own a second later, as it does a rate limit's 429."""
    reason = "tenant 'acme' has spent its day budget; new requests are accepted again from ..."
    reply = await refused(monkeypatch, status_code=429, code="insufficient_quota",
                          reason=reason, retry_after_s=3600)
    assert reply.status_code == 429
    assert (reply.headers["retry-after"], reply.headers["x-should-retry"]) == ("3600", "false")
    assert reply.json()["error"] == {"message": reason, "type": "insufficient_quota",
                                     "param": None, "code": "insufficient_quota"}


async def test_a_rejection_is_readable_only_by_its_own_tenant(router_app, monkeypatch) -> None:
    """GET /v1/requests/{id} answers only the tenant the status names. A rejection of a
    request produced straight to Kafka was stored without its tenant, and a status with
    none was shown to every tenant: another tenant's quota and prompt size, by a guessable
    id ('r-42'). Its tenant is stored now, and a status naming none is nobody's."""
    from gpusched_router.adapters.results import _status_fields

    refused = Rejection(request_id="r-42", tenant="globex", status_code=429,
                        reason="tenant 'globex' is over its limit of 1000 tokens per minute")
    fields = _status_fields(refused)
    assert fields["tenant"] == "globex" and fields["status"] == "rejected"
    assert "tenant" not in _status_fields(refused.model_copy(update={"tenant": None}))

    stored: dict = {}

    async def status(request_id: str) -> dict | None:
        return stored.get(request_id)

    monkeypatch.setattr(router_app.state.hub, "status", status)
    transport = httpx.ASGITransport(router_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        async def read(key: str) -> int:
            reply = await client.get("/v1/requests/r-42",
                                     headers={"authorization": f"Bearer {key}"})
            return reply.status_code

        stored["r-42"] = {"status": "rejected", "result": {"reason": "..."}}  # none named
        assert (await read("sk-acme-demo"), await read("sk-globex-demo")) == (404, 404)
        stored["r-42"] = {**stored["r-42"], "tenant": "globex"}
        assert (await read("sk-acme-demo"), await read("sk-globex-demo")) == (404, 200)


@pytest.mark.parametrize("path,status", [
    ("/v1/models", 200), ("/v1/models/qwen2.5-1.5b", 200), ("/v1/models/nope", 404),
    ("/v1/requests/r-42", 200), ("/v1/requests/r-43", 404),
])
async def test_head_answers_as_get_does_without_the_body(router_app, monkeypatch, path: str,
                                                         status: int) -> None:
    """OpenAI clients and load balancers probe with HEAD: every read answered 405. The
    schema still names each read once (HEAD beside GET would repeat its operation id)."""
    async def stored(request_id: str) -> dict | None:
        return {"status": "queued", "tenant": "acme"} if request_id == "r-42" else None

    monkeypatch.setattr(router_app.state.hub, "status", stored)
    transport = httpx.ASGITransport(router_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router",
                                 headers={"authorization": "Bearer sk-acme-demo"}) as client:
        got, head = await client.get(path), await client.head(path)
        schema = (await client.get("/openapi.json")).json()
    assert (got.status_code, head.status_code, head.content) == (status, status, b"")
    assert head.headers == got.headers  # content-length too: what GET's body weighs
    assert not any("head" in operations for operations in schema["paths"].values())


async def test_reply_ids_are_prefixed_as_openai_prefixes_them() -> None:
    """cmpl- for completions, chatcmpl- for chat, streamed or not (chat said cmpl-)."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    for kind, prefix in (("completions", "cmpl-"), ("chat", "chatcmpl-")):
        assert _full_response(parsed, kind, _result("completed", "stop"))["id"] == \
            f"{prefix}req-1"
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_result("completed", "stop"))
        deadline_s = asyncio.get_running_loop().time() + 5
        events = [e async for e in _sse(parsed, kind, queue, deadline_s, lambda _: None)]
        assert json.loads(events[0].decode().removeprefix("data: "))["id"] == f"{prefix}req-1"


async def test_answers_with_redis_away_are_counted_as_the_5xx_they_are(router_app) -> None:
    """The server-errors alert reads the router's requests by outcome: a 503 for Redis away
    was not counted, so a whole Redis outage left the alert's ratio at zero."""
    reply = await post(router_app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert reply.status_code == 503 and "Redis is unavailable" in reply.text
    transport = httpx.ASGITransport(router_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        metrics = (await client.get("/metrics")).text
    served = re.search(r'gpusched_router_requests_total\{outcome="http_503",'
                       r'priority_class="unknown"\} ([0-9.]+)', metrics)
    assert served is not None and float(served.group(1)) >= 1


async def test_a_client_that_hangs_up_mid_upload_is_no_server_error(router_app) -> None:
    """A client's time-out while it still sent its body was logged as an error and counted
    as a 500, which the server-errors alert reads."""
    body = json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi " * 10_000}).encode()
    received = [{"type": "http.request", "body": body[:20], "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await router_app({
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "server": ("router", 80),
        "client": ("127.0.0.1", 5000),
        "headers": [(b"authorization", b"Bearer sk-acme-demo"),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]}, receive, send)
    [start] = [m for m in sent if m["type"] == "http.response.start"]
    assert start["status"] == 499


def test_a_spent_budgets_429_has_openais_insufficient_quota_type() -> None:
    """As OpenAI's own: clients telling a spent quota from a rate limit read `type` too."""
    error = ApiError(429, "the day budget is spent", code="insufficient_quota").body()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert ApiError(429, "over tokens per minute").body()["error"]["type"] == \
        "invalid_request_error"


async def test_a_request_whose_body_comes_after_the_drain_is_not_sent(monkeypatch) -> None:
    """A request that reached the router after its drain (a slow upload) was published and
    ran, billed, while its client was told 503 `router_shutting_down` not to retry. Now it
    is not sent: a 503 the client may retry at once, elsewhere."""
    app, published = answering(monkeypatch, lambda request: Rejection(
        request_id=request.request_id, tenant=request.tenant, status_code=422, reason="no"))
    app.state.hub.stop(lambda request_id: ApiError(503, "stopped"))
    reply = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert published == [] and reply.status_code == 503
    assert reply.json()["error"]["code"] == "router_not_taking_requests"
    assert "nothing was sent, send it again" in reply.json()["error"]["message"]
    assert reply.headers["retry-after"] == "1" and "x-should-retry" not in reply.headers


async def test_a_stopped_router_answers_every_client_it_still_waits_on(monkeypatch) -> None:
    """Stopped (SIGTERM: a rollout), the router waited for its clients' requests until the
    grace period's SIGKILL cut them off with no answer, no status and no `x-request-id`,
    and the openai SDK sent them again (a second run). Now, on the real server: a request
    that ends within the drain time-out is answered as ever; past it, a client still waiting
    gets a 503 naming its request, which goes on (nothing is cancelled), a stream under way
    an error event; and the server exits."""
    import uvicorn

    from gpusched_common.web import Server

    monkeypatch.setattr("gpusched_router.main.make_redis", lambda settings: NoBudgetSpent())
    app = create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                    router_drain_s=0.5))
    published: dict[str, InferenceRequest] = {}  # by prompt
    cancels: list[bytes] = []

    async def publish(message: bytes, topic: str, **options: object) -> None:
        if topic not in {spec.name for spec in REQUESTS.values()}:
            cancels.append(message)
            return
        request = InferenceRequest.model_validate_json(message)
        published[request.prompt] = request
        if request.prompt == "streamed":  # under way: its first token is out
            app.state.hub.dispatch([SimpleNamespace(value=TokenChunk(
                request_id=request.request_id, seq=0, text=" a", token_count=1).to_bytes())])

    monkeypatch.setattr(app.state.broker, "publish", publish)
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off",
                                   log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={
                    "authorization": "Bearer sk-acme-demo"}) as client:
                def body(prompt: str, stream: bool = False) -> dict:
                    return {"model": "qwen2.5-1.5b", "prompt": prompt, "max_tokens": 3,
                            "stream": stream}

                async def streamed() -> list[str]:
                    async with client.stream("POST", "/v1/completions",
                                             json=body("streamed", True)) as reply:
                        assert reply.status_code == 200
                        return [line async for line in reply.aiter_lines() if line]

                replies = [asyncio.create_task(client.post("/v1/completions", json=body(p)))
                           for p in ("ends in time", "runs on")]
                stream = asyncio.create_task(streamed())
                while len(published) < 3:
                    await asyncio.sleep(0.01)
                server.should_exit = True  # as SIGTERM does
                while server.servers[0].is_serving():
                    await asyncio.sleep(0.01)
                with pytest.raises(httpx.ConnectError):  # stopped, it takes no new request
                    await client.get("/v1/models")
                done = published["ends in time"].request_id
                app.state.hub.dispatch([SimpleNamespace(value=_result(
                    "completed", "length", done).to_bytes())])
                in_time, runs_on = [await reply for reply in replies]
                events = await stream
            await serving  # the server ends once its clients are answered
    finally:
        server.force_exit = True
        await serving
    assert in_time.status_code == 200 and in_time.json()["choices"][0]["text"] == " partial"
    request_id = published["runs on"].request_id
    assert runs_on.status_code == 503
    assert runs_on.headers["x-request-id"] == request_id
    assert (runs_on.headers["retry-after"], runs_on.headers["x-should-retry"]) == ("1", "false")
    error = runs_on.json()["error"]
    assert error["code"] == "router_shutting_down"
    assert f"GET /v1/requests/{request_id}" in error["message"]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == " a"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "router_shutting_down"
    assert published["streamed"].request_id in error["message"]
    assert events[2:] == ["data: [DONE]"]
    assert cancels == []


async def served(app: FastAPI, name: str) -> dict[tuple[str, str], float]:
    """The router's counter `name` as /metrics serves it: (priority_class, outcome) ->
    count."""
    from prometheus_client.parser import text_string_to_metric_families

    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        text = (await client.get("/metrics")).text
    return {(s.labels["priority_class"], s.labels["outcome"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


@pytest.mark.parametrize("outcome,status,answered", [
    (lambda r: _result("completed", "length", r.request_id), 200, "completed"),
    (lambda r: Rejection(request_id=r.request_id, status_code=429, reason="over quota"), 429,
     "over_quota"),
    (lambda r: Rejection(request_id=r.request_id, status_code=422, reason="fits no node"), 422,
     "unschedulable"),
    (lambda r: Rejection(request_id=r.request_id, status_code=503, reason="waited too long",
                         code="queue_time_exceeded"), 503, "queue_time_exceeded"),
    (lambda r: Rejection(request_id=r.request_id, status_code=404, reason="no such model"),
     404, "rejected"),
    (lambda r: _result("failed", "executor error: boom", r.request_id), 502, "failed"),
    (lambda r: engine_refused(r.request_id), 400, "engine_refused"),
    (lambda r: _result("cancelled", "cancelled: by its client", r.request_id), 409,
     "cancelled"),
    (lambda r: None, 504, "timed_out"),
], ids=["completed", "429", "422", "expired", "404", "502", "engine-4xx", "409", "504"])
async def test_how_each_request_taken_in_ended_is_counted(monkeypatch, outcome, status: int,
                                                          answered: str) -> None:
    """The router counted a request at its door only (`accepted`): a request taken in that
    then failed on its node (502), or that the router stopped waiting for (504), was
    counted nowhere, and no alert could see requests taken in and never answered. Each
    answer to a request taken in is counted now, by class and how it ended; every series
    is served from the start, at 0, so a first failure is an increase()."""
    app, published = answering(monkeypatch, outcome, request_timeout_s=0.2)
    before = await served(app, "gpusched_router_answers_total")
    assert len(before) == 3 * 12 and not any(before.values())
    reply = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert reply.status_code == status
    after = await served(app, "gpusched_router_answers_total")
    [request] = published
    assert {key: n for key, n in after.items() if n} == {(request.priority_class, answered): 1}
    assert {key: n for key, n in (await served(app, "gpusched_router_requests_total")).items()
            if n} == {(request.priority_class, "accepted"): 1}


def _chunk(seq: int, text: str) -> TokenChunk:
    return TokenChunk(request_id="req-1", seq=seq, text=text, token_count=1)


@pytest.mark.parametrize("events,answered", [
    ([_chunk(0, " partial"), _result("completed", "length")], "completed"),
    ([_chunk(0, " partial"), _result("failed", "executor error: boom")], "failed"),
    ([_chunk(0, " partial"), _result("cancelled", "cancelled: by its client")], "cancelled"),
    ([_chunk(0, " a"), _chunk(0, " b")], "started_over"),
    ([_chunk(0, " other"), _result("completed", "length")], "started_over"),
    ([_chunk(0, " partial"), _shutting_down("req-1")], "router_stopped"),
    ([_chunk(0, " partial")], "timed_out"),
], ids=["completed", "failed", "cancelled", "started-over", "other-text", "router-stopped",
        "timed-out"])
async def test_a_stream_says_how_it_ended_once(events: list, answered: str) -> None:
    """A streamed request's end comes after its 200: the stream tells the router how."""
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    ended: list[str] = []
    deadline_s = asyncio.get_running_loop().time() + 0.2
    [e async for e in _sse(parsed, "completions", queue, deadline_s, ended.append)]
    assert ended == [answered]


async def test_a_stream_its_client_leaves_is_counted_as_client_gone() -> None:
    parsed = completion({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True})
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(_chunk(0, " partial"))
    ended: list[str] = []
    stream = _sse(parsed, "completions", queue, asyncio.get_running_loop().time() + 5,
                  ended.append, lambda why: None)
    await anext(stream)
    await stream.aclose()  # the client hung up
    assert ended == ["client_gone"]


async def test_a_replays_503_for_a_request_never_taken_in_is_counted_as_a_503(
        monkeypatch) -> None:
    """A retry with an Idempotency-Key whose first use was refused before it ran (or that
    Kafka did not take when the retry sent it) is answered 503, as a request Kafka did not
    take is: it was counted as `replayed` only, so the server-errors alert, which reads the
    router's 503s, did not see a Kafka outage that only retries met."""
    from gpusched_router.adapters.idempotency import IdempotencyKeys

    body = {"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}
    app, published = answering(monkeypatch, lambda request: None)

    async def claimed(self, tenant: str, key: str, use: FirstUse) -> FirstUse:
        return FirstUse("req-first", request_digest("/v1/completions", body), 1000)

    async def no_holder(self, tenant: str, key: str) -> None:
        return None  # the first use's router freed the key: it was refused

    async def no_status(request_id: str) -> None:
        return None

    monkeypatch.setattr(IdempotencyKeys, "claim", claimed)
    monkeypatch.setattr(IdempotencyKeys, "holder", no_holder)
    monkeypatch.setattr(app.state.hub, "status", no_status)
    reply = await post(app, "/v1/completions", json.dumps(body), **{"idempotency-key": "k-1"})
    assert reply.status_code == 503 and "was refused before it ran" in reply.text
    assert published == []
    at_door = {key: n for key, n in (await served(app, "gpusched_router_requests_total")
                                     ).items() if n}
    assert at_door == {(completion(body).request.priority_class, "http_503"): 1}
    assert not any((await served(app, "gpusched_router_answers_total")).values())


async def test_a_replay_of_a_stored_outcome_is_counted_replayed_and_answered(
        monkeypatch) -> None:
    from gpusched_router.adapters.idempotency import IdempotencyKeys

    body = {"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}
    app, published = answering(monkeypatch, lambda request: None)

    async def claimed(self, tenant: str, key: str, use: FirstUse) -> FirstUse:
        return FirstUse("req-first", request_digest("/v1/completions", body), 1000)

    async def ended(request_id: str) -> dict:
        return {"status": "failed", "tenant": "acme", "result": json.loads(
            _result("failed", "executor error: boom", request_id).to_bytes())}

    monkeypatch.setattr(IdempotencyKeys, "claim", claimed)
    monkeypatch.setattr(app.state.hub, "status", ended)
    reply = await post(app, "/v1/completions", json.dumps(body), **{"idempotency-key": "k-1"})
    assert reply.status_code == 502 and published == []
    counted = [{key: n for key, n in (await served(app, name)).items() if n}
               for name in ("gpusched_router_requests_total", "gpusched_router_answers_total")]
    cls = completion(body).request.priority_class
    assert counted == [{(cls, "replayed"): 1}, {(cls, "failed"): 1}]


async def test_only_requests_at_the_door_are_counted_there() -> None:
    """Status reads, cancels and model lookups counted their 401s, 404s and Redis-away 503s
    as requests at the door, so clients polling expired ids (or any read in a Redis outage)
    moved the server-errors alert's ratio though no completion was refused."""
    app = create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                    redis=RedisSettings(url="redis://127.0.0.1:1/0")))
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    key = {"authorization": "Bearer sk-acme-demo"}
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        answers = [(await client.get("/v1/models/nope")).status_code,
                   (await client.get("/v1/requests/abc")).status_code,
                   (await client.get("/v1/requests/abc", headers=key)).status_code,
                   (await client.post("/v1/requests/abc/cancel", headers=key)).status_code]
        assert answers == [404, 401, 503, 503]
        assert await served(app, "gpusched_router_requests_total") == {}
        await client.post("/v1/completions", headers=key, json={"model": "nope"})
    assert await served(app, "gpusched_router_requests_total") == {("unknown", "http_400"): 1}


def traced(monkeypatch, tracer_provider: TracerProvider) -> None:
    """Routers made from now on send their spans to `tracer_provider` (the test's
    `span_exporter`)."""
    monkeypatch.setattr("gpusched_router.main.make_tracer_provider",
                        lambda service, settings: tracer_provider)


def server_span(span_exporter: InMemorySpanExporter) -> ReadableSpan:
    """The one server span ended: the request's."""
    [span] = [s for s in span_exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    return span


async def test_a_requests_server_span_lasts_until_its_answer(
        monkeypatch, tracer_provider: TracerProvider,
        span_exporter: InMemorySpanExporter) -> None:
    """The router's server span ended once Kafka had the request, without the HTTP
    attributes OpenTelemetry's conventions require: the wait for the result and how it
    ended never reached Jaeger. It lasts until the answer has gone out now, and says it."""
    traced(monkeypatch, tracer_provider)
    app, published = answering(monkeypatch, lambda request: None)
    replying = asyncio.create_task(post(app, "/v1/completions", json.dumps(
        {"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3})))
    while not published:
        await asyncio.sleep(0.01)
    [request] = published
    result_at_ns = time.time_ns()
    app.state.hub.dispatch([SimpleNamespace(value=_result(
        "completed", "length", request.request_id).to_bytes())])
    reply = await replying
    assert reply.status_code == 200
    span = server_span(span_exporter)
    assert span.name == "POST /v1/completions" and span.end_time >= result_at_ns
    assert format(span.context.trace_id, "032x") == reply.headers["x-trace-id"]
    assert dict(span.attributes) == {
        "http.request.method": "POST", "http.route": "/v1/completions",
        "url.path": "/v1/completions", "url.scheme": "http",
        "http.response.status_code": 200, "gpusched.request_id": request.request_id,
        "gpusched.tenant": "acme", "gpusched.priority_class": request.priority_class,
        "gpusched.model": "qwen2.5-1.5b", "gpusched.outcome": "completed"}
    assert span.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("outcome,status,error", [
    (lambda r: None, 504, True),
    (lambda r: _result("failed", "executor error: boom", r.request_id), 502, True),
    (lambda r: Rejection(request_id=r.request_id, status_code=429, reason="over quota"), 429,
     False),
    (lambda r: _result("cancelled", "cancelled: by its client", r.request_id), 409, False),
], ids=["504", "502", "429", "409"])
async def test_a_server_error_marks_its_requests_span_an_error_and_a_client_error_does_not(
        monkeypatch, tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter,
        outcome, status: int, error: bool) -> None:
    """As OpenTelemetry's conventions say of a server span: a 5xx sets its status ERROR
    (Jaeger shows it failed), a 4xx is the client's and leaves it unset."""
    traced(monkeypatch, tracer_provider)
    app, _ = answering(monkeypatch, outcome, request_timeout_s=0.2)
    reply = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert reply.status_code == status
    span = server_span(span_exporter)
    assert span.attributes["http.response.status_code"] == status
    assert span.attributes["gpusched.request_id"] == reply.headers["x-request-id"]
    assert span.status.status_code is (StatusCode.ERROR if error else StatusCode.UNSET)
    assert span.attributes.get("error.type") == (str(status) if error else None)


async def test_a_request_refused_at_the_door_has_its_span_with_its_status(
        monkeypatch, tracer_provider: TracerProvider,
        span_exporter: InMemorySpanExporter) -> None:
    """A refusal at the door (a bad body: 400) made no span at all, nor did a fault (500)."""
    traced(monkeypatch, tracer_provider)
    app, published = answering(monkeypatch, lambda request: None)
    reply = await post(app, "/v1/chat/completions", json.dumps({"model": "qwen2.5-1.5b"}))
    assert reply.status_code == 400 and published == []
    span = server_span(span_exporter)
    assert span.name == "POST /v1/chat/completions"
    assert span.attributes["http.route"] == "/v1/chat/completions"
    assert span.attributes["http.response.status_code"] == 400
    assert span.attributes["gpusched.request_id"] == reply.headers["x-request-id"]
    assert span.status.status_code is StatusCode.UNSET
    span_exporter.clear()
    monkeypatch.setattr("gpusched_router.main.parse_chat", lambda *args: 1 / 0)
    reply = await post(app, "/v1/chat/completions", json.dumps({"model": "qwen2.5-1.5b"}))
    assert reply.status_code == 500
    span = server_span(span_exporter)
    assert span.attributes["http.response.status_code"] == 500
    assert span.attributes["error.type"] == "ZeroDivisionError"
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


async def test_a_stream_that_fails_marks_its_requests_span_an_error(
        monkeypatch, tracer_provider: TracerProvider,
        span_exporter: InMemorySpanExporter) -> None:
    """A stream's 200 goes out with its first token: a failure after it is told in an error
    event, and is the server's error all the same."""
    traced(monkeypatch, tracer_provider)

    def fails_midway(request: InferenceRequest) -> RequestResult:
        app.state.hub.dispatch([SimpleNamespace(value=_chunk(0, " partial").model_copy(
            update={"request_id": request.request_id}).to_bytes())])
        return _result("failed", "executor error: boom", request.request_id)

    app, _ = answering(monkeypatch, fails_midway)
    reply = await post(app, "/v1/completions", json.dumps(
        {"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3, "stream": True}))
    assert reply.status_code == 200 and '"error"' in reply.text
    span = server_span(span_exporter)
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["gpusched.outcome"] == "failed"
    assert span.status.status_code is StatusCode.ERROR
    assert "executor error: boom" in span.status.description


async def test_a_stream_its_client_leaves_ends_its_span_having_said_so(
        monkeypatch, tracer_provider: TracerProvider,
        span_exporter: InMemorySpanExporter) -> None:
    """A client that leaves while a chunk is being sent to it (held up: it read slowly)
    interrupts the send, which left the stream's generator unclosed at its yield: how the
    request ended, and its cancel, waited for the garbage collector, after the request's
    span had ended. The stream is closed as its answer ends now: the span ends, once,
    saying the client has gone, and the cancel goes out in the request's trace."""
    traced(monkeypatch, tracer_provider)

    def two_chunks(request: InferenceRequest) -> None:
        app.state.hub.dispatch([SimpleNamespace(value=_chunk(seq, text).model_copy(
            update={"request_id": request.request_id}).to_bytes())
            for seq, text in enumerate((" a", " b"))])

    app, _ = answering(monkeypatch, two_chunks)
    body = json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "stream": True}).encode()
    incoming = [{"type": "http.request", "body": body, "more_body": False}]
    held_up = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await held_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) == 2:
            held_up.set()  # the second chunk waits on the client, which leaves
            await asyncio.Event().wait()

    await app({"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
               "method": "POST", "scheme": "http", "path": "/v1/completions",
               "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
               "headers": [(b"authorization", b"Bearer sk-acme-demo"),
                           (b"content-type", b"application/json")],
               "client": ("127.0.0.1", 1), "server": ("router", 80)}, receive, send)
    span = server_span(span_exporter)  # ended as the answer did
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["gpusched.outcome"] == "client_gone"
    headers = dict(sent[0]["headers"])
    assert format(span.context.trace_id, "032x") == headers[b"x-trace-id"].decode()
    for _ in range(10):  # the cancel goes out on its own
        await asyncio.sleep(0)
    [cancel] = [s for s in span_exporter.get_finished_spans() if s.name == "cancel"]
    assert cancel.parent.span_id == span.context.span_id
    assert dict(cancel.attributes) == {"gpusched.request_id": headers[b"x-request-id"].decode(),
                                       "gpusched.cancel_reason": "client disconnected"}


async def test_the_cancel_of_a_request_kafka_did_not_take_goes_in_its_trace(
        monkeypatch, tracer_provider: TracerProvider,
        span_exporter: InMemorySpanExporter) -> None:
    """The router's cancels were published with no span open: FastStream began a trace of
    its own with each, which named no request, and which every agent's span of the cancel
    joined; the request's trace showed it ended for no cause."""
    traced(monkeypatch, tracer_provider)
    monkeypatch.setattr("gpusched_router.main.make_redis", lambda settings: NoBudgetSpent())
    app = create_app(RouterSettings(telemetry=TelemetrySettings(otlp_endpoint="")))

    async def publish(message: bytes, topic: str, **options: object) -> None:
        if topic != CONTROL.name:
            raise KafkaTimeoutError  # as aiokafka gives up

    monkeypatch.setattr(app.state.broker, "publish", publish)
    reply = await post(app, "/v1/completions",
                       json.dumps({"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3}))
    assert reply.status_code == 503
    for _ in range(10):  # the cancel goes out on its own
        await asyncio.sleep(0)
    span = server_span(span_exporter)
    assert span.attributes["http.response.status_code"] == 503
    assert span.status.status_code is StatusCode.ERROR
    [cancel] = [s for s in span_exporter.get_finished_spans() if s.name == "cancel"]
    assert cancel.context.trace_id == span.context.trace_id
    assert cancel.parent.span_id == span.context.span_id
    assert cancel.attributes["gpusched.request_id"] == reply.headers["x-request-id"]


async def test_a_cancel_over_http_goes_in_its_requests_trace_from_any_router(
        monkeypatch, redis_url: str) -> None:
    """`POST /v1/requests/{id}/cancel` published its cancel in a trace of its own, apart
    from the request's. The request's status names the span it was taken in under, and
    the cancel goes out under it, from the router that took it in or any other."""
    request_id = f"req-{uuid.uuid4().hex}"
    monkeypatch.setattr("gpusched_router.main._new_request_id", lambda: request_id)
    settings = RouterSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                              redis=RedisSettings(url=redis_url))
    taking, cancelling = create_app(settings), create_app(settings)
    cancels: list[dict] = []

    @cancelling.state.broker.subscriber(CONTROL.name)
    async def on_cancel(msg: KafkaMessage) -> None:
        cancels.append(msg.headers)

    async with TestKafkaBroker(taking.state.broker), TestKafkaBroker(
            cancelling.state.broker):
        replying = asyncio.create_task(post(taking, "/v1/completions", json.dumps(
            {"model": "qwen2.5-1.5b", "prompt": "hi", "max_tokens": 3})))
        async with asyncio.timeout(5):
            while await taking.state.hub.status(request_id) is None:
                await asyncio.sleep(0.01)
        cancel = await post(cancelling, f"/v1/requests/{request_id}/cancel", "")
        assert cancel.status_code == 202
        taking.state.hub.dispatch([SimpleNamespace(value=_result(
            "cancelled", "cancelled: by its client", request_id).to_bytes())])
        reply = await replying
    assert reply.status_code == 409
    [headers] = cancels
    assert headers["traceparent"].split("-")[1] == reply.headers["x-trace-id"]
