"""The usage query API (HTTP, OpenAPI at /openapi.json): totals per tenant and window with a
group-by, top tenants, per-request usage and CSV export. A tenant's key reads only that
tenant; an admin key reads every tenant."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from gpusched_accounting.adapters.store import UsageStore
from gpusched_accounting.domain.usage import (
    DIMENSION_CODE,
    GRANULARITY_S,
    MAX_END_AHEAD_MS,
    Granularity,
    GroupBy,
    Totals,
    cover,
    finest_kept,
    oldest_kept_s,
)
from gpusched_common.catalog import TenantDirectory
from gpusched_common.kafka_records import WallClockMs
from gpusched_common.web import get_and_head

DEFAULT_WINDOW_MS = 86_400_000
MAX_CSV_BUCKETS = 100_000
CSV_PAGE_BUCKETS = 500
"""Buckets an export reads from Redis at once."""
CSV_CHUNK_CHARS = 64 * 1024
"""About how much of an export goes out at once."""
FORMULA_SIGNS = frozenset("=+-@\t\r")
"""A CSV cell starting with one of these is a formula to a spreadsheet."""
SECONDS_LOOK = (10**9, 10**11)
"""Epoch values in this range are seconds (2001-5138), not milliseconds (1970-1973)."""
MAX_EPOCH_MS_DIGITS = 19
"""Longest number read as epoch milliseconds (any 64-bit one); a longer one is no time."""
QUOTED_CHARS = 40
"""How much of a value an error message quotes back."""


class UsageTotals(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    requests: int = Field(description="Requests that ran, each counted once.")
    gpu_seconds: float
    cost_usd: float


class GroupRow(UsageTotals):
    group: str = Field(description="Value of the group_by dimension (a model name, ...).")


class TenantUsage(BaseModel):
    tenant: str
    totals: UsageTotals
    groups: list[GroupRow] | None = Field(description="A row per value of group_by; null "
                                          "without group_by.")


class UsageReport(BaseModel):
    start_ms: int = Field(description="Window start actually used (bucket-aligned).")
    end_ms: int = Field(description="Window end (exclusive), bucket-aligned.")
    granularity: Granularity = Field(description="Finest bucket used at the window's edges.")
    group_by: GroupBy | None = Field(description="The dimension asked; null for totals only.")
    tenants: list[TenantUsage]


class TopTenant(UsageTotals):
    tenant: str


class TopReport(BaseModel):
    start_ms: int
    end_ms: int
    by: str
    tenants: list[TopTenant]


class RequestUsage(UsageTotals):
    request_id: str
    tenant: str
    model: str
    final: bool = Field(description="True once a placement of it has ended (its final "
                        "record arrived); a preempted request may still run again.")


def _cell(text: str) -> str:
    """A name as a CSV cell a spreadsheet shows as text: one starting with a formula sign
    (a node named '-A1' reached Excel as the formula =-A1) gets a leading quote."""
    return f"'{text}" if text[:1] in FORMULA_SIGNS else text


def _parse_time(value: str | None, default_ms: int, name: str) -> int:
    """Epoch milliseconds or an ISO 8601 time (UTC unless it says otherwise), its basic
    date form (20261130) included."""
    if value is None:
        return default_ms
    # ISO 8601's basic date, 20261130: as epoch milliseconds it would be January 1970
    if len(value) == 8 and value.isascii() and value.isdigit() and value[:2] in ("19", "20"):
        try:
            return _parse_time(f"{value[:4]}-{value[4:6]}-{value[6:]}", default_ms, name)
        except HTTPException:  # no date: say so of what was sent
            raise _not_a_time(name, value) from None
    if value.isascii() and value.isdigit():
        if len(value) > MAX_EPOCH_MS_DIGITS:  # and int() refuses over 4,300 digits
            raise _not_a_time(name, value)
        at_ms = int(value)
        if SECONDS_LOOK[0] <= at_ms < SECONDS_LOOK[1]:
            raise HTTPException(400, f"{name}={value} looks like epoch seconds; send epoch "
                                f"milliseconds ({at_ms * 1000}) or an ISO 8601 time")
        return at_ms
    try:  # case-blind: RFC 3339 allows 't' and 'z', and Python reads 'Z' but not 'z'
        moment = datetime.fromisoformat(value.upper())
    except ValueError:
        raise _not_a_time(name, value) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _iso(at_s: int) -> str:
    return datetime.fromtimestamp(at_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _not_a_time(name: str, value: str) -> HTTPException:
    return HTTPException(400, f"{name}={_quoted(value)} is neither epoch milliseconds nor an "
                         "ISO 8601 time like 2026-11-30T10:00:00Z")


def _quoted(value: str) -> str:
    """`value` as an error message quotes it: its start only, if it is long."""
    if len(value) <= QUOTED_CHARS:
        return repr(value)
    return f"{value[:QUOTED_CHARS]!r}... ({len(value)} characters)"


def _each_known_once(request: Request) -> None:
    """A 400 for a query parameter the route does not have or one given twice: FastAPI
    ignores the first silently (`?model=x`, a misspelt `groupby=`, an admin's `tenants=`
    answered every model's or tenant's totals) and takes the last of the second
    (`group_by=model&group_by=node` grouped by node only)."""
    params = request.query_params
    route = request.scope["route"]
    accepted = _query_names(route.dependant)
    unknown = [k for k in dict.fromkeys(params.keys()) if k not in accepted]
    if unknown:
        raise HTTPException(400, f"unknown query parameter {', '.join(map(_quoted, unknown))}; "
                            f"{route.path} takes {', '.join(accepted) or 'none'}")
    twice = sorted({k for k in params.keys() if len(params.getlist(k)) > 1})
    if twice:
        raise HTTPException(400, f"{', '.join(twice)} given more than once; give each "
                            "parameter once")


def _query_names(dependant: Dependant) -> list[str]:
    """The query parameters an endpoint and its dependencies take, in declared order."""
    return [p.alias for p in dependant.query_params] + [
        name for d in dependant.dependencies for name in _query_names(d)]


def build_router(store: UsageStore, tenants: TenantDirectory, clock: WallClockMs) -> APIRouter:
    api = APIRouter(prefix="/v1/usage", tags=["usage"], dependencies=[Depends(_each_known_once)])

    def caller(authorization: str | None) -> str | None:
        """The tenant a key belongs to; None for an admin key; 401 otherwise."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise HTTPException(401, "missing API key: send 'Authorization: Bearer <key>'")
        if key in tenants.admin_api_keys:
            return None
        tenant = tenants.by_api_key(key)
        if tenant is None:
            raise HTTPException(401, "unknown API key")
        return tenant.name

    async def readable(who: str | None, tenant: str | None) -> str | None:
        """The tenant to read (None: all, admin only); 403 for another tenant's data; 404 for
        a tenant neither configured nor ever billed (a misspelt name would read as zeros)."""
        if who is not None and tenant not in (None, who):
            raise HTTPException(403, f"this API key belongs to tenant '{who}' and cannot read "
                                f"{_quoted(tenant)}; use that tenant's key or an admin key")
        if who is None and tenant is not None and tenants.get(tenant) is None:
            billed = await store.tenants()
            if tenant not in billed:
                known = sorted({t.name for t in tenants.tenants} | set(billed))
                raise HTTPException(404, f"no tenant {_quoted(tenant)}: it is not configured "
                                    f"and has no usage; tenants: {', '.join(known)}")
        return tenant or who

    def asked_window(start: str | None, end: str | None) -> tuple[int, int, int]:
        """The window asked, its end cut where nothing is billed later, and now (epoch ms);
        400 for an empty one."""
        now = clock()
        asked_end_ms = _parse_time(end, now, "end")
        # a day before the end asked, as documented: a day before the cut one answered an
        # end years ahead (or in microseconds) with the next day's zeros
        start_ms = _parse_time(start, asked_end_ms - DEFAULT_WINDOW_MS, "start")
        # nothing is billed later (an unbounded end would also make millions of buckets)
        end_ms = min(asked_end_ms, now + MAX_END_AHEAD_MS)
        if start_ms >= end_ms:
            default = ", end - 24 h by default" if start is None else ""
            cut = f" (the end asked, {asked_end_ms}, is cut to a day from now: nothing is " \
                "billed later)" if asked_end_ms > end_ms else ""
            raise HTTPException(400, f"start ({start_ms}{default}) must be before end "
                                f"({end_ms}){cut}")
        return start_ms, end_ms, now

    def window(start: str | None, end: str | None) -> tuple[int, int, Granularity]:
        """The window a report reads (its start no older than day buckets are kept: the
        report's start_ms says so) and the finest granularity kept at its start."""
        start_ms, end_ms, now = asked_window(start, end)
        oldest_ms = now - store.retention.day_s * 1000  # nothing older is kept
        if end_ms <= oldest_ms:  # it would read as zeros, as if nothing had been used
            raise HTTPException(400, f"usage is kept for {store.retention.day_s // 86400} "
                                f"days and this window ends ({end_ms}) before that")
        start_ms = max(start_ms, oldest_ms)
        return start_ms, end_ms, finest_kept(start_ms, now, store.retention.as_dict())

    Start = Query(default=None, description="Window start: epoch ms or ISO 8601; default "
                  "end - 24 h.")
    End = Query(default=None, description="Window end (exclusive): epoch ms or ISO 8601; "
                "default now.")
    Auth = Header(default=None, description="Bearer <API key>")

    # every field is answered, null ones too: the schema requires them (group_by was left
    # out of a report without it, so the answer failed the schema clients validate against)
    @get_and_head(api, "", response_model=UsageReport)
    async def usage(
        tenant: str | None = Query(default=None, description="Default: the caller's tenant; "
                                   "an admin key without it reads every tenant."),
        group_by: GroupBy | None = Query(default=None, description="Adds a row per value."),
        start: str | None = Start, end: str | None = End,
        authorization: str | None = Auth,
    ) -> UsageReport:
        """Token, request, GPU-second and cost totals of tenants over a window."""
        who = caller(authorization)
        wanted = await readable(who, tenant)
        start_ms, end_ms, finest = window(start, end)
        plan = cover(start_ms, end_ms, finest)
        names = [wanted] if wanted else await store.tenants()
        prefix = f"{DIMENSION_CODE[group_by]}:" if group_by else None
        rows = []
        if wanted is None and group_by is None:  # every tenant from the all-tenants buckets
            _, per_tenant = await store.window(None, plan.buckets, "u:")
            rows = [TenantUsage(tenant=t, totals=UsageTotals(**per_tenant.get(t, Totals())
                                                              .public()), groups=None)
                    for t in names]
        else:
            for name in names:
                total, groups = await store.window(name, plan.buckets, prefix)
                rows.append(TenantUsage(
                    tenant=name, totals=UsageTotals(**total.public()),
                    groups=[GroupRow(group=k, **v.public()) for k, v in sorted(groups.items())]
                    if group_by else None))
        return UsageReport(start_ms=plan.start_s * 1000, end_ms=plan.end_s * 1000,
                           granularity=finest, group_by=group_by, tenants=rows)

    @get_and_head(api, "/top", response_model=TopReport)
    async def top(
        by: Literal["cost_usd", "tokens", "gpu_seconds", "requests"] = "cost_usd",
        limit: int = Query(default=10, ge=1, le=1000),
        start: str | None = Start, end: str | None = End,
        authorization: str | None = Auth,
    ) -> TopReport:
        """The tenants that used the most over a window (admin key only)."""
        if caller(authorization) is not None:
            raise HTTPException(403, "top tenants compares every tenant: use an admin key")
        start_ms, end_ms, finest = window(start, end)
        plan = cover(start_ms, end_ms, finest)
        _, per_tenant = await store.window(None, plan.buckets, "u:")

        def score(t: Totals) -> float:
            return {"cost_usd": t.cost_nusd, "tokens": t.tokens, "gpu_seconds": t.gpu_us,
                    "requests": t.requests}[by]

        ranked = sorted(per_tenant.items(), key=lambda kv: (-score(kv[1]), kv[0]))[:limit]
        return TopReport(start_ms=plan.start_s * 1000, end_ms=plan.end_s * 1000, by=by,
                         tenants=[TopTenant(tenant=t, **v.public()) for t, v in ranked])

    @get_and_head(api, "/requests/{request_id}", response_model=RequestUsage)
    async def request_usage(request_id: str = Path(max_length=128),
                            authorization: str | None = Auth) -> RequestUsage:
        """What one request has been billed so far (partial records included); kept for the
        dedup window after its last record."""
        who = caller(authorization)
        found = await store.request_usage(request_id)
        # another tenant's request is answered as unknown: whose it is is not for this key
        if found is None or who not in (None, found["tenant"]):
            raise HTTPException(404, f"no usage recorded for request '{request_id}' (unknown, "
                                "not billed yet, older than the dedup window, or another "
                                "tenant's)")
        return RequestUsage(**found)

    @get_and_head(api, "/export.csv", response_class=StreamingResponse,
                  responses={200: {"content": {"text/csv": {}}}})
    async def export_csv(
        request: Request,
        tenant: str | None = Query(default=None, description="Default: the caller's tenant; "
                                   "an admin key without it exports every tenant."),
        granularity: Granularity = "hour",
        start: str | None = Start, end: str | None = End,
        authorization: str | None = Auth,
    ) -> StreamingResponse:
        """One CSV row per bucket, tenant and field (the total and every model, node, GPU type
        and priority class), in bucket order. Every bucket of `granularity` that overlaps the
        window comes whole (its row names its start): windows that share a bucket both
        include it, so export on bucket boundaries, or at a finer granularity. A window
        starting before the oldest bucket of `granularity` still kept is a 400."""
        who = caller(authorization)
        wanted = await readable(who, tenant)
        start_ms, end_ms, now = asked_window(start, end)
        # Every bucket of the window must still be kept: the older part of a window was cut
        # off without a word (no row or header says so), as if nothing had been used then.
        kept_s = store.retention.as_dict()[granularity]
        oldest_s = oldest_kept_s(now, granularity, kept_s)
        if start_ms < oldest_s * 1000:
            coarser = "" if granularity == "day" else ", or use a coarser granularity"
            raise HTTPException(400, f"{granularity} buckets are kept for {kept_s} s after "
                                f"they end, and this window starts ({start_ms}) before the "
                                f"oldest kept one, {_iso(oldest_s)}: start it there or "
                                f"later{coarser}")
        span = GRANULARITY_S[granularity]
        plan = cover(start_ms, end_ms, granularity)
        names = [wanted] if wanted else await store.tenants()
        requested = (plan.end_s - plan.start_s) // span * len(names)
        if requested > MAX_CSV_BUCKETS:
            raise HTTPException(400, f"{requested} buckets requested; the limit is "
                                f"{MAX_CSV_BUCKETS}: narrow the window or use a coarser "
                                "granularity")
        starts = range(plan.start_s, plan.end_s, span)
        codes = {f"{c}:": d for d, c in DIMENSION_CODE.items()}

        # Read a page of buckets at a time and send about CSV_CHUNK_CHARS at once: the whole
        # file was built in memory first (about three times its size) and then sent a row
        # per chunk, which took minutes for a large export and held the event loop (and the
        # usage consumer on it) meanwhile.
        async def pages() -> AsyncIterator[tuple[str, range, list[dict[str, Totals]]]]:
            for name in names:
                for page in range(0, len(starts), CSV_PAGE_BUCKETS):
                    part = starts[page:page + CSV_PAGE_BUCKETS]
                    yield name, part, await store.buckets(name, [(granularity, s) for s in part])

        read = pages()
        # read before the answer starts: with Redis away this is the 503 with Retry-After,
        # not a 200 whose body breaks off (a client saw a cut connection, or a short file)
        page = await anext(read, None)
        headers = {"content-disposition": 'attachment; filename="usage.csv"'}
        if request.method == "HEAD":  # the GET's status and headers; nothing more is read
            await read.aclose()
            return StreamingResponse(iter(()), media_type="text/csv", headers=headers)

        async def body() -> AsyncIterator[str]:
            out = io.StringIO()
            writer = csv.writer(out)
            writer.writerow(["bucket_start", "granularity", "tenant", "dimension", "value",
                             "prompt_tokens", "completion_tokens", "requests", "gpu_seconds",
                             "cost_usd"])
            next_page = page
            while next_page is not None:
                name, part, buckets = next_page
                for s, fields in zip(part, buckets):
                    stamp = _iso(s)
                    for field, totals in sorted(fields.items()):
                        dim, value = ("total", "") if field == "t" else (
                            codes.get(field[:2], field[:1]), field[2:])
                        writer.writerow([
                            stamp, granularity, _cell(name), dim, _cell(value),
                            totals.prompt_tokens, totals.completion_tokens, totals.requests,
                            f"{totals.gpu_seconds:.6f}", f"{totals.cost_usd:.9f}"])
                if out.tell() >= CSV_CHUNK_CHARS:
                    yield out.getvalue()
                    out.seek(0)
                    out.truncate()
                next_page = await anext(read, None)
            yield out.getvalue()

        return StreamingResponse(body(), media_type="text/csv", headers=headers)

    return api
