"""Message contracts: type tags, versions, strictness, and the documented Kafka shape."""

import json

import pytest
from aiokafka.structs import ConsumerRecord
from pydantic import ConfigDict, ValidationError

from gpusched_common.contracts import (
    CANCEL,
    MAX_RECORD_BYTES,
    PLACEMENT,
    REQUEST,
    RESULT_EVENT,
    ChatTurn,
    InferenceRequest,
    LoadFailure,
    NestedTooDeep,
    NodeState,
    Placement,
    Rejection,
    Resume,
    TokenChunk,
    UsageRecord,
    count_prompt_tokens,
    decode_json_object,
    invalid_fields,
)
from gpusched_common.kafka_records import dead_letter
from gpusched_common.topics import ALL_TOPICS, NODE_STATE, REQUESTS, partition_for_key


def test_documented_kafka_request_shape_parses() -> None:
    raw = json.dumps({"request_id": "r-1", "tenant": "acme", "priority_class": "batch",
                      "model": "qwen2.5-1.5b", "prompt": "hello", "max_tokens": 8,
                      "created_at_ms": 1})
    request = REQUEST.validate_json(raw)
    assert request.type == "inference_request" and request.version == 1
    assert request.attempt == 0


@pytest.mark.parametrize("change", [
    {"version": 2}, {"type": "other"}, {"max_tokens": 0}, {"priority_class": "urgent"},
    {"request_id": "has space"}, {"unknown_field": 1},
])
def test_request_rejects_what_it_does_not_know(change: dict) -> None:
    base = {"request_id": "r-1", "tenant": "acme", "model": "m", "prompt": "p",
            "created_at_ms": 1}
    with pytest.raises(ValidationError):
        REQUEST.validate_python(base | change)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_sampling_value_that_is_no_number_is_refused_as_such(field: str) -> None:
    """`"temperature": NaN` (json.loads takes it) was refused as 'less than or equal to 2'."""
    raw = json.dumps({"request_id": "r-1", "tenant": "acme", "model": "m", "prompt": "p",
                      "created_at_ms": 1, field: float("nan")})
    with pytest.raises(ValidationError, match="finite number"):
        REQUEST.validate_json(raw)


def test_result_events_dispatch_on_type_tag() -> None:
    chunk = TokenChunk(request_id="r", seq=0, text=" a", token_count=1)
    rejection = Rejection(request_id="r", status_code=404, reason="no such model")
    assert isinstance(RESULT_EVENT.validate_json(chunk.to_bytes()), TokenChunk)
    assert isinstance(RESULT_EVENT.validate_json(rejection.to_bytes()), Rejection)


def test_every_placement_id_leaves_room_for_its_usage_records_ids() -> None:
    """A placement id of 201-300 characters was taken, and its final usage record's id
    then failed to validate inside the agent: no result, no bill, and an agent that
    crashed at every start on the claim left over."""
    request = InferenceRequest(request_id="r" * 128, tenant="t", model="m", prompt="p",
                               created_at_ms=5, attempt=100, requeued="preempted")
    longest = Placement(placement_id=f"{request.request_id}#100", node_id="n",
                        gpu_indices=(0,), kv_cache_mib=1, scheduler_epoch=1, placed_at_ms=0,
                        request=request)
    for suffix in (":final", ":123456"):
        UsageRecord(event_id=longest.placement_id + suffix, request_id=request.request_id,
                    placement_id=longest.placement_id, tenant="t", model="m",
                    priority_class="standard", node_id="n", gpu_type="H100-80GB",
                    prompt_tokens=0, completion_tokens=0, gpu_seconds=0.0, started_at_ms=0,
                    ended_at_ms=0)
    too_long = longest.model_dump(mode="json") | {"placement_id": "p" * 200}
    with pytest.raises(ValidationError, match="placement_id"):
        PLACEMENT.validate_python(too_long)


