"""Accounting settings (GPUSCHED_* environment variables)."""

from pydantic import Field

from gpusched_common.settings import ServiceSettings


class AccountingSettings(ServiceSettings):
    http_port: int = Field(default=8082, ge=0, le=65535)
    dedup_ttl_s: int = Field(
        default=14 * 86_400, ge=3600, description="How long an applied usage event id is "
        "remembered; must exceed the longest possible redelivery (topic retention).")
    fetch_max_records: int = Field(default=2000, ge=1, le=50_000)
