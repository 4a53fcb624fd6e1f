"""The agent runtime with the simulated executor and in-memory publish and ledger: duplicate
and stale placements, cancel and preempt mid-stream, partial usage deltas, SIGTERM drain,
a restart that hands back what a crashed run left, and the handlers' dead letters for
records that are no command."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from faststream.kafka import KafkaMessage, TestKafkaBroker
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, Counter

from gpusched_agent import handlers
from gpusched_agent import main as agent_main
from gpusched_agent.adapters.executor import ExecutorUnavailable, PromptTokens
from gpusched_agent.adapters.ledger import MemoryLedger
from gpusched_agent.adapters.simulated import SimulatedExecutor
from gpusched_agent.domain.inventory import parse_simulated
from gpusched_agent.domain.node import NodeModel
from gpusched_agent.runtime import AgentRuntime, Ignored, Reused, Stale, Started, Stopping
from gpusched_agent.settings import AgentSettings
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models
from gpusched_common.contracts import (
    CANCEL,
    DEAD_LETTER,
    LAST_ATTEMPT,
    MAX_USAGE_GPU_SECONDS,
    PLACEMENT_COMMAND,
    REASON_CHARS,
    Cancel,
    InferenceRequest,
    LoadFailure,
    Message,
    NodeState,
    Placement,
    Preempt,
    RequestResult,
    TokenChunk,
    UsageRecord,
)
from gpusched_common.settings import KafkaSettings, RedisSettings, TelemetrySettings

CATALOG = load_models(Path(__file__).resolve().parents[2] / "config")
MODEL = "qwen2.5-1.5b"


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[Message, str, str]] = []

    async def __call__(self, message: Message, topic: str, key: str, wait: bool = True) -> None:
        self.sent.append((message, topic, key))

    def of(self, kind: type) -> list:
        return [m for m, _, _ in self.sent if isinstance(m, kind)]


def make(time_scale: float = 0.01, usage_interval_s: float = 60.0, epoch: int | None = None,
         spec: str = "2xH100-80GB", ledger: MemoryLedger | None = None, now_ms: int = 1_000,
         sink: Sink | None = None, clock: Callable[[], int] | None = None,
         node_id: str = "n1", **options: Any) -> tuple[AgentRuntime, Sink, MemoryLedger]:
    """A runtime started at `now_ms` (its run id; the time throughout, unless `clock`
    says otherwise); pass `ledger` to restart on one, `options` to set AgentRuntime's."""
    sink, ledger = sink or Sink(), ledger or MemoryLedger(epoch)
    runtime = AgentRuntime(node_id, NodeModel.from_inventory(parse_simulated(spec, node_id)),
                           CATALOG, SimulatedExecutor(time_scale, seed=7), sink, ledger,
                           clock or (lambda: now_ms), chunk_tokens=4, heartbeat_s=1.0,
                           usage_interval_s=usage_interval_s, **options)
    return runtime, sink, ledger


def placement(rid: str, max_tokens: int = 8, epoch: int = 1, gpu: int = 0,
              attempt: int = 0) -> Placement:
    req = InferenceRequest(request_id=rid, tenant="acme", model=MODEL, prompt="hello there",
                           max_tokens=max_tokens, created_at_ms=0, attempt=attempt,
                           requeued="preempted" if attempt else None)
    return Placement(placement_id=f"{rid}#{attempt}", node_id="n1", gpu_indices=(gpu,),
                     kv_cache_mib=64, scheduler_epoch=epoch, placed_at_ms=0, request=req)


