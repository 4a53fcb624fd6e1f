"""The FastStream Kafka broker every service uses, with tracing and metrics middlewares."""

from __future__ import annotations

from typing import Any

from faststream.kafka import KafkaBroker
from faststream.kafka.opentelemetry import KafkaTelemetryMiddleware
from faststream.kafka.prometheus import KafkaPrometheusMiddleware
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from gpusched_common.settings import KafkaSettings


def make_broker(
    settings: KafkaSettings,
    service_name: str,
    tracer_provider: TracerProvider | None,
    registry: CollectorRegistry | None,
    **kwargs: object,
) -> KafkaBroker:
    """A broker whose every publish and consume is a span (W3C context in Kafka headers)
    and is counted in `registry`. Producer waits for the leader's ack (`acks=all` on one node)
    and is idempotent, so a retried send is not duplicated by the broker.

    Handlers take one argument, the message itself (`msg: KafkaMessage`): no dependency
    injection per call (it resolved the message in a worker thread, about as costly as
    handling a batch), and each handler validates the raw bytes it reads once."""
    middlewares = []
    if tracer_provider is not None:
        middlewares.append(KafkaTelemetryMiddleware(tracer_provider=tracer_provider))
    if registry is not None:
        middlewares.append(KafkaPrometheusMiddleware(registry=registry, app_name=service_name))
    return KafkaBroker(
        settings.bootstrap,
        client_id=f"gpusched-{service_name}",
        acks="all",
        enable_idempotence=True,
        linger_ms=1,
        middlewares=middlewares,
        apply_types=False,
        decoder=_the_message,
        logger=None,
        **kwargs,
    )


async def lean_batch_parser(records: Any, original: Any) -> Any:
    """FastStream's batch parsing without the per-record work its handlers here never read:
    decoding every record's headers into a dict, and its telemetry's per-record baggage
    (together about as costly as handling the record). The message is FastStream's own, made
    from the first record and then given the whole batch; batch handlers read each record's
    own trace context (`telemetry.record_carrier`)."""
    msg = await original(records[:1])
    first, last = records[0], records[-1]
    msg.raw_message = records
    msg.body = [r.value or b"" for r in records]
    msg.batch_headers = []
    msg.message_id = f"{first.offset}-{last.offset}-{first.timestamp}"
    return msg


async def _the_message(msg: Any, original: Any) -> Any:
    """What a handler is called with: the message, not its decoded body."""
    return msg


RAW_BATCH: dict[str, Any] = {"parser": lean_batch_parser}
"""Subscriber options for batch handlers that parse `msg.raw_message` themselves."""
