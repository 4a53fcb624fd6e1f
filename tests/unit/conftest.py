"""Fixtures the unit tests share: a Redis of a test module's own, for what only Redis's
scripts decide (the whole stack is for tests/integration), and the spans a service would
send to Jaeger."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpusched_common.settings import TelemetrySettings
from gpusched_common.telemetry import make_tracer_provider
from gpusched_ops.testing import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this module's own, started as the local stack starts it (a failing start
    fails the tests that need it: only a machine without redis-server skips them)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (ops/scripts/install-redis.sh)")
    url, stop = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop()


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    """The spans `tracer_provider` ended, as Jaeger would get them (`get_finished_spans`)."""
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter: InMemorySpanExporter) -> TracerProvider:
    """A service's tracer provider (its sampler: every trace, as the default ratio says)
    exporting to `span_exporter` as each span ends."""
    provider = make_tracer_provider("test", TelemetrySettings(otlp_endpoint=""))
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    return provider
