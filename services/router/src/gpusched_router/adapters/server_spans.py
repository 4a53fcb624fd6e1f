"""The SERVER span of each request to the router's door, from its first byte in to its
answer's last byte out, as OpenTelemetry's HTTP semantic conventions name and mark it."""

from __future__ import annotations

from collections.abc import Collection

from opentelemetry import trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.http_attributes import (
    HTTP_REQUEST_METHOD,
    HTTP_RESPONSE_STATUS_CODE,
    HTTP_ROUTE,
)
from opentelemetry.semconv.attributes.url_attributes import URL_PATH, URL_SCHEME
from opentelemetry.trace import SpanKind, StatusCode
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ServerSpans:
    """ASGI middleware: a span `<method> <route>` (SERVER) for each request to one of
    `routes` (paths without parameters, each its own route), current while the app handles
    it: what the handler publishes goes in its trace, and the handler names the request on
    it (`trace.get_current_span()`). It ends once the app has answered: a streamed answer
    once its stream has ended or its client has left, not when the handler returns. It
    says the method, the route and the status sent (`http.response.status_code`); a 5xx
    sets its status ERROR with `error.type` the status, as does an exception the app
    raises (`error.type` its type; the app's outer error handler answers it 500, where
    nothing was sent); a 4xx is the client's, and leaves it unset, as the conventions say
    of a server span. Paths not in `routes` (status reads, /metrics, health checks) make
    no span: a trace each would crowd requests' traces out of Jaeger's store."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, routes: Collection[str]) -> None:
        self._app = app
        self._tracer = tracer
        self._routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._routes:
            await self._app(scope, receive, send)
            return
        method, route = scope["method"], scope["path"]
        answered: list[int] = []  # the status sent, once it is

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and not answered:
                answered.append(message["status"])
                span.set_attribute(HTTP_RESPONSE_STATUS_CODE, message["status"])
                if message["status"] >= 500:
                    span.set_attribute(ERROR_TYPE, str(message["status"]))
                    span.set_status(StatusCode.ERROR)
            await send(message)

        with self._tracer.start_as_current_span(
                f"{method} {route}", kind=SpanKind.SERVER, attributes={
                    HTTP_REQUEST_METHOD: method, HTTP_ROUTE: route, URL_PATH: route,
                    URL_SCHEME: scope.get("scheme", "http")},
                record_exception=False, set_status_on_exception=False) as span:
            try:
                await self._app(scope, receive, sending)
            except ClientDisconnect:  # the client left mid-answer: no fault of the server
                raise
            except Exception as exc:  # a fault; unanswered, the outer handler answers 500
                span.record_exception(exc)
                if not answered:
                    span.set_attribute(HTTP_RESPONSE_STATUS_CODE, 500)
                span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
                span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
                raise
