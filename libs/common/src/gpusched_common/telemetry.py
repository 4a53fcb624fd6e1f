"""OpenTelemetry set-up: one tracer provider per service exporting spans over OTLP/HTTP.

The W3C trace context rides in Kafka headers (see `broker.make_broker`), so one request is
one trace across router, scheduler, agent and accounting.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib import metadata

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from gpusched_common.contracts import (
    DeadLetter,
    InferenceRequest,
    Message,
    Rejection,
    RequestResult,
    cut_reason,
)
from gpusched_common.settings import TelemetrySettings

log = logging.getLogger(__name__)

MAX_SPAN_LINKS = 4096
"""Links a span keeps (the SDK's default, 128, dropped the rest): a scheduler's `scheduling
cycle` links each request it decided, up to 1,024 it planned (`max_units_per_cycle`) plus
the placements it sends again and the work it ends (cancelled, expired)."""

_IDS = RandomIdGenerator()


def release() -> str:
    """The gpusched release this process runs, its spans' `service.version`: the version of
    gpusched-common, which every service has, installed with it from one source tree
    (`unknown` run from a tree not installed)."""
    try:
        return metadata.version("gpusched-common")
    except metadata.PackageNotFoundError:
        return "unknown"


def make_tracer_provider(service_name: str, settings: TelemetrySettings,
                         instance_id: str | None = None) -> TracerProvider:
    """A provider exporting to `settings.otlp_endpoint`; call `.shutdown()` on exit to flush.
    Its spans name the service, its `release()` and, as `service.instance.id`, the instance
    (`instance_id`: an agent's node id, which tells its spans from other agents' in Jaeger;
    else one the SDK makes up per process)."""
    identity = {"service.name": service_name, "service.version": release()}
    if instance_id is not None:
        identity["service.instance.id"] = instance_id
    provider = TracerProvider(
        resource=Resource.create(identity),
        sampler=ParentBasedTraceIdRatio(settings.trace_sample_ratio),
        span_limits=SpanLimits(max_links=MAX_SPAN_LINKS),
    )
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint.rstrip("/") + "/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def context_from(carrier: dict[str, str]) -> Context:
    return extract(carrier)


def carried(carrier: dict[str, str]) -> trace.Span:
    """The span a W3C carrier (trace headers) names, as a parent; an invalid one where it
    names none (empty, malformed)."""
    return trace.get_current_span(extract(carrier))


def in_trace(carrier: dict[str, str]) -> AbstractContextManager[trace.Span]:
    """What is published within goes in the trace `carrier` names (W3C trace headers), as
    if under the span they name; with none, in a new trace each."""
    return trace.use_span(carried(carrier))


def carrier_of(span: trace.Span) -> dict[str, str]:
    """The W3C carrier (trace headers) naming `span`, sampled or not, for a record or a
    stored status; empty where `span` is invalid. The inverse of `carried`."""
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def carried_span(carrier: dict[str, str]) -> trace.SpanContext:
    """The span a W3C carrier names; not `is_valid` where it names none (empty, malformed)."""
    return carried(carrier).get_span_context()


def record_carrier(headers: object) -> dict[str, str]:
    """The W3C trace headers of a Kafka record (a batch consumer's per-record parent)."""
    return {k: v.decode(errors="replace") for k, v in (headers or ())  # type: ignore[attr-defined]
            if k in ("traceparent", "tracestate") and isinstance(v, bytes)}


def request_attributes(request: InferenceRequest) -> dict[str, str]:
    """The attributes that name a request on its spans, alike in every service: Jaeger finds
    a request's trace by its tag `gpusched.request_id`."""
    return {"gpusched.request_id": request.request_id, "gpusched.tenant": request.tenant,
            "gpusched.priority_class": request.priority_class, "gpusched.model": request.model}


def mark_failure(span: trace.Span, ended: Message | None,
                 exc: BaseException | None = None) -> None:
    """Give `span` status ERROR, with the reason, where `ended` (the record it sends, or
    the one its work ended with) ends a request in failure: a rejection, a dead letter, a
    failed result; and record `exc`, the exception behind it, if any. Anything else leaves
    the status unset (OpenTelemetry: errors SHOULD set Error, success leaves it unset, and
    only an operator's override sets Ok): a request cancelled, handed back or completed
    did not fail."""
    if isinstance(ended, Rejection | DeadLetter):
        reason = ended.reason
    elif isinstance(ended, RequestResult) and ended.status == "failed":
        reason = cut_reason(ended.finish_reason)
    else:
        return
    if exc is not None:
        span.record_exception(exc)
    span.set_status(trace.Status(trace.StatusCode.ERROR, reason))


@contextmanager
def untraced() -> Iterator[None]:
    """Publish in this block without starting a trace: for messages of no request sent all
    the time (heartbeats, scaling signals), each of which was a trace of its own, and which
    crowded requests out of Jaeger's store. Its current span is a fresh unsampled one, so a
    span started under it, FastStream's publish spans included, is not recorded (samplers
    are parent-based), and the `traceparent` it puts in a record tells consumers not to
    record theirs either."""
    unsampled = trace.NonRecordingSpan(trace.SpanContext(
        trace_id=_IDS.generate_trace_id(), span_id=_IDS.generate_span_id(), is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT)))
    with trace.use_span(unsampled):
        yield


def trace_id_hex(span: trace.Span | None = None) -> str | None:
    """The 32-hex-digit trace id of `span` (default: the current span), None when unsampled
    (Jaeger never gets such a trace: an id would send the user looking for nothing)."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid and ctx.trace_flags.sampled else None
