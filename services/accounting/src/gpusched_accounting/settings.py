"""Accounting settings (GPUSCHED_* environment variables)."""

from pydantic import Field, model_validator

from gpusched_common.settings import ServiceSettings

DAY_S = 86_400
CONSUMER_GROUP = "gpusched-accounting"
DEDUP_TTL_S = 7 * DAY_S
MIN_DEDUP_TTL_S = 3600
"""The shortest dedup window accounting starts with, and so the shortest `gpusched
reconcile --dedup-ttl-s` takes."""


class AccountingSettings(ServiceSettings):
    http_port: int = Field(default=8082, ge=0, le=65535)
    consumer_group: str = Field(
        default=CONSUMER_GROUP, min_length=1, description="Kafka consumer group of the "
        "usage topic; instances in one group share its partitions.")
    dedup_ttl_s: int = Field(
        default=DEDUP_TTL_S, ge=MIN_DEDUP_TTL_S, description="How long a request's applied "
        "event ids are remembered after its last record (5 minutes more: DEDUP_MARGIN_S). "
        "Records that ended longer ago are "
        "refused (dead letter), so it must exceed the longest redelivery (a consumer down this "
        "long needs `gpusched reconcile`).")
    minute_retention_s: int = Field(
        default=2 * DAY_S, ge=3600, description="How long minute buckets are kept after they "
        "end (about 0.7 KiB per active tenant-minute); older windows use hour buckets.")
    hour_retention_s: int = Field(default=35 * DAY_S, ge=DAY_S,
                                  description="How long hour buckets are kept.")
    day_retention_s: int = Field(default=400 * DAY_S, ge=32 * DAY_S,
                                 description="How long day buckets are kept (month budgets "
                                 "are summed from them, hence at least 32 days).")
    fetch_max_records: int = Field(
        default=40_000, ge=1, le=100_000, description="Usage records per Kafka fetch; their "
        "offsets commit once all of them are applied.")
    apply_chunk_records: int = Field(
        default=5000, ge=1, le=50_000, description="Usage records per Lua call (one atomic "
        "step). A fetch is applied in chunks; the next chunk is parsed while Redis applies "
        "the previous one, and larger chunks share more bucket updates.")

    budget_recheck_s: float = Field(
        default=60.0, gt=0, le=86_400, description="Every this often (and at start) each "
        "budget flag is checked against budgets.yaml as this instance read it: a budget raised "
        "or removed unblocks its tenant, whose refused requests bill nothing that would check "
        "it. A check that fails (Redis away) is tried again within 5 s.")

    gc_young_threshold: int = Field(
        default=50_000, ge=700, le=1_000_000, description="As for every service; 50,000 here: a "
        "fetch keeps tens of thousands of records alive, and with Python's 700 they were "
        "scanned and promoted again and again (about 15% of the CPU per record).")

    @model_validator(mode="after")
    def _retention_grows(self) -> "AccountingSettings":
        if not self.minute_retention_s <= self.hour_retention_s <= self.day_retention_s:
            raise ValueError("retention must grow with the bucket size: minute_retention_s <= "
                             "hour_retention_s <= day_retention_s")
        return self
