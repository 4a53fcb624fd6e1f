"""What one usage record adds to which rollup counters, and how a time window maps onto
buckets; pure, so the live apply, the query API and the reconciliation share one rule.

Every counter is an integer (GPU time in microseconds, cost in nano-USD), so totals are
exact sums whatever the order in which records are applied.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from gpusched_common.catalog import GPU_TYPES, NOT_BOOL, load_models, read_config_as
from gpusched_common.contracts import UsageRecord

Granularity = Literal["minute", "hour", "day"]
GRANULARITY_S: dict[Granularity, int] = {"minute": 60, "hour": 3600, "day": 86_400}
GRANULARITY_CODE: dict[Granularity, str] = {"minute": "m", "hour": "h", "day": "d"}

GroupBy = Literal["model", "node", "gpu_type", "priority_class"]
"""What a report can split one tenant's usage by (its rows are per tenant already)."""
Dimension = GroupBy | Literal["tenant"]
DIMENSION_CODE: dict[Dimension, str] = {"model": "m", "node": "n", "gpu_type": "g",
                                        "priority_class": "c", "tenant": "u"}
"""Prefix of a bucket hash field: `m:<model>`; `t` alone is the bucket's total. The `u:`
(tenant) fields exist only in the all-tenants buckets."""
TOTAL_FIELD = "t"
MAX_END_AHEAD_MS = 86_400_000
"""A usage record ending later than a day after accounting's clock (its agent's clock is
that far off) is dead-lettered, not billed into a bucket no query or budget reads before
then; a query window's end is cut there too."""
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


_COUNTERS = struct.Struct("<5q")
COUNTERS_SIZE = _COUNTERS.size


def unpack(raw: bytes | None) -> Totals:
    """A packed counter value (five little-endian int64 in `Totals` order, as the Lua apply
    writes it) back into Totals; None (absent) is zero."""
    if not raw:
        return Totals()
    return Totals(*_COUNTERS.unpack_from(raw))


def pack(totals: Totals) -> bytes:
    return _COUNTERS.pack(*totals.as_tuple())


MAX_GPU_HOUR_USD = 1000.0
MAX_USD_PER_MILLION_TOKENS = 1000.0
"""Far above any real price, and low enough that one record's cost (at most 8 GPUs for a
month and 10**9 tokens of each kind: under $8M) stays exact in a bucket's nano-USD counter
(2**53: $9M)."""
GpuHourUsd = Annotated[float, Field(ge=0, le=MAX_GPU_HOUR_USD, allow_inf_nan=False), NOT_BOOL]
TokenUsd = Annotated[float, Field(ge=0, le=MAX_USD_PER_MILLION_TOKENS, allow_inf_nan=False),
                     NOT_BOOL]
# A negative price made USD budgets never trip, NaN or infinity dead-lettered every record
# (its cost cannot be rounded to nano-USD): refused when prices.yaml is read, at start


class ModelPrice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: TokenUsd = Field(default=0.0, description="USD per million prompt tokens.")
    completion: TokenUsd = Field(default=0.0, description="USD per million completion tokens.")
    retired: bool = Field(default=False, strict=True, description="A model no longer in "
                          "models.yaml, whose records still come (work in flight, a "
                          "backlog) and are recomputed by reconcile: billed at this price.")


_FREE = ModelPrice()


