"""Versioned message contracts for every Kafka topic of gpusched.

Each message carries a `type` tag and a `version`; consumers parse raw bytes once with the
`TypeAdapter`s below and dispatch on the type. Field units are in the names.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

PriorityClass = Literal["interactive", "standard", "batch"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = ("interactive", "standard", "batch")
"""Highest first: the scheduler serves them in this order."""

RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/@-]+$")]

LAST_ATTEMPT = 100
"""The highest attempt number a request may reach (preemptions, drains, lost nodes)."""

PlacementId = Annotated[str, Field(min_length=1, max_length=140)]
"""'<request_id>#<attempt>' (a request id is 128 characters at most, an attempt 100), so
that its usage records' ids ('<placement_id>:final', ':<n>') stay within theirs."""


def check_placement_id(placement_id: str, request_id: str) -> None:
    """Raise ValueError unless `placement_id` is '<request_id>#<attempt>'."""
    attempt = placement_id.removeprefix(request_id + "#")
    if attempt == placement_id or not (attempt.isascii() and attempt.isdigit()):
        raise ValueError(f"placement_id {placement_id!r} must be its request_id, '#' and the "
                         f"attempt number ('{request_id}#0')")


def cut_reason(value: Any) -> Any:
    """`value` cut to REASON_CHARS when it is a string (else left to validation)."""
    return value[:REASON_CHARS] if isinstance(value, str) else value


Reason = Annotated[str, BeforeValidator(cut_reason)]
"""Why a command was given or a record refused, cut to REASON_CHARS as it is read or made.
A cancel's reason ends up in its request's result (the agent's, or the scheduler's for a
request still waiting): one Kafka took at 1 MB made a result Kafka refused, which the agent
sent again forever, after a restart too (its final records are filed), and the placement
never ended."""


Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False,
                                     description="Sampling temperature as in "
                                     "OpenAI's API (0: always the likeliest token).")]
Seed = Annotated[int, Field(ge=-2**63, le=2**63 - 1, description="Sampling seed: a 64-bit "
                           "integer, as engines (PyTorch, vLLM) take it.")]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                              description="Nucleus sampling: draw from the likeliest "
                              "tokens that together hold this much probability.")]


def _stop_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("stop must be a string or a list of up to 4 strings")
    return value


StopStrings = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=256)]],
    BeforeValidator(_stop_list),
    Field(max_length=4, description="Up to 4 strings, as in OpenAI's API (one string is a list "
          "of one): the text ends before the first of them the model generates."),
]

MAX_PROMPT_CHARS = 200_000
"""Largest prompt accepted anywhere (router and Kafka); the model's context limit also applies."""

MAX_RECORD_BYTES = 1_000_000
"""The largest record value gpusched publishes: under Kafka's default limit of 1 MiB a record
(the broker's `message.max.bytes`, the producer's `max.request.size`), with room for its key,
headers and framing."""

MAX_HANDBACK_BYTES = MAX_RECORD_BYTES - 4096
"""The largest request record handed back for another attempt: room is left for the
placement the scheduler wraps it in."""

MAX_REQUEST_BYTES = 640 * 1024
"""The largest `inference_request` record taken in (router: 413; produced to Kafka: a dead
letter and a 413 rejection), as JSON: a chat carries its text twice (messages, and the prompt
rendered from them), and control characters take 6 bytes each. A request grows on its way:
the scheduler wraps it in a placement, and a preempted one goes back with the tokens it has
(up to max_tokens of them), so this leaves about 360 KiB of MAX_RECORD_BYTES for those."""

MAX_QUEUE_MS = 7 * 24 * 3600 * 1000
"""Longest queue time limit a request or a class may set: a week."""

MAX_QUEUE_LIST = 10_000
"""Most of the line the scheduler's GET /v1/queue lists at once (`limit`)."""

MAX_USAGE_TOKENS = 10**9
"""Most tokens of each kind one usage record bills (see `UsageRecord`); a request's
`prompt_tokens` override stays within it, or its agent could not bill the request."""


