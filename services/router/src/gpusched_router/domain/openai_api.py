"""OpenAI-compatible request parsing and response shaping; pure, no I/O.

`decode_body` turns a request's bytes into JSON, and `parse_*` a decoded body into an
`InferenceRequest`, or either into an `ApiError` (a value, with the HTTP status and a reason
a user can act on).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpusched_common.catalog import ModelCatalog, Tenant
from gpusched_common.contracts import (
    MAX_PROMPT_CHARS,
    MAX_QUEUE_MS,
    MAX_REQUEST_BYTES,
    PRIORITY_CLASSES,
    ChatTurn,
    InferenceRequest,
    NestedTooDeep,
    Seed,
    StopStrings,
    Temperature,
    TopP,
    count_prompt_tokens,
    decode_json,
)

DEFAULT_MAX_TOKENS = 16
"""What OpenAI's completions API uses when `max_tokens` is absent."""

MAX_BODY_DEPTH = 64
"""Deepest nesting of arrays and objects in a body (OpenAI's requests use 5): far below
Python's recursion limit, which a deeper body reaches again in whatever walks it next (the
Idempotency-Key's digest)."""

PRIORITY_HEADER = "x-priority-class"
MAX_QUEUE_HEADER = "x-max-queue-ms"
"""The longest the request may wait for a GPU, in milliseconds (its `max_queue_ms`)."""
IDEMPOTENCY_HEADER = "idempotency-key"

ONE_VALUE_HEADERS = {PRIORITY_HEADER: "X-Priority-Class", MAX_QUEUE_HEADER: "X-Max-Queue-Ms",
                     IDEMPOTENCY_HEADER: "Idempotency-Key"}
"""Headers that take one value, by the name they are written with."""


_CODE_OF_STATUS = {401: "invalid_api_key", 404: "not_found", 409: "conflict",
                   413: "request_too_large", 429: "rate_limit_exceeded", 502: "server_error",
                   503: "service_unavailable", 504: "timeout"}


@dataclass(frozen=True)
class ApiError:
    """An error as OpenAI's API shapes it: `type` is the class (`invalid_request_error` for
    4xx, `server_error` for 5xx, `insufficient_quota` for a spent budget, as OpenAI's own),
    `code` the string a client matches on (SDKs read it as `e.code`), `param` the request
    field at fault."""

    status_code: int
    message: str
    code: str | None = None
    param: str | None = None

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status_code >= 500 else \
            "insufficient_quota" if self.code == "insufficient_quota" else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code or _CODE_OF_STATUS.get(self.status_code)}}


NOT_SUPPORTED: dict[str, str] = {
    "logprobs": "gpusched does not return token log-probabilities",
    "top_logprobs": "gpusched does not return token log-probabilities",
    "echo": "gpusched does not echo the prompt in the reply",
    "suffix": "gpusched does not insert text before a suffix",
    "tools": "gpusched does not call tools",
    "functions": "gpusched does not call functions",
    "logit_bias": "gpusched does not bias token probabilities",
    "audio": "gpusched replies in text only",
    "web_search_options": "gpusched does not search the web",
}
"""OpenAI fields whose request, ignored, would change what the reply means: when set to
anything but off (null, false, 0, empty) they are refused with the reason."""

ON_WHEN_GIVEN = frozenset({"web_search_options"})
"""Of NOT_SUPPORTED, those an empty value still turns on (OpenAI searches the web with
`web_search_options: {}`): refused unless null."""


def _not_supported(body: dict[str, Any]) -> ApiError | None:
    for name, reason in NOT_SUPPORTED.items():
        if body.get(name) or (name in ON_WHEN_GIVEN and body.get(name) is not None):
            return ApiError(400, f"{name}: {reason}; leave it out", param=name)
    if "prompt" in body and body.get("logprobs") is not None and body["logprobs"] is not False:
        # the legacy API's logprobs is a count: 0 still asks for the chosen tokens' own
        return ApiError(400, f"logprobs: {NOT_SUPPORTED['logprobs']}; leave it out",
                        param="logprobs")
    modalities = body.get("modalities")
    if modalities not in (None, [], ["text"]):  # off values pass, as for the fields above
        return ApiError(400, f"modalities: gpusched replies in text only; ask for [\"text\"] "
                        f"or leave it out, not {modalities!r}", param="modalities")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of < 1):
        return ApiError(400, f"best_of: {best_of!r} is not a positive integer", param="best_of")
    if best_of is not None and best_of > 1:
        return ApiError(400, f"best_of is {best_of}; gpusched draws one sample per request",
                        param="best_of")
    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        return ApiError(400, "response_format: an object is expected, such as "
                        "{\"type\": \"text\"}", param="response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return ApiError(400, f"response_format: gpusched does not constrain output to "
                        f"'{response_format.get('type')}'; only text", param="response_format")
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
"""A presence or frequency penalty, in OpenAI's range."""


