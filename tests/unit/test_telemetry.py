"""Tracing helpers shared by the services (gpusched_common.telemetry), on FastStream's
in-memory broker with the telemetry middleware every service's broker has."""

from __future__ import annotations

from faststream.kafka import KafkaMessage, TestKafkaBroker
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpusched_common.broker import make_broker
from gpusched_common.settings import KafkaSettings, TelemetrySettings
from gpusched_common.telemetry import make_tracer_provider, untraced

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