@pytest.mark.parametrize("ids,field", [
    ({"event_id": "evt-1"}, "event_id"),  # the same id under two requests was billed twice
    ({"event_id": "r#1:final"}, "event_id"),  # another placement's
    ({"event_id": "r#0final"}, "event_id"),
    ({"placement_id": "other#7", "event_id": "other#7:final"}, "placement_id"),
    ({"placement_id": "r#x", "event_id": "r#x:final"}, "placement_id"),
    ({"placement_id": "r", "event_id": "r:final"}, "placement_id"),
])
def test_a_usage_record_whose_ids_are_not_its_placements_is_invalid(ids, field) -> None:
    """Accounting keeps a request's applied event ids under its request id: an event id
    that came with two request ids was billed twice, once under each."""
    base = {"event_id": "r#0:final", "request_id": "r", "placement_id": "r#0", "tenant": "t",
            "model": "m", "priority_class": "standard", "node_id": "n", "gpu_type": "H100",
            "prompt_tokens": 1, "completion_tokens": 0, "gpu_seconds": 0.0,
            "started_at_ms": 0, "ended_at_ms": 0}
    UsageRecord.model_validate(base)
    UsageRecord.model_validate(base | {"event_id": "r#0:12"})
    with pytest.raises(ValidationError, match=f"{field} '"):
        UsageRecord.model_validate(base | ids)


def test_a_placement_its_agent_could_not_bill_is_invalid_on_the_wire() -> None:
    """An agent names its usage records after the placement: one whose id was not its
    request's would have run and then failed to bill (its usage record invalid)."""
    request = InferenceRequest(request_id="r", tenant="t", model="m", prompt="p",
                               created_at_ms=5)
    placed = Placement(placement_id="r#0", node_id="n", gpu_indices=(0,), kv_cache_mib=1,
                       scheduler_epoch=1, placed_at_ms=0, request=request)
    for other in ("other#0", "r", "r#", "r#1:2"):
        with pytest.raises(ValidationError, match="placement_id"):
            PLACEMENT.validate_python(placed.model_dump(mode="json") | {"placement_id": other})


def test_messages_round_trip_unchanged() -> None:
    request = InferenceRequest(request_id="r", tenant="t", model="m", prompt="p",
                               created_at_ms=5)
    assert REQUEST.validate_json(request.to_bytes()) == request


def test_a_reader_one_release_behind_takes_records_that_use_no_newer_field() -> None:
    class OlderRequest(InferenceRequest):  # a release before stop strings (extra="forbid")
        model_config = ConfigDict(extra="forbid", json_schema_extra=None)

    OlderRequest.model_fields.pop("stop")
    OlderRequest.model_rebuild(force=True)
    plain = InferenceRequest(request_id="r", tenant="t", model="m", prompt="p", created_at_ms=5)
    assert OlderRequest.model_validate_json(plain.to_bytes()).request_id == "r"
    assert "null" not in plain.to_bytes().decode()  # unset optional fields are left out
    with_stop = plain.model_copy(update={"stop": ["\n"]})
    with pytest.raises(ValidationError, match="stop"):  # the new feature needs the new reader
        OlderRequest.model_validate_json(with_stop.to_bytes())


def test_node_states_without_load_failures_read_and_write_as_a_release_before() -> None:
    """An agent a release behind reports no `load_failures`: its node takes every model it
    runs. An agent that has none leaves the field out, so a scheduler a release behind
    (which refuses fields it does not know) still reads its reports; one with a failure
    carries each model with the end of its cooldown on the agent's clock."""
    old = json.dumps({"type": "node_state", "version": 1, "node_id": "n1", "seq": 3,
                      "started_at_ms": 1, "reported_at_ms": 2, "gpus": []}).encode()
    state = NodeState.model_validate_json(old)
    assert state.load_failures is None
    assert b"load_failures" not in state.to_bytes()
    failed = state.model_copy(update={"load_failures": (
        LoadFailure(model="qwen2.5-1.5b", until_ms=60_002),)})
    assert NodeState.model_validate_json(failed.to_bytes()) == failed


def test_a_resume_without_what_its_engine_told_reads_and_writes_as_a_release_before() -> None:
    """A hand-back from an agent a release behind carries no engine count nor first token's
    time; one that has neither leaves them out, so a reader a release behind (which refuses
    fields it does not know) still takes it; one with them carries them unchanged."""
    old = {"request_id": "r", "tenant": "t", "model": "m", "prompt": "p", "max_tokens": 8,
           "created_at_ms": 1, "attempt": 1, "requeued": "preempted",
           "resume": {"tokens": [" a"], "streamed_tokens": 1, "next_seq": 1}}
    request = REQUEST.validate_python(old)
    assert (request.resume.prompt_tokens, request.resume.ttft_ms) == (None, None)
    assert json.loads(request.to_bytes())["resume"] == old["resume"]
    told = request.model_copy(update={"resume": request.resume.model_copy(
        update={"prompt_tokens": 1_000, "ttft_ms": 120.0})})
    assert REQUEST.validate_json(told.to_bytes()) == told