class PriceTable(BaseModel):
    """Cost = GPU time at its GPU type's hourly price + tokens at their model's price per
    million. A type or model missing from the table costs the `default` entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu_hour_usd: dict[str, GpuHourUsd] = Field(default_factory=dict)
    model_usd_per_million_tokens: dict[str, ModelPrice] = Field(default_factory=dict)

    def rates(self, gpu_type: str, gpu_us: int, model: str) -> Rates:
        gpu_hour = 0.0 if gpu_type == NO_GPU else self.gpu_hour_usd.get(
            gpu_type, self.gpu_hour_usd.get("default", 0.0))
        price = self.model_usd_per_million_tokens.get(model) or \
            self.model_usd_per_million_tokens.get("default") or _FREE
        return Rates(gpu_us * gpu_hour / 3600 * 1000,  # gpu_us/1e6 h/3600 x USD x 1e9 nUSD
                     price.prompt, price.completion)

    def cost_nusd(self, gpu_type: str, gpu_us: int, model: str, prompt_tokens: int,
                  completion_tokens: int) -> int:
        """Nano-USD of one record, rounded once per record (so it never depends on order)."""
        return self.rates(gpu_type, gpu_us, model).cost_nusd(prompt_tokens, completion_tokens)


class Rates(NamedTuple):
    """What one record's parts cost: its GPU time in nano-USD, and USD per million prompt
    and completion tokens."""

    gpu_nusd: float
    prompt_usd: float
    completion_usd: float

    def cost_nusd(self, prompt_tokens: int, completion_tokens: int) -> int:
        return round(self.gpu_nusd + prompt_tokens * self.prompt_usd * 1000
                     + completion_tokens * self.completion_usd * 1000)


def load_prices(config_dir: Path) -> PriceTable:
    """Read `prices.yaml`; raises ValueError naming the file when it is missing or invalid.
    A missing one is no price table of zeros: a config folder named wrongly (reconcile's in
    a Docker image) billed, or recomputed, every cost as 0. Its GPU types must be gpusched's
    and its models `models.yaml`'s: a misspelt one billed at the `default` price, or free."""
    path = config_dir / "prices.yaml"
    table = read_config_as(PriceTable, path)
    models = load_models(config_dir).names
    unknown = [f"gpu_hour_usd.{t} (GPU types: {', '.join(GPU_TYPES)})"
               for t in table.gpu_hour_usd if t not in GPU_TYPES and t != "default"]
    unknown += [f"model_usd_per_million_tokens.{m} (models.yaml: {', '.join(models)})"
                for m, price in table.model_usd_per_million_tokens.items()
                if m not in models and m != "default" and not price.retired]
    if unknown:
        raise ValueError(f"{path} is invalid: no such GPU type or model: {'; '.join(unknown)}"
                         " (what is not listed costs the `default` entry; a model no longer"
                         " served keeps its price with `retired: true`)")
    return table