class Message(BaseModel):
    """Base of every contract: immutable, strict about unknown fields, versioned."""

    # cache_strings="keys": field names repeat in every record, ids and texts hardly ever;
    # caching those too costs more than it saves on hot consumers (accounting, scheduler)
    model_config = ConfigDict(extra="forbid", frozen=True, cache_strings="keys")
    version: Literal[1] = 1

    def to_bytes(self) -> bytes:
        """JSON without the optional fields that are unset (None): a reader one release
        behind, which refuses fields it does not know, still takes every record that uses
        no newer field (a rolling upgrade)."""
        return self.model_dump_json(exclude_none=True).encode()


MAX_CHAT_NAME_CHARS = 64
"""Longest `ChatTurn.name`: the limit OpenAI documented and enforced (`^[a-zA-Z0-9_-]{1,64}$`),
which clients still cut names to."""

_NOT_IN_A_NAME = re.compile(r"[\s<|\\/>]")
r"""What OpenAI refuses in a chat message's name now (`^[^\s<|\\/>]+$`): whitespace, and
the characters chat templates make their special tokens of (`<|im_start|>`)."""


def _chat_name(name: str) -> str:
    if (bad := _NOT_IN_A_NAME.search(name)) is not None:
        raise ValueError(f"{bad.group()!r} is not allowed in a name, as in OpenAI's API: no "
                         "whitespace nor any of < | \\ / > (use _ or - instead)")
    return name


ChatName = Annotated[str, Field(min_length=1, max_length=MAX_CHAT_NAME_CHARS),
                     AfterValidator(_chat_name)]


class ChatTurn(BaseModel):
    """One message of a chat request's conversation (text only), and who wrote it where the
    client named them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)
    # newer than the turn: None is left out of the record (`Message.to_bytes`), so a reader
    # one release behind takes every turn without one
    name: ChatName | None = Field(
        default=None, description="The participant who wrote it, to tell apart participants "
        "of the same role (OpenAI's `name`; multi-agent clients send it).")


class Resume(BaseModel):
    """What the earlier attempts of a preempted or drained request generated: the next
    attempt goes on after it instead of starting over, so a streaming client sees no text
    twice and the tokens are billed once."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: tuple[str, ...] = Field(default=(), max_length=32_768, description="Generated "
                                    "so far, one item per token, in order.")
    streamed_tokens: int = Field(default=0, ge=0, description="How many of `tokens` were "
                                 "streamed.")
    next_seq: int = Field(default=0, ge=0, description="`seq` of the next token chunk.")
    # What the earlier attempts learned, which the request's own fields do not say: those
    # stay as the client sent them, since the scheduler tells a hand-back from another
    # request under the same id by what it asks for (`InferenceRequest.asks`)
    prompt_tokens: int | None = Field(
        default=None, ge=1, le=MAX_USAGE_TOKENS, strict=True, description="The prompt as "
        "an earlier attempt's engine counted it (its tokenizer and chat template), where "
        "that is not the request's own count: what was billed and what the result reports "
        "(`InferenceRequest.billed_prompt_tokens`), and what bounds the reply in the model's "
        "context (`InferenceRequest.reply_limit`).")
    ttft_ms: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="From the request's creation "
        "to its first token, as the attempt that generated it measured: the result's.")


ASKS_VERSION = 1
"""Of `InferenceRequest.asks_digest`: raised when `asks()` or a chat turn's fields change
what the digest of a request already made is (a new optional field, left out while unset,
does not)."""


def asks_differ(digest: str, other: str) -> bool:
    """Whether two `asks_digest`s are of requests that ask for different things: False for
    the same, and for two of different versions, which cannot tell."""
    return digest != other and digest.partition(":")[0] == other.partition(":")[0]


