"""What one usage record adds to which rollup counters, and how a time window maps onto
buckets; pure, so the live apply, the query API and the reconciliation share one rule.

Every counter is an integer (GPU time in microseconds, cost in nano-USD), so totals are
exact sums whatever the order in which records are applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from gpusched_common.contracts import UsageRecord

Granularity = Literal["minute", "hour", "day"]
GRANULARITY_S: dict[Granularity, int] = {"minute": 60, "hour": 3600, "day": 86_400}
GRANULARITY_CODE: dict[Granularity, str] = {"minute": "m", "hour": "h", "day": "d"}

Dimension = Literal["model", "node", "gpu_type", "priority_class", "tenant"]
DIMENSION_CODE: dict[Dimension, str] = {"model": "m", "node": "n", "gpu_type": "g",
                                        "priority_class": "c", "tenant": "u"}
"""Prefix of a bucket hash field: `m:<model>`; `t` alone is the bucket's total. The `u:`
(tenant) fields exist only in the all-tenants buckets."""
TOTAL_FIELD = "t"
NO_GPU = "none"
"""gpu_type of a record for a placement that never ran (a hand-back): no request counted."""


@dataclass(frozen=True)
class Totals:
    """Counters of one bucket field, one request or one window. Integers only."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    gpu_us: int = 0
    cost_nusd: int = 0

    def __add__(self, other: Totals) -> Totals:
        return Totals(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.prompt_tokens, self.completion_tokens, self.requests, self.gpu_us,
                self.cost_nusd)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def gpu_seconds(self) -> float:
        return self.gpu_us / 1_000_000

    @property
    def cost_usd(self) -> float:
        return self.cost_nusd / 1_000_000_000

    def public(self) -> dict[str, int | float]:
        """The shape the query API answers with (seconds and USD, not micro/nano units)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "requests": self.requests, "gpu_seconds": self.gpu_seconds,
                "cost_usd": round(self.cost_usd, 9)}


COUNTERS = tuple(f.name for f in fields(Totals))


def unpack(raw: bytes | str | None) -> Totals:
    """A packed bucket value ("p c r g n", as the Lua apply writes it) back into Totals."""
    if not raw:
        return Totals()
    text = raw.decode() if isinstance(raw, bytes) else raw
    return Totals(*(int(v) for v in text.split()))


class ModelPrice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: float = Field(default=0.0, ge=0, description="USD per million prompt tokens.")
    completion: float = Field(default=0.0, ge=0,
                              description="USD per million completion tokens.")


_FREE = ModelPrice()


class PriceTable(BaseModel):
    """Cost = GPU time at its GPU type's hourly price + tokens at their model's price per
    million. A type or model missing from the table costs the `default` entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu_hour_usd: dict[str, float] = Field(default_factory=dict)
    model_usd_per_million_tokens: dict[str, ModelPrice] = Field(default_factory=dict)

    def cost_nusd(self, gpu_type: str, gpu_us: int, model: str, prompt_tokens: int,
                  completion_tokens: int) -> int:
        """Nano-USD of one record, rounded once per record (so it never depends on order)."""
        gpu_hour = 0.0 if gpu_type == NO_GPU else self.gpu_hour_usd.get(
            gpu_type, self.gpu_hour_usd.get("default", 0.0))
        price = self.model_usd_per_million_tokens.get(model) or \
            self.model_usd_per_million_tokens.get("default") or _FREE
        nusd = (gpu_us * gpu_hour / 3600 * 1000  # gpu_us/1e6 h/3600 x USD x 1e9 nUSD
                + prompt_tokens * price.prompt * 1000 + completion_tokens * price.completion * 1000)
        return round(nusd)


def load_prices(config_dir: Path) -> PriceTable:
    """Read `prices.yaml`; a missing file means everything costs 0."""
    path = config_dir / "prices.yaml"
    if not path.is_file():
        return PriceTable()
    try:
        return PriceTable.model_validate(yaml.safe_load(path.read_text()) or {})
    except ValueError as exc:
        raise ValueError(f"{path} is invalid: {exc}") from exc


@dataclass(frozen=True)
class UsageRow:
    """One usage record reduced to what the apply needs; `as_json_row` is what the Lua
    script reads. `counts_request`: a final record of a placement that ran; the request is
    counted once, on the first such record (a preempted request runs twice, counts once)."""

    event_id: str
    request_id: str
    tenant: str
    model: str
    node_id: str
    gpu_type: str
    priority_class: str
    prompt_tokens: int
    completion_tokens: int
    gpu_us: int
    cost_nusd: int
    final: bool
    counts_request: bool
    ended_at_ms: int

    def as_json_row(self) -> list[str | int]:
        return [self.event_id, self.request_id, self.tenant, self.model, self.node_id,
                self.gpu_type, self.priority_class, self.prompt_tokens, self.completion_tokens,
                self.gpu_us, self.cost_nusd, int(self.final), int(self.counts_request),
                self.ended_at_ms]