def test_chat_turns_without_a_name_read_and_write_as_a_release_before() -> None:
    """A chat turn's `name` is newer than the turn: a turn without one leaves it out, so a
    reader a release behind (which refuses fields it does not know) still takes the request,
    and makes the same asks digest of it (agents compare theirs to tell a redelivery from
    another request under the same id); a named turn carries its name unchanged."""
    class OlderTurn(ChatTurn):  # a release before names
        model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=None)

    OlderTurn.model_fields.pop("name")
    OlderTurn.model_rebuild(force=True)

    class OlderRequest(InferenceRequest):
        model_config = ConfigDict(extra="forbid", json_schema_extra=None)
        messages: tuple[OlderTurn, ...] | None = None

    plain = InferenceRequest(request_id="r", tenant="t", model="m", prompt="p",
                             created_at_ms=5, messages=(ChatTurn(role="user", content="hi"),))
    assert json.loads(plain.to_bytes())["messages"] == [{"role": "user", "content": "hi"}]
    older = OlderRequest.model_validate_json(plain.to_bytes())
    assert older.asks_digest() == plain.asks_digest()
    named = plain.model_copy(update={"messages": (
        ChatTurn(role="user", content="hi", name="alice"),)})
    assert REQUEST.validate_json(named.to_bytes()) == named
    assert named.asks_digest() != plain.asks_digest()
    with pytest.raises(ValidationError, match="name"):  # the new feature needs the new reader
        OlderRequest.model_validate_json(named.to_bytes())


def resumed(resume: Resume | None, max_tokens: int = 32_000) -> InferenceRequest:
    """A request of 3 prompt tokens by the estimate, at the attempt `resume` says."""
    return InferenceRequest(request_id="r", tenant="t", model="m", prompt="hello there",
                            max_tokens=max_tokens, created_at_ms=1, resume=resume,
                            attempt=0 if resume is None else 1,
                            requeued=None if resume is None else "preempted")


@pytest.mark.parametrize("resume,billed,reply", [
    (None, 3, 32_000),  # a first attempt: what it asks
    (Resume(tokens=(" a",) * 5), 3, 32_000),  # its engine counted the prompt as estimated
    (Resume(tokens=(" a",) * 5, prompt_tokens=1_000), 1_000, 31_768),  # the room left
    (Resume(prompt_tokens=1_000), 1_000, 31_768),  # stopped before its first token
    (Resume(tokens=(" a",) * 5, prompt_tokens=500), 500, 32_000),  # room beyond max_tokens
    # that engine served a longer context than the catalog's: on to max_tokens
    (Resume(tokens=(" a",) * 31_800, prompt_tokens=1_000), 1_000, 32_000),
])
def test_a_resumed_reply_is_bounded_by_the_room_its_engines_prompt_count_leaves(
        resume: Resume | None, billed: int, reply: int) -> None:
    """A context of 32,768: 3 + 32,000 fits; by its engine's count of 1,000 the prompt
    leaves room for 31,768 tokens, which the attempt that runs it asks its engine for, and
    the scheduler sizes its KV cache by. The request itself still asks for 32,000."""
    request = resumed(resume)
    assert request.billed_prompt_tokens == billed and request.prompt_token_count == 3
    assert request.reply_limit(32_768) == reply
    assert request.context_tokens(32_768) == billed + reply
    assert request.asks() == resumed(None).asks()


def test_what_earlier_attempts_did_is_reported_as_they_billed_it() -> None:
    request = resumed(Resume(tokens=(" a", " b"), streamed_tokens=2, next_seq=2,
                             prompt_tokens=1_000, ttft_ms=250.0))
    assert request.so_far() == {"text": " a b", "prompt_tokens": 1_000,
                                "completion_tokens": 2, "ttft_ms": 250.0}


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe",
                                 b'{"n": ' + b"1" * 5000 + b"}"])
