"""Tracing helpers shared by the services (gpusched_common.telemetry), on FastStream's
in-memory broker with the telemetry middleware every service's broker has."""

from __future__ import annotations

from importlib import metadata

import pytest
from faststream.kafka import KafkaMessage, TestKafkaBroker
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gpusched_common.broker import make_broker
from gpusched_common.contracts import (
    DeadLetter,
    InferenceRequest,
    Message,
    Rejection,
    RequestResult,
)
from gpusched_common.settings import KafkaSettings, TelemetrySettings
from gpusched_common.telemetry import make_tracer_provider, mark_failure, release, untraced

TOPIC = "gpusched.test"


async def test_a_message_published_untraced_starts_no_trace() -> None:
    """What a service publishes all the time for no request (an agent's heartbeat, the
    scheduler's scaling signal) was a trace each, publish and consume spans, and such traces
    crowded requests out of Jaeger's store. Published under `untraced()`, neither the
    publisher nor the consumer records a span; published otherwise, both still do."""
    spans = InMemorySpanExporter()
    provider = make_tracer_provider("test", TelemetrySettings(otlp_endpoint=""))
    provider.add_span_processor(SimpleSpanProcessor(spans))
    broker = make_broker(KafkaSettings(), "test", provider, None)
    traceparents: list[str] = []

    @broker.subscriber(TOPIC)
    async def on_message(msg: KafkaMessage) -> None:
        traceparents.append(msg.headers["traceparent"])

    async with TestKafkaBroker(broker) as br:
        with untraced():
            await br.publish(b"{}", TOPIC)
        assert not spans.get_finished_spans()
        # its sampled flag off: consumers elsewhere record none either
        assert not int(traceparents[0][-2:], 16) & 1
        await br.publish(b"{}", TOPIC)
    assert spans.get_finished_spans()


def result(status: str) -> RequestResult:
    return RequestResult(request_id="r", tenant="acme", model="m", status=status,
                         finish_reason=f"{status}: why", prompt_tokens=1, completion_tokens=0,
                         queued_ms=0, total_ms=0)


@pytest.mark.parametrize("ended,error", [
    (Rejection(request_id="r", tenant="acme", status_code=422, reason="fits nowhere"),
     "fits nowhere"),
    (DeadLetter(source_topic="t", partition=0, offset=1, key=None, payload="{", reason="not JSON",
                service="scheduler", at_ms=1), "not JSON"),
    (result("failed"), "failed: why"),
    (result("completed"), None),
    (result("cancelled"), None),
    (InferenceRequest(request_id="r", tenant="acme", model="m", prompt="p", max_tokens=1,
                      created_at_ms=0, attempt=1, requeued="preempted"), None),
    (None, None),
])
def test_a_span_is_marked_failed_only_where_its_request_failed(
        ended: Message | None, error: str | None) -> None:
    """No span was ever marked as an error, so Jaeger could not tell a failed request's
    trace from a completed one's. A span whose record ends its request in failure (a
    rejection, a dead letter, a failed result) has status ERROR with the reason, and the
    exception behind it where there is one; any other is left unset, never Ok."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with provider.get_tracer("test").start_as_current_span("decision") as span:
        mark_failure(span, ended, ValueError("boom"))
    [finished] = spans.get_finished_spans()
    if error is None:
        assert finished.status.status_code is StatusCode.UNSET and not finished.events
    else:
        assert (finished.status.status_code, finished.status.description) == (
            StatusCode.ERROR, error)
        assert [e.attributes["exception.type"] for e in finished.events] == ["ValueError"]


def test_spans_name_the_release_and_the_instance_given() -> None:
    """Spans named their service alone: in Jaeger, neither the release a service ran nor
    (for agents) the node could be told. `service.version` is the release; an instance id
    given (an agent's node id) is `service.instance.id`, else the SDK makes one up."""
    settings = TelemetrySettings(otlp_endpoint="")
    named = make_tracer_provider("gpu-agent", settings, instance_id="node-7").resource
    assert (named.attributes["service.instance.id"], named.attributes["service.version"]) == (
        "node-7", metadata.version("gpusched-common"))
    assert release() == metadata.version("gpusched-common")
    unnamed = make_tracer_provider("router", settings).resource.attributes
    assert unnamed["service.instance.id"] and unnamed["service.version"] == release()