def row_for(usage: UsageRecord, prices: PriceTable) -> UsageRow:
    gpu_us = round(usage.gpu_seconds * 1_000_000)
    return UsageRow(
        event_id=usage.event_id, request_id=usage.request_id, tenant=usage.tenant,
        model=usage.model, node_id=usage.node_id, gpu_type=usage.gpu_type,
        priority_class=usage.priority_class, prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens, gpu_us=gpu_us,
        cost_nusd=prices.cost_nusd(usage.gpu_type, gpu_us, usage.model, usage.prompt_tokens,
                                   usage.completion_tokens),
        final=usage.final, counts_request=usage.final and usage.gpu_type != NO_GPU,
        ended_at_ms=usage.ended_at_ms)


def bucket_start_s(at_ms: int, granularity: Granularity) -> int:
    """Start (epoch seconds, UTC) of the bucket holding `at_ms`; records bucket by ended_at."""
    span = GRANULARITY_S[granularity]
    return at_ms // 1000 // span * span


def field_of(dimension: Dimension, value: str) -> str:
    return f"{DIMENSION_CODE[dimension]}:{value}"


def fields_of(row: UsageRow, all_tenants: bool) -> list[str]:
    """The bucket hash fields one row adds to: total, model, node, GPU type, class (and the
    tenant in the all-tenants scope). Mirrors the Lua apply; used by the reconciliation."""
    out = [TOTAL_FIELD, field_of("model", row.model), field_of("node", row.node_id),
           field_of("gpu_type", row.gpu_type), field_of("priority_class", row.priority_class)]
    if all_tenants:
        out.append(field_of("tenant", row.tenant))
    return out


# ---- windows ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cover:
    """Buckets that exactly tile [start_s, end_s): whole days, then whole hours, then minutes."""

    start_s: int
    end_s: int
    buckets: tuple[tuple[Granularity, int], ...]


def cover(start_ms: int, end_ms: int, finest: Granularity = "minute") -> Cover:
    """The fewest buckets tiling the window, its edges widened to `finest` bucket bounds
    (so [10:00:30, 10:05:10) becomes [10:00, 10:06) with minute buckets)."""
    unit = GRANULARITY_S[finest]
    start_s = start_ms // 1000 // unit * unit
    end_s = -(-end_ms // (unit * 1000)) * unit
    end_s = max(end_s, start_s)
    order: list[Granularity] = [g for g in ("day", "hour", "minute")
                                if GRANULARITY_S[g] >= unit]
    return Cover(start_s, end_s, tuple(_tile(start_s, end_s, order)))


def _tile(start_s: int, end_s: int, order: list[Granularity]) -> list[tuple[Granularity, int]]:
    if start_s >= end_s:
        return []
    coarse, *finer = order
    span = GRANULARITY_S[coarse]
    first = -(-start_s // span) * span
    last = end_s // span * span
    if not finer:
        return [(coarse, s) for s in range(start_s, end_s, span)]
    if first >= last:
        return _tile(start_s, end_s, finer)
    return (_tile(start_s, first, finer) + [(coarse, s) for s in range(first, last, span)]
            + _tile(last, end_s, finer))


def finest_kept(start_ms: int, now_ms: int, retention_s: dict[Granularity, int]
                ) -> Granularity:
    """The finest granularity whose buckets still exist at the window's start (minute
    buckets expire first); a window reaching further back is answered at a coarser grain."""
    age_s = (now_ms - start_ms) / 1000
    for g in ("minute", "hour"):
        if age_s <= retention_s[g]:  # type: ignore[index]
            return g  # type: ignore[return-value]
    return "day"


# ---- recomputation ------------------------------------------------------------------------

def recompute(rows: Iterable[UsageRow], granularity: Granularity = "day"
              ) -> dict[tuple[str, int], Totals]:
    """Totals per (tenant, bucket start) from raw rows, with the same dedup (event id) and
    request-counting rules as the live apply: what the live counters must equal."""
    seen: set[tuple[str, str]] = set()
    counted: set[str] = set()
    out: dict[tuple[str, int], Totals] = {}
    for row in rows:
        if (row.request_id, row.event_id) in seen:
            continue
        seen.add((row.request_id, row.event_id))
        request = 1 if row.counts_request and row.request_id not in counted else 0
        if request:
            counted.add(row.request_id)
        key = (row.tenant, bucket_start_s(row.ended_at_ms, granularity))
        out[key] = out.get(key, Totals()) + Totals(row.prompt_tokens, row.completion_tokens,
                                                   request, row.gpu_us, row.cost_nusd)
    return out