def test_decode_json_object_says_what_is_wrong(raw: bytes) -> None:
    with pytest.raises(ValueError, match="JSON"):
        decode_json_object(raw)


def test_a_dead_letter_fits_in_a_record_whatever_it_came_from() -> None:
    """A 200 KB key of control bytes (Kafka takes it) was copied whole and JSON-escaped to
    1.2 MB: the producer refused the dead letter, and the scheduler read the record again
    forever, every request of its class waiting behind it."""
    worst = b"\x01" * 900_000
    record = ConsumerRecord(REQUESTS["standard"].name, 0, 7, 1000, 0, worst, worst, None, 0,
                            len(worst), ())
    letter = dead_letter(record, "x" * 10_000, "scheduler", 1000)
    assert len(letter.to_bytes()) < MAX_RECORD_BYTES // 2
    assert letter.key and letter.payload and letter.offset == 7


def test_a_record_nested_past_pythons_recursion_limit_is_a_value_error() -> None:
    """json.loads raised RecursionError, which every reader that skips or dead-letters a bad
    record with `except ValueError` let through: the routers' requests group read its batch
    again and again, and the scheduler dead-lettered it as a crash, with a traceback."""
    deep = b'{"x":' + b"[" * 3000 + b"]" * 3000 + b"}"
    with pytest.raises(NestedTooDeep, match="nests arrays and objects deeper than Python"):
        decode_json_object(deep)


@pytest.mark.parametrize("adapter,raw,reason", [
    (CANCEL, b'{"type": "cancel"}', "request_id: Field required; reason: Field required; "
     "at_ms: Field required"),
    (REQUEST, b'{"request_id": "r", "tenant": "t", "model": "m", "prompt": "x", '
     b'"created_at_ms": 1, "max_tokens": "many", "rack": 7}',
     "max_tokens: Input should be a valid integer; rack: Extra inputs are not permitted"),
    (CANCEL, b"{oops", "value: Invalid JSON: key must be a string at line 1 column 2"),
])
def test_a_refused_record_names_every_bad_field_on_one_line(adapter, raw: bytes,
                                                            reason: str) -> None:
    with pytest.raises(ValidationError) as refused:
        adapter.validate_json(raw)
    assert invalid_fields(refused.value) == reason


@pytest.mark.parametrize("field,value", [
    ("prompt_tokens", "true"), ("prompt_tokens", '"10"'), ("prompt_tokens", "10.0"),
    ("max_tokens", "true"), ("max_tokens", '"8"'), ("max_tokens", "8.0"),
])
def test_a_request_whose_token_counts_are_not_plain_numbers_is_invalid(field, value) -> None:
    """A request with `"prompt_tokens": true` was billed as 1 prompt token whatever its
    prompt (its agent bills `prompt_token_count`), "10" as 10."""
    base = {"request_id": "r", "tenant": "t", "model": "m", "prompt": "x" * 400,
            "created_at_ms": 1}
    raw = json.dumps(base)[:-1] + f', "{field}": {value}}}'
    with pytest.raises(ValidationError, match=field):
        REQUEST.validate_json(raw)


def test_a_request_whose_prompt_its_agent_could_not_bill_is_invalid() -> None:
    """prompt_tokens 10**9 + 1 was taken, placed and run, and then its usage record (at most
    10**9 tokens) failed to validate inside the agent: no bill."""
    base = {"request_id": "r", "tenant": "t", "model": "m", "prompt": "p", "created_at_ms": 1}
    largest = REQUEST.validate_python(base | {"prompt_tokens": 10**9})
    UsageRecord(event_id="r#0:final", request_id="r", placement_id="r#0", tenant="t",
                model="m", priority_class="standard", node_id="n", gpu_type="H100-80GB",
                prompt_tokens=largest.prompt_token_count, completion_tokens=0,
                gpu_seconds=0.0, started_at_ms=0, ended_at_ms=0)
    with pytest.raises(ValidationError, match="prompt_tokens"):
        REQUEST.validate_python(base | {"prompt_tokens": 10**9 + 1})