async def settle(runtime: AgentRuntime, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while runtime.in_flight:
            await asyncio.sleep(0.005)


async def until_tokens(sink: Sink, n: int) -> int:
    async with asyncio.timeout(10):
        while sum(c.token_count for c in sink.of(TokenChunk)) < n:
            await asyncio.sleep(0.001)
    return sum(c.token_count for c in sink.of(TokenChunk))


def usage_sum(sink: Sink, rid: str) -> tuple[int, int, float]:
    """What the request's records bill; their positions tile the prompt and the reply from
    0, each position in one record (accounting bills a position once)."""
    records = [u for u in sink.of(UsageRecord) if u.request_id == rid]
    assert len({u.event_id for u in records}) == len(records)  # unique event ids
    for start, count in (("prompt_from", "prompt_tokens"),
                         ("completion_from", "completion_tokens")):
        spans = sorted((getattr(u, start), getattr(u, count)) for u in records
                       if getattr(u, count))
        tiled = itertools.accumulate((n for _, n in spans[:-1]), initial=0)
        assert [a for a, _ in spans] == list(tiled)[:len(spans)], f"{rid}: {count} at {spans}"
    return (sum(u.prompt_tokens for u in records), sum(u.completion_tokens for u in records),
            sum(u.gpu_seconds for u in records))


async def test_a_placement_runs_and_bills_once_even_when_delivered_twice() -> None:
    runtime, sink, _ = make()
    p = placement("r1")
    assert isinstance(await runtime.command(p), Started)
    assert await runtime.command(p) == Ignored("duplicate")
    await settle(runtime)
    assert await runtime.command(p) == Ignored("duplicate")  # also after it finished
    [result] = sink.of(RequestResult)
    assert result.status == "completed" and result.completion_tokens == 8
    assert len(result.text.split()) == 8
    [usage] = sink.of(UsageRecord)
    assert usage.event_id == "r1#0:final" and usage.completion_tokens == 8
    assert usage.prompt_tokens == result.prompt_tokens and usage.gpu_seconds > 0


async def test_another_request_under_a_claimed_placements_id_is_rejected_not_dropped() -> None:
    """A scheduler that forgot a request (past its memory of decisions, or restarted) placed
    another under the same id as `<id>#0`: the claim of the first made the agent ignore it as
    a duplicate, the scheduler then dropped it as ended, and nothing answered it. It is
    rejected (the caller dead-letters it) and not run; a redelivery of the first is still a
    duplicate."""
    runtime, sink, _ = make()
    first = placement("reused")
    assert isinstance(await runtime.command(first), Started)
    await settle(runtime)
    second = placement("reused", max_tokens=5)
    outcome = await runtime.command(second)
    assert isinstance(outcome, Reused), outcome
    assert "request_id 'reused'" in outcome.reason and "give each request its own id" in \
        outcome.reason
    assert await runtime.command(first) == Ignored("duplicate")
    await settle(runtime)
    assert len(sink.of(RequestResult)) == 1
    running = placement("again", max_tokens=4000)  # and while the first still runs here
    assert isinstance(await runtime.command(running), Started)
    assert isinstance(await runtime.command(placement("again", max_tokens=3)), Reused)
    assert await runtime.command(running) == Ignored("duplicate")
    runtime._stop(running.placement_id, "cancelled", "test over")
    await settle(runtime)


async def test_the_first_token_streams_alone_then_chunks_of_chunk_tokens() -> None:
    runtime, sink, _ = make()  # chunk_tokens=4
    await runtime.command(placement("t1", max_tokens=10))
    await settle(runtime)
    # the first chunk is the client's time to first token: it does not wait for 3 more
    assert [c.token_count for c in sink.of(TokenChunk)] == [1, 4, 4, 1]


async def test_stale_and_future_scheduler_epochs_are_rejected() -> None:
    """A command with an epoch no leader has taken yet used to be taken, and raised the
    highest epoch seen: every command of the real leader was then refused as stale."""
    runtime, sink, ledger = make(epoch=5)
    out = await runtime.command(placement("old", epoch=4))
    assert isinstance(out, Stale) and "current leader's 5" in out.reason
    forged = Preempt(placement_id="x#0", request_id="x", node_id="n1", scheduler_epoch=10**6,
                     reason="x")
    out = await runtime.command(forged)
    assert isinstance(out, Stale) and "newer than the current leader's 5" in out.reason
    ledger.epoch = 7  # a new leader took over
    assert isinstance(await runtime.command(placement("new", epoch=7)), Started)
    ledger.epoch = None  # Redis came back without its data
    out = await runtime.command(placement("zombie", epoch=6))  # < seen 7
    assert isinstance(out, Stale) and "already took commands from" in out.reason
    stale_preempt = Preempt(placement_id="new#0", request_id="new", node_id="n1",
                            scheduler_epoch=3, reason="x")
    assert isinstance(await runtime.command(stale_preempt), Stale)
    await settle(runtime)
    assert [r.request_id for r in sink.of(RequestResult)] == ["new"]
    assert "old#0" not in ledger.claims  # a stale placement claims nothing


async def test_a_forged_epoch_while_redis_has_none_does_not_fence_off_the_next_leader(
) -> None:
    """With no leader epoch in Redis (none written yet, or Redis lost its data), a command
    carrying a huge epoch raised the highest epoch seen: the real leader's commands were
    then all refused as stale until the agent restarted."""
    runtime, sink, ledger = make(epoch=None)
    forged = Preempt(placement_id="x#0", request_id="x", node_id="n1", scheduler_epoch=2**62,
                     reason="x")
    assert isinstance(await runtime.command(forged), Ignored)  # nothing of that id runs
    ledger.epoch = 3  # the real leader writes its token
    assert isinstance(await runtime.command(placement("legit", epoch=3)), Started)
    await settle(runtime)
    assert [r.request_id for r in sink.of(RequestResult)] == ["legit"]


async def test_cancel_mid_stream_stops_promptly_and_bills_what_was_produced() -> None:
    runtime, sink, _ = make(time_scale=1.0)
    await runtime.command(placement("c1", max_tokens=2000))
    await until_tokens(sink, 8)
    assert isinstance(runtime.cancel(Cancel(request_id="c1", reason="client went away",
                                            at_ms=0)), Stopping)
    await settle(runtime, timeout_s=1)
    [result] = sink.of(RequestResult)
    assert result.status == "cancelled" and 8 <= result.completion_tokens < 2000
    assert result.finish_reason == "cancelled: client went away"
    streamed = sum(c.token_count for c in sink.of(TokenChunk))
    prompt, completion, gpu_s = usage_sum(sink, "c1")
    assert completion == result.completion_tokens == streamed
    assert prompt == result.prompt_tokens and gpu_s > 0
    assert [u.final for u in sink.of(UsageRecord)] == [True]


async def test_cancel_that_arrives_before_its_placement_ends_it_unbilled() -> None:
    runtime, sink, _ = make()
    runtime.cancel(Cancel(request_id="early", reason="client went away", at_ms=0))
    await runtime.command(placement("early"))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.status == "cancelled" and result.completion_tokens == 0
    assert usage_sum(sink, "early") == (0, 0, 0.0)


async def test_a_cancel_of_a_megabyte_reason_still_ends_its_request_in_one_record() -> None:
    """Any Kafka client may send a cancel: one with a 1 MB reason (Kafka takes it) made a
    result Kafka refused, sent again forever, and the placement never ended."""
    raw = Cancel(request_id="big", reason="", at_ms=0).to_bytes().replace(
        b'"reason":""', b'"reason":"' + b"x" * 1_048_000 + b'"')
    runtime, sink, ledger = make()
    runtime.cancel(CANCEL.validate_json(raw))
    await runtime.command(placement("big"))
    # one kept in Redis whole (by a release before the cut) for an agent that missed it
    ledger.cancels["kept"] = "x" * 1_048_000
    await runtime.command(placement("kept"))
    await settle(runtime)
    results = sink.of(RequestResult)
    assert [r.status for r in results] == ["cancelled"] * 2
    assert all(len(r.to_bytes()) < 3 * REASON_CHARS for r in results)
    assert PLACEMENT_COMMAND.validate_json(Preempt(
        placement_id="big#0", request_id="big", node_id="n1", scheduler_epoch=0,
        reason="y" * 10 * REASON_CHARS).to_bytes()).reason == "y" * REASON_CHARS


async def test_a_cancel_the_agent_never_read_ends_its_placement_unbilled() -> None:
    """The agent was down when the cancel went out on Kafka; the router kept it in Redis."""
    runtime, sink, ledger = make()
    ledger.cancels["missed"] = "client disconnected"
    await runtime.command(placement("missed"))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.status == "cancelled" and result.completion_tokens == 0
    assert result.finish_reason == "cancelled: client disconnected"
    assert usage_sum(sink, "missed") == (0, 0, 0.0)


async def test_preempt_bills_usage_so_far_and_hands_the_request_back_in_front() -> None:
    runtime, sink, _ = make(time_scale=1.0)
    await runtime.command(placement("p1", max_tokens=2000))
    await until_tokens(sink, 4)
    out = await runtime.command(Preempt(placement_id="p1#0", request_id="p1", node_id="n1",
                                        scheduler_epoch=1, reason="interactive work"))
    assert isinstance(out, Stopping)
    await settle(runtime, timeout_s=1)
    assert sink.of(RequestResult) == []  # the client keeps waiting for the next attempt
    [usage] = sink.of(UsageRecord)
    assert usage.final and 4 <= usage.completion_tokens < 2000
    [(again, topic, key)] = [s for s in sink.sent if isinstance(s[0], InferenceRequest)]
    assert topic == topics.REQUESTS["standard"].name and key == "p1"
    assert (again.attempt, again.requeued) == (1, "preempted")
    # its memory is free again
    assert runtime.node.gpus[0].active == {}


async def test_a_preempted_request_resumes_where_it_stopped_streaming_and_billing_once(
) -> None:
    """Before, the next attempt started over at seq 0: a streaming client got the first
    attempt's text and then the whole text again, and both attempts were billed."""
    first, sink, _ = make(time_scale=1.0)
    await first.command(placement("p2", max_tokens=40))
    await until_tokens(sink, 6)
    await first.command(Preempt(placement_id="p2#0", request_id="p2", node_id="n1",
                                scheduler_epoch=1, reason="interactive work"))
    await settle(first, timeout_s=1)
    [again] = sink.of(InferenceRequest)
    assert again.resume is not None and 6 <= len(again.resume.tokens) < 40
    streamed = sink.of(TokenChunk)
    assert again.resume.next_seq == len(streamed)
    assert again.resume.streamed_tokens == sum(c.token_count for c in streamed)

    second = make(sink=sink, now_ms=2_000)[0]  # another node runs the next attempt
    p = placement("p2", max_tokens=40, attempt=1)
    await second.command(p.model_copy(update={"request": again}))
    await settle(second)
    [result] = sink.of(RequestResult)
    chunks = sink.of(TokenChunk)
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # one stream, no repeat
    assert "".join(c.text for c in chunks) == result.text
    assert result.text.startswith("".join(again.resume.tokens))
    assert result.completion_tokens == sum(c.token_count for c in chunks) == 40
    prompt, completion, _ = usage_sum(sink, "p2")
    assert (prompt, completion) == (result.prompt_tokens, 40)  # each token billed once
    # the first token came at 1,000 ms, in the first attempt (it was null after a resume)
    assert result.ttft_ms == again.resume.ttft_ms == 1_000.0


async def test_partial_usage_records_are_deltas_that_sum_to_the_total() -> None:
    runtime, sink, _ = make(time_scale=1.0, usage_interval_s=0.02)
    await runtime.command(placement("long", max_tokens=150))
    await settle(runtime)
    records = sink.of(UsageRecord)
    assert len(records) >= 3 and [r.final for r in records] == [False] * (len(records) - 1) + [True]
    assert [r.event_id for r in records[:2]] == ["long#0:1", "long#0:2"]
    [result] = sink.of(RequestResult)
    prompt, completion, _ = usage_sum(sink, "long")
    assert (prompt, completion) == (result.prompt_tokens, 150)
    assert records[0].prompt_tokens == result.prompt_tokens  # the prompt is billed once


class SlowFirstToken(SimulatedExecutor):
    """Its first token comes `first_token_s` after the start: loading the model (`load`),
    or prefilling a long prompt (`prefill`)."""

    def __init__(self, where: str, first_token_s: float) -> None:
        super().__init__(1.0, seed=7)
        self.where, self.first_token_s = where, first_token_s

    async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
        if self.where == "load":
            await asyncio.sleep(self.first_token_s)

    def generate(self, job):  # noqa: ANN001, ANN202
        async def tokens():  # noqa: ANN202
            if self.where == "prefill":
                await asyncio.sleep(self.first_token_s)
            for _ in range(job.request.max_tokens):
                await asyncio.sleep(0.001)
                yield " x"
        return tokens()


@pytest.mark.parametrize("where", ["load", "prefill"])
async def test_a_crash_before_the_first_token_loses_at_most_one_usage_interval(where) -> None:
    """Partial usage records were made only as tokens came: a crash while the model loaded
    or the prompt prefilled lost all the GPU time since the start, not one interval."""
    runtime, sink, ledger = make(usage_interval_s=0.05)
    runtime.executor = SlowFirstToken(where, first_token_s=10.0)
    await runtime.command(placement("slow"))
    await asyncio.sleep(0.5)
    await crash("slow#0")
    restarted, _, _ = make(ledger=ledger, now_ms=2_000, sink=sink)
    await restarted.recover()
    prompt, completion, gpu_seconds = usage_sum(sink, "slow")
    assert gpu_seconds >= 0.5 - 2 * 0.05 and (prompt, completion) == (3, 0)


async def test_partial_records_before_the_first_token_and_the_final_sum_exactly() -> None:
    runtime, sink, _ = make(usage_interval_s=0.05)
    runtime.executor = SlowFirstToken("load", first_token_s=0.3)
    await runtime.command(placement("slow", max_tokens=50))
    await settle(runtime)
    await asyncio.sleep(0.1)  # no partial record comes after the final one
    records = sink.of(UsageRecord)
    assert [r.final for r in records] == [False] * (len(records) - 1) + [True]
    assert records[0].completion_tokens == 0 and records[0].gpu_seconds > 0
    [result] = sink.of(RequestResult)
    assert usage_sum(sink, "slow")[:2] == (result.prompt_tokens, result.completion_tokens)


class KafkaAway(Sink):
    """Refuses confirmed sends while `away`, as aiokafka does once its request time-out
    passes with no broker."""

    def __init__(self) -> None:
        super().__init__()
        self.away = False
        self.refused = 0

    async def __call__(self, message: Message, topic: str, key: str, wait: bool = True) -> None:
        if self.away and wait:
            self.refused += 1
            raise TimeoutError("no broker")
        await super().__call__(message, topic, key, wait)


async def test_records_kafka_refuses_are_sent_once_it_is_back_and_the_reporter_lives_on(
) -> None:
    """Before, a refused final record ended the run's task with the claim held and nothing
    sent again (no result, no bill), a refused partial usage record lost its deltas, and a
    refused heartbeat ended the reporter for good (the node looked lost forever)."""
    sink = KafkaAway()
    runtime, _, ledger = make(time_scale=1.0, usage_interval_s=0.02, sink=sink)
    runtime._heartbeat_s = 0.02
    reporter = asyncio.create_task(runtime.report_forever())
    await runtime.command(placement("r1", max_tokens=60))
    await until_tokens(sink, 1)
    sink.away = True
    async with asyncio.timeout(10):
        while runtime.node.gpus[0].active:  # generation ended; its finals are refused
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert sink.refused >= 3 and not sink.of(RequestResult) and ledger.held["n1"]
    reports = len(sink.of(NodeState))
    sink.away = False
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.completion_tokens == 60
    prompt, completion, _ = usage_sum(sink, "r1")
    assert (prompt, completion) == (result.prompt_tokens, 60)  # no delta lost
    assert not ledger.held["n1"]  # released once sent
    await asyncio.sleep(0.1)
    assert len(sink.of(NodeState)) > reports and not reporter.done()
    assert ledger.alive_nodes == {"n1"}  # said in Redis all along: its work is not retried
    reporter.cancel()


async def test_waiting_on_kafka_for_the_last_records_is_no_gpu_time() -> None:
    """`a` ends while Kafka refuses its last chunk for a second. Before, its meter ran on
    until the chunk went out: `a` was billed the outage as GPU time, and `b`, sharing the
    GPU meanwhile, only half of its own."""
    class SlowForA(Sink):
        refused_until: float | None = None

        async def __call__(self, message, topic, key, wait=True) -> None:  # noqa: ANN001
            if wait and isinstance(message, TokenChunk) and message.request_id == "a":
                now = asyncio.get_running_loop().time()
                self.refused_until = self.refused_until or now + 1.0
                if now < self.refused_until:
                    raise TimeoutError("no broker")
            await super().__call__(message, topic, key, wait)

    runtime, sink, _ = make(time_scale=1.0, sink=SlowForA())
    await runtime.command(placement("warm", max_tokens=1))  # the model loaded first
    await settle(runtime)
    await runtime.command(placement("a", max_tokens=10))
    await runtime.command(placement("b", max_tokens=400))
    await settle(runtime)
    a, b = usage_sum(sink, "a")[2], usage_sum(sink, "b")[2]
    assert a < 0.25 and b > 0.6, (a, b)  # ~0.01 and ~0.9 with Kafka answering at once


async def test_an_agent_cut_off_from_kafka_and_redis_stops_its_work_before_it_runs_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A network partition: the scheduler hears no report and finds no alive mark, and
    retries the node's work elsewhere. Before, the agent ran it on meanwhile, so the request
    ran and was billed twice. A Kafka or a Redis outage alone stops nothing."""
    from gpusched_agent import runtime as runtime_module

    class RedisAway(MemoryLedger):
        away = False

        async def alive(self, node_id: str) -> None:
            if self.away:
                raise ConnectionError("Redis is away")
            await super().alive(node_id)

    monkeypatch.setattr(runtime_module, "FENCE_AFTER_S", 1.0)
    sink, ledger = KafkaAway(), RedisAway()
    runtime, _, _ = make(time_scale=1.0, sink=sink, ledger=ledger)
    runtime._heartbeat_s = 0.1
    reporter = asyncio.create_task(runtime.report_forever())
    await runtime.command(placement("long", max_tokens=5000))
    await until_tokens(sink, 1)
    ledger.away = True  # Redis alone: Kafka still takes the reports
    await asyncio.sleep(2.2)
    assert runtime.in_flight == 1
    ledger.away, sink.away = False, True  # Kafka alone: Redis still takes the alive mark
    await asyncio.sleep(2.2)
    assert runtime.in_flight == 1
    ledger.away = True  # both
    await asyncio.sleep(2.5)
    assert runtime._running["long#0"].stop_reason == "drained"  # its records wait for Kafka
    sink.away = ledger.away = False  # back: the hand-back goes out, billed for what it used
    await settle(runtime)
    [again] = sink.of(InferenceRequest)
    assert (again.request_id, again.attempt, again.requeued) == ("long", 1, "node_lost")
    assert again.resume is not None and len(again.resume.tokens) == usage_sum(sink, "long")[1]
    assert not sink.of(RequestResult)
    reporter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reporter


@pytest.mark.parametrize("case", ["redis-hangs-kafka-away", "redis-away-slow-heartbeat"])
async def test_the_fence_is_neither_late_on_a_silent_redis_nor_early_on_a_slow_heartbeat(
        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Cut off, Redis answers nothing for its client's whole time-out: the fence, looked at
    only after each alive mark, came seconds after the scheduler's retry. With a heartbeat
    slower than the fence, a Redis outage alone (Kafka taking every report) stopped all
    work."""
    from gpusched_agent import runtime as runtime_module

    class SilentRedis(MemoryLedger):
        async def alive(self, node_id: str) -> None:
            if case == "redis-hangs-kafka-away":
                await asyncio.sleep(5)  # no answer before the client's time-out
            raise ConnectionError("Redis is away")

    monkeypatch.setattr(runtime_module, "FENCE_AFTER_S", 1.0)
    sink = KafkaAway()
    runtime, _, _ = make(time_scale=1.0, sink=sink, ledger=SilentRedis())
    runtime._heartbeat_s = 30.0 if case == "redis-away-slow-heartbeat" else 0.1
    await runtime.command(placement("long", max_tokens=5000))
    await until_tokens(sink, 1)
    sink.away = case == "redis-hangs-kafka-away"
    reporter = asyncio.create_task(runtime.report_forever())
    await asyncio.sleep(2.6)
    stopped = runtime._running["long#0"].stop_reason
    assert stopped == ("drained" if case == "redis-hangs-kafka-away" else None)
    reporter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reporter
    sink.away = False
    if stopped is None:
        await runtime.command(Preempt(placement_id="long#0", request_id="long", node_id="n1",
                                      scheduler_epoch=1, reason="test over"))
    await settle(runtime)


async def test_a_drain_begun_while_cut_off_does_not_put_the_fence_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's heartbeat counted as contact: an agent already cut off when it was told
    to stop ran its work on past the scheduler's retry."""
    from gpusched_agent import runtime as runtime_module

    class RedisAway(MemoryLedger):
        async def alive(self, node_id: str) -> None:
            raise ConnectionError("Redis is away")

    monkeypatch.setattr(runtime_module, "FENCE_AFTER_S", 1.5)
    sink = KafkaAway()
    runtime, _, _ = make(time_scale=1.0, sink=sink, ledger=RedisAway())
    runtime._heartbeat_s = 0.1
    await runtime.command(placement("long", max_tokens=5000))
    await until_tokens(sink, 1)
    reporter = asyncio.create_task(runtime.report_forever())
    await asyncio.sleep(0.3)  # reported once: contact
    sink.away = True
    await asyncio.sleep(1.0)
    reporter.cancel()  # SIGTERM
    with contextlib.suppress(asyncio.CancelledError):
        await reporter
    draining = asyncio.create_task(runtime.drain(timeout_s=30))
    await asyncio.sleep(1.2)  # 2.2 s cut off: fenced by now, not 1.5 s after the drain began
    assert "cut off from Kafka and Redis" in runtime._running["long#0"].detail
    sink.away = False
    await draining


async def test_a_stop_that_comes_as_a_reply_ends_at_its_stop_string_changes_nothing() -> None:
    """The stop string was found and the engine's stream was closing when a preempt came:
    the request was handed back with every token, the stop string and what followed
    included, instead of completing."""
    closing = asyncio.Event()

    class ClosesSlowly(SimulatedExecutor):
        def generate(self, job):  # noqa: ANN001, ANN202
            async def tokens():  # noqa: ANN202
                try:
                    for token in ["Hello", " there", "!END", " more"]:
                        await asyncio.sleep(0.01)
                        yield token
                finally:
                    closing.set()
                    await asyncio.sleep(0.1)  # an HTTP stream's close, an abort
            return tokens()

    runtime, sink, _ = make(time_scale=1.0)
    runtime.executor = ClosesSlowly(1.0, seed=1)
    p = placement("s", max_tokens=20)
    await runtime.command(p.model_copy(update={"request": p.request.model_copy(
        update={"stop": ["END"]})}))
    await closing.wait()
    await runtime.command(Preempt(placement_id="s#0", request_id="s", node_id="n1",
                                  scheduler_epoch=1, reason="interactive work"))
    await settle(runtime)
    assert not sink.of(InferenceRequest)
    [result] = sink.of(RequestResult)
    assert (result.status, result.finish_reason, result.text) == ("completed", "stop",
                                                                  "Hello there!")


async def test_the_agent_says_it_is_alive_while_a_node_state_send_hangs() -> None:
    """Before, the alive mark was refreshed between reports, so a send blocked on a Kafka
    that was away (aiokafka waits 40 s) let it lapse and the node's work was retried."""
    class Hangs(Sink):
        async def __call__(self, message, topic, key, wait=True) -> None:
            if isinstance(message, NodeState):
                await asyncio.Event().wait()  # never answers

    runtime, _, ledger = make(sink=Hangs())
    reporter = asyncio.create_task(runtime.report_forever())
    await asyncio.sleep(0.1)
    assert ledger.alive_nodes == {"n1"}
    ledger.alive_nodes.clear()
    await asyncio.sleep(1.2)
    assert ledger.alive_nodes == {"n1"}  # said again while the report still hangs
    reporter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reporter


async def test_a_stop_string_ends_the_text_before_it_and_streams_nothing_past_it() -> None:
    def run_with(rid: str, stop: list[str] | None) -> Placement:
        p = placement(rid, max_tokens=64)
        return p.model_copy(update={"request": p.request.model_copy(
            update={"seed": 3, "stop": stop})})

    runtime, sink, _ = make()
    await runtime.command(run_with("free", None))
    await settle(runtime)
    [free] = sink.of(RequestResult)
    assert free.finish_reason == "length" and free.completion_tokens == 64
    chunks = sink.of(TokenChunk)
    tokens = [c.text for c in chunks]  # chunks of 4 tokens: cut a stop across two of them
    stop = tokens[3][-3:] + tokens[4][:4]
    end = free.text.find(stop)
    assert 0 < end < len(free.text) - len(stop)

    runtime, sink, _ = make()
    await runtime.command(run_with("cut", ["never said", stop]))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert (result.status, result.finish_reason, result.text) == ("completed", "stop",
                                                                  free.text[:end])
    streamed = sink.of(TokenChunk)
    assert "".join(c.text for c in streamed) == result.text  # nothing past the stop string
    # billed: every token generated, up to the one that completed the stop string
    words = [" " + w for w in free.text.split(" ")[1:]]  # the simulated tokens are " word"
    upto = next(k for k in range(64) if stop in "".join(words[:k]))
    _, completion, _ = usage_sum(sink, "cut")
    assert sum(c.token_count for c in streamed) == completion == result.completion_tokens == upto


async def test_requests_share_a_gpu_and_their_gpu_seconds_add_up_to_busy_time() -> None:
    runtime, sink, _ = make(time_scale=1.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i in range(4):
        await runtime.command(placement(f"s{i}", max_tokens=60))
    await settle(runtime)
    busy_s = loop.time() - t0
    results = sink.of(RequestResult)
    assert len(results) == 4 and all(r.completion_tokens == 60 for r in results)
    billed = sum(u.gpu_seconds for u in sink.of(UsageRecord))
    assert 0 < billed <= busy_s * 1.05
    # batched: four requests together take far less than four times one alone
    alone_runtime, alone_sink, _ = make(time_scale=1.0)
    t1 = loop.time()
    await alone_runtime.command(placement("solo", max_tokens=60))
    await settle(alone_runtime)
    assert busy_s < 2.5 * (loop.time() - t1)


async def test_drain_finishes_short_work_hands_back_long_work_and_reports_stopped() -> None:
    runtime, sink, _ = make(time_scale=1.0)
    await runtime.command(placement("short", max_tokens=5))
    await runtime.command(placement("long", max_tokens=5000, gpu=1))
    await until_tokens(sink, 5)
    await runtime.drain(timeout_s=0.3)
    assert runtime.in_flight == 0 and runtime.status == "stopped"
    assert [r.request_id for r in sink.of(RequestResult)] == ["short"]
    [again] = [m for m in sink.of(InferenceRequest)]
    assert (again.request_id, again.attempt, again.requeued) == ("long", 1, "node_lost")
    assert usage_sum(sink, "long")[1] > 0
    states = sink.of(NodeState)
    assert [s.status for s in states][-2:] == ["draining", "stopped"]
    # while draining or stopped, new work is handed back, not run, as drained work: first in
    # line and no refusal (a request refused by 4 nodes before failed "not runnable")
    await runtime.command(placement("late"))
    once_refused = placement("unlucky")
    await runtime.command(once_refused.model_copy(update={"request": once_refused.request
                                                          .model_copy(update={"refused": 4})}))
    await settle(runtime)
    back = sink.of(InferenceRequest)
    assert [(m.request_id, m.requeued, m.refused) for m in back] == [
        ("long", "node_lost", None), ("late", "node_lost", None), ("unlucky", "node_lost", 4)]
    assert not sink.of(RequestResult)[1:]


async def test_an_engine_stopping_with_a_draining_agent_uses_up_no_refusal() -> None:
    """A rolling restart stops vLLM beside the agent: the work it drops while the node drains
    goes back as drained work, not as the node's refusal (one refused 4 times before failed
    "not runnable after 5 attempts")."""
    runtime, sink, _ = make(time_scale=1.0)
    real = runtime.executor.generate

    def generate(job):
        async def tokens():
            async for token in real(job):
                if runtime.status != "ready":  # the engine got its SIGTERM too
                    raise ExecutorUnavailable("inference server dropped the stream")
                yield token
        return tokens()

    runtime.executor.generate = generate  # type: ignore[method-assign]
    refused_before = placement("long", max_tokens=5000)
    await runtime.command(refused_before.model_copy(update={
        "request": refused_before.request.model_copy(update={"refused": 4})}))
    await until_tokens(sink, 1)
    await runtime.drain(timeout_s=2)
    await settle(runtime)
    [back] = sink.of(InferenceRequest)
    assert (back.requeued, back.refused) == ("node_lost", 4)
    assert not sink.of(RequestResult)


async def test_a_drained_agent_stops_saying_it_is_alive_though_a_write_swallows_a_cancel(
) -> None:
    """Python 3.11's wait_for (redis-py writes under it) may swallow a cancel as its write is
    done: the task saying the agent is alive, cancelled once, went on after the drain, and
    the stopped node said in Redis that it was alive."""
    runtime, _, ledger = make()
    marks, writing = [], asyncio.Event()
    swallowed = 0

    async def alive(node_id: str) -> None:
        nonlocal swallowed
        marks.append(asyncio.get_running_loop().time())
        writing.set()
        try:
            await asyncio.sleep(0.2)  # the write in flight
        except asyncio.CancelledError:
            if swallowed == 0:  # as wait_for does when the write is done
                swallowed += 1
                return
            raise
        finally:
            writing.clear()

    ledger.alive = alive  # type: ignore[method-assign]
    runtime.start_reporting()
    await asyncio.sleep(0.3)
    await writing.wait()  # SIGTERM lands while a mark is being written
    await runtime.drain(timeout_s=0.1)
    drained = asyncio.get_running_loop().time()
    await asyncio.sleep(1.5)
    assert swallowed == 1 and not [t for t in marks if t > drained]


async def test_a_draining_agent_goes_on_with_heartbeats_and_saying_it_is_alive() -> None:
    """The agent stops its reporter on SIGTERM. Before, the drain (20 s by default) then
    sent one report: past the scheduler's 10 s node time-out, with the alive mark lapsed,
    the node was taken for lost and its work retried elsewhere while it still ran here, so
    it ran and was billed twice."""
    runtime, sink, ledger = make(time_scale=1.0)
    runtime._heartbeat_s = 0.05
    await runtime.command(placement("long", max_tokens=5000))
    await until_tokens(sink, 1)
    ledger.alive_nodes.clear()
    draining = asyncio.create_task(runtime.drain(timeout_s=1.2))
    await asyncio.sleep(1.1)
    assert runtime.status == "draining" and runtime.in_flight == 1
    assert ledger.alive_nodes == {"n1"}  # said again during the drain
    ledger.alive_nodes.clear()
    assert len([s for s in sink.of(NodeState) if s.status == "draining"]) >= 5
    await draining
    assert [s.status for s in sink.of(NodeState)][-1] == "stopped"
    await asyncio.sleep(1.1)
    assert not ledger.alive_nodes  # stopped: nothing says it is alive any more


async def test_a_drain_that_starts_while_a_gpu_read_hangs_goes_on_with_heartbeats() -> None:
    """NVML stuck: stopping the reporter cancelled its read but left it set, and the
    drain's heartbeat died on that cancelled read after one report."""
    inventory = parse_simulated("2xH100-80GB", "n1")

    async def never_answers() -> list:
        await asyncio.Event().wait()
        return inventory
    sink, ledger = Sink(), MemoryLedger(None)
    runtime = AgentRuntime("n1", NodeModel.from_inventory(inventory), CATALOG,
                           SimulatedExecutor(1.0, seed=7), sink, ledger, lambda: 1000,
                           chunk_tokens=4, heartbeat_s=0.05, usage_interval_s=60.0,
                           read_inventory=never_answers)
    reporter = asyncio.create_task(runtime.report_forever())
    await runtime.command(placement("long", max_tokens=5000))
    await until_tokens(sink, 1)
    await asyncio.sleep(0.3)  # a read is in flight
    reporter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reporter
    draining = asyncio.create_task(runtime.drain(timeout_s=1.5))
    await asyncio.sleep(0.2)
    ledger.alive_nodes.clear()
    await asyncio.sleep(1.1)
    assert ledger.alive_nodes == {"n1"}
    # a report a second: each waits a second for the read, as the heartbeat does then
    assert len([s for s in sink.of(NodeState) if s.status == "draining"]) >= 2
    await draining


async def test_more_gpu_time_than_a_record_holds_is_billed_at_the_most_and_ends() -> None:
    """A simulator sped up 10**11-fold measured years of GPU time: the usage record
    failed to validate, and the request ended with no result and no bill."""
    runtime, sink, _ = make(time_scale=1e-11)
    await runtime.command(placement("fast", max_tokens=8))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.status == "completed"
    assert usage_sum(sink, "fast")[2] == MAX_USAGE_GPU_SECONDS


async def preempted_after_tokens(rid: str, attempt: int = 0) -> tuple[InferenceRequest, Sink]:
    """`rid` preempted once it has streamed tokens: its next attempt (with its resume)."""
    first, sink, _ = make(time_scale=1.0)
    await first.command(placement(rid, max_tokens=40, attempt=attempt))
    await until_tokens(sink, 6)
    await first.command(Preempt(placement_id=f"{rid}#{attempt}", request_id=rid, node_id="n1",
                                scheduler_epoch=1, reason="interactive work"))
    await settle(first)
    [again] = sink.of(InferenceRequest)
    return again, sink


async def test_a_resumed_attempt_cancelled_before_it_starts_reports_what_came_before() -> None:
    """Its result said 0 tokens and no text, though the earlier attempt had streamed and
    billed them (the same cancel a moment later, while it ran, reported them all)."""
    again, sink = await preempted_after_tokens("a")
    second, _, _ = make(sink=sink, now_ms=2_000)
    second.cancel(Cancel(request_id="a", reason="user pressed stop", at_ms=0))
    await second.command(placement("a", attempt=1).model_copy(update={"request": again}))
    await settle(second)
    [result] = sink.of(RequestResult)
    assert result.status == "cancelled" and result.text == "".join(again.resume.tokens)
    prompt, completion, _ = usage_sum(sink, "a")
    assert (result.prompt_tokens, result.completion_tokens) == (prompt, completion)
    assert completion == len(again.resume.tokens) > 0


async def test_work_stopped_on_its_last_attempt_ends_failed_instead_of_an_unreadable_retry(
) -> None:
    """A request preempted on attempt 100 was handed back as attempt 101, which no
    consumer reads: it was dead-lettered, billed and never answered."""
    runtime, sink, _ = make(time_scale=1.0)
    await runtime.command(placement("last", max_tokens=40, attempt=100))
    await until_tokens(sink, 6)
    await runtime.command(Preempt(placement_id="last#100", request_id="last", node_id="n1",
                                  scheduler_epoch=1, reason="interactive work"))
    await settle(runtime)
    assert not sink.of(InferenceRequest)
    [result] = sink.of(RequestResult)
    assert result.status == "failed" and "attempt 100 was its last" in result.finish_reason
    assert result.completion_tokens == usage_sum(sink, "last")[1] > 0


async def test_a_restarted_agent_hands_back_what_its_crashed_run_left_and_ends_it() -> None:
    crashed, _, ledger = make(time_scale=1.0)
    await crashed.command(placement("done", max_tokens=2))
    await crashed.command(placement("cut", max_tokens=5000))
    await crashed.command(placement("moved", max_tokens=5000, gpu=1))
    async with asyncio.timeout(10):
        while crashed.in_flight > 2:
            await asyncio.sleep(0.005)
    for task in [t for t in asyncio.all_tasks() if t.get_name() in ("cut#0", "moved#0")]:
        task.cancel()  # the process dies: no final records, the claims stay filed
        with pytest.raises(asyncio.CancelledError):
            await task
    ledger.retried.add("moved#0")  # the scheduler declared the node lost and moved it
    ledger.held["n1"]["junk#0"] = b"1000 {not a placement"  # dropped, not fatal

    restarted, sink, _ = make(ledger=ledger, now_ms=2_000)
    assert await restarted.recover() == 1
    # both end for the scheduler and billing, with nothing billed
    assert sorted((u.event_id, u.final, u.completion_tokens)
                  for u in sink.of(UsageRecord)) == [("cut#0:final", True, 0),
                                                     ("moved#0:final", True, 0)]
    [again] = sink.of(InferenceRequest)  # only what the scheduler has not retried itself
    assert (again.request_id, again.attempt, again.requeued) == ("cut", 1, "node_lost")
    assert await restarted.command(placement("cut", max_tokens=5000)) == Ignored("duplicate")
    assert await restarted.recover() == 0 and ledger.held == {"n1": {}}


async def crash(placement_id: str) -> None:
    """Kill the run of `placement_id` as a crash of the process would: no final records,
    its claim stays filed."""
    [task] = [t for t in asyncio.all_tasks() if t.get_name() == placement_id]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_crash_does_not_use_up_the_attempts_agents_may_refuse() -> None:
    """A request agents could not run 4 times was running when its agent crashed. The
    restart handed it back as a fifth refusal, so it ended failed; a crash is a lost node,
    which `refused` does not count (nor does the scheduler's own retry of a lost node)."""
    crashed, sink, ledger = make(time_scale=1.0)
    cut = placement("cut", max_tokens=5000, attempt=4)
    await crashed.command(cut.model_copy(update={
        "request": cut.request.model_copy(update={"refused": 4})}))
    await until_tokens(sink, 1)
    await crash("cut#4")

    restarted, sink, _ = make(ledger=ledger, now_ms=2_000)
    assert await restarted.recover() == 1
    assert not sink.of(RequestResult)
    [again] = sink.of(InferenceRequest)
    assert (again.attempt, again.requeued, again.refused) == (5, "node_lost", 4)


class DiesPublishingTheResult(Sink):
    """Kafka refuses the result after the final usage went out (the process then dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def __call__(self, message: Message, topic: str, key: str, wait: bool = True) -> None:
        if isinstance(message, RequestResult):
            self.refused += 1
            raise ConnectionError("Kafka refuses the result")
        await super().__call__(message, topic, key, wait)


async def died_publishing_the_result() -> tuple[DiesPublishingTheResult, MemoryLedger]:
    """A run of 'done' (6 tokens) killed while Kafka refuses its result: what it published,
    and the ledger it filed its final records in."""
    crashed, dying, ledger = make(sink=DiesPublishingTheResult())
    await crashed.command(placement("done", max_tokens=6))
    [task] = [t for t in asyncio.all_tasks() if t.get_name() == "done#0"]
    async with asyncio.timeout(5):
        while not dying.refused:
            await asyncio.sleep(0.005)
    task.cancel()  # the process dies while the result waits for Kafka
    with pytest.raises(asyncio.CancelledError):
        await task
    return dying, ledger


async def test_a_crash_while_the_final_records_go_out_ends_with_them_published_not_a_rerun(
) -> None:
    """The scheduler still counts `done` as placed (it has not read the final usage yet):
    the next run publishes the filed final records again (the usage applies once: same
    event id) and hands nothing back, so the request has its result and runs once."""
    dying, ledger = await died_publishing_the_result()
    [billed] = dying.of(UsageRecord)
    assert (billed.event_id, billed.completion_tokens) == ("done#0:final", 6)
    assert list(ledger.held["n1"]) == ["done#0"]

    restarted, sink, _ = make(ledger=ledger, now_ms=2_000)
    assert await restarted.recover() == 0
    assert sink.of(UsageRecord) == [billed]
    [result] = sink.of(RequestResult)
    assert (result.request_id, result.status, result.completion_tokens) == ("done", "completed", 6)
    assert not sink.of(InferenceRequest)
    assert ledger.held == {"n1": {}}


def in_trace(trace_id: int) -> contextlib.AbstractContextManager:
    """The context a placement's command is taken in: FastStream's span of its record, of
    the request's trace `trace_id` (sampled)."""
    return trace.use_span(trace.NonRecordingSpan(trace.SpanContext(
        trace_id, trace_id, is_remote=True, trace_flags=trace.TraceFlags(
            trace.TraceFlags.SAMPLED))))


class TracedSink(Sink):
    """What the agent publishes, and the span each is published under (FastStream's publish
    goes in its trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.under: list[tuple[type, trace.SpanContext]] = []

    async def __call__(self, message: Message, topic: str, key: str, wait: bool = True) -> None:
        self.under.append((type(message), trace.get_current_span().get_span_context()))
        await super().__call__(message, topic, key, wait)


async def test_after_a_crash_what_the_next_run_publishes_stays_in_the_requests_trace(
) -> None:
    """The claim kept no trace context and `recover` published outside any span: after a
    crash, a request's zero final usage and its next attempt (or the final records its run
    had filed) each started a trace of its own, and its trace in Jaeger ended at the
    crash. A claim the release before filed (no trace context) is still handed back, in new
    traces as before; and the scheduler still reads the placement after the first space."""
    crashed, dying, ledger = make(time_scale=1.0, sink=DiesPublishingTheResult())
    cut = placement("cut", max_tokens=5000)
    with in_trace(4):
        await crashed.command(cut)
    with in_trace(7):
        await crashed.command(placement("done", max_tokens=6, gpu=1))
    assert ledger.held["n1"]["cut#0"].partition(b" ")[2] == cut.to_bytes()
    async with asyncio.timeout(5):
        while not dying.refused:  # "done" filed its final records; its result waits
            await asyncio.sleep(0.005)
    await crash("cut#0")
    await crash("done#0")
    before = placement("before", max_tokens=5000, gpu=1)
    ledger.held["n1"]["before#0"] = b"1000 " + before.to_bytes()

    restarted, sink, _ = make(ledger=ledger, now_ms=2_000, sink=TracedSink())
    assert await restarted.recover() == 2
    assert sorted((m.__name__, ctx.trace_id) for m, ctx in sink.under) == [
        ("InferenceRequest", 0), ("InferenceRequest", 4), ("RequestResult", 7),
        ("UsageRecord", 0), ("UsageRecord", 4), ("UsageRecord", 7)]
    assert sorted(r.request_id for r in sink.of(InferenceRequest)) == ["before", "cut"]


async def test_a_run_is_a_span_of_its_requests_trace_saying_how_it_ended(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """Nothing showed the inference itself: the agent's span of a placement ended as its
    run began. Each run is now a span in the placement's trace, under which its records
    go out, naming the request (its class too, as the router's and scheduler's spans do),
    placement, node, model and GPUs, and at its end how it ended and the reply's tokens."""
    runtime, sink, _ = make(time_scale=1.0, sink=TracedSink(),
                            tracer=tracer_provider.get_tracer("gpu-agent"))
    with in_trace(5):
        await runtime.command(placement("done", max_tokens=3))
    with in_trace(6):
        await runtime.command(placement("moved", max_tokens=5000, gpu=1))
    await until_tokens(sink, 4)
    await runtime.command(Preempt(placement_id="moved#0", request_id="moved", node_id="n1",
                                  scheduler_epoch=1, reason="interactive work"))
    await settle(runtime)
    runs = {s.attributes["gpusched.request_id"]: s
            for s in span_exporter.get_finished_spans() if s.name == "run"}
    assert {rid: (s.context.trace_id, s.parent.span_id) for rid, s in runs.items()} == {
        "done": (5, 5), "moved": (6, 6)}
    assert {k: v for k, v in runs["done"].attributes.items() if k != "gpusched.finish_reason"
            } == {"gpusched.request_id": "done", "gpusched.placement_id": "done#0",
                  "gpusched.node_id": "n1", "gpusched.tenant": "acme", "gpusched.model": MODEL,
                  "gpusched.priority_class": "standard", "gpusched.attempt": 0,
                  "gpusched.gpu_indices": (0,),
                  "gpusched.status": "completed", "gpusched.completion_tokens": 3,
                  "gpusched.token_chunks": 2}
    moved = runs["moved"].attributes
    assert (moved["gpusched.status"], moved["gpusched.finish_reason"]) == (
        "handed_back", "preempted")
    assert moved["gpusched.completion_tokens"] == usage_sum(sink, "moved")[1] > 0
    # every record a run published went under its span, but its token chunks: untraced
    assert {ctx.span_id for kind, ctx in sink.under if kind is not TokenChunk} == {
        s.context.span_id for s in runs.values()}
    assert not any(ctx.trace_flags.sampled for kind, ctx in sink.under if kind is TokenChunk)


def test_an_agents_spans_name_its_node_as_their_instance() -> None:
    """Every agent's spans said only `service.name` gpu-agent and an id made up per
    process: in Jaeger, one agent could not be told from the other 99. Its node id is its
    `service.instance.id` now, beside the release it runs as `service.version`."""
    app = agent_main.create_app(AgentSettings(
        telemetry=TelemetrySettings(otlp_endpoint=""), simulate="1xH100-80GB",
        node_id="gpu-node-7", redis=RedisSettings(url="redis://127.0.0.1:1/0")))
    resource = app.state.runtime._tracer.resource.attributes
    assert (resource["service.name"], resource["service.instance.id"]) == (
        "gpu-agent", "gpu-node-7")
    assert resource["service.version"] == metadata.version("gpusched-common")


async def test_node_state_reports_start_no_trace(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """Each heartbeat, published outside any span, was a trace of its own: 100 nodes
    reporting every 2 s made 50 traces a second, pushing requests' traces out of Jaeger's
    newest 20,000 within minutes."""
    broker = make_broker(KafkaSettings(), "gpu-agent", tracer_provider, None)

    async def publish(message: Message, topic: str, key: str, wait: bool = True) -> None:
        await broker.publish(message.to_bytes(), topic, key=key.encode())

    runtime, _, _ = make(sink=publish)
    async with TestKafkaBroker(broker):
        for _ in range(3):
            await runtime.report()
    assert span_exporter.get_finished_spans() == ()


async def test_token_chunks_are_counted_on_the_run_span_not_spans_of_their_own(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """Each token chunk went through FastStream's publish under the `run` span, a create
    and a publish span each: a long reply made thousands of spans in its trace. Chunks go
    out untraced now, and the `run` span says how many were sent."""
    broker = make_broker(KafkaSettings(), "gpu-agent", tracer_provider, None)
    chunks: list[TokenChunk] = []

    async def publish(message: Message, topic: str, key: str, wait: bool = True) -> None:
        if isinstance(message, TokenChunk):
            chunks.append(message)
        await broker.publish(message.to_bytes(), topic, key=key.encode())

    runtime, _, _ = make(sink=publish, tracer=tracer_provider.get_tracer("gpu-agent"))
    async with TestKafkaBroker(broker):
        with in_trace(5):
            await runtime.command(placement("long", max_tokens=200))
        await settle(runtime)
    spans = span_exporter.get_finished_spans()
    [run] = [s for s in spans if s.name == "run"]
    assert len(chunks) > 40 and run.attributes["gpusched.token_chunks"] == len(chunks)
    # the result's, and the final usage's: a create and a publish span each
    assert sorted(s.name for s in spans if s.name != "run") == [
        "gpusched.results create", "gpusched.results publish",
        "gpusched.usage create", "gpusched.usage publish"]
    assert {s.context.trace_id for s in spans} == {5}


class YieldsBytes(SimulatedExecutor):
    """An executor whose third token is bytes, not text: its run fails."""

    def generate(self, job):  # noqa: ANN001, ANN202
        async def tokens():  # noqa: ANN202
            for token in [" a", " b", b" c"]:
                yield token
        return tokens()


async def test_a_run_that_ends_failed_is_a_span_with_status_error(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """No span was ever marked as an error: in Jaeger, a run whose executor failed, or one
    that ended failed on its last attempt, looked like one that completed. Such a `run`
    span has status ERROR now, with the reason, and the exception where one ended it; a
    run completed or cancelled leaves it unset (OpenTelemetry: never Ok)."""
    runtime, _, _ = make(tracer=tracer_provider.get_tracer("gpu-agent"))
    runtime.executor = YieldsBytes(0.01, seed=7)
    with in_trace(5):
        await runtime.command(placement("bytes"))
    await settle(runtime)
    runtime.executor = SimulatedExecutor(0.01, seed=7)
    runtime.cancel(Cancel(request_id="gone", reason="client left", at_ms=1))
    last = placement("last", attempt=LAST_ATTEMPT)  # fits nowhere here, and may not go back
    for command in (placement("done", max_tokens=3), placement("gone"),
                    last.model_copy(update={"kv_cache_mib": 200_000})):
        with in_trace(6):
            await runtime.command(command)
    await settle(runtime)
    runs = {s.attributes["gpusched.request_id"]: s
            for s in span_exporter.get_finished_spans() if s.name == "run"}
    assert {rid: (s.status.status_code, s.attributes["gpusched.status"])
            for rid, s in runs.items()} == {
        "bytes": (StatusCode.ERROR, "failed"), "last": (StatusCode.ERROR, "failed"),
        "done": (StatusCode.UNSET, "completed"), "gone": (StatusCode.UNSET, "cancelled")}
    assert "yielded bytes, not text" in runs["bytes"].status.description
    [error] = runs["bytes"].events
    assert (error.name, error.attributes["exception.type"]) == ("exception", "TypeError")
    assert "was its last" in runs["last"].status.description and not runs["last"].events


@pytest.mark.parametrize("spec", ["1xL4-24GB"])
async def test_placement_that_does_not_fit_is_handed_back_with_a_zero_final_usage(spec) -> None:
    runtime, sink, _ = make(spec=spec)
    big = placement("big").model_copy(update={"kv_cache_mib": 30_000})
    await runtime.command(big)
    await settle(runtime)
    [usage] = sink.of(UsageRecord)
    assert usage.final and (usage.prompt_tokens, usage.completion_tokens) == (0, 0)
    [again] = sink.of(InferenceRequest)
    assert again.requeued == "handback" and again.attempt == 1


class LoadsNothing(SimulatedExecutor):
    """Runs out of GPU memory loading any model, after `load_s`."""

    load_s = 0.0

    async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
        await asyncio.sleep(self.load_s)
        raise RuntimeError("CUDA out of memory")


def on_gpus(p: Placement, gpus: tuple[int, ...]) -> Placement:
    return p.model_copy(update={"gpu_indices": gpus, "request": p.request.model_copy(
        update={"num_gpus": len(gpus)})})


@pytest.mark.parametrize("gpus", [(0,), (0, 1)])
async def test_a_model_that_failed_to_load_is_not_reported_loaded_and_its_work_goes_back(
        gpus) -> None:
    """A load that failed (CUDA out of memory) left the model's weights counted and
    reported loaded: the scheduler sent that model's work on here, and every request ended
    failed. The engine is at fault, not the request: it goes back, as a refusal."""
    runtime, sink, _ = make()
    runtime.executor = LoadsNothing(0.01, seed=7)
    free_mib = [g.memory_free_mib for g in runtime.node.state("n1", 1, 0, 0).gpus]
    await runtime.command(on_gpus(placement("a"), gpus))
    await runtime.command(on_gpus(placement("b"), gpus))  # waits for the same load
    await settle(runtime)
    assert not sink.of(RequestResult)
    assert sorted((r.request_id, r.attempt, r.requeued, r.refused)
                  for r in sink.of(InferenceRequest)) == [("a", 1, "node_lost", 1),
                                                          ("b", 1, "node_lost", 1)]
    state = runtime.node.state("n1", 2, 0, 0)
    assert [g.loaded_models for g in state.gpus] == [(), ()]
    assert [g.memory_free_mib for g in state.gpus] == free_mib


async def test_a_model_that_failed_to_load_is_reported_until_its_cooldown_ends_or_it_loads(
) -> None:
    """A node that could not load a model (a corrupt file there) got its work again and
    again, each time using up one of the request's refusals: after the fifth it failed,
    while other nodes served the model. The node now reports the model, with the end of its
    cooldown, before the requests that waited for the load go back, so the scheduler sends
    them elsewhere; the report drops it once the cooldown ends, or once a load succeeds."""
    now, failed = [1_000], []
    runtime, sink, _ = make(clock=lambda: now[0], monotonic=lambda: now[0] / 1000,
                            load_failure_cooldown_s=60.0, load_failed=failed.append)
    runtime.executor = LoadsNothing(0.01, seed=7)
    await runtime.command(placement("a"))
    await runtime.command(placement("b"))  # waits for the same load
    await settle(runtime)
    assert failed == [MODEL]  # once per load, not per waiter
    cooling = (LoadFailure(model=MODEL, until_ms=61_000),)
    [(at, reported)] = [(i, m) for i, (m, _, _) in enumerate(sink.sent)
                        if isinstance(m, NodeState)]
    assert reported.load_failures == cooling
    assert all(i > at for i, (m, _, _) in enumerate(sink.sent)
               if isinstance(m, InferenceRequest))  # the hand-backs come after it
    now[0] = 60_999
    assert runtime.node_state().load_failures == cooling
    now[0] = 61_000
    assert runtime.node_state().load_failures is None
    assert b"load_failures" not in runtime.node_state().to_bytes()

    await runtime.command(placement("c"))  # fails again: a new cooldown
    await settle(runtime)
    assert runtime.node_state().load_failures == (LoadFailure(model=MODEL, until_ms=121_000),)
    runtime.executor = SimulatedExecutor(0.01, seed=7)  # the file was fixed
    await runtime.command(placement("d"))  # placed before the scheduler knew
    await settle(runtime)
    assert [r.status for r in sink.of(RequestResult)] == ["completed"]
    assert runtime.node_state().load_failures is None and failed == [MODEL, MODEL]


async def test_a_load_failure_counts_once_and_its_cooldown_keeps_to_the_monotonic_clock(
) -> None:
    """A failed load on each of a node's GPUs in one go is one incident (the alert reads
    three in half an hour as a node that keeps failing). A wall clock set back an hour (an
    NTP step) lengthened the cooldown by that hour; the node now reports what is left of it
    on the monotonic clock."""
    wall, mono, failed = [1_000_000], [50.0], []
    runtime, _, _ = make(clock=lambda: wall[0], monotonic=lambda: mono[0],
                         load_failure_cooldown_s=60.0, load_failed=failed.append)
    runtime.executor = LoadsNothing(0.01, seed=7)
    await runtime.command(placement("a", gpu=0))
    await runtime.command(placement("b", gpu=1))
    await settle(runtime)
    assert failed == [MODEL]
    wall[0] -= 3_600_000  # set back an hour
    mono[0] += 30.0
    assert runtime.node_state().load_failures == (
        LoadFailure(model=MODEL, until_ms=wall[0] + 30_000),)
    mono[0] += 30.0
    assert runtime.node_state().load_failures is None
    await runtime.command(placement("c"))  # a new incident once the cooldown is over
    await settle(runtime)
    assert failed == [MODEL, MODEL]


async def test_a_load_that_fails_as_its_engine_goes_down_starts_no_cooldown() -> None:
    """The node takes no work at all while its engine is down; once it is back, the model
    is placed here again at once."""
    class Down(SimulatedExecutor):
        async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
            raise ExecutorUnavailable("connection refused")

    failed: list[str] = []
    runtime, sink, _ = make(load_failed=failed.append)
    runtime.executor = Down(0.01, seed=7)
    await runtime.command(placement("a"))
    await settle(runtime)
    [again] = sink.of(InferenceRequest)
    assert again.requeued == "node_lost" and runtime.node.down is not None
    assert runtime.node_state().load_failures is None and not failed


async def test_a_load_that_fails_after_its_request_was_cancelled_is_not_reported_loaded(
) -> None:
    runtime, sink, _ = make()
    runtime.executor = LoadsNothing(0.01, seed=7)
    runtime.executor.load_s = 0.1
    await runtime.command(placement("gone"))
    await asyncio.sleep(0.02)  # loading
    runtime.cancel(Cancel(request_id="gone", reason="client_gone", at_ms=0))
    await settle(runtime)
    assert runtime.node.gpus[0].loaded_mib  # the load goes on without its request
    await asyncio.sleep(0.15)
    assert runtime.node.state("n1", 1, 0, 0).gpus[0].loaded_models == ()


@pytest.mark.parametrize("change", [{"prompt_tokens": 1_000_000_001}, {"max_tokens": 32_768}])
async def test_a_placement_beyond_its_models_context_is_handed_back_unrun(change) -> None:
    """The scheduler refuses such a request; a placement of one (from any Kafka client)
    ran here, and one claiming a billion prompt tokens ended with no result, no usage and
    its claim held: its usage record could not be written. Handed back, the scheduler
    answers it with the reason."""
    runtime, sink, ledger = make()
    p = placement("long")
    await runtime.command(p.model_copy(update={"request": p.request.model_copy(update=change)}))
    await settle(runtime)
    [usage] = sink.of(UsageRecord)
    assert usage.final and (usage.prompt_tokens, usage.completion_tokens) == (0, 0)
    [again] = sink.of(InferenceRequest)
    assert (again.attempt, again.requeued) == (1, "handback")
    assert not sink.of(TokenChunk) and not ledger.held["n1"]


async def test_an_executor_yielding_bytes_fails_its_request_billed_for_its_text() -> None:
    """bytes passed as a token until the result's text was joined, which raised: the run
    ended with no result, no usage and its claim held until the agent restarted."""
    runtime, sink, ledger = make()
    runtime.executor = YieldsBytes(0.01, seed=7)
    await runtime.command(placement("b"))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.status == "failed" and "yielded bytes, not text" in result.finish_reason
    assert usage_sum(sink, "b")[:2] == (result.prompt_tokens, result.completion_tokens) == (3, 2)
    assert not ledger.held["n1"]


@pytest.mark.parametrize("partials", [False, True], ids=["at-once", "after-partials"])
async def test_a_fault_in_the_agent_itself_ends_the_request_failed_billed_and_released(
        partials: bool) -> None:
    """An exception the run did not expect (here from the node model) ended its task
    silently: no result, no usage, no hand-back, and its claim stayed filed until the
    agent restarted. After partial records, its final one bills only what they did not."""
    runtime, sink, ledger = make(time_scale=1.0, usage_interval_s=0.01) if partials else make()
    finish = runtime.node.finish

    def fails_once(placement: Placement) -> None:
        runtime.node.finish = finish  # type: ignore[method-assign]
        raise RuntimeError("a bug")

    runtime.node.finish = fails_once  # type: ignore[method-assign]
    await runtime.command(placement("r", max_tokens=100 if partials else 8))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert (result.status, result.finish_reason) == ("failed", "agent error: RuntimeError('a bug')")
    prompt, completion, gpu_seconds = usage_sum(sink, "r")
    assert (prompt, completion) == (result.prompt_tokens, result.completion_tokens)
    records = [u.final for u in sink.of(UsageRecord)]
    assert gpu_seconds > 0 and records[-1] and sum(records) == 1  # none after the final
    assert len(records) > 2 if partials else (completion == 8 and records == [True])
    assert not ledger.held["n1"] and not runtime.node.gpus[0].active


@pytest.mark.parametrize("stop", ["preempt", "cancel"])
async def test_stop_in_the_same_tick_as_the_placement_still_ends_it_cleanly(stop) -> None:
    runtime, sink, _ = make()
    await runtime.command(placement("now"))
    if stop == "preempt":
        await runtime.command(Preempt(placement_id="now#0", request_id="now", node_id="n1",
                                      scheduler_epoch=1, reason="x"))
    else:
        runtime.cancel(Cancel(request_id="now", reason="gone", at_ms=0))
    await settle(runtime)
    assert usage_sum(sink, "now") == (0, 0, 0.0) and len(sink.of(UsageRecord)) == 1
    if stop == "preempt":
        [again] = sink.of(InferenceRequest)
        assert again.requeued == "preempted" and sink.of(RequestResult) == []
    else:
        [result] = sink.of(RequestResult)
        assert result.status == "cancelled"


async def test_dropped_chunks_warn_once_per_request_and_are_all_counted(caplog) -> None:
    from prometheus_client import CollectorRegistry, Counter

    from gpusched_agent.main import DroppedRecords

    registry = CollectorRegistry()
    dropped = DroppedRecords(Counter("dropped_total", "d", ["message"], registry=registry),
                             remember=2)
    loop = asyncio.get_running_loop()

    def answer(exc: Exception | None) -> asyncio.Future:
        sent = loop.create_future()
        if exc is None:
            sent.set_result(None)
        else:
            sent.set_exception(exc)
        return sent

    def chunk(rid: str, seq: int) -> TokenChunk:
        return TokenChunk(request_id=rid, seq=seq, text="x", token_count=1)

    with caplog.at_level("WARNING", logger="gpusched_agent.main"):
        for seq in range(5):
            dropped(chunk("a", seq), "a", answer(TimeoutError("no leader")))
        dropped(chunk("a", 5), "a", answer(None))  # taken: neither counted nor logged
        for rid in ("b", "c", "a"):  # "a" was forgotten when "c" came: warned again
            dropped(chunk(rid, 0), rid, answer(TimeoutError("no leader")))
    warned = [r.getMessage() for r in caplog.records]
    assert [w.split()[2] for w in warned] == ["a", "b", "c", "a"]
    assert "TokenChunk for a dropped by Kafka" in warned[0] and "no leader" in warned[0]
    assert registry.get_sample_value("dropped_total", {"message": "TokenChunk"}) == 8


@pytest.mark.parametrize("raw", [b'{"final": 5}', b'{"final": null}', b'{"final": [5]}',
                                 b'{"final": [{}]}', b'{"final": [{"topic": "gpusched.usage"}]}',
                                 b'{"final": [{"topic": [], "value": "", "key": ""}]}'])
def test_an_outbox_of_another_shape_is_a_value_error(raw: bytes) -> None:
    """KeyError or TypeError escaped `recover` (which drops a ValueError's entry with a
    log line), so the agent could not start."""
    from gpusched_common import outbox

    with pytest.raises(ValueError):
        outbox.decode(raw)


@pytest.mark.parametrize("change", [{"gpu_indices": (-5,)}, {"gpu_indices": (1, -1)},
                                    {"placement_id": ""}, {"placement_id": "p" * 301}])
def test_a_placement_the_agent_could_not_end_is_invalid_on_the_wire(change) -> None:
    """Taken, (-5,) raised IndexError inside the run, and an id over 300 characters made its
    final usage invalid: no result, no hand-back, no usage, and the claim left behind made
    the next start fail in `recover`; (1, -1) ran a 2-GPU gang on GPU 1 alone."""
    from pydantic import ValidationError

    from gpusched_common.contracts import PLACEMENT

    raw = placement("bad").model_dump(mode="json") | change
    with pytest.raises(ValidationError):
        PLACEMENT.validate_python(raw)


async def test_a_drain_goes_on_when_kafka_refuses_its_reports() -> None:
    """The first report's time-out ended the drain at once: nothing running was stopped,
    handed back or billed."""
    sink = Sink()

    async def refusing_node_states(message, topic, key, wait=True) -> None:  # noqa: ANN001
        if isinstance(message, NodeState):
            raise TimeoutError("Kafka away")
        await sink(message, topic, key, wait)

    runtime, _, _ = make(time_scale=1.0, sink=sink)
    runtime._publish = refusing_node_states  # type: ignore[method-assign]
    await runtime.command(placement("d", max_tokens=2000))
    await until_tokens(sink, 1)
    await runtime.drain(timeout_s=0.05)
    [again] = sink.of(InferenceRequest)
    assert again.requeued == "node_lost" and runtime.in_flight == 0
    assert sum(u.final for u in sink.of(UsageRecord)) == 1


async def test_a_token_chunk_kafka_refuses_goes_with_the_result() -> None:
    """A send that raised (no metadata, a full buffer) failed a healthy request as an
    'executor error'."""
    sink, refused = Sink(), []

    async def refusing_a_chunk(message, topic, key, wait=True) -> None:  # noqa: ANN001
        if isinstance(message, TokenChunk) and message.seq == 1 and not refused:
            refused.append(message)
            raise TimeoutError("metadata not available")
        await sink(message, topic, key, wait)

    runtime, _, _ = make(sink=sink)
    runtime._publish = refusing_a_chunk  # type: ignore[method-assign]
    await runtime.command(placement("k", max_tokens=10))
    await settle(runtime)
    [result] = sink.of(RequestResult)
    assert result.status == "completed" and result.completion_tokens == 10
    assert [c.seq for c in sink.of(TokenChunk)] == [0, 2, 3] and refused


async def test_recover_sends_filed_records_again_while_kafka_is_away_at_start() -> None:
    """The first refusal raised out of `recover`: the agent failed to start whenever Kafka
    was briefly away."""
    _, ledger = await died_publishing_the_result()

    class AwayOnce(Sink):
        async def __call__(self, message, topic, key, wait=True) -> None:  # noqa: ANN001
            if not hasattr(self, "refused"):
                self.refused = True
                raise ConnectionError("Kafka is not up yet")
            await super().__call__(message, topic, key, wait)

    restarted, sink, _ = make(ledger=ledger, now_ms=2_000, sink=AwayOnce())
    async with asyncio.timeout(10):
        assert await restarted.recover() == 0
    [result] = sink.of(RequestResult)
    assert result.status == "completed" and ledger.held == {"n1": {}}


async def test_a_gpu_read_that_never_answers_marks_the_gpus_unhealthy_not_the_heartbeat() -> None:
    """NVML stuck on a GPU fallen off the bus held the heartbeat: no node state went out,
    while the agent still said in Redis it was alive, so the scheduler kept its stale view."""
    from gpusched_agent.runtime import INVENTORY_STUCK_S

    now_s, answer = [0.0], asyncio.Event()
    inventory = parse_simulated("2xH100-80GB", "n1")

    async def read() -> list:
        await answer.wait()
        return inventory

    runtime = AgentRuntime("n1", NodeModel.from_inventory(inventory), CATALOG,
                           SimulatedExecutor(0.01, seed=7), Sink(), MemoryLedger(), lambda: 0,
                           chunk_tokens=4, heartbeat_s=1.0, read_inventory=read,
                           monotonic=lambda: now_s[0])
    async with asyncio.timeout(5):
        await runtime._reread_inventory()  # returns after a second, unanswered
        assert all(g.info.healthy for g in runtime.node.gpus)
        now_s[0] = INVENTORY_STUCK_S
        await runtime._reread_inventory()
        assert [g.info.unhealthy_reason for g in runtime.node.gpus] == [
            "reading the GPUs (NVML) has not answered for 30 s"] * 2
        answer.set()
        await runtime._reread_inventory()  # it answers at last: healthy again
    assert all(g.info.healthy for g in runtime.node.gpus)


async def test_a_gpu_read_that_fails_marks_the_gpus_unhealthy_until_one_succeeds() -> None:
    """An NVML error out of the re-read was only logged: every GPU stayed healthy and kept
    getting work, with nothing read about any of them."""
    inventory, failing = parse_simulated("2xH100-80GB", "n1"), [True]

    async def read() -> list:
        if failing[0]:
            raise RuntimeError("NVML: Unknown Error")
        return inventory

    runtime = AgentRuntime("n1", NodeModel.from_inventory(inventory), CATALOG,
                           SimulatedExecutor(0.01, seed=7), Sink(), MemoryLedger(), lambda: 0,
                           chunk_tokens=4, heartbeat_s=1.0, read_inventory=read)
    async with asyncio.timeout(5):
        await runtime._reread_inventory()
        assert [g.info.unhealthy_reason for g in runtime.node.gpus] == [
            "reading the GPUs (NVML) failed: RuntimeError('NVML: Unknown Error')"] * 2
        assert not any(g.healthy for g in runtime.node.state("n1", 1, 0, 0).gpus)
        failing[0] = False
        await runtime._reread_inventory()
    assert all(g.info.healthy for g in runtime.node.gpus)

# --- 1. fencing: a leader elected after Redis lost its data ----------------------------------
async def test_a_leader_elected_after_redis_lost_its_data_is_not_fenced_off_for_good() -> None:
    """Redis held epoch 7 and the agent took its commands (highest_epoch 7). Redis restarts
    empty; the next leader INCRs gpusched:scheduler:epoch to 1 and sends with epoch 1, which
    equals what Redis holds. The agent refuses it as 'older than epoch 7 this agent already
    took commands from', and every later command too, until the agent restarts."""
    runtime, sink, ledger = make(epoch=7)
    assert isinstance(await runtime.command(placement("before", epoch=7)), Started)
    await settle(runtime)
    ledger.epoch = 1  # Redis came back empty; the new leader took the lease: INCR -> 1
    out = await runtime.command(placement("after", epoch=1))
    assert isinstance(out, Started), out
    await settle(runtime)


# --- 2. context limit vs a hand-back carrying the engine's prompt count ----------------------
class CountsALongerPrompt(SimulatedExecutor):
    """An engine whose tokenizer/chat template counts 1,000 prompt tokens where gpusched
    estimated 3 (within the model's context, so the agent bills it and carries it on). A
    first attempt generates `before_stop` tokens and goes on until stopped; a resumed one,
    at most `resumed` more (the model ends its text). `asked`: each attempt's max_tokens."""

    def __init__(self, before_stop: int = 5, resumed: int = 3) -> None:
        super().__init__(0.01, seed=7)
        self.before_stop, self.resumed = before_stop, resumed
        self.asked: list[int] = []

    def generate(self, job):  # noqa: ANN001, ANN202
        self.asked.append(job.request.max_tokens)

        async def tokens():  # noqa: ANN202
            if not job.prefix:
                yield PromptTokens(1_000)
                for _ in range(self.before_stop):
                    await asyncio.sleep(0)
                    yield " x"
                await asyncio.Event().wait()  # generating on, until stopped
            for _ in range(min(self.resumed, job.request.max_tokens)):
                await asyncio.sleep(0)
                yield " y"
        return tokens()


async def preempted_engine_counted(request: InferenceRequest, engine: CountsALongerPrompt,
                                   ) -> tuple[InferenceRequest, Sink]:
    """`request` run by `engine` (its first token at 1,500 ms) until it has generated all
    `before_stop` tokens, then preempted: its next attempt."""
    first, sink, _ = make(now_ms=1_500)
    first.executor = engine
    await first.command(placement(request.request_id).model_copy(update={"request": request}))
    async with asyncio.timeout(10):
        while engine.before_stop > sum(r.completion_tokens for r in first._running.values()):
            await asyncio.sleep(0.001)
    await first.command(Preempt(placement_id=f"{request.request_id}#0",
                                request_id=request.request_id, node_id="n1",
                                scheduler_epoch=1, reason="interactive work"))
    await settle(first)
    [again] = sink.of(InferenceRequest)
    return again, sink


async def test_a_request_handed_back_as_it_asked_gets_the_room_its_engines_count_leaves(
) -> None:
    """3 (estimate) + 32,000 max_tokens fits qwen2.5-1.5b's 32,768, so it was admitted and
    ran, and its engine counted the prompt as 1,000. Preempted, it went back with max_tokens
    cut to the 31,768 that count leaves: another request to the scheduler (not what the
    first attempt asked), which dead-lettered it, and its client's stream stalled. Now it
    goes back as it asked, with the count in its resume; the attempt that runs it asks its
    engine for the room left, and its result tells the prompt billed and the time of the
    first token, which came in the first attempt."""
    engine = CountsALongerPrompt()
    asked = placement("near", max_tokens=32_000).request
    again, sink = await preempted_engine_counted(asked, engine)
    assert again.asks() == asked.asks() and again.prompt_tokens is None
    assert (again.resume.prompt_tokens, len(again.resume.tokens), again.resume.ttft_ms) == (
        1_000, 5, 1_500.0)

    second, _, _ = make(sink=sink, now_ms=2_000)
    second.executor = engine
    await second.command(placement("near", attempt=1).model_copy(update={"request": again}))
    await settle(second)
    assert engine.asked == [32_000, 32_768 - 1_000 - 5]
    [result] = sink.of(RequestResult)
    assert (result.status, result.finish_reason, result.completion_tokens) == (
        "completed", "stop", 8)
    assert usage_sum(sink, "near")[:2] == (result.prompt_tokens, 8) == (1_000, 8)
    assert result.ttft_ms == 1_500.0


async def test_a_reply_its_engine_ran_past_the_catalogs_context_tells_the_prompt_billed(
) -> None:
    """llama-3.1-8b has 8,192 positions in the catalog; vLLM serves it with 131,072. With
    the prompt counted 1,000, its engine generated 7,300 tokens, past the 7,192 left, and
    the request was preempted: the hand-back dropped the engine's count, so its result said
    3 prompt tokens where 1,000 were billed. Now the count goes on in the resume, and the
    reply goes on to max_tokens (the room cannot hold what it has)."""
    engine = CountsALongerPrompt(before_stop=7_300, resumed=8_000)
    asked = placement("late", max_tokens=8_000).request.model_copy(
        update={"model": "llama-3.1-8b"})
    again, sink = await preempted_engine_counted(asked, engine)
    assert (again.resume.prompt_tokens, len(again.resume.tokens)) == (1_000, 7_300)

    second, _, _ = make(sink=sink, now_ms=2_000)
    second.executor = engine
    await second.command(placement("late", attempt=1).model_copy(update={"request": again}))
    await settle(second)
    assert engine.asked == [8_000, 700]
    [result] = sink.of(RequestResult)
    assert (result.status, result.finish_reason) == ("completed", "length")
    assert usage_sum(sink, "late")[:2] == (result.prompt_tokens, result.completion_tokens) \
        == (1_000, 8_000)


# --- 3. a failed load whose last waiter ended for another reason ------------------------------
class SlowPartials(Sink):
    """A Kafka client that, once cancelled mid-send of a partial usage record, still waits
    for Kafka's answer (it swallows the cancel, as the runtime's comments allow for)."""

    async def __call__(self, message, topic, key, wait=True) -> None:  # noqa: ANN001
        if isinstance(message, UsageRecord) and not message.final:
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                await asyncio.sleep(0.3)
        await super().__call__(message, topic, key, wait)


@pytest.mark.parametrize("race", ["same-tick", "slow-partial"])
async def test_a_load_that_fails_as_its_last_waiter_stops_is_not_reported_loaded(race) -> None:
    """The load task forgets the weights only where no placement is active; a waiter forgets
    them only if it saw _LoadFailed. A waiter stopped (cancel, preempt, drain) that is still
    active when the load fails -- in the same tick, or while `_execute` awaits its partial
    task (a send in flight) -- does neither: the model stays counted and reported loaded."""
    if race == "same-tick":
        runtime, sink, _ = make()

        class FailsAsCancelled(SimulatedExecutor):
            async def load(self, model, gpu_index: int) -> None:  # noqa: ANN001
                await asyncio.sleep(0.05)
                runtime.cancel(Cancel(request_id="gone", reason="client_gone", at_ms=0))
                raise RuntimeError("CUDA out of memory")

        runtime.executor = FailsAsCancelled(0.01, seed=7)
        await runtime.command(placement("gone"))
    else:
        runtime, sink, _ = make(usage_interval_s=0.05, sink=SlowPartials())
        runtime.executor = LoadsNothing(0.01, seed=7)
        runtime.executor.load_s = 0.2
        await runtime.command(placement("gone"))
        await asyncio.sleep(0.1)  # loading; its first partial is being sent
        runtime.cancel(Cancel(request_id="gone", reason="client_gone", at_ms=0))
    await settle(runtime)
    await asyncio.sleep(0.1)
    [result] = sink.of(RequestResult)
    assert result.status == "cancelled"
    assert runtime.node.state("n1", 1, 0, 0).gpus[0].loaded_models == ()


# --- checks that hold (kept as regression tests) ---------------------------------------------
class SwallowsCancel(Sink):
    """Swallows a cancel landing in a partial's send and reports it sent."""

    async def __call__(self, message, topic, key, wait=True) -> None:  # noqa: ANN001
        if isinstance(message, UsageRecord) and not message.final:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)
        await super().__call__(message, topic, key, wait)


@pytest.mark.parametrize("stop", ["none", "preempt", "cancel"])
async def test_partials_and_final_sum_exactly_with_a_client_that_swallows_cancels(stop) -> None:
    runtime, sink, _ = make(time_scale=1.0, usage_interval_s=0.01, sink=SwallowsCancel())
    await runtime.command(placement("sw", max_tokens=300))
    await until_tokens(sink, 20)
    if stop == "preempt":
        await runtime.command(Preempt(placement_id="sw#0", request_id="sw", node_id="n1",
                                      scheduler_epoch=1, reason="x"))
    elif stop == "cancel":
        runtime.cancel(Cancel(request_id="sw", reason="x", at_ms=0))
    await settle(runtime)
    await asyncio.sleep(0.2)
    records = [u for u in sink.of(UsageRecord) if u.request_id == "sw"]
    assert records[-1].final and sum(u.final for u in records) == 1  # none after the final
    partial_ids = [int(u.event_id.rsplit(":", 1)[1]) for u in records if not u.final]
    assert partial_ids == sorted(set(partial_ids))
    _, completion, _ = usage_sum(sink, "sw")
    handed = sink.of(InferenceRequest)
    billed_tokens = len(handed[0].resume.tokens) if handed else sink.of(
        RequestResult)[0].completion_tokens
    assert completion == billed_tokens


# --- 4. a partial send that outlives the run keeps its meter (and KV cache) running ----------
async def test_waiting_on_a_partial_send_after_the_run_ended_is_no_gpu_time() -> None:
    """As test_waiting_on_kafka_for_the_last_records_is_no_gpu_time, for the partial task:
    `_execute` awaits it (a send in flight, its cancel swallowed by the client) before
    node.finish and the meters stop, so `a` is billed Kafka's wait as GPU time and `b`,
    sharing the GPU, only part of its own."""
    class SlowPartialOfA(Sink):
        async def __call__(self, message, topic, key, wait=True) -> None:  # noqa: ANN001
            if isinstance(message, UsageRecord) and not message.final and message.request_id == "a":
                try:
                    await asyncio.sleep(1.0)
                except asyncio.CancelledError:
                    await asyncio.sleep(1.0)
            await super().__call__(message, topic, key, wait)

    runtime, sink, _ = make(time_scale=1.0, usage_interval_s=0.01, sink=SlowPartialOfA())
    await runtime.command(placement("warm", max_tokens=1))
    await settle(runtime)
    await runtime.command(placement("a", max_tokens=30))  # ~0.05 s
    await runtime.command(placement("b", max_tokens=400))
    await settle(runtime)
    a, b = usage_sum(sink, "a")[2], usage_sum(sink, "b")[2]
    assert a < 0.25 and b > 0.6, (a, b)


async def test_another_nodes_command_sharing_the_partition_makes_no_span(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """An agent reads the placements partition its node id hashes to, the commands of every
    node sharing it, and skips the others': about 17 of 100 agents read each partition, and
    each put a `gpusched.placements process` span of every command in its request's trace.
    Only the agent the command is for makes one now."""
    broker = make_broker(KafkaSettings(), "gpu-agent", tracer_provider, None)
    runtime, _, _ = make(node_id="n1", tracer=tracer_provider.get_tracer("gpu-agent"))
    handlers.register(broker, runtime, Counter(
        "commands", "", ["command", "outcome"], registry=CollectorRegistry()))
    partition = topics.partition_for_key("n1", topics.PLACEMENTS.partitions)
    other = next(f"n{i}" for i in itertools.count(2)
                 if topics.partition_for_key(f"n{i}", topics.PLACEMENTS.partitions) == partition)
    async with TestKafkaBroker(broker) as br:
        for node_id, trace_id in ((other, 5), ("n1", 6)):
            command = placement(f"for-{node_id}", max_tokens=1).model_copy(
                update={"node_id": node_id})
            with in_trace(trace_id):  # the scheduler's `schedule` span
                await br.publish(command.to_bytes(), topics.PLACEMENTS.name,
                                 key=node_id.encode(), partition=partition)
        await settle(runtime)
    processed = [s.context.trace_id for s in span_exporter.get_finished_spans()
                 if s.name == f"{topics.PLACEMENTS.name} process"]
    assert processed == [6]


async def test_a_keyless_unreadable_command_is_dead_lettered_once_by_the_agents_sharing_it(
        ) -> None:
    """Agents whose node ids hash to one placements partition all read a record produced
    there without a key; one of them dead-letters it when it is no command (before: each
    of them did, one dead letter per agent)."""
    broker = make_broker(KafkaSettings(), "gpu-agent", None, None)
    ledger, letters = MemoryLedger(), []
    nodes = ("node-2", "node-3")
    partition = topics.partition_for_key(nodes[0], topics.PLACEMENTS.partitions)
    assert topics.partition_for_key(nodes[1], topics.PLACEMENTS.partitions) == partition
    for node in nodes:
        runtime, _, _ = make(node_id=node, ledger=ledger)
        handlers.register(broker, runtime, Counter(
            "commands", "", ["command", "outcome"], registry=CollectorRegistry()))

    @broker.subscriber(topics.DEAD_LETTERS.name)
    async def dead(msg: KafkaMessage) -> None:
        letters.append(DEAD_LETTER.validate_json(msg.body))

    async with TestKafkaBroker(broker) as br:  # its keyless record has b"" as key: alike
        await br.publish(b'{"type": "placement"}', topics.PLACEMENTS.name, partition=partition)
        await br.publish(b'{"type": "preempt"}', topics.PLACEMENTS.name, partition=partition,
                         key=b"node-3")  # keyed: node-3's alone, node-2 skips it
    assert [(d.service, d.reason.split(":")[0]) for d in letters] == \
        [("gpu-agent", "not a placement or preempt")] * 2
