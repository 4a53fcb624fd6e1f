"""Scheduler settings (GPUSCHED_* environment variables)."""

from pydantic import Field

from gpusched_common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    http_port: int = Field(default=8081, ge=0, le=65535)
    cycle_window_ms: float = Field(
        default=5.0, ge=0, le=1000, description="Micro-batch window: pending work is collected "
        "this long after the first arrival, then solved as one batch.")
    node_timeout_s: float = Field(
        default=10.0, gt=0, description="A node silent this long receives no new work.")
    scheduler_epoch: int = Field(default=1, ge=0, description="Fencing token on placements.")
    fetch_max_records: int = Field(default=500, ge=1, le=10_000)