def test_prompt_tokens_are_four_bytes_each_rounded_up() -> None:
    assert count_prompt_tokens("") == 1
    assert count_prompt_tokens("abcd") == 1
    assert count_prompt_tokens("abcde") == 2
    assert count_prompt_tokens("tok " * 100) == 100
    # bytes of UTF-8, not characters: 2 + 3 + 4 bytes
    assert count_prompt_tokens("é") == 1
    assert count_prompt_tokens("é日😀") == 3
    assert count_prompt_tokens("é" * 100) == 50


def test_topics_are_named_once_with_a_class_each() -> None:
    names = [t.name for t in ALL_TOPICS]
    assert len(names) == len(set(names))
    assert set(REQUESTS) == {"interactive", "standard", "batch"}
    assert NODE_STATE.cleanup_policy == "compact"


def test_partition_for_key_matches_kafka_default_partitioner() -> None:
    from aiokafka.partitioner import DefaultPartitioner

    parts = list(range(6))
    for key in ("node-1", "node-2", "gpu-host-17"):
        assert partition_for_key(key, 6) == DefaultPartitioner()(key.encode(), parts, parts)


@pytest.mark.parametrize("copies,min_insync", [(1, "1"), (2, "2"), (3, "2")])
def test_topics_with_copies_acknowledge_a_write_once_two_have_it(
        copies: int, min_insync: str) -> None:
    """acks=all waits for the in-sync copies, and Kafka's default minimum of them is 1: an
    acknowledged request or usage record could go with the one broker that had it."""
    from gpusched_common import topics

    for spec in topics.ALL_TOPICS:
        made = topics.new_topic(spec, copies)
        assert made.topic_configs["min.insync.replicas"] == min_insync
        assert made.replication_factor == copies and made.num_partitions == spec.partitions


async def test_a_fixed_topic_someone_else_creates_meanwhile_is_checked_too(monkeypatch) -> None:
    """Kafka's auto-create (or an operator) may make gpusched.placements between the list
    and the create: "already exists" was taken as done, so its count was never checked. And
    a topic Kafka does not describe is said to be so, not to have 0 partitions."""
    from aiokafka.errors import TopicAlreadyExistsError

    from gpusched_common import topics

    described = {"gpusched.placements": [{"error_code": 0, "topic": "gpusched.placements",
                                          "partitions": [{}] * 12}]}

    class Admin:
        def __init__(self, **_: object) -> None: ...
        async def start(self) -> None: ...
        async def close(self) -> None: ...
        async def list_topics(self) -> list[str]:
            return []

        async def create_topics(self, new: list) -> object:
            return type("R", (), {"topic_errors": [
                (n.name, TopicAlreadyExistsError.errno, "exists") for n in new]})()

        async def describe_topics(self, names: list[str]) -> list[dict]:
            return [d for n in names for d in described.get(n, [
                {"error_code": 3, "topic": n, "partitions": []}])]

    monkeypatch.setattr(topics, "AIOKafkaAdminClient", Admin)
    monkeypatch.setattr(topics, "DESCRIBE_RETRY_S", 0.0)
    with pytest.raises(topics.TopicsMismatch) as wrong:
        await topics.ensure_topics("kafka:9092", (topics.PLACEMENTS, topics.CONTROL))
    assert "gpusched.placements has 12 partitions, gpusched needs exactly 6" in str(wrong.value)
    assert "Kafka did not describe gpusched.control" in str(wrong.value)
    described["gpusched.placements"][0]["partitions"] = [{}] * 6
    await topics.ensure_topics("kafka:9092", (topics.PLACEMENTS, topics.RESULTS))  # fine


def test_a_requests_status_and_another_requests_cancel_never_share_a_redis_key() -> None:
    """Request ids may hold ':', so the status hash of request 'x:cancelled' was the cancel
    marker of request 'x': storing one failed (WRONGTYPE) and stalled the router's status
    consumer, and the agents' claim of 'x' failed after it had taken the claim."""
    from gpusched_common.redis_keys import CANCELLED_KEY
    from gpusched_router.adapters.results import STATUS_KEY

    assert STATUS_KEY.format("x:cancelled") != CANCELLED_KEY.format("x")
    assert not CANCELLED_KEY.format("x").startswith(STATUS_KEY.format(""))