class _Body(BaseModel):
    # Strict, as OpenAI's own schema: "3" or true is no max_tokens (lax pydantic read them as
    # 3 and 1). The fields from `user` on are accepted and ignored, but of the type OpenAI's
    # schema gives them ("x" for a penalty passed); any other field is ignored.
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, max_length=128)
    max_tokens: int | None = Field(default=None, ge=1, le=32_768)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=32_768, description="Chat's newer name for max_tokens, which it "
        "takes before; accepted on completions too, where it was ignored unchecked.")
    stream: bool | None = False
    seed: Seed | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StopStrings | None = None
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class CompletionBody(_Body):
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: Any = None  # checked as the turn's own (`ChatTurn.name`)
    tool_calls: list[Any] | None = None  # refused when not empty: passing on without them
    function_call: dict[str, Any] | None = None  # would change the conversation


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)


@dataclass(frozen=True)
class ParsedRequest:
    request: InferenceRequest
    stream: bool
    include_usage: bool


def decode_body(raw: bytes) -> Any:
    """The JSON value `raw` holds, or a 400 `ApiError` for a body Python cannot read or pass
    on whole: not JSON, a number over Python's int digit limit (4,300), nesting deeper than
    MAX_BODY_DEPTH, or text that is not Unicode (a lone surrogate, which no encoder takes)."""
    try:
        body = decode_json(raw, "request body")
    except NestedTooDeep:  # named by the router's own limit, which a client must meet
        return _too_deep()
    except ValueError as exc:
        return ApiError(400, str(exc))
    return _unreadable(body) or body


def _unreadable(body: Any) -> ApiError | None:
    """A 400 for the first container in `body` nested deeper than MAX_BODY_DEPTH, or string
    (key or value) holding a lone surrogate; None if none. Walks without recursion."""
    if isinstance(body, str):
        return _lone_surrogate(body, "the body", None)
    todo: list[tuple[Any, tuple[str | int, ...]]] = (
        [(body, ())] if isinstance(body, dict | list) else [])
    while todo:
        value, where = todo.pop()
        if len(where) >= MAX_BODY_DEPTH:
            return _too_deep()
        parent = ".".join(map(str, where)) or None  # its keys were checked on the way
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and (bad := _lone_surrogate(
                    key, f"a key of {parent or 'the body'}", parent)):
                return bad
            if isinstance(item, str):
                field = f"{parent}.{key}" if parent else str(key)
                if bad := _lone_surrogate(item, field, field):
                    return bad
            elif isinstance(item, dict | list):
                todo.append((item, (*where, key)))
    return None


def _lone_surrogate(text: str, place: str, param: str | None) -> ApiError | None:
    """A 400 naming `place` if `text` holds a lone surrogate: json.loads makes one of an
    escape of half a UTF-16 pair (\\udc00), or of the bytes UTF-8 would give it, and
    nothing can encode it again."""
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return ApiError(400, f"request body is not valid UTF-8 text: {place} has a lone "
                        f"surrogate \\u{code:04x} at character {exc.start} (half of a UTF-16 "
                        "pair); send text as UTF-8", param=param)
    return None


def _too_deep() -> ApiError:
    return ApiError(400, f"request body nests arrays and objects more than {MAX_BODY_DEPTH} "
                    "levels deep")


def parse_completion(
    body: Any, tenant: Tenant, headers: Mapping[str, str], catalog: ModelCatalog,
    request_id: str, now_ms: int,
) -> ParsedRequest | ApiError:
    if isinstance(body, dict) and isinstance(body.get("prompt"), list) and any(
            not isinstance(p, str) for p in body["prompt"]):
        return ApiError(400, "prompt: token-id prompts are not supported; send the prompt as "
                        "a string", param="prompt")
    parsed = _validate(CompletionBody, body)
    if isinstance(parsed, ApiError):
        return parsed
    if isinstance(parsed.prompt, list):
        if len(parsed.prompt) != 1:
            return ApiError(400, "prompt must be a string or a list of exactly one string",
                            param="prompt")
        prompt = parsed.prompt[0]
    else:
        prompt = parsed.prompt
    return _finish(parsed, prompt, tenant, headers, catalog, request_id, now_ms)