class InferenceRequest(Message):
    """A request to generate text; produced by the router or by any Kafka client.

    `attempt` grows each time the request is handed back for scheduling (agent refused it,
    its node was lost, it was preempted); (request_id, attempt) identifies one placement.
    """

    type: Literal["inference_request"] = "inference_request"
    request_id: RequestId
    tenant: Name
    priority_class: PriorityClass = "standard"
    model: Name
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    # strict, as the usage record's counts: agents bill these, and `true` or "10" is no
    # number of tokens to bill
    max_tokens: int = Field(default=64, ge=1, le=32_768, strict=True)
    prompt_tokens: int | None = Field(
        default=None, ge=1, le=MAX_USAGE_TOKENS, strict=True,
        description="Override the counted prompt length (trace replays).")
    seed: Seed | None = None
    temperature: Temperature | None = None  # None: the executor's own setting
    top_p: TopP | None = None
    stop: StopStrings | None = None
    num_gpus: int = Field(
        default=1, ge=1, le=8, description="GPUs of one node that run it together (a gang: "
        "tensor parallel; weights and KV cache are split evenly across them).")
    attempt: int = Field(default=0, ge=0, le=LAST_ATTEMPT)
    refused: int | None = Field(
        default=None, ge=1, le=LAST_ATTEMPT, description="How many of its attempts an agent "
        "could not run (handed back unrun, or its engine unavailable): a limit of its own, "
        "which preemptions, drains and lost nodes do not use up.")
    requeued: Literal["handback", "preempted", "node_lost"] | None = Field(
        default=None, description="Why this attempt was queued again; preempted and node_lost "
        "attempts go to the front of their class.")
    messages: tuple[ChatTurn, ...] | None = Field(
        default=None, max_length=1024, description="A chat request's conversation, for "
        "engines that apply the model's own chat template (the openai executor); `prompt` "
        "is its plain rendering, which sizes and bills the request.")
    resume: Resume | None = None
    created_at_ms: int = Field(ge=0)
    max_queue_ms: int | None = Field(
        default=None, ge=1, le=MAX_QUEUE_MS, description="Longest this request may wait for "
        "its first placement, from `created_at_ms`; past it, it ends unrun with a 503 "
        "rejection. Its class's limit (GPUSCHED_<CLASS>_MAX_QUEUE_S), where set, caps it.")

    @model_validator(mode="after")
    def _attempts_agree(self) -> InferenceRequest:
        """A later attempt says why it was queued again, and only a later attempt goes on
        after earlier ones' tokens (they billed its prompt and those tokens): a record that
        claims a resume without them would run unbilled."""
        if (self.attempt == 0) != (self.requeued is None):
            raise ValueError(f"attempt {self.attempt} with requeued={self.requeued!r}: a "
                             "first attempt (0) has no requeued, a later one says why it was "
                             "queued again; clients send neither")
        if self.refused is not None and self.refused > self.attempt:
            raise ValueError(f"refused {self.refused} on attempt {self.attempt}: agents hand "
                             "back a request as its next attempt; clients do not send it")
        resume = self.resume
        if resume is not None:
            if self.attempt == 0:
                raise ValueError("resume is set only on a later attempt (gpusched's own retry "
                                 "of a preempted or handed-back request); clients do not send it")
            if not resume.streamed_tokens <= len(resume.tokens) <= self.max_tokens:
                raise ValueError(f"resume has {len(resume.tokens)} tokens, "
                                 f"{resume.streamed_tokens} streamed, for max_tokens "
                                 f"{self.max_tokens}: streamed <= tokens <= max_tokens")
        return self

    def asks(self) -> tuple[Any, ...]:
        """Everything the request asks for, not its times or attempts: what tells a
        redelivery, or a producer's retry, of a request (equal) from another request under
        the same id (different)."""
        return (self.tenant, self.model, self.priority_class, self.prompt, self.max_tokens,
                self.num_gpus, self.seed, self.temperature, self.top_p,
                tuple(self.stop or ()), self.messages)

    def asks_digest(self) -> str:
        """`asks()` as a digest that is the same in every process (Python's `hash` is not),
        `<ASKS_VERSION>:<hex>`: digests of two versions (a release that asks for more) are
        not compared (`asks_differ`)."""
        # a turn without a name digests as it did before turns had one
        asked = [*self.asks()[:-1], [m.model_dump(exclude_none=True)
                                     for m in self.messages or ()]]
        text = json.dumps(asked, ensure_ascii=False, separators=(",", ":"))
        digest = hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:32]
        return f"{ASKS_VERSION}:{digest}"

    @property
    def prompt_token_count(self) -> int:
        """The prompt tokens this request asks to be sized for (prompt plus max_tokens
        within the model's context, checked as it is taken in): the explicit override,
        else `count_prompt_tokens(prompt)`."""
        return self.prompt_tokens or count_prompt_tokens(self.prompt)

    @property
    def billed_prompt_tokens(self) -> int:
        """The prompt tokens this request is billed for: as an earlier attempt's engine
        counted them (`Resume.prompt_tokens`), else `prompt_token_count`."""
        counted = None if self.resume is None else self.resume.prompt_tokens
        return counted or self.prompt_token_count

    def reply_limit(self, context_limit_tokens: int) -> int:
        """The most tokens the reply may have, the resumed ones included: max_tokens, or
        less where the prompt as an earlier attempt's engine counted it leaves less room in
        the model's context (no engine generates past it, and one asked to refuses the
        request). Not where the tokens the request has already overran that room: that
        engine serves a longer context than the catalog's, and the reply goes on to
        max_tokens."""
        if self.resume is None or self.resume.prompt_tokens is None:
            return self.max_tokens  # by its own count, which it was taken in by
        room = context_limit_tokens - self.resume.prompt_tokens
        return room if max(1, len(self.resume.tokens)) <= room < self.max_tokens \
            else self.max_tokens

    def context_tokens(self, context_limit_tokens: int) -> int:
        """The positions of the model's context this attempt may take (its KV cache): its
        prompt as billed and `reply_limit`; prompt plus max_tokens for a first attempt."""
        return self.billed_prompt_tokens + self.reply_limit(context_limit_tokens)

    def so_far(self) -> dict[str, Any]:
        """The text and tokens earlier attempts generated and billed (the resume), and when
        the first came, as the result of an attempt that ends without running reports them:
        nothing for a first one. (A stop string would have ended the request: the text
        holds none.)"""
        if self.resume is None:
            return {"text": "", "prompt_tokens": 0, "completion_tokens": 0, "ttft_ms": None}
        return {"text": "".join(self.resume.tokens), "prompt_tokens": self.billed_prompt_tokens,
                "completion_tokens": len(self.resume.tokens), "ttft_ms": self.resume.ttft_ms}