class UsageRow(NamedTuple):
    """One usage record reduced to what the apply needs (a tuple: built once per record on
    the hot path). `counts_request`: a final record of a placement that ran; the request is
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
    prompt_from: int = -1
    completion_from: int = -1
    """Positions of the first prompt and completion token the record bills; -1 (an older
    agent's record): its tokens are billed as they are, and no position is noted."""
    rates: Rates = Rates(0.0, 0.0, 0.0)
    """What its parts cost, for the cost of fewer tokens than it carries."""


def row_for(usage: UsageRecord, prices: PriceTable) -> UsageRow:
    gpu_us = round(usage.gpu_seconds * 1_000_000)
    rates = prices.rates(usage.gpu_type, gpu_us, usage.model)
    return UsageRow(  # positional: this runs once per usage record
        usage.event_id, usage.request_id, usage.tenant, usage.model, usage.node_id,
        usage.gpu_type, usage.priority_class, usage.prompt_tokens, usage.completion_tokens,
        gpu_us, rates.cost_nusd(usage.prompt_tokens, usage.completion_tokens),
        usage.final, usage.final and usage.gpu_type != NO_GPU, usage.ended_at_ms,
        -1 if usage.prompt_from is None else usage.prompt_from,
        -1 if usage.completion_from is None else usage.completion_from, rates)


# ---- token positions: each one of a request billed once -----------------------------------

def take(spans: list[int], start: int, n: int) -> int:
    """Adds positions [start, start + n) to `spans` (sorted disjoint [from, to) ranges,
    flattened; touching ones merged) and returns how many of them it did not hold. The apply
    script's `take` (adapters/store.py) is its twin."""
    if n <= 0:
        return 0
    if not spans or start > spans[-1]:  # after every span: the common cases
        spans += (start, start + n)
        return n
    if start == spans[-1]:
        spans[-1] = start + n
        return n
    end, lo, hi, covered = start + n, start, start + n, 0
    out: list[int] = []
    placed = False
    for i in range(0, len(spans), 2):
        a, b = spans[i], spans[i + 1]
        if b < lo or a > hi:  # apart: neither overlapping nor touching
            if a > hi and not placed:
                out += (lo, hi)
                placed = True
            out += (a, b)
        else:
            covered += max(0, min(b, end) - max(a, start))
            lo, hi = min(lo, a), max(hi, b)
    if not placed:
        out += (lo, hi)
    spans[:] = out
    return n - covered


class Billed(NamedTuple):
    """What one row bills: the positions no earlier row of its request billed, and their
    cost; GPU time is always its own."""

    prompt_tokens: int
    completion_tokens: int
    cost_nusd: int


NOTHING = Billed(0, 0, 0)


def billed(row: UsageRow, spans: tuple[list[int], list[int]]) -> Billed:
    """What `row` bills after the earlier rows of its request, whose prompt and completion
    positions are in `spans` (updated here): a request started over after its node died
    bills its prompt, and each completion position, once."""
    if row.prompt_from < 0:
        return bill_of(row, row.prompt_tokens, row.completion_tokens)
    prompt, completion = spans
    return bill_of(row, take(prompt, row.prompt_from, row.prompt_tokens),
                   take(completion, row.completion_from, row.completion_tokens))


def bill_of(row: UsageRow, prompt_tokens: int, completion_tokens: int) -> Billed:
    """`row` billing that many of its tokens (all of them: its own cost, exactly)."""
    if (prompt_tokens, completion_tokens) == (row.prompt_tokens, row.completion_tokens):
        return Billed(prompt_tokens, completion_tokens, row.cost_nusd)
    return Billed(prompt_tokens, completion_tokens,
                  row.rates.cost_nusd(prompt_tokens, completion_tokens))


def content_digest(row: UsageRow) -> str:
    """16 hex digits of what a record bills (everything but its ids and its cost, which
    follows the price table of the day): the same record delivered again has the same
    digest, another record under a reused event id almost surely not."""
    billed = (f"{row.tenant} {row.model} {row.node_id} {row.gpu_type} {row.priority_class} "
              f"{row.prompt_tokens} {row.completion_tokens} {row.gpu_us} {int(row.final)} "
              f"{row.ended_at_ms}")  # names hold no space: one text per content
    return hashlib.blake2b(billed.encode(), digest_size=8).hexdigest()


def bills_nothing(row: UsageRow) -> bool:
    """No tokens, no GPU time, no request counted: never a conflict (an agent's zero final
    made again at recover), since dropping it loses nothing."""
    return not (row.prompt_tokens or row.completion_tokens or row.gpu_us
                or row.counts_request)


def bucket_start_s(at_ms: int, granularity: Granularity) -> int:
    """Start (epoch seconds, UTC) of the bucket holding `at_ms`; records bucket by ended_at."""
    span = GRANULARITY_S[granularity]
    return at_ms // 1000 // span * span


def field_of(dimension: Dimension, value: str) -> str:
    return f"{DIMENSION_CODE[dimension]}:{value}"


def fields_of(row: UsageRow, all_tenants: bool) -> list[str]:
    """The bucket hash fields one row adds to: total, model, node, GPU type, class (and the
    tenant in the all-tenants scope); `bucket_deltas` sums rows into exactly these."""
    out = [TOTAL_FIELD, field_of("model", row.model), field_of("node", row.node_id),
           field_of("gpu_type", row.gpu_type), field_of("priority_class", row.priority_class)]
    if all_tenants:
        out.append(field_of("tenant", row.tenant))
    return out


# ---- the apply's outcome of each row, and the bucket deltas of a batch -------------------

CONFLICT, STALE, DUPLICATE, NEW, COUNTED = -2, -1, 0, 1, 2
"""Outcome of a row in an apply: an event id applied before with other content (refused:
not billed to either), an event id no longer kept of a record older than the dedup window
(refused), an event id applied before with the same content (or before digests were
kept), new, or new and the first to count its request."""


def _another_owner(owner: dict[str, tuple[str, str]], row: UsageRow) -> bool:
    """Whether `row`'s request id is already another tenant's or model's in `owner` (request
    id -> its first row's tenant and model, noted here): a reused request id."""
    return owner.setdefault(row.request_id, (row.tenant, row.model)) != (row.tenant, row.model)


def guess_outcomes(rows: Sequence[UsageRow], oldest_ms: int) -> list[int]:
    """The outcomes if nothing in the batch was seen before: a duplicate when the batch
    repeats an event (a conflict when with other content: `content_digest`), even one that
    ended before `oldest_ms`; else stale when it ended before then; COUNTED for the first
    final record of a request in the batch that counts it. In the order the apply script
    decides: an id it still keeps is never stale, and a stale row makes its request id
    nobody's."""
    first: dict[tuple[str, str], UsageRow] = {}
    owner: dict[str, tuple[str, str]] = {}
    counted: set[str] = set()
    out = []
    for row in rows:
        seen = first.get((row.request_id, row.event_id))
        if seen is None and row.ended_at_ms < oldest_ms:
            out.append(STALE)
        elif _another_owner(owner, row):
            out.append(CONFLICT)
        elif seen is not None:
            # digests only for a repeat: the common batch has none
            out.append(DUPLICATE if bills_nothing(row)
                       or content_digest(seen) == content_digest(row) else CONFLICT)
        else:
            first[(row.request_id, row.event_id)] = row
            if row.counts_request and row.request_id not in counted:
                counted.add(row.request_id)
                out.append(COUNTED)
            else:
                out.append(NEW)
    return out


def _add(into: dict[str, list[int]], name: str, add: list[int] | tuple[int, ...]) -> None:
    v = into.get(name)
    if v is None:
        into[name] = list(add)
    else:
        v[0] += add[0]; v[1] += add[1]; v[2] += add[2]; v[3] += add[3]; v[4] += add[4]  # noqa: E702


Bucket = tuple[str | None, Granularity, int]
"""(tenant, or None for all tenants; granularity; start, epoch seconds)."""


def guess_billed(rows: Sequence[UsageRow], outcomes: Sequence[int]
                 ) -> list[Billed | UsageRow]:
    """What each row bills if no position of its request was billed before the batch
    (NOTHING for a row that is not new). A row that bills all it carries stands for itself
    (it has the fields of a `Billed`): the common case costs no allocation."""
    earlier: dict[str, UsageRow | tuple[list[int], list[int]]] = {}
    out: list[Billed | UsageRow] = []
    for row, outcome in zip(rows, outcomes):
        if outcome < NEW:
            out.append(NOTHING)
            continue
        if row.prompt_from < 0:
            out.append(row)
            continue
        before = earlier.get(row.request_id)
        if before is None:  # the first of its request in the batch
            earlier[row.request_id] = row
            out.append(row)
            continue
        if isinstance(before, UsageRow):  # the second: note the first's positions
            spans: tuple[list[int], list[int]] = ([], [])
            billed(before, spans)
            before = earlier[row.request_id] = spans
        out.append(billed(row, before))
    return out


def bucket_deltas(rows: Sequence[UsageRow], outcomes: Sequence[int],
                  bills: Sequence[Billed | UsageRow],
                  retention_s: dict[Granularity, int]
                  ) -> tuple[dict[Bucket, tuple[int, dict[str, list[int]]]], list[str]]:
    """What the new rows (outcome NEW or COUNTED) add to each bucket, each its `bills` entry:
    per tenant and for all tenants, in minute, hour and day buckets: (the time it expires,
    epoch s; {field: [prompt, completion, requests, gpu_us, cost_nusd]}); and the tenants
    that have new rows. Rows are summed per (tenant, minute) first, so the cost of the
    coarser buckets does not grow with the batch."""
    per_minute: dict[tuple[str, int], dict[str, list[int]]] = {}
    for row, outcome, bill in zip(rows, outcomes, bills):
        if outcome < NEW:
            continue
        add = (bill.prompt_tokens, bill.completion_tokens, 1 if outcome == COUNTED else 0,
               row.gpu_us, bill.cost_nusd)
        fields = per_minute.setdefault((row.tenant, row.ended_at_ms // 60_000 * 60), {})
        for name in fields_of(row, all_tenants=False):
            _add(fields, name, add)
    buckets: dict[Bucket, tuple[int, dict[str, list[int]]]] = {}
    for (tenant, minute_s), fields in per_minute.items():
        for granularity, span in GRANULARITY_S.items():
            start = minute_s - minute_s % span
            expire_at_s = start + span + retention_s[granularity]
            own = buckets.setdefault((tenant, granularity, start), (expire_at_s, {}))[1]
            every = buckets.setdefault((None, granularity, start), (expire_at_s, {}))[1]
            for name, add in fields.items():
                _add(own, name, add)
                _add(every, name, add)
            _add(every, field_of("tenant", tenant), fields[TOTAL_FIELD])
    return buckets, sorted({tenant for tenant, _ in per_minute})


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


def oldest_kept_s(now_ms: int, granularity: Granularity, retention_s: int) -> int:
    """Start (epoch s) of the oldest bucket of `granularity` Redis still keeps at `now_ms`:
    each expires `retention_s` after its end (`bucket_deltas`), and an older one would read
    as if nothing had been used."""
    span_ms = GRANULARITY_S[granularity] * 1000
    return -(-(now_ms - span_ms - retention_s * 1000) // span_ms) * (span_ms // 1000)


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

DEDUP_MARGIN_S = 300
"""How much longer than the dedup window a request's event ids are kept. A record is stale
(refused) when it ended a window before accounting's clock as its batch began; its ids
expire a window after the apply on Redis's clock, which runs later by the time the batch's
earlier chunks took, or ahead by a skew between the two hosts. Without the margin a record
delivered again in that gap was neither stale nor known, and billed twice."""


def dedup_expires_at_ms(expires_at_ms: int, applied_at_ms: int, ended_at_ms: int,
                        dedup_ttl_s: int) -> int:
    """When the live apply forgets a request's event ids (its request record expires) once it
    applies one more of its records at `applied_at_ms`, having kept them until
    `expires_at_ms` (0: none kept): `dedup_ttl_s` + DEDUP_MARGIN_S after the apply, or after
    the record's end if later (a record ending ahead of accounting's clock stays
    redeliverable until its end + the window), never earlier than before. The apply script
    (adapters/store.py) sets the record's TTL by this rule; a request id used again after it
    counts as a new request."""
    return max(expires_at_ms,
               max(applied_at_ms, ended_at_ms) + (dedup_ttl_s + DEDUP_MARGIN_S) * 1000)


def recompute(rows: Iterable[UsageRow], granularity: Granularity = "day", *,
              dedup_ttl_s: int) -> dict[tuple[str, int], Totals]:
    """Totals per (tenant, bucket start) from raw rows in topic order, with the same dedup
    (event id), request-counting, position and forgetting rules as the live apply: what the
    live counters must equal. Every (tenant, bucket) with a row has an entry, zero where
    every row was dropped.

    Which rows apply is decided in the order they ended, each as if applied when it ended.
    Of records that share an event id, the first counts (the live apply dead-letters a later
    one with other content), and a request id is another tenant's or model's only while its
    ids are kept: once they are forgotten (`dedup_expires_at_ms`), a request under the same
    id is a new one, billed and counted again, as live (README: ids are unique within the
    dedup window only). What each applied row bills of its request (the positions no
    earlier row billed, `billed`) and whether it is the one counting the request follow the
    order the rows come in: the live apply meets a request's records in topic order (all on
    its tenant's partition), whatever their ends say (agents' clocks differ)."""
    rows = list(rows)
    events: dict[str, set[str]] = {}
    owner: dict[str, tuple[str, str]] = {}
    expires_at_ms: dict[str, int] = {}
    incarnation: dict[str, int] = {}
    applied: dict[int, int] = {}  # row index -> its request id's incarnation
    out: dict[tuple[str, int], Totals] = {}
    for i in sorted(range(len(rows)), key=lambda i: rows[i].ended_at_ms):  # stable
        row = rows[i]
        rid = row.request_id
        out.setdefault((row.tenant, bucket_start_s(row.ended_at_ms, granularity)), Totals())
        if expires_at_ms.get(rid, row.ended_at_ms + 1) <= row.ended_at_ms:
            del events[rid], owner[rid], expires_at_ms[rid]
            incarnation[rid] += 1
        seen = events.setdefault(rid, set())
        if row.event_id in seen or _another_owner(owner, row):
            continue
        seen.add(row.event_id)
        expires_at_ms[rid] = dedup_expires_at_ms(expires_at_ms.get(rid, 0), row.ended_at_ms,
                                                 row.ended_at_ms, dedup_ttl_s)
        applied[i] = incarnation.setdefault(rid, 0)
    counted: set[tuple[str, int]] = set()
    positions: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for i in sorted(applied):
        row = rows[i]
        request = (row.request_id, applied[i])
        counts = row.counts_request and request not in counted
        if counts:
            counted.add(request)
        bill = billed(row, positions.setdefault(request, ([], [])))
        key = (row.tenant, bucket_start_s(row.ended_at_ms, granularity))
        out[key] += Totals(bill.prompt_tokens, bill.completion_tokens, int(counts), row.gpu_us,
                           bill.cost_nusd)
    return out
