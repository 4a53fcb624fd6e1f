"""Typed settings shared by every service, read from GPUSCHED_* environment variables.

Each service composes these into its own settings object, validated once at start-up.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_CONFIG_DIR = Path(__file__).resolve().parents[4] / "config"


def server_root(url: str) -> str:
    """The root of an OpenAI-shaped HTTP server (an inference server, a gpusched service),
    to which its users append /v1/...: `url` without trailing slashes and one trailing /v1,
    as OpenAI clients write a base URL. A path before it (a proxy's prefix) is kept."""
    parts = urlsplit(url)
    return parts._replace(path=parts.path.rstrip("/").removesuffix("/v1").rstrip("/")).geturl()


class KafkaSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUSCHED_KAFKA_", extra="ignore")
    bootstrap: str = Field(
        default="127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,host:port]."
    )
    replication_factor: int = Field(
        default=1, ge=1, le=7, description="Copies of each partition of the topics a service "
        "creates at start (3 on a production cluster; existing topics are left as they are).")


class RedisSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUSCHED_REDIS_", extra="ignore")
    url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL.")
    timeout_s: float = Field(
        default=5.0, gt=0, le=60, description="Longest wait for Redis to connect or answer "
        "one command; then the caller fails with a clear error (a refused or dropped "
        "connection is retried for about 3 s first).")
    max_connections: int = Field(
        default=200, ge=1, le=10_000, description="Connections one process opens at most; a "
        "command beyond them waits for a free one (up to timeout_s) instead of failing.")


class TelemetrySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPUSCHED_", extra="ignore")
    otlp_endpoint: str | None = Field(
        default="http://127.0.0.1:4318",
        description="OTLP/HTTP base URL of the trace collector (Jaeger); empty disables export.",
    )
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)


class ServiceSettings(BaseSettings):
    """Fields every service has; a service subclasses it with its own."""

    model_config = SettingsConfigDict(env_prefix="GPUSCHED_", extra="ignore")
    http_port: int = Field(default=8080, ge=0, le=65535, description="HTTP port (0 = any).")
    http_host: str = Field(default="127.0.0.1", description="Address the HTTP server binds.")
    config_dir: Path = Field(
        default=REPO_CONFIG_DIR, description="Folder with models.yaml and tenants.yaml."
    )
    log_level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    gc_young_threshold: int = Field(
        default=700, ge=700, le=1_000_000, description="Allocations between collections of "
        "Python's youngest generation (Python's default: 700). Consumers that hold large "
        "batches alive run faster with more; older generations are then collected less "
        "often too.")
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