MAX_GPU_MEMORY_MIB = 2**24
"""16 TiB: far beyond any one GPU, and far inside the 64-bit sums the solver adds it to."""


class GpuState(BaseModel):
    """One schedulable GPU (or MIG instance) of a node, as its agent sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int = Field(ge=0)
    uuid: str
    gpu_type: str = Field(description="Catalog name, e.g. 'H100-80GB'.")
    memory_total_mib: int = Field(ge=0, le=MAX_GPU_MEMORY_MIB, description="What gpusched "
                                  "may use: the GPU's memory less what other processes held "
                                  "when the agent started.")
    memory_free_mib: int = Field(le=MAX_GPU_MEMORY_MIB, description="Total minus loaded "
                                 "weights minus reserved KV cache.")
    healthy: bool = True
    loaded_models: tuple[str, ...] = Field(default=(), description="Weights in memory: a "
        "model's name, or '<model>#tp<n>' for its shard from an n-GPU gang, which serves only "
        "gangs of that size (catalog.weights_name).")
    running_requests: int = Field(default=0, ge=0)
    name: str = Field(default="", description="NVML name, e.g. 'NVIDIA H100 80GB HBM3'.")
    mig_parent_uuid: str | None = Field(
        default=None, description="Set when this device is a MIG instance of that GPU.")
    kv_cache_free_mib: int | None = Field(
        default=None, le=MAX_GPU_MEMORY_MIB, description="Memory a new request of a loaded "
        "model can use for its KV cache: free memory plus the weights of idle (evictable) "
        "models.")
    idle_models: tuple[str, ...] | None = Field(
        default=None, description="Loaded models nothing runs now, least recently used "
        "first: the agent unloads them to make room for other work (their weights are "
        "kv_cache_free_mib less memory_free_mib). Unset when there are none.")
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected_errors: int | None = None
    unhealthy_reason: str | None = None


class LoadFailure(BaseModel):
    """A model whose load failed on a node lately, and until when the node asks not to get
    its work (its agent's clock, as `NodeState.reported_at_ms`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: Name
    until_ms: int


class NodeState(Message):
    """The full state of one node; compacted topic keyed by node id, so the latest wins.

    `active_placement_ids` lists placements whose memory is already counted in
    `memory_free_mib`; the scheduler keeps its own reservation for any other placement.
    """

    type: Literal["node_state"] = "node_state"
    node_id: Name
    status: Literal["ready", "draining", "stopped"] = "ready"
    seq: int = Field(ge=0, le=2**62, description="Grows with every report of one agent run.")
    started_at_ms: int
    reported_at_ms: int
    gpus: tuple[GpuState, ...]
    active_placement_ids: tuple[str, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    executor: str | None = Field(default=None, description="simulated, torch or openai.")
    models: tuple[Name, ...] | None = Field(
        default=None, max_length=4096, description="The catalog models this node can run "
        "(its inference server serves only some); unset: every catalog model.")
    load_failures: tuple[LoadFailure, ...] | None = Field(
        default=None, max_length=4096, description="Models whose load failed on this node "
        "lately (a corrupt file, memory another process holds): the scheduler places none "
        "of them here until `until_ms`, as if the node were away, and still counts it as "
        "serving them (no request is rejected for it). Unset when there are none.")


class Placement(Message):
    """A scheduler's command to run one request on GPUs of one node (keyed by node id)."""

    type: Literal["placement"] = "placement"
    placement_id: PlacementId = Field(description="'<request_id>#<attempt>': unique per "
                                      "attempt.")
    node_id: Name
    gpu_indices: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        min_length=1, max_length=8, description="All GPUs of the gang; one usually.")
    kv_cache_mib: int = Field(ge=0, description="KV cache reserved on each of its GPUs.")
    scheduler_epoch: int = Field(ge=0, description="Fencing token of the scheduler that placed it.")
    placed_at_ms: int
    request: InferenceRequest

    @model_validator(mode="after")
    def _id_is_the_requests(self) -> Placement:
        """Its agent names its usage records after it, which must be the request's (see
        `UsageRecord`): a placement it could not bill is refused on the wire, not run."""
        check_placement_id(self.placement_id, self.request.request_id)
        return self


class Preempt(Message):
    """A scheduler's command to stop a running placement so that higher-priority work fits;
    the agent bills usage so far and hands the request back with requeued='preempted'."""

    type: Literal["preempt"] = "preempt"
    placement_id: PlacementId
    request_id: RequestId
    node_id: Name
    scheduler_epoch: int = Field(ge=0)
    reason: Reason


class Cancel(Message):
    """Stop a request wherever it runs (the client went away, or asked to); the agent bills
    usage so far and ends it with status 'cancelled'. Keyed by request id."""

    type: Literal["cancel"] = "cancel"
    request_id: RequestId
    reason: Reason
    at_ms: int


class TokenChunk(Message):
    """Some generated tokens of a request, in order of `seq`."""

    type: Literal["token_chunk"] = "token_chunk"
    request_id: RequestId
    seq: int = Field(ge=0)
    text: str
    token_count: int = Field(ge=0)


class RequestResult(Message):
    """The terminal outcome of an accepted request; exactly one per request reaches clients."""

    type: Literal["request_result"] = "request_result"
    request_id: RequestId
    tenant: str
    model: str
    status: Literal["completed", "failed", "cancelled"]
    finish_reason: str = Field(description="'length', 'stop', or what went wrong.")
    text: str = ""
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    node_id: str | None = None
    gpu_indices: tuple[int, ...] = ()
    queued_ms: float = Field(ge=0, description="From creation to start of execution.")
    total_ms: float = Field(ge=0, description="From creation to the last token.")
    ttft_ms: float | None = Field(default=None, description="From creation to the first token.")
    engine_status_code: int | None = Field(
        default=None, ge=400, le=499, description="A failed request's HTTP status from the "
        "inference engine that refused it as sent (400, 413, 422: its prompt longer than the "
        "model's context by the engine's tokenizer, turns its chat template refuses), with "
        "the engine's message in `finish_reason`: the client is answered with it, not a 502, "
        "and told not to send the request again as it is.")

    @model_validator(mode="after")
    def _refused_means_failed(self) -> RequestResult:
        if self.engine_status_code is not None and self.status != "failed":
            raise ValueError(f"engine_status_code is for a failed request, not a "
                             f"{self.status} one")
        return self


MAX_RETRY_AFTER_S = 3600
"""The latest a rejection may say a retry fits: a reader one release behind refuses more."""


class Rejection(Message):
    """A request refused before running; the client's terminal answer, with a reason."""

    type: Literal["rejection"] = "rejection"
    request_id: RequestId
    tenant: str | None = None
    status_code: int = Field(ge=400, le=599, description="HTTP-equivalent: 400, 404, 429, ...")
    reason: Reason
    code: str | None = Field(
        default=None, max_length=64, description="What a client matches on where the status "
        "alone does not say (OpenAI's error `code`): queue_time_exceeded, "
        "tokens_per_minute_exceeded, insufficient_quota (a spent budget).")
    retry_after_s: int | None = Field(
        default=None, ge=1, le=MAX_RETRY_AFTER_S, description="When a retry may be admitted, "
        "where the scheduler can tell (a tokens-per-minute quota; a spent budget, at most "
        "this far ahead); the router's Retry-After.")


MAX_USAGE_GPU_SECONDS = 8 * 31 * 86_400
"""With MAX_USAGE_TOKENS: far beyond any one record (a request's prompt and output; 8 GPUs
for a month, where agents bill every few seconds, an hour at most), and far inside the
counters accounting adds them to, which are exact up to 2**53 per bucket (285 GPU-years of
microseconds); at 10**9 GPU-seconds ten records in a day lost precision and 10,000 wrapped
the counter negative."""
MAX_EPOCH_MS = 10**13
"""Year 2286: a larger timestamp is in micro- or nanoseconds, not milliseconds."""


class UsageRecord(Message):
    """Metered consumption of one request on one node; billed exactly once by `event_id`.

    `final` marks the last record of a placement; non-final ones are periodic partials,
    each covering only what was consumed since the previous record (deltas, never totals).
    """

    type: Literal["usage"] = "usage"
    event_id: str = Field(min_length=1, max_length=200)
    request_id: RequestId
    placement_id: PlacementId
    tenant: Name  # accounting stores "<tenant> <model>": neither may hold a space
    model: Name
    priority_class: PriorityClass
    node_id: Name
    gpu_type: Name
    # strict: a bill, its bucket or its staleness is not guessed from `true`, "10", 1.5e12
    # or "no" (a JSON integer is a valid gpu_seconds)
    prompt_tokens: int = Field(ge=0, le=MAX_USAGE_TOKENS, strict=True)
    completion_tokens: int = Field(ge=0, le=MAX_USAGE_TOKENS, strict=True)
    gpu_seconds: float = Field(ge=0, le=MAX_USAGE_GPU_SECONDS, allow_inf_nan=False,
                               strict=True, description="Share of one GPU integrated over the "
                               "run.")
    final: bool = Field(default=True, strict=True)
    started_at_ms: int = Field(ge=0, le=MAX_EPOCH_MS, strict=True)
    ended_at_ms: int = Field(ge=0, le=MAX_EPOCH_MS, strict=True)
    prompt_from: int | None = Field(
        default=None, ge=0, le=MAX_USAGE_TOKENS, strict=True,
        description="Position in the request's prompt of the first prompt token this record "
        "bills; accounting bills each position of a request once, whichever attempts ran it "
        "(a request started over after its node died). Unset (older agents): billed as sent.")
    completion_from: int | None = Field(
        default=None, ge=0, le=MAX_USAGE_TOKENS, strict=True,
        description="Position in the request's reply of the first completion token this "
        "record bills (a resumed attempt goes on after the tokens it carries); set with "
        "prompt_from.")

    @model_validator(mode="after")
    def _positions_together(self) -> UsageRecord:
        if (self.prompt_from is None) != (self.completion_from is None):
            raise ValueError("prompt_from and completion_from are set together or not at all")
        return self

    @model_validator(mode="after")
    def _ids_agree(self) -> UsageRecord:
        """Ids are the placement's, as agents build them: accounting keeps a request's
        applied event ids under its request id, so an event id of another request or
        placement was billed again under each request id it came with."""
        check_placement_id(self.placement_id, self.request_id)
        if not self.event_id.startswith(self.placement_id + ":"):
            raise ValueError(f"event_id {self.event_id!r} must start with its placement_id "
                             f"and ':' ('{self.placement_id}:final', '{self.placement_id}:1')")
        return self


class BudgetExhausted(Message):
    """A tenant spent its budget for a period; the router answers 429 until it resets."""

    type: Literal["budget_exhausted"] = "budget_exhausted"
    tenant: str
    period: str = Field(description="e.g. 'day:2026-11-30'.")
    limit: float
    spent: float
    unit: Literal["tokens", "usd"]
    at_ms: int


class ScalingSignal(Message):
    """GPUs wanted per model to meet each class's latency target, for an external
    autoscaler (KEDA, HPA)."""

    type: Literal["scaling_signal"] = "scaling_signal"
    model: str
    gpus_wanted: int = Field(ge=0)
    gpus_in_use: int = Field(ge=0)
    queue_depth: dict[str, int]
    at_ms: int


class DeadLetter(Message):
    """A record a service could not process, kept with the reason and where it came from."""

    type: Literal["dead_letter"] = "dead_letter"
    source_topic: str
    partition: int
    offset: int
    key: str | None = None
    payload: str = Field(description="The record's value as text (UTF-8, replaced), truncated.")
    reason: Reason
    service: str
    at_ms: int


ResultEvent = Annotated[TokenChunk | RequestResult | Rejection, Field(discriminator="type")]
PlacementCommand = Annotated[Placement | Preempt, Field(discriminator="type")]
Event = Annotated[BudgetExhausted | ScalingSignal, Field(discriminator="type")]
RESULT_EVENT = TypeAdapter(ResultEvent)
PLACEMENT_COMMAND = TypeAdapter(PlacementCommand)
EVENT = TypeAdapter(Event)
CANCEL = TypeAdapter(Cancel)
REQUEST = TypeAdapter(InferenceRequest)
NODE_STATE = TypeAdapter(NodeState)
PLACEMENT = TypeAdapter(Placement)
USAGE = TypeAdapter(UsageRecord)
DEAD_LETTER = TypeAdapter(DeadLetter)
REQUEST_ID = TypeAdapter(RequestId)
"""A request id read from outside a record (a command line): the ids the contracts hold."""

DEAD_LETTER_PAYLOAD_CHARS = 65_536
DEAD_LETTER_KEY_CHARS = 1_024
REASON_CHARS = 2_000
"""How much of a refused record's value and key a dead letter keeps, and of the reason it
and a rejection give (which may quote the record's field names). JSON escapes a control
character to six bytes, so a dead letter or rejection stays far under MAX_RECORD_BYTES
whatever it came from: one Kafka refused as too large made its service read the record
again forever, and every record behind it waited."""


def invalid_fields(exc: ValidationError) -> str:
    """Every error of a refused record on one line, `field.path: what is wrong; ...`: the
    reason a dead letter gives (pydantic's own text runs over lines with links)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}"
                     for e in exc.errors())


class NestedTooDeep(ValueError):
    """JSON nested deeper than Python's recursion limit lets `json.loads` read."""


def decode_json(raw: bytes | str, what: str = "value") -> Any:
    """The JSON value `raw` holds, read from outside gpusched (a record produced to Kafka, a
    request body); `what` names it in the reason. Raises ValueError with a reason a producer
    can act on for anything Python cannot read: not JSON or not UTF-8, a number over its int
    digit limit (4,300), or nesting deeper than its recursion limit (`NestedTooDeep`).
    json.loads raises RecursionError for that last, which a reader's `except ValueError` let
    through: one such record stopped a consumer group that reads a failed batch again."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    except ValueError as exc:  # json's one other: int() of a number over the digit limit
        raise ValueError(f"{what} is not valid JSON: a number has more than "
                         f"{sys.get_int_max_str_digits()} digits") from exc
    except RecursionError as exc:
        raise NestedTooDeep(f"{what} nests arrays and objects deeper than Python reads (its "
                            f"recursion limit, {sys.getrecursionlimit()})") from exc


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a record value as a JSON object; raises ValueError with a readable reason
    (`decode_json`'s, or that it is no object)."""
    value = decode_json(raw)
    if not isinstance(value, dict):
        raise ValueError(f"value must be a JSON object, got {type(value).__name__}")
    return value


def count_prompt_tokens(prompt: str) -> int:
    """The token count gpusched bills for a prompt without a tokenizer: ceil(UTF-8 bytes / 4).

    Four bytes per token is the usual English average of BPE tokenizers; a request may carry
    an explicit `prompt_tokens` instead.
    """
    # an ASCII string's length is its UTF-8 size, known without encoding it (the scheduler
    # sizes every pending request on every cycle)
    size = len(prompt) if prompt.isascii() else len(prompt.encode())
    return max(1, -(-size // 4))
