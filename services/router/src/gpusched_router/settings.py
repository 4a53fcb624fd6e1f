"""Router settings (GPUSCHED_* environment variables)."""

from pydantic import Field

from gpusched_common.settings import ServiceSettings


class RouterSettings(ServiceSettings):
    http_port: int = Field(default=8080, ge=0, le=65535)
    request_timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="Longest a client waits for a terminal result."
    )
    status_ttl_s: int = Field(
        default=86_400, ge=60, description="How long GET /v1/requests/{id} remembers a "
        "request, and a tenant's Idempotency-Key its first use."
    )
    max_body_bytes: int = Field(default=1_048_576, ge=1024, description="Largest request body.")
    publish_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="Longest the router waits for Kafka to take a "
        "request before it answers 503 (Kafka down or stalled).")
    router_drain_s: float = Field(
        default=10.0, ge=0, le=3600, description="On SIGTERM, the requests the router's "
        "clients wait on get this long to end before each of those clients is answered 503 "
        "(the request goes on). The grace period before SIGKILL must cover it and the "
        "shutdown after it (30 s in Compose, Kubernetes and the local stack).")