def parse_chat(
    body: Any, tenant: Tenant, headers: Mapping[str, str], catalog: ModelCatalog,
    request_id: str, now_ms: int,
) -> ParsedRequest | ApiError:
    parsed = _validate(ChatBody, body)
    if isinstance(parsed, ApiError):
        return parsed
    for i, message in enumerate(parsed.messages):
        if message.role == "tool":  # it answers a tool call, which is refused: it has none
            where = f"messages.{i}.role"
            return ApiError(400, f"{where}: a 'tool' message answers a tool call, and tool "
                            "calling is not supported; leave tool results out, or send them "
                            "as a user message", param=where)
        if message.tool_calls or message.function_call:
            where = f"messages.{i}.{'tool_calls' if message.tool_calls else 'function_call'}"
            return ApiError(400, f"{where}: tool calls are not supported, so a conversation "
                            "that holds them cannot go on here", param=where)
        content_at = f"messages.{i}.content"
        if message.content is None:  # as OpenAI: only a message of tool calls has none
            return ApiError(400, f"{content_at}: a {message.role} message needs its content",
                            param=content_at)
        if message.content == []:  # as OpenAI; an empty string passes, as an empty prompt
            return ApiError(400, f"{content_at}: the list of content parts is empty; send one "
                            "text part at least, or the content as a string", param=content_at)
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            where = f"{content_at}.{j}"
            if part.get("type") != "text":
                return ApiError(400, f"{where}: a content part of type '{part.get('type')}' "
                                "is not supported; send text parts ({\"type\": \"text\", "
                                "\"text\": ...}) only", param=where)
            if not isinstance(part.get("text"), str):
                return ApiError(400, f"{where}: a text part needs its text as a string",
                                param=f"{where}.text")
    turns: list[ChatTurn] = []
    for i, message in enumerate(parsed.messages):
        try:  # the turn's own limits: its joined text parts are one content
            turns.append(ChatTurn(role=message.role, content=_text_of(message),
                                  name=message.name))
        except ValidationError as exc:
            return _invalid(exc, within=("messages", i))
    conversation = tuple(turns)
    return _finish(parsed, render_chat(conversation), tenant, headers, catalog, request_id,
                   now_ms, conversation)


def render_chat(turns: tuple[ChatTurn, ...]) -> str:
    """A plain chat template: one `role: text` line per message (`role (name): text` for a
    named one), then `assistant:`. It sizes and bills the request, and is what the torch and
    simulated executors run."""
    return "\n".join([*(f"{t.role} ({t.name}): {t.content}" if t.name else
                        f"{t.role}: {t.content}" for t in turns), "assistant:"])


def _text_of(message: ChatMessage) -> str:
    """A message's text: its text parts (parse_chat refuses the others) one per line, as
    vLLM joins them for the model's template (`"Summarize:"` and `"The cat sat."` are not
    `"Summarize:The cat sat."`)."""
    if isinstance(message.content, list):
        return "\n".join(p["text"] for p in message.content)
    return message.content or ""


def _validate(model: type[_Body], body: Any) -> Any:
    if not isinstance(body, dict):
        return ApiError(400, "request body must be a JSON object")
    if refused := _not_supported(body):
        return refused
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        return _invalid(exc)


_UNION_BRANCHES = frozenset({"str", "constrained-str", "int", "float", "bool", "none", "list",
                             "dict"})
"""Names pydantic puts in an error's path for the branch of a union that refused the value
(`prompt.str`): not a field of the body, so left out of `param`."""


