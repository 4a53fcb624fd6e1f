"""The FastStream Kafka broker every service uses, with tracing and metrics middlewares."""

from __future__ import annotations

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
    and is idempotent, so a retried send is not duplicated by the broker."""
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
        logger=None,
        **kwargs,
    )