def _invalid(exc: ValidationError, within: tuple[str | int, ...] = ()) -> ApiError:
    """The 400 for a request field pydantic refused, named by its path in the body (the
    model validated sits at `within`)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in (*within, *err["loc"]) if p not in _UNION_BRANCHES
                     and "[" not in str(p)) or None
    return ApiError(400, f"{where}: {err['msg']}" if where else err["msg"], param=where)


def _finish(
    parsed: _Body, prompt: str, tenant: Tenant,
    headers: Mapping[str, str], catalog: ModelCatalog, request_id: str, now_ms: int,
    messages: tuple[ChatTurn, ...] | None = None,
) -> ParsedRequest | ApiError:
    # one result per request: answering n > 1 with one choice loses n - 1
    if parsed.n not in (None, 1):
        return ApiError(400, f"n is {parsed.n}; one choice per request is supported, send "
                        f"{parsed.n} requests instead", param="n")
    spec = catalog.get(parsed.model)
    if spec is None:
        return ApiError(404, f"model '{parsed.model}' does not exist; available models: "
                        f"{', '.join(catalog.names)}", code="model_not_found", param="model")
    priority_header = headers.get(PRIORITY_HEADER)
    if priority_header is not None and priority_header not in PRIORITY_CLASSES:
        return ApiError(400, f"X-Priority-Class '{priority_header}' is not one of "
                        f"{', '.join(PRIORITY_CLASSES)}", param="X-Priority-Class")
    max_queue_ms = _max_queue_ms(headers.get(MAX_QUEUE_HEADER))
    if isinstance(max_queue_ms, ApiError):
        return max_queue_ms
    if len(prompt) > MAX_PROMPT_CHARS:
        what = "the conversation rendered as a prompt" if messages else "prompt"
        return ApiError(400, f"{what} is {len(prompt)} characters; the limit is "
                        f"{MAX_PROMPT_CHARS}", param="messages" if messages else "prompt")
    max_tokens = parsed.max_completion_tokens or parsed.max_tokens or DEFAULT_MAX_TOKENS
    prompt_tokens = count_prompt_tokens(prompt)
    if prompt_tokens + max_tokens > spec.context_limit_tokens:
        # the wording clients match to trim a conversation: "maximum context length"
        return ApiError(400, f"{spec.name}'s maximum context length is "
                        f"{spec.context_limit_tokens} tokens; the prompt ({prompt_tokens} "
                        f"tokens) plus max_tokens ({max_tokens}) exceed it: shorten the prompt "
                        "or lower max_tokens", code="context_length_exceeded",
                        param="max_tokens")
    if (never := tenant.never_admitted(prompt_tokens + max_tokens)) is not None:
        return ApiError(400, never, code="tokens_per_minute_exceeded", param="max_tokens")
    request = InferenceRequest(
        request_id=request_id,
        tenant=tenant.name,
        priority_class=priority_header or tenant.default_priority_class,  # type: ignore[arg-type]
        model=spec.name,
        prompt=prompt,
        max_tokens=max_tokens,
        seed=parsed.seed,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        stop=parsed.stop or None,
        messages=messages,
        num_gpus=spec.num_gpus,  # as a vLLM deployment fixes its tensor-parallel size
        created_at_ms=now_ms,
        max_queue_ms=max_queue_ms,
    )
    if (size := len(request.to_bytes())) > MAX_REQUEST_BYTES:  # Kafka would refuse it
        return ApiError(413, f"the request is {size} bytes as a Kafka record, over the limit "
                        f"of {MAX_REQUEST_BYTES}: shorten the "
                        + ("conversation (its text is carried twice: as the messages and as "
                           "the prompt rendered from them)" if messages else "prompt"),
                        param="messages" if messages else "prompt")
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    return ParsedRequest(request=request, stream=bool(parsed.stream),
                         include_usage=include_usage)


def repeated_header(values_of: Callable[[str], list[str]]) -> ApiError | None:
    """A 400 for a header of ONE_VALUE_HEADERS sent more than once (which value was meant
    is a guess); None when each came at most once. `values_of` gives a header's values."""
    for name, written in ONE_VALUE_HEADERS.items():
        if (sent := len(values_of(name))) > 1:
            return ApiError(400, f"{written} was sent {sent} times; send it once", param=written)
    return None


def _max_queue_ms(header: str | None) -> int | None | ApiError:
    if header is None:
        return None
    if re.fullmatch(r"[0-9]{1,12}", header.strip()) and 1 <= int(header) <= MAX_QUEUE_MS:
        return int(header)
    shown = header.encode("latin-1", "replace").decode("utf-8", "replace")  # as it was sent
    return ApiError(400, f"X-Max-Queue-Ms '{shown}' is not a whole number of milliseconds "
                    f"from 1 to {MAX_QUEUE_MS} (a week)", param="X-Max-Queue-Ms")
