"""Accounting domain: counters a usage record adds (exact integer units), cost, windows as
buckets, the recomputation used by `gpusched reconcile`, and budgets; and what the query API
answers to a window it cannot read. What only the store's scripts decide is tested against a
Redis of this module's own (`start_redis`), where redis-server is installed."""

import argparse
import asyncio
import json
import re
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from unittest.mock import AsyncMock

import httpx
import pytest
import yaml
from aiokafka.structs import ConsumerRecord
from faststream.kafka import TestKafkaBroker
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError

from gpusched_accounting import handlers
from gpusched_accounting.adapters.store import APPLIED, REQUEST_KEY, Retention, UsageStore
from gpusched_accounting.domain import budgets as b
from gpusched_accounting.domain.usage import (
    CONFLICT,
    COUNTED,
    COUNTERS_SIZE,
    DEDUP_MARGIN_S,
    DUPLICATE,
    GRANULARITY_S,
    NEW,
    STALE,
    TOTAL_FIELD,
    ModelPrice,
    PriceTable,
    Totals,
    billed,
    bucket_deltas,
    content_digest,
    cover,
    dedup_expires_at_ms,
    fields_of,
    finest_kept,
    guess_billed,
    guess_outcomes,
    load_prices,
    pack,
    recompute,
    row_for,
    take,
    unpack,
)
from gpusched_accounting.handlers import enforce_budgets
from gpusched_accounting.main import create_app
from gpusched_accounting.settings import CONSUMER_GROUP, AccountingSettings
from gpusched_common import topics
from gpusched_common.broker import make_broker
from gpusched_common.catalog import load_models, load_tenants
from gpusched_common.contracts import DEAD_LETTER, USAGE, UsageRecord
from gpusched_common.redis_client import make_redis
from gpusched_common.redis_keys import BUDGET_EXHAUSTED_KEY
from gpusched_common.settings import KafkaSettings, RedisSettings, TelemetrySettings

CONFIG = Path(__file__).resolve().parents[2] / "config"
PRICES = PriceTable(gpu_hour_usd={"H100-80GB": 3.6},
                    model_usd_per_million_tokens={"m": ModelPrice(prompt=1.0, completion=2.0)})
H, D = 3_600_000, 86_400_000
WEEK_S = 7 * 86_400  # the dedup window, GPUSCHED_DEDUP_TTL_S's default


def usage(**kw) -> UsageRecord:
    base = dict(event_id="r#0:final", request_id="r", placement_id="r#0", tenant="acme",
                model="m", priority_class="batch", node_id="n", gpu_type="H100-80GB",
                prompt_tokens=10, completion_tokens=5, gpu_seconds=0.1234567, final=True,
                started_at_ms=0, ended_at_ms=1)
    return UsageRecord(**(base | kw))


def test_row_counts_gpu_time_in_microseconds_and_cost_in_nano_usd() -> None:
    row = row_for(usage(gpu_seconds=1.0), PRICES)
    assert row.gpu_us == 1_000_000
    # 1 s at $3.6/h = $0.001; 10 prompt tokens at $1/M + 5 at $2/M = $0.00002
    assert row.cost_nusd == 1_000_000 + 20_000
    assert row.counts_request


@pytest.mark.parametrize("kw", [{"final": False}, {"gpu_type": "none"}])
def test_partials_and_hand_backs_do_not_count_a_request(kw: dict) -> None:
    assert not row_for(usage(**kw), PRICES).counts_request


def test_unknown_gpu_type_and_model_cost_the_default_entry() -> None:
    prices = PriceTable(gpu_hour_usd={"default": 3.6})
    assert prices.cost_nusd("X", 1_000_000, "unknown", 0, 0) == 1_000_000
    assert prices.cost_nusd("none", 1_000_000, "unknown", 0, 0) == 0


def test_shipped_price_table_loads() -> None:
    assert load_prices(CONFIG).gpu_hour_usd["H100-80GB"] > 0


@pytest.mark.parametrize("prices,needle", [
    ("gpu_hour_usd: {H100-80GB: -3.6}", "greater than or equal to 0"),
    ("gpu_hour_usd: {default: .nan}", "finite number"),
    ("gpu_hour_usd: {H100-80GB: .inf}", "finite number"),
    ("gpu_hour_usd: {H100-80GB: 1.0e6}", "less than or equal to 1000"),
    ("model_usd_per_million_tokens: {m: {prompt: .inf}}", "finite number"),
    ("model_usd_per_million_tokens: {m: {completion: 1.0e12}}", "less than or equal to 1000"),
])
def test_a_price_that_cannot_bill_stops_the_start(tmp_path, prices, needle) -> None:
    """They loaded: a negative GPU price made USD budgets never trip, NaN or infinity made
    every record's cost unroundable (each one dead-lettered), a huge one overflowed the
    nano-USD counters."""
    (tmp_path / "prices.yaml").write_text(prices + "\n")
    with pytest.raises(ValueError, match=f"prices.yaml is invalid: (.|\n)*{needle}"):
        load_prices(tmp_path)


@pytest.mark.parametrize("typo,needle", [
    (("  llama-3.1-70b:", "  llama-3.1-70B:"), "model_usd_per_million_tokens.llama-3.1-70B"),
    (("  H100-80GB: 2.50", "  H100-80G: 2.50"), "gpu_hour_usd.H100-80G (GPU types: H100-80GB"),
], ids=["model", "gpu-type"])
def test_a_misspelt_price_entry_stops_the_start(tmp_path, typo, needle) -> None:
    """A misspelt model or GPU type loaded without a word and billed at the `default` price
    (free without one): accounting bills only what it can name."""
    for name in ("models.yaml", "prices.yaml"):
        (tmp_path / name).write_text((CONFIG / name).read_text().replace(*typo))
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'prices.yaml'} is invalid: no such GPU type or model: {needle}")):
        load_prices(tmp_path)


def test_a_config_folder_without_prices_stops_the_start(tmp_path) -> None:
    """It read as prices of 0: accounting billed nothing, and reconcile recomputed every
    cost as 0 (its default folder does not exist in the Docker image)."""
    with pytest.raises(ValueError, match="prices.yaml is missing: set GPUSCHED_CONFIG_DIR"):
        load_prices(tmp_path)


def test_bucket_deltas_of_the_guessed_outcomes_sum_to_the_recomputed_totals() -> None:
    """What the apply adds (Python's sums of the guessed outcomes) equals the reconciliation's
    recomputation, with repeats in the batch, a request run twice, a reused event id and a
    stale record."""
    rows = [row_for(usage(event_id=f"r{i % 7}#{i % 2}:final", request_id=f"r{i % 7}",
                          placement_id=f"r{i % 7}#{i % 2}", tenant=f"t{i % 14 % 3}",
                          node_id=f"n{i % 14 % 4}", ended_at_ms=D + i % 14 * 50_000), PRICES)
            for i in range(40)]
    rows.append(row_for(usage(event_id="r0#0:final", request_id="r0", placement_id="r0#0",
                              tenant="t9", ended_at_ms=D), PRICES))
    rows.append(row_for(usage(event_id="old#0:final", request_id="old", placement_id="old#0",
                              ended_at_ms=0), PRICES))
    outcomes = guess_outcomes(rows, oldest_ms=1)
    assert outcomes[-1] == STALE and outcomes[-2] == CONFLICT
    assert outcomes.count(COUNTED) == 7 and DUPLICATE in outcomes
    retention = {"minute": 0, "hour": 0, "day": 0}
    buckets, tenants = bucket_deltas(rows, outcomes, guess_billed(rows, outcomes), retention)
    assert tenants == ["t0", "t1", "t2"]
    want = recompute((r for r in rows if r.ended_at_ms >= 1), dedup_ttl_s=WEEK_S)
    added = {(t, s): Totals(*f[TOTAL_FIELD]) for (t, g, s), (_, f) in buckets.items()
             if t and g == "day"}
    assert added == {k: v for k, v in want.items() if v != Totals()}
    every = Totals(*buckets[(None, "day", D // 1000)][1][TOTAL_FIELD])
    assert every == sum(want.values(), Totals())
    minutes = [f[TOTAL_FIELD] for (t, g, _), (_, f) in buckets.items() if t and g == "minute"]
    assert Totals(*map(sum, zip(*minutes))) == every


def test_fields_cover_every_dimension_and_tenant_only_in_all_scope() -> None:
    row = row_for(usage(), PRICES)
    assert fields_of(row, False) == ["t", "m:m", "n:n", "g:H100-80GB", "c:batch"]
    assert fields_of(row, True)[-1] == "u:acme"


def test_unpack_reads_the_lua_packing() -> None:
    assert unpack(pack(Totals(1, 2, 3, 4, 5))) == Totals(1, 2, 3, 4, 5)
    assert unpack(None) == Totals()
    assert Totals(1, 2, 3, 1_500_000, 2_000_000_000).public()["cost_usd"] == 2.0


@pytest.mark.parametrize("start_ms,end_ms,expect", [
    # whole day
    (D, 2 * D, [("day", 86_400)]),
    # 23:58 to 01:02 next day: two minutes, one hour, two minutes
    (D - 2 * 60_000, D + H + 2 * 60_000,
     [("minute", 86_280), ("minute", 86_340), ("hour", 86_400), ("minute", 90_000),
      ("minute", 90_060)]),
    # unaligned edges widen to the minute
    (D + 30_000, D + 90_500, [("minute", 86_400), ("minute", 86_460)]),
])
def test_cover_tiles_a_window_with_the_fewest_buckets(start_ms, end_ms, expect) -> None:
    assert list(cover(start_ms, end_ms).buckets) == expect


def test_cover_is_exact_and_gapless_for_a_day_back_from_now() -> None:
    now = 1_700_000_123_456
    plan = cover(now - D, now)
    spans = sorted((s, s + GRANULARITY_S[g]) for g, s in plan.buckets)
    assert spans[0][0] == plan.start_s and spans[-1][1] == plan.end_s
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(plan.buckets) < 140


def test_old_windows_fall_back_to_coarser_buckets() -> None:
    keep = {"minute": 3600, "hour": 86_400, "day": 10 * 86_400}
    assert finest_kept(10 * H - 60_000, 10 * H, keep) == "minute"
    assert finest_kept(0, 10 * H, keep) == "hour"
    assert finest_kept(0, 3 * D, keep) == "day"
    assert cover(H + 60_000, 3 * H, "hour").buckets == (("hour", 3600), ("hour", 7200))


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 25)), max_size=12))
def test_take_bills_only_the_positions_not_taken_before(ranges) -> None:
    spans: list[int] = []
    held: set[int] = set()
    for start, n in ranges:
        new = set(range(start, start + n)) - held
        assert take(spans, start, n) == len(new)
        held |= new
        pairs = list(zip(spans[::2], spans[1::2]))
        assert set().union(*(range(a, b) for a, b in pairs)) == held
        assert all(a < b for a, b in pairs)  # sorted, apart, none empty
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(pairs, pairs[1:]))


def started_over() -> list:
    """A request's records, in the order they end: its first attempt billed the prompt and 35
    tokens, then its node died; the next attempt started over and was preempted after 50
    tokens; the third resumed after them and made 10 more."""
    return [usage(event_id="r#0:1", placement_id="r#0", final=False, prompt_tokens=100,
                  prompt_from=0, completion_tokens=20, completion_from=0, ended_at_ms=1),
            usage(event_id="r#0:2", placement_id="r#0", final=False, prompt_tokens=0,
                  prompt_from=100, completion_tokens=15, completion_from=20, ended_at_ms=2),
            usage(event_id="r#1:final", placement_id="r#1", prompt_tokens=100, prompt_from=0,
                  completion_tokens=50, completion_from=0, ended_at_ms=3),
            usage(event_id="r#2:final", placement_id="r#2", prompt_tokens=0, prompt_from=100,
                  completion_tokens=10, completion_from=50, ended_at_ms=4)]


def test_a_request_started_over_bills_its_prompt_and_each_reply_position_once() -> None:
    """Its node died mid-reply: the next attempt ran the prompt and the first 35 tokens again,
    and its records bill them again. Accounting bills each position once (100 prompt and 60
    completion tokens here, not 200 and 95), and all of its GPU time; in one batch or
    record by record, and the recomputation agrees."""
    rows = [row_for(u, PRICES) for u in started_over()]
    want = Totals(100, 60, 1, sum(r.gpu_us for r in rows),
                  sum(r.rates.gpu_nusd for r in rows) + 100 * 1000 + 60 * 2000)
    [total] = recompute(rows, dedup_ttl_s=WEEK_S).values()
    assert total == replace(want, cost_nusd=total.cost_nusd)
    assert total.cost_nusd == pytest.approx(want.cost_nusd, abs=len(rows))  # rounded per row
    outcomes = guess_outcomes(rows, oldest_ms=0)
    bills = guess_billed(rows, outcomes)
    assert [(b.prompt_tokens, b.completion_tokens) for b in bills] == \
        [(100, 20), (0, 15), (0, 15), (0, 10)]
    buckets, _ = bucket_deltas(rows, outcomes, bills, {"minute": 0, "hour": 0, "day": 0})
    assert Totals(*buckets[("acme", "day", 0)][1][TOTAL_FIELD]) == total
    # record by record, even with the records of one attempt out of order
    spans: tuple = ([], [])
    assert [billed(r, spans)[:2] for r in (rows[1], rows[0], rows[2], rows[3])] == \
        [(0, 15), (100, 20), (0, 15), (0, 10)]
    # reconcile bills them in topic order, as the live apply met them, whatever their ends
    # (the second attempt's agent, its clock a day ahead, got its final record in first)
    ahead = rows[2]._replace(ended_at_ms=D)
    by_day = recompute([ahead, rows[0], rows[1], rows[3]], dedup_ttl_s=WEEK_S)
    assert by_day[("acme", D // 1000)].as_tuple()[:3] == (100, 50, 1)
    assert by_day[("acme", 0)].as_tuple()[:3] == (0, 10, 0)


def test_a_record_without_positions_bills_all_it_carries() -> None:
    """An agent one release behind sends none: its tokens are billed as they come, and it
    notes no position."""
    old = [u.model_copy(update={"prompt_from": None, "completion_from": None})
           for u in started_over()]
    rows = [row_for(u, PRICES) for u in old]
    [total] = recompute(rows, dedup_ttl_s=WEEK_S).values()
    assert (total.prompt_tokens, total.completion_tokens) == (200, 95)
    assert total.cost_nusd == sum(r.cost_nusd for r in rows)


def test_positions_are_set_together_or_not_at_all() -> None:
    with pytest.raises(ValidationError, match="set together"):
        usage(prompt_from=0)


def test_recompute_ignores_repeats_and_counts_a_request_once() -> None:
    first = row_for(usage(event_id="r#0:final", placement_id="r#0"), PRICES)
    preempted_rerun = row_for(usage(event_id="r#1:final", placement_id="r#1",
                                    ended_at_ms=D + 5), PRICES)
    partial = row_for(usage(event_id="r#1:p1", placement_id="r#1", final=False,
                            ended_at_ms=D + 1), PRICES)
    rows = [first, partial, preempted_rerun, first, partial]
    totals = recompute(rows, dedup_ttl_s=WEEK_S)
    assert totals[("acme", 0)].requests == 1 and totals[("acme", 86_400)].requests == 0
    assert sum(t.completion_tokens for t in totals.values()) == 15
    backwards = recompute(list(reversed(rows)), dedup_ttl_s=WEEK_S)
    assert backwards[("acme", 86_400)].completion_tokens == 10


def test_a_reused_event_id_with_other_content_is_a_conflict_not_a_duplicate() -> None:
    """A second request under a used request id has the same event ids ('<rid>#0:final'):
    its usage was dropped as a duplicate of the first one's, billed to nobody. The same
    record again, even costed at a price changed since, is a duplicate as before."""
    first = row_for(usage(), PRICES)
    again = row_for(usage(), PriceTable(gpu_hour_usd={"H100-80GB": 9.0}))
    reused = row_for(usage(tenant="globex", prompt_tokens=50_000), PRICES)
    assert guess_outcomes([first, again, reused], 0) == [COUNTED, DUPLICATE, CONFLICT]
    assert content_digest(first) == content_digest(again) != content_digest(reused)


def test_a_zero_final_made_again_is_a_duplicate_not_a_conflict() -> None:
    """Redis away while a run ended: its agent could neither file its final records nor
    release its claim, and, started again, ended the placement once more with a zero final
    under the same event id. It was dead-lettered as a reused id (an alert naming a request
    id used once); it bills nothing, so dropping it as a duplicate loses nothing."""
    first = row_for(usage(), PRICES)
    again = row_for(usage(gpu_type="none", prompt_tokens=0, completion_tokens=0,
                          gpu_seconds=0.0, ended_at_ms=5), PRICES)
    assert guess_outcomes([first, again], 0) == [COUNTED, DUPLICATE]


def test_every_record_of_another_request_under_a_used_request_id_is_a_conflict() -> None:
    """Only the records whose event ids collided were refused: the second request's other
    partials and attempts were billed, to its tenant, under the first one's request id."""
    first = row_for(usage(), PRICES)
    others = [row_for(usage(tenant="globex", event_id=event, placement_id=event.split(":")[0],
                            final=event.endswith("final")), PRICES)
              for event in ("r#0:1", "r#0:final", "r#1:final")]
    assert guess_outcomes([first, *others], 0) == [COUNTED, CONFLICT, CONFLICT, CONFLICT]
    assert recompute([first, *others], dedup_ttl_s=WEEK_S) == \
        recompute([first], dedup_ttl_s=WEEK_S) | {("globex", 0): Totals()}


def test_a_request_id_used_again_after_the_dedup_window_is_a_new_request() -> None:
    """README allows it (ids are unique within 7 days; the usage topic keeps 30), and the
    live apply bills it, its request record expired: recompute never forgot an id, dropped
    the second request's records (another tenant's id, or its event ids seen before) and
    `gpusched reconcile` reported the right live totals as a difference. Read a partition
    after another, the later request can come first."""
    def run(tenant: str, ended_at_ms: int, placement: str = "r#0"):  # noqa: ANN202
        """A placement's partial and final record."""
        return [row_for(usage(tenant=tenant, placement_id=placement, event_id=f"{placement}:"
                              f"{n}", final=n == "final", ended_at_ms=ended_at_ms + i), PRICES)
                for i, n in enumerate(("1", "final"))]

    first, again, other = run("acme", D), run("acme", 9 * D), run("globex", 9 * D)
    KEPT_MS = (WEEK_S + DEDUP_MARGIN_S) * 1000  # noqa: N806
    one = recompute(first, dedup_ttl_s=WEEK_S)[("acme", 1 * 86_400)]
    assert one.requests == 1 and one.completion_tokens == 10
    assert recompute(first + again, dedup_ttl_s=WEEK_S)[("acme", 9 * 86_400)] == one
    assert recompute(other + first, dedup_ttl_s=WEEK_S)[("globex", 9 * 86_400)] == one
    # within the window and its margin it is the first request's still: not billed, its
    # day compared at 0
    soon = recompute(first + run("globex", D + KEPT_MS - 2), dedup_ttl_s=WEEK_S)
    assert soon[("globex", 8 * 86_400)] == Totals()
    # ids are kept the window after the request's last record (a run after preemption),
    # not its first
    later = recompute(first + run("globex", D + KEPT_MS + 1), dedup_ttl_s=WEEK_S)
    assert later[("globex", 8 * 86_400)] == one
    rerun = run("acme", 2 * D, placement="r#1")
    kept = recompute(first + rerun + run("globex", D + KEPT_MS + 1), dedup_ttl_s=WEEK_S)
    assert kept[("globex", 8 * 86_400)] == Totals()


def test_the_ids_of_a_record_ending_ahead_are_kept_from_its_end() -> None:
    """As the apply sets a request record's TTL: the window after the apply, or after the
    record's end if later, never shortened by a later record."""
    margin_ms = DEDUP_MARGIN_S * 1000
    assert dedup_expires_at_ms(0, 1000, 500, 60) == 61_000 + margin_ms
    assert dedup_expires_at_ms(0, 1000, 5000, 60) == 65_000 + margin_ms
    assert dedup_expires_at_ms(900_000, 1000, 500, 60) == 900_000


class LiveDays:
    """Redis as `reconcile` reads it: day totals (`live`: bucket key -> packed totals), in
    one pipeline."""

    def __init__(self, live: dict[str, bytes]) -> None:
        self.live = live
        self.asked: list[str] = []

    def pipeline(self, transaction: bool) -> "LiveDays":
        return self

    async def __aenter__(self) -> "LiveDays":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def hget(self, key: str, field: str) -> None:
        self.asked.append(key)

    async def execute(self) -> list[bytes | None]:
        return [self.live.get(key) for key in self.asked]

    async def aclose(self) -> None:
        return None


def reconciling(monkeypatch, topic: list[UsageRecord], live: dict[str, bytes],
                applied: int | None = None, tail: tuple[UsageRecord, ...] = ()) -> ModuleType:
    """`gpusched_accounting.reconcile` reading a usage topic of one partition that holds
    `topic` (accounting's group committed the first `applied` of them, by default all) and
    then `tail` (produced while Redis was read), and a Redis of `live` day totals."""
    from gpusched_accounting import reconcile

    held = [*topic, *tail]

    async def read_usage(bootstrap: str, since: dict[int, int] | None = None
                         ) -> tuple[list, dict[int, int]]:
        first, end = (0, len(topic)) if since is None else (since.get(0, 0), len(held))
        return [reconcile.Retained(0, i, held[i]) for i in range(first, end)], {0: end}

    async def applied_offsets(bootstrap: str, group: str) -> dict[int, int]:
        return {0: len(topic) if applied is None else applied}

    monkeypatch.setattr(reconcile, "read_usage", read_usage)
    monkeypatch.setattr(reconcile, "applied_offsets", applied_offsets)
    monkeypatch.setattr(reconcile.Redis, "from_url", lambda url: LiveDays(live))
    return reconcile


def reconcile_args(tenant: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(kafka="kafka", redis="redis", tenant=tenant, config_dir=CONFIG,
                              dedup_ttl_s=WEEK_S, consumer_group=CONSUMER_GROUP)


def billed_alone(record: UsageRecord) -> Totals:
    """What one record bills when it is its request's only one, at the shipped prices."""
    row = row_for(record, load_prices(CONFIG))
    return Totals(row.prompt_tokens, row.completion_tokens, 1, row.gpu_us, row.cost_nusd)


async def test_reconcile_compares_every_tenant_day_it_counts_and_agrees_after_a_reuse(
        monkeypatch) -> None:
    """A (tenant, day) whose every record recompute dropped was counted in
    tenant_days_checked but never compared: usage billed there live went unseen. And the
    request id used again after the window, billed live, was a false difference."""
    from gpusched_accounting.adapters.store import bucket_key

    first = usage(ended_at_ms=D)
    reused = usage(ended_at_ms=9 * D)  # acme again, a week and more later
    clash = usage(tenant="globex", ended_at_ms=D + 5)  # within the window: not billed
    billed = pack(billed_alone(first))
    live = {bucket_key("acme", "day", 86_400): billed, bucket_key("acme", "day", 9 * 86_400):
            billed, bucket_key("globex", "day", 86_400): pack(Totals(prompt_tokens=10))}

    reconcile = reconciling(monkeypatch, [first, reused, clash], live)
    report = await reconcile.run(reconcile_args())
    assert report["tenant_days_checked"] == 3
    assert [(d["tenant"], d["day"], d["recomputed"]["prompt_tokens"], d["live"][
        "prompt_tokens"]) for d in report["differences"]] == [("globex", "1970-01-02", 0, 10)]


async def test_reconcile_reads_a_live_total_that_is_no_counter_as_a_difference(
        monkeypatch) -> None:
    """A day's total that is no packed counter (written by hand, say) raised struct.error
    out of the command: a traceback and exit 1, naming no day, from the tool meant to find
    such a total."""
    from gpusched_accounting.adapters.store import bucket_key

    reconcile = reconciling(monkeypatch, [usage(ended_at_ms=D)],
                            {bucket_key("acme", "day", 86_400): b"garbage"})
    [diff] = (await reconcile.run(reconcile_args()))["differences"]
    assert (diff["tenant"], diff["day"], diff["live"]) == (
        "acme", "1970-01-02", f"unreadable: 7 bytes, not the {COUNTERS_SIZE} of a counter")


async def test_reconcile_with_a_group_that_committed_nothing_says_so(monkeypatch) -> None:
    """A misspelt --consumer-group (Kafka answers no offsets for a group it does not know)
    marked every day still being billed: nothing compared, exit 0, over a Redis that had
    lost every total."""
    reconcile = reconciling(monkeypatch, [usage(ended_at_ms=D)], {})

    async def nothing_committed(bootstrap: str, group: str) -> dict[int, int]:
        return {}

    monkeypatch.setattr(reconcile, "applied_offsets", nothing_committed)
    with pytest.raises(reconcile.NamesNothing, match=re.escape(
            f"consumer group '{CONSUMER_GROUP}' has committed nothing on gpusched.usage")):
        await reconcile.run(reconcile_args())


async def test_reconcile_of_one_tenant_totals_that_tenant_only(monkeypatch) -> None:
    """`--tenant acme` compared acme's days only, but its recomputed_total summed every
    tenant's: another tenant's usage read as acme's."""
    from gpusched_accounting.adapters.store import bucket_key

    acme, globex = usage(ended_at_ms=D), usage(tenant="globex", event_id="g#0:final",
                                                request_id="g", placement_id="g#0",
                                                prompt_tokens=7000, ended_at_ms=D)
    billed = billed_alone(acme)
    reconcile = reconciling(monkeypatch, [acme, globex],
                            {bucket_key("acme", "day", 86_400): pack(billed)})
    report = await reconcile.run(reconcile_args(tenant="acme"))
    assert report["differences"] == [] and report["recomputed_total"] == billed.public()


async def test_reconcile_leaves_the_days_still_being_billed_unchecked(monkeypatch) -> None:
    """On a running system the topic was read up to its end at one moment and Redis later:
    a record accounting had not applied yet, or one produced and applied in between, made
    its day differ, either way, and exit 1 as lost billing would. Only a day whose every
    record accounting has committed is compared now; the others are listed as still being
    billed, and a real difference is still found."""
    from gpusched_accounting.adapters.store import bucket_key

    def request(rid: str, tenant: str = "acme", ended_at_ms: int = D) -> UsageRecord:
        return usage(request_id=rid, placement_id=f"{rid}#0", event_id=f"{rid}#0:final",
                     tenant=tenant, ended_at_ms=ended_at_ms)

    done = [request(f"a{i}") for i in range(3)] + [request("b", ended_at_ms=2 * D),
                                                   request("i", tenant="initech")]
    behind = request("g", tenant="globex")  # not applied yet: nothing live
    during = request("late")  # produced and applied while Redis was read
    one = billed_alone(done[0])
    live = {bucket_key("acme", "day", 86_400): pack(one + one + one + one),
            bucket_key("acme", "day", 2 * 86_400): pack(one),
            bucket_key("initech", "day", 86_400): pack(Totals(prompt_tokens=1))}  # lost

    reconcile = reconciling(monkeypatch, [*done, behind], live, applied=len(done),
                            tail=(during,))
    report = await reconcile.run(reconcile_args())
    assert [(d["tenant"], d["day"]) for d in report["differences"]] == [
        ("initech", "1970-01-02")]
    assert report["still_being_billed"] == [{"tenant": "acme", "day": "1970-01-02"},
                                            {"tenant": "globex", "day": "1970-01-02"}]
    assert report["tenant_days_checked"] == 2 and report["records"] == 7
    assert report["recomputed_total"] == (one + one).public()
    acme = await reconcile.run(reconcile_args(tenant="acme"))
    assert acme["differences"] == [] and acme["still_being_billed"] == [
        {"tenant": "acme", "day": "1970-01-02"}]


class FreshRedisStore:
    """`UsageStore.send_apply` as an empty Redis answers it: the apply script takes the
    guessed outcomes when they are the true ones, as they are with nothing applied before."""

    dedup_ttl_s = 7 * 86_400

    def __init__(self) -> None:
        self.applied: list = []

    async def send_apply(self, rows, now_ms: int):  # noqa: ANN201 - a PendingApply
        store = self

        class Pending:
            async def result(self) -> list[int]:
                out = guess_outcomes(rows, now_ms - store.dedup_ttl_s * 1000)
                store.applied += [r for r, o in zip(rows, out) if o >= NEW]
                return [APPLIED if o >= NEW else o for o in out]

            async def abandon(self) -> None:
                pass

        return Pending()


async def test_usage_under_a_reused_event_id_is_dead_lettered_not_billed() -> None:
    """It went nowhere: no bill, no dead letter, counted as a duplicate. A redelivery of the
    first record is still a duplicate, silently."""
    broker = make_broker(KafkaSettings(), "accounting", None, None)
    store, registry, letters = FreshRedisStore(), CollectorRegistry(), []

    @broker.subscriber(topics.DEAD_LETTERS.name)
    async def dead_letter(msg) -> None:  # noqa: ANN001
        letters.append(DEAD_LETTER.validate_json(msg.body))

    handlers.register(broker, store, PRICES, b.BudgetTable(), lambda: D, "g", 100, 100,
                      trace.get_tracer("test"), registry)
    first = usage()
    reused = usage(tenant="globex", prompt_tokens=50_000, gpu_seconds=900.0)
    async with TestKafkaBroker(broker) as br:
        await br.publish_batch(first.to_bytes(), first.to_bytes(), reused.to_bytes(),
                               topic=topics.USAGE.name)
    assert [r.tenant for r in store.applied] == ["acme"]
    [letter] = letters
    assert letter.payload == reused.to_bytes().decode()
    assert letter.reason.startswith(f"event id {first.event_id} reused with other content: "
                                    "not billed")
    counted = {o: registry.get_sample_value("gpusched_accounting_usage_records_total",
                                            {"outcome": o}) for o in ("duplicate", "conflict")}
    assert counted == {"duplicate": 1, "conflict": 1}


async def test_a_batchs_dead_letters_and_bills_go_in_the_trace_of_their_own_record(
        tracer_provider: TracerProvider, span_exporter: InMemorySpanExporter) -> None:
    """One fetch of four requests' usage, each record in its request's trace, the second
    unreadable and the fourth reusing the first's event id. The fetch's span was made in the
    first request's trace, and so were both dead letters published under it: the second and
    fourth requests' traces lacked them, and the first showed failures not its own. Now each
    dead letter carries the trace of the record it refuses, and the batch makes no span."""
    broker = make_broker(KafkaSettings(), "accounting", tracer_provider, None)
    letters: dict[int, str] = {}

    @broker.subscriber(topics.DEAD_LETTERS.name)
    async def dead_letter(msg) -> None:  # noqa: ANN001
        letters[DEAD_LETTER.validate_json(msg.body).offset] = msg.headers["traceparent"]

    handlers.register(broker, FreshRedisStore(), PRICES, b.BudgetTable(), lambda: D, "g", 100,
                      100, tracer_provider.get_tracer("accounting"))
    [on_usage] = [s for s in broker.subscribers if s.topic_names == [topics.USAGE.name]]
    values = [usage().to_bytes(), b"{not usage", usage(request_id="s", event_id="s#0:final",
              placement_id="s#0").to_bytes(), usage(tenant="globex").to_bytes()]
    records = tuple(ConsumerRecord(
        topics.USAGE.name, 0, n, 0, 0, b"acme", value, None, 4, len(value),
        [("traceparent", f"00-{n:032x}-{n:016x}-01".encode())])
        for n, value in enumerate(values, start=1))
    async with TestKafkaBroker(broker):
        on_usage.parser._setup(AsyncMock())  # the Kafka consumer it commits on
        await on_usage.consume(records)
    assert {offset: parent.split("-")[1] for offset, parent in letters.items()} == {
        2: f"{2:032x}", 4: f"{4:032x}"}
    by_trace = sorted((s.context.trace_id, s.name) for s in span_exporter.get_finished_spans()
                      if s.context.trace_id in (1, 3))
    assert by_trace == [(1, "bill usage"), (3, "bill usage")]


def test_day_and_month_periods() -> None:
    at = 1_764_504_000_000  # 2025-11-30T12:00:00Z
    day = b.period_of(at, "day")
    assert day.label == "day:2025-11-30" and day.end_ms - day.start_ms == D
    month = b.period_of(at, "month")
    assert month.label == "month:2025-11" and len(month.day_starts_s) == 30
    assert month.end_ms == 1_764_547_200_000  # 2025-12-01T00:00:00Z


def test_budget_exhaustion_and_reason() -> None:
    budget = b.Budget(tenant="acme", period="day", limit=100, unit="tokens")
    assert not b.is_exhausted(budget, Totals(prompt_tokens=60, completion_tokens=39))
    assert b.is_exhausted(budget, Totals(prompt_tokens=60, completion_tokens=40))
    usd = b.Budget(tenant="acme", period="month", limit=1.5, unit="usd")
    assert b.is_exhausted(usd, Totals(cost_nusd=1_500_000_000))
    text = b.reason(budget, b.period_of(0, "day"), Totals(prompt_tokens=100))
    assert "100 of 100 tokens" in text and "1970-01-02T00:00:00Z" in text
    small = b.Budget(tenant="acme", period="day", limit=0.001, unit="usd")  # was $0.00 of $0.00
    assert "$0.00100 of $0.00100" in b.reason(small, b.period_of(0, "day"),
                                              Totals(cost_nusd=1_000_000))


class FlagStore:
    """The store calls `enforce_budgets` makes, over fixed spending."""

    def __init__(self, spending: Totals) -> None:
        self.spending_now, self.flag, self.calls = spending, None, []

    async def spending(self, tenant: str, day_starts_s) -> Totals:
        return self.spending_now

    async def clear_exhausted(self, tenant: str, judged_at_ms: int, read=None) -> None:
        self.calls.append("clear")
        self.flag = None

    async def set_exhausted(self, tenant: str, flag: dict, until_ms: int,
                            judged_at_ms: int, read=None) -> bool:
        self.calls.append("set")
        told = self.flag is not None and self.flag["period"] == flag["period"] \
            and self.flag["announced"]
        self.flag, self.until_ms = flag | {"announced": told}, until_ms
        return not told

    async def announced(self, tenant: str, flag: dict, until_ms: int) -> None:
        self.flag = flag | {"announced": True}


async def test_a_spent_second_budget_flags_the_tenant_once_and_never_clears_it() -> None:
    """Before, the unspent first budget cleared the flag on every batch and the spent second
    set it again: a `budget_exhausted` event per batch, and requests let through between."""
    table = b.BudgetTable(budgets=(
        b.Budget(tenant="acme", period="month", limit=10**9, unit="tokens"),
        b.Budget(tenant="acme", period="day", limit=100, unit="tokens")))
    store, events = FlagStore(Totals(prompt_tokens=150)), []

    async def publish(message, topic, key) -> None:
        events.append(message)

    for _ in range(3):
        await enforce_budgets(store, table, {"acme"}, D, publish)
    assert len(events) == 1 and "clear" not in store.calls
    assert store.flag["limit"] == 100
    store.spending_now = Totals()  # a new day
    await enforce_budgets(store, table, {"acme"}, 2 * D, publish)
    assert store.flag is None and len(events) == 1


async def test_a_budget_exhausted_event_kafka_refused_goes_out_with_the_redelivery() -> None:
    """The flag was set before the event was published: the batch's redelivery found it
    set for the same period, and the event never went out."""
    table = b.BudgetTable(budgets=(b.Budget(tenant="acme", period="day", limit=100,
                                            unit="tokens"),))
    store, events = FlagStore(Totals(prompt_tokens=150)), []

    async def kafka_away(message, topic, key) -> None:
        raise TimeoutError("no broker")

    async def publish(message, topic, key) -> None:
        events.append(message)

    with pytest.raises(TimeoutError):
        await enforce_budgets(store, table, {"acme"}, D, kafka_away)
    assert store.flag is not None  # the router refuses the tenant already
    for _ in range(2):
        await enforce_budgets(store, table, {"acme"}, D, publish)
    assert [e.type for e in events] == ["budget_exhausted"]


async def test_a_spent_month_holds_the_flag_past_a_spent_days_end() -> None:
    """With a day and a month budget both spent, the flag named the first (the day) and
    expired at midnight: the tenant was let through with its month spent."""
    table = b.BudgetTable(budgets=(
        b.Budget(tenant="acme", period="day", limit=100, unit="tokens"),
        b.Budget(tenant="acme", period="month", limit=120, unit="tokens")))
    store, events = FlagStore(Totals(prompt_tokens=150)), []

    async def publish(message, topic, key) -> None:
        events.append(message)

    await enforce_budgets(store, table, {"acme"}, D, publish)
    month = b.period_of(D, "month")
    assert store.flag["limit"] == 120 and store.until_ms == month.end_ms
    assert [e.period for e in events] == [month.label]


@pytest.mark.parametrize("field,value", [
    ("gpu_seconds", "Infinity"), ("gpu_seconds", "1e308"), ("gpu_seconds", "1e9"),
    ("prompt_tokens", "1" + "0" * 400),
    ("completion_tokens", str(2**70)), ("ended_at_ms", str(10**19)),
])
def test_usage_records_that_would_overflow_the_counters_are_invalid(field, value) -> None:
    """Before, they validated and then overflowed (`row_for` raised, so the batch was read
    again forever) or would have wrapped Redis's 64-bit counters (10,000 records of 10**9
    GPU-seconds in one day did; ten lost precision)."""
    raw = usage().model_dump_json()
    raw = raw.replace(f'"{field}":{getattr(usage(), field)}', f'"{field}":{value}')
    assert value in raw
    with pytest.raises(ValidationError):
        USAGE.validate_json(raw)


@pytest.mark.parametrize("field,value", [
    ("prompt_tokens", "true"), ("prompt_tokens", '"10"'), ("completion_tokens", "10.0"),
    ("final", '"no"'), ("gpu_seconds", "true"), ("gpu_seconds", '"3600"'),
    ("ended_at_ms", '"1800000001000"'), ("ended_at_ms", "1800000001000.0"),
    ("ended_at_ms", "true"), ("started_at_ms", '"0"'),
])
def test_usage_records_whose_counts_are_not_plain_numbers_are_invalid(field, value) -> None:
    """They were billed as coerced: `true` as 1 token or 1 GPU-second, "10" and 10.0 as 10,
    "3600" as a GPU-hour, "no" as not final; a time as text, a float or `true` (1 ms after
    1970) picked the record's bucket and whether it was too old to apply."""
    raw = usage().model_dump_json()
    raw = raw.replace(f'"{field}":{json.dumps(getattr(usage(), field))}', f'"{field}":{value}')
    assert value in raw
    with pytest.raises(ValidationError):
        USAGE.validate_json(raw)


@pytest.mark.parametrize("field,value", [
    ("tenant", "acme evil"), ("tenant", ""), ("model", "a model"), ("node_id", "n 1"),
])
def test_usage_records_naming_what_accounting_cannot_store_are_invalid(field, value) -> None:
    """Accounting keeps "<tenant> <model>" per request: a tenant 'acme evil' read back as
    tenant 'acme', model 'evil ...', so acme's key could read it; a '' tenant, once billed,
    made an admin's `?tenant=` read every tenant."""
    with pytest.raises(ValidationError):
        UsageRecord.model_validate(usage().model_dump() | {field: value})


def test_shipped_budgets_load() -> None:
    assert b.load_budgets(CONFIG, {t.name for t in load_tenants(CONFIG).tenants}).of("initech")


@pytest.mark.parametrize("budgets,needle", [
    ([{"tenant": "initeck", "period": "day", "limit": 5, "unit": "tokens"}],
     "tenant(s) initeck not in tenants.yaml"),
    ([{"tenant": "acme", "period": "day", "limit": 100, "unit": "tokens"},
      {"tenant": "acme", "period": "day", "limit": 5, "unit": "tokens"}],
     "tenant 'acme' has two day budgets in tokens"),
], ids=["misspelt-tenant", "two-alike"])
def test_a_budget_that_would_never_be_enforced_as_written_stops_the_start(
        tmp_path, budgets, needle) -> None:
    """Both loaded: a misspelt tenant's budget was never enforced, and of two alike the
    smaller silently won."""
    (tmp_path / "budgets.yaml").write_text(yaml.safe_dump({"budgets": budgets}))
    with pytest.raises(ValueError, match=re.escape(needle)):
        b.load_budgets(tmp_path, {"acme", "initech"})


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/usage/export.csv"])
@pytest.mark.parametrize("field", ["start", "end"])
async def test_a_number_too_long_to_be_a_time_is_a_400_that_quotes_it_short(path, field) -> None:
    """Before, a number over Python's 4,300 digits raised out of int(): a plain-text 500."""
    app = create_app(AccountingSettings(telemetry=TelemetrySettings(otlp_endpoint="")))
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # a 500 is an answer too
    async with httpx.AsyncClient(transport=transport, base_url="http://accounting") as client:
        reply = await client.get(path, params={field: "1" * 5000},
                                 headers={"authorization": "Bearer sk-acme-demo"})
    assert reply.status_code == 400
    detail = reply.json()["detail"]
    assert detail.startswith(f"{field}='{'1' * 40}'... (5000 characters) is neither epoch "
                             "milliseconds nor an ISO 8601 time")
    assert len(detail) < 200


async def test_a_window_whose_end_was_cut_to_a_day_from_now_says_so() -> None:
    """The 400 named the end it had cut, not the one asked, and not why."""
    app = create_app(AccountingSettings(telemetry=TelemetrySettings(otlp_endpoint="")))
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://accounting") as client:
        reply = await client.get("/v1/usage", params={"start": "2200-01-01",
                                                      "end": "2200-01-02"},
                                 headers={"authorization": "Bearer sk-acme-demo"})
    assert reply.status_code == 400
    assert "(the end asked, 7258204800000, is cut to a day from now: nothing is billed " \
        "later)" in reply.json()["detail"]


def test_an_iso_basic_date_is_a_date_not_milliseconds_of_1970() -> None:
    """`start=20261130` read as 20,261,130 ms: January 1970, clamped to the retention
    without a word."""
    from gpusched_accounting.api import _parse_time

    assert _parse_time("20261130", 0, "start") == 1_795_996_800_000  # 2026-11-30T00:00Z
    assert _parse_time("0", 5, "start") == 0 and _parse_time("99999999", 0, "end") == 99999999


@pytest.mark.parametrize("value", ["2026-11-30T10:00:00Z", "2026-11-30T10:00:00z",
                                   "2026-11-30t10:00:00z", "2026-11-30T11:00:00+01:00"])
def test_an_rfc_3339_time_in_either_case_is_read(value: str) -> None:
    """RFC 3339 allows a lowercase 'z': `start=...T10:00:00z` was a 400, 'not an ISO 8601
    time'."""
    from gpusched_accounting.api import _parse_time

    assert _parse_time(value, 0, "start") == 1_795_996_800_000 + 10 * H


@pytest.mark.parametrize("query", ["group_by=model&group_by=node", "tenant=acme&tenant=acme"])
async def test_a_query_parameter_given_twice_is_a_400(query: str) -> None:
    """The last value was taken without a word: grouped by node only."""
    app = create_app(AccountingSettings(telemetry=TelemetrySettings(otlp_endpoint="")))
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://accounting") as client:
        reply = await client.get(f"/v1/usage?{query}",
                                 headers={"authorization": "Bearer sk-acme-demo"})
    assert reply.status_code == 400 and "given more than once" in reply.json()["detail"]


@pytest.mark.parametrize("persistence,memory,problems", [
    ({"aof_enabled": 1}, {"maxmemory_policy": "noeviction"}, []),
    ({"aof_enabled": 0}, {"maxmemory_policy": "noeviction"}, ["AOF is off (appendonly no)"]),
    ({"aof_enabled": 1}, {"maxmemory_policy": "volatile-lru"},
     ["maxmemory-policy is volatile-lru"]),
])
async def test_a_redis_that_could_lose_applied_ids_is_named_at_start(
        persistence: dict, memory: dict, problems: list[str]) -> None:
    """Accounting warns at start when its Redis would lose the ids of applied usage (no AOF:
    a restart; an evicting policy, ElastiCache's default: memory pressure), after which a
    redelivered record is billed again. The manifests for a cluster's own Redis said
    nothing of either."""
    from redis.exceptions import ResponseError

    from gpusched_common.redis_client import durability_problems

    class Info:
        async def info(self, section: str) -> dict:
            return persistence if section == "persistence" else memory

    found = await durability_problems(Info())  # type: ignore[arg-type]
    assert [p.split(":")[0] for p in found] == problems

    class Refusing:
        async def info(self, section: str) -> dict:
            raise ResponseError("unknown command 'INFO'")

    assert await durability_problems(Refusing()) == []  # type: ignore[arg-type]


def test_a_name_that_starts_like_a_formula_is_text_in_the_csv_export() -> None:
    """A node named '-A1' reached a spreadsheet as the formula =-A1."""
    from gpusched_accounting.api import _cell

    assert [_cell(v) for v in ("-A1", "@x", "=1", "+1", "h100-0", "")] == [
        "'-A1", "'@x", "'=1", "'+1", "h100-0", ""]


async def test_an_eight_digit_date_that_is_none_is_a_400_quoting_what_was_sent() -> None:
    """20261399 was quoted back as '2026-13-99', a string the caller never sent."""
    app = create_app(AccountingSettings(telemetry=TelemetrySettings(otlp_endpoint="")))
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://accounting") as client:
        reply = await client.get("/v1/usage", params={"start": "20261399"},
                                 headers={"authorization": "Bearer sk-acme-demo"})
    assert reply.status_code == 400 and "start='20261399'" in reply.json()["detail"]


@pytest.mark.parametrize("change,needle", [
    (lambda d: d["tenants"][1]["api_keys"].append(d["tenants"][0]["api_keys"][0]),
     "is listed for acme and again for globex"),
    (lambda d: d["tenants"][1]["api_keys"].append(d["admin_api_keys"][0]),
     "again for the admin keys"),
    (lambda d: d["tenants"].append(dict(d["tenants"][0], api_keys=["sk-other"])),
     "tenant name(s) listed twice: acme"),
    (lambda d: d["tenants"][0]["api_keys"].append(" sk-spaced"), "has spaces around it"),
], ids=["two-tenants", "tenant-and-admin", "name-twice", "spaces"])
def test_a_key_with_two_owners_stops_the_start(tmp_path, change, needle) -> None:
    """A key listed twice went to the tenant listed last (one tenant's requests billed to
    another, its usage read by another); a tenant's key that is also an admin key read
    every tenant's usage."""
    tenants = yaml.safe_load((CONFIG / "tenants.yaml").read_text())
    change(tenants)
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_tenants(tmp_path)


def test_merge_keys_still_load_and_a_budget_written_twice_stops_the_start(tmp_path) -> None:
    """A key brought in by `<<:` and set again is no key given twice; budgets.yaml is read
    as strictly as the other files (its second `budgets:` block replaced the first)."""
    (tmp_path / "tenants.yaml").write_text(
        "tenants:\n  - name: hooli\n    api_keys: [sk-h]\n    quota: &small\n"
        "      tokens_per_minute: 3000\n      max_inflight_requests: 3\n"
        "  - name: pied\n    api_keys: [sk-p]\n"
        "    quota: {<<: *small, max_inflight_requests: 5}\n")
    pied = load_tenants(tmp_path).get("pied")
    assert (pied.quota.tokens_per_minute, pied.quota.max_inflight_requests) == (3000, 5)
    (tmp_path / "budgets.yaml").write_text(
        "budgets:\n  - {tenant: hooli, period: day, limit: 10, unit: tokens}\n"
        "budgets:\n  - {tenant: pied, period: day, limit: true, unit: tokens}\n")
    with pytest.raises(ValueError, match="found the key 'budgets' twice"):
        b.load_budgets(tmp_path, {"hooli", "pied"})
    (tmp_path / "budgets.yaml").write_text(
        "budgets:\n  - {tenant: pied, period: day, limit: true, unit: tokens}\n")
    with pytest.raises(ValueError, match="limit"):
        b.load_budgets(tmp_path, {"hooli", "pied"})
    (tmp_path / "budgets.yaml").write_text("# none yet\n")
    assert not b.load_budgets(tmp_path, {"hooli", "pied"}).budgets


@pytest.mark.parametrize("change,needle", [
    (lambda ms: ms.append(dict(ms[1], context_limit_tokens=131072)),
     "value: Value error, model(s) listed twice: qwen2.5-1.5b"),
    (lambda ms: ms[0].update(num_gpus=True), "models.0.num_gpus: Value error, a number is "
     "wanted, not true/false"),
    (lambda ms: ms[0].update(weight_memory_mib="16k"), "models.0.weight_memory_mib: "
     "Input should be a valid integer, unable to parse string as an integer"),
    (lambda ms: ms[0].update(weight_memory_mib=16000.5), "models.0.weight_memory_mib: "
     "Input should be a valid integer, got a number with a fractional part"),
    (lambda ms: ms[0].update(num_gpu=2), "models.0.num_gpu: Extra inputs are not permitted"),
    (lambda ms: ms[0].update(weight_memory_mib=10**19), "models.0.weight_memory_mib: Input "
     "should be less than or equal to 4294967296"),
    (lambda ms: ms[0].update(context_limit_tokens=2**63 - 1), "models.0.context_limit_tokens: "
     "Input should be less than or equal to 134217728"),
    (lambda ms: ms[0].update(kv_cache_bytes_per_token=2**40), "models.0."
     "kv_cache_bytes_per_token: Input should be less than or equal to 1073741824"),
], ids=["model-twice", "bool-gpus", "text-memory", "fractional-memory", "misspelt-key",
        "memory-past-64-bits", "context-past-64-bits", "kv-past-64-bits"])
def test_a_model_written_so_it_is_read_otherwise_stops_the_start_in_one_line(
        tmp_path, change, needle) -> None:
    """A model listed twice was served by its last entry while /v1/models listed both;
    `true` read as 1 (GPU, or MiB of weights); and every error came as pydantic's text over
    many lines, without the file's name. Sizes past what the solver's 64-bit arrays hold
    loaded, and stopped every scheduling cycle (1e19 MiB) or placed the model (2**63 - 1)."""
    models = yaml.safe_load((CONFIG / "models.yaml").read_text())
    change(models["models"])
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    with pytest.raises(ValueError) as refused:
        load_models(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'models.yaml'} is invalid: {needle}"


def test_whole_numbers_written_as_floats_still_load(tmp_path) -> None:
    """A models.yaml that loaded before (16384.0 for 16384, 8e0, which YAML 1.1 reads as
    text) is not refused for it."""
    models = yaml.safe_load((CONFIG / "models.yaml").read_text())
    models["models"][0].update(weight_memory_mib=16384.0, num_gpus=2.0, parameters_b="8e0")
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    first = load_models(tmp_path).models[0]
    assert (first.weight_memory_mib, first.num_gpus, first.parameters_b) == (16384, 2, 8.0)


def test_a_retired_models_price_is_kept_for_its_records(tmp_path) -> None:
    """A model taken out of models.yaml: its price refused the start, and once deleted, its
    records still to come billed at the default price (and reconcile saw every retained day
    of it differ)."""
    for name in ("models.yaml", "prices.yaml"):
        shutil.copy(CONFIG / name, tmp_path)
    with (tmp_path / "prices.yaml").open("a") as prices:
        prices.write("  gpt-old: {prompt: 9.0, completion: 9.0, retired: true}\n")
    assert load_prices(tmp_path).rates("H100-80GB", 0, "gpt-old")[1:] == (9.0, 9.0)


def test_a_budgets_file_that_is_no_yaml_is_named_once_on_one_line(tmp_path) -> None:
    (tmp_path / "budgets.yaml").write_text("budgets: [\n")
    with pytest.raises(ValueError) as refused:
        b.load_budgets(tmp_path, {"acme"})
    assert str(refused.value).count("budgets.yaml") == 1 and "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"{tmp_path / 'budgets.yaml'} is not valid YAML")


def test_a_config_folder_that_is_a_file_is_an_error_naming_it(tmp_path) -> None:
    """`reconcile --config-dir config/prices.yaml` (the file for the folder) raised
    NotADirectoryError out of the command: a traceback and exit 1, which means totals
    differ."""
    (tmp_path / "prices.yaml").write_text("gpu_hour_usd: {}\n")
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'prices.yaml' / 'prices.yaml'} cannot be read: [Errno 20]")):
        load_prices(tmp_path / "prices.yaml")


@pytest.mark.parametrize("quota,needle", [
    ("quota: {tokens_per_minute: 1000}\n    quota: {max_inflight_requests: 2}",
     "found the key 'quota' twice"),
    ("quota: {tokens_per_minute: 1000, tokens_per_minute: 5}",
     "found the key 'tokens_per_minute' twice"),
    ("quota: {tokens_per_minute: }", "tokens_per_minute has no value"),
    ("quota: {tokens_per_minute: true}", "tokens_per_minute"),
    ("weight: .inf", "weight"),
], ids=["quota-twice", "limit-twice", "empty-limit", "bool-limit", "infinite-weight"])
def test_a_tenant_written_so_it_is_read_otherwise_stops_the_start(tmp_path, quota, needle
                                                                  ) -> None:
    """Each was taken silently: a second `quota:` block replaced the first (its limits
    gone), a repeated key's last value won, an empty limit meant none, `true` a limit of 1
    token (every request a 400), and an infinite weight put one tenant first in every
    class."""
    (tmp_path / "tenants.yaml").write_text(
        f"tenants:\n  - name: hooli\n    api_keys: [sk-h]\n    {quota}\n")
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_tenants(tmp_path)


def test_a_template_placeholder_left_in_a_config_file_is_an_error_naming_it(tmp_path) -> None:
    """`api_keys: [{{ .Values.acmeKey }}]` (a Helm value not filled in) is a mapping used as
    a key: every service stopped at start with a TypeError traceback naming no file."""
    (tmp_path / "tenants.yaml").write_text(
        "tenants:\n  - name: hooli\n    api_keys: [{{ .Values.acmeKey }}]\n")
    with pytest.raises(ValueError) as refused:
        load_tenants(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'tenants.yaml'} is not valid YAML")
    assert "template placeholder" in str(refused.value) and "line 3" in str(refused.value)


NOW = 1_764_504_000_000  # 2025-11-30T12:00:00Z, the query API's clock below


@pytest.fixture
def usage_app(monkeypatch):
    """Accounting's app at a fixed clock over a store in which nothing was billed (no Redis
    runs here: its address refuses at once, should a query get that far)."""
    app = create_app(AccountingSettings(telemetry=TelemetrySettings(otlp_endpoint=""),
                                        redis=RedisSettings(url="redis://127.0.0.1:1/0")),
                     clock=lambda: NOW)
    store = app.state.store

    async def tenants() -> list[str]:
        return []

    async def window(tenant, buckets, prefix) -> tuple[Totals, dict]:
        return Totals(), {}

    async def buckets(tenant, buckets) -> list[dict]:
        return [{} for _ in buckets]

    async def request_usage(request_id: str) -> dict:
        return {"request_id": request_id, "tenant": "acme", "model": "m", "final": True,
                **Totals(requests=1).public()}

    for name, read in [("tenants", tenants), ("window", window), ("buckets", buckets),
                       ("request_usage", request_usage)]:
        monkeypatch.setattr(store, name, read)
    return app


async def ask(app, path: str, key: str = "sk-acme-demo", method: str = "GET",
              **params: str) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # a 500 is an answer too
    async with httpx.AsyncClient(transport=transport, base_url="http://accounting") as client:
        return await client.request(method, path, params=params,
                                    headers={"authorization": f"Bearer {key}"})


@pytest.mark.parametrize("granularity,back_ms,status", [
    # the oldest bucket kept ends its retention ago, or later
    ("minute", 2 * D + 60_000, 200), ("minute", 2 * D + 61_000, 400), ("minute", 3 * D, 400),
    ("hour", 35 * D + H, 200), ("hour", 35 * D + 2 * H, 400),
    ("day", 400 * D + 12 * H, 200), ("day", 401 * D, 400),
])
async def test_an_export_starting_before_its_buckets_are_kept_is_a_400(
        usage_app, granularity: str, back_ms: int, status: int) -> None:
    """The part of the window older than the granularity's buckets were kept was cut off
    without a word (a 200 whose rows began later; a 400 only for a window ending before
    them), while /v1/usage answered the whole window at a coarser grain."""
    reply = await ask(usage_app, "/v1/usage/export.csv", granularity=granularity,
                      start=str(NOW - back_ms), end=str(NOW))
    assert reply.status_code == status, reply.text
    if status == 400:
        detail = reply.json()["detail"]
        kept_s = {"minute": 2 * 86_400, "hour": 35 * 86_400, "day": 400 * 86_400}[granularity]
        assert detail.startswith(f"{granularity} buckets are kept for {kept_s} s after they "
                                 f"end, and this window starts ({NOW - back_ms}) before")
        assert detail.endswith("use a coarser granularity") == (granularity != "day")
    else:
        assert reply.text.startswith("bucket_start,granularity,tenant,")


@pytest.mark.parametrize("path", ["/v1/usage", "/v1/usage/export.csv"])
@pytest.mark.parametrize("end", ["2100-01-01T00:00:00Z", str(NOW * 1000)])
async def test_an_end_past_the_cut_without_a_start_is_a_400_not_the_next_days_zeros(
        usage_app, path: str, end: str) -> None:
    """The default start was a day before the end as cut (a day from now), not before the
    end asked: an end years ahead, or in microseconds, answered 200 with the next day's
    zeros."""
    reply = await ask(usage_app, path, end=end)
    assert reply.status_code == 400
    asked_ms = int(end) if end.isdigit() else 4_102_444_800_000
    assert reply.json()["detail"] == (
        f"start ({asked_ms - D}, end - 24 h by default) must be before end ({NOW + D}) (the "
        f"end asked, {asked_ms}, is cut to a day from now: nothing is billed later)")


async def test_an_end_less_than_two_days_ahead_reads_the_day_before_it(usage_app) -> None:
    """Records ending up to a day ahead of accounting's clock are billed: a window reaching
    there is answered, from a day before the end asked to the cut."""
    reply = await ask(usage_app, "/v1/usage", end=str(NOW + D + 12 * H))
    assert reply.status_code == 200
    assert (reply.json()["start_ms"], reply.json()["end_ms"]) == (NOW + 12 * H, NOW + D)


@pytest.mark.parametrize("path,key,params,unknown,takes", [
    ("/v1/usage", "sk-acme-demo", {"model": "m"}, "'model'", "tenant, group_by, start, end"),
    ("/v1/usage", "sk-acme-demo", {"groupby": "model"}, "'groupby'", "tenant, group_by,"),
    ("/v1/usage", "sk-acme-demo", {"from": "2099-01-01", "to": "2099-01-02"}, "'from', 'to'",
     "tenant,"),
    ("/v1/usage", "sk-admin-demo", {"tenants": "globex"}, "'tenants'", "tenant,"),
    ("/v1/usage/top", "sk-admin-demo", {"tenant": "globex"}, "'tenant'",
     "by, limit, start, end"),
    ("/v1/usage/export.csv", "sk-acme-demo", {"gran": "day"}, "'gran'",
     "tenant, granularity, start, end"),
    ("/v1/usage/requests/r1", "sk-acme-demo", {"tenant": "acme"}, "'tenant'", "none"),
])
async def test_a_query_parameter_the_route_does_not_have_is_a_400_naming_those_it_has(
        usage_app, path: str, key: str, params: dict, unknown: str, takes: str) -> None:
    """They were ignored: `?model=x` answered every model's total, an admin's
    `?tenants=globex` every tenant's, `/top?tenant=globex` the top of all tenants."""
    reply = await ask(usage_app, path, key, **params)
    assert reply.status_code == 400
    detail = reply.json()["detail"]
    route = path.replace("r1", "{request_id}")
    assert detail.startswith(f"unknown query parameter {unknown}; {route} takes {takes}")


@pytest.mark.parametrize("key,params", [("sk-acme-demo", {}),
                                        ("sk-admin-demo", {"tenant": "acme"})])
async def test_an_export_with_redis_away_is_a_503_to_retry_not_a_200_cut_short(
        usage_app, monkeypatch, key: str, params: dict) -> None:
    """Its first Redis read came once the 200 and its headers were out: the body broke off
    (a cut connection, or a short file) where every other query answered 503."""
    async def away(tenant, buckets) -> list:
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(usage_app.state.store, "buckets", away)
    reply = await ask(usage_app, "/v1/usage/export.csv", key, **params)
    assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1")
    assert reply.json()["detail"].startswith("Redis is unavailable (ConnectionError)")


def two_tenants_read(usage_app, monkeypatch) -> list[tuple[str | None, int]]:
    """The store's pages as an export reads them (tenant, buckets), of two tenants whose
    every bucket holds one prompt token."""
    read: list[tuple[str | None, int]] = []

    async def tenants() -> list[str]:
        return ["acme", "globex"]

    async def one_each(tenant, buckets) -> list[dict]:
        read.append((tenant, len(buckets)))
        return [{TOTAL_FIELD: Totals(prompt_tokens=1)} for _ in buckets]

    monkeypatch.setattr(usage_app.state.store, "tenants", tenants)
    monkeypatch.setattr(usage_app.state.store, "buckets", one_each)
    return read


async def test_an_export_reads_every_page_of_every_tenant_in_order(usage_app,
                                                                  monkeypatch) -> None:
    """The first page is read before the answer starts, the others as it goes."""
    read = two_tenants_read(usage_app, monkeypatch)
    reply = await ask(usage_app, "/v1/usage/export.csv", "sk-admin-demo", granularity="minute",
                      start=str(NOW - 1000 * 60_000), end=str(NOW))
    assert read == [("acme", 500), ("acme", 500), ("globex", 500), ("globex", 500)]
    rows = reply.text.splitlines()
    assert len(rows) == 1 + 2000 and rows[1].startswith("2025-11-29T19:20:00Z,minute,acme,")
    assert rows[-1].startswith("2025-11-30T11:59:00Z,minute,globex,total,,1,")


async def test_head_of_an_export_reads_its_first_page_only(usage_app, monkeypatch) -> None:
    """HEAD ran the whole export (up to 100,000 buckets read, on the event loop the usage
    consumer shares) and threw it away; it reads the first page, which tells whether Redis
    answers (a 503 otherwise), as GET does before it starts."""
    read = two_tenants_read(usage_app, monkeypatch)
    reply = await ask(usage_app, "/v1/usage/export.csv", "sk-admin-demo", "HEAD",
                      granularity="minute", start=str(NOW - 1000 * 60_000), end=str(NOW))
    assert (reply.status_code, reply.content) == (200, b"")
    assert read == [("acme", 500)]


@pytest.mark.parametrize("key,params", [
    ("sk-acme-demo", {}), ("sk-acme-demo", {"group_by": "model"}), ("sk-admin-demo", {}),
    ("sk-admin-demo", {"group_by": "node"}),
])
async def test_a_usage_report_conforms_to_its_own_openapi_schema(usage_app, monkeypatch,
                                                                 key: str, params: dict) -> None:
    """The schema requires group_by; a report without one left it out."""
    import jsonschema

    async def tenants() -> list[str]:
        return ["acme", "globex"]

    async def window(tenant, buckets, prefix) -> tuple[Totals, dict]:
        if tenant is None:
            return Totals(), {"acme": Totals(requests=2)}
        return Totals(requests=2), {"x": Totals(requests=2)} if prefix else {}

    monkeypatch.setattr(usage_app.state.store, "tenants", tenants)
    monkeypatch.setattr(usage_app.state.store, "window", window)
    spec = (await ask(usage_app, "/openapi.json")).json()
    reply = await ask(usage_app, "/v1/usage", key, **params)
    assert reply.status_code == 200
    report = reply.json()
    jsonschema.validate(report, {"$ref": "#/components/schemas/UsageReport",
                                 "components": spec["components"]})
    assert report["group_by"] == params.get("group_by")
    assert all((t["groups"] is None) == (not params) for t in report["tenants"])


@pytest.mark.parametrize("key,status", [("sk-admin-demo", 404), ("sk-acme-demo", 403)])
async def test_a_tenant_it_cannot_read_is_quoted_short(usage_app, key: str,
                                                       status: int) -> None:
    """The 404 of a tenant neither configured nor billed (and the 403 of another tenant's)
    echoed the whole name: 3,000 characters sent, over 3,000 answered."""
    reply = await ask(usage_app, "/v1/usage", key, tenant="x" * 3000)
    assert reply.status_code == status
    assert f"'{'x' * 40}'... (3000 characters)" in reply.json()["detail"]
    assert len(reply.text) < 400


@pytest.mark.parametrize("path,key,status", [
    ("/v1/usage", "sk-acme-demo", 200), ("/v1/usage/top", "sk-admin-demo", 200),
    ("/v1/usage/top", "sk-acme-demo", 403), ("/v1/usage/requests/r1", "sk-acme-demo", 200),
    ("/v1/usage/requests/r1", "sk-globex-demo", 404), ("/v1/usage/export.csv", "sk-acme-demo", 200),
    ("/healthz", "", 503), ("/metrics", "", 200),
])
async def test_head_answers_as_get_does_without_the_body(usage_app, path: str, key: str,
                                                         status: int) -> None:
    """Every read answered HEAD with 405, where the router's answer as GET does. The schema
    still names each read once."""
    got, head = await ask(usage_app, path, key), await ask(usage_app, path, key, "HEAD")
    assert (got.status_code, head.status_code, head.content) == (status, status, b"")
    assert head.headers == got.headers
    schema = (await ask(usage_app, "/openapi.json")).json()
    assert not any("head" in operations for operations in schema["paths"].values())


async def test_a_budget_recheck_that_fails_is_tried_again_and_then_runs_every_period(
        monkeypatch) -> None:
    """Checked once at start, a flag whose check failed (Redis away) stayed until its period
    ended although its budget was raised; and a replica's stale flag was never checked."""
    calls, pauses = [], []

    async def recheck() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            raise RedisConnectionError("Redis is away")

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 4:
            raise asyncio.CancelledError

    monkeypatch.setattr(handlers.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await handlers.recheck_forever(recheck, every_s=60)
    assert len(calls) == 4 and pauses == [handlers.RECHECK_RETRY_S] * 2 + [60, 60]


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[UsageStore]:
    """The live store over an empty Redis, with the service's default windows."""
    redis = make_redis(RedisSettings(url=redis_url))
    await redis.flushall()
    yield UsageStore(redis, WEEK_S, Retention(2 * 86_400, 35 * 86_400, 400 * 86_400))
    await redis.aclose()


async def test_a_record_delivered_again_while_its_id_is_kept_is_a_silent_duplicate(
        redis_store: UsageStore) -> None:
    """Applied a day late, and delivered again 6.5 days later (a restart, a rebalance): its
    id was still kept, yet it ended before the dedup window, and the apply called it stale.
    It was dead-lettered as 'not applied, check it with reconcile' and counted stale,
    although it had been billed once."""
    broker = make_broker(KafkaSettings(), "accounting", None, None)
    registry, letters, now = CollectorRegistry(), [], [NOW]

    @broker.subscriber(topics.DEAD_LETTERS.name)
    async def dead_letter(msg) -> None:  # noqa: ANN001
        letters.append(DEAD_LETTER.validate_json(msg.body))

    handlers.register(broker, redis_store, PRICES, b.BudgetTable(), lambda: now[0], "g", 100,
                      100, trace.get_tracer("test"), registry)
    late = usage(started_at_ms=NOW - D - 1000, ended_at_ms=NOW - D).to_bytes()
    async with TestKafkaBroker(broker) as br:
        await br.publish_batch(late, topic=topics.USAGE.name)
        now[0] = NOW + 6 * D + D // 2
        await br.publish_batch(late, topic=topics.USAGE.name)
    assert letters == []
    counted = {o: registry.get_sample_value("gpusched_accounting_usage_records_total",
                                            {"outcome": o}) for o in ("applied", "duplicate",
                                                                      "stale")}
    assert counted == {"applied": 1, "duplicate": 1, "stale": 0}
    assert (await redis_store.request_usage("r"))["prompt_tokens"] == 10


async def test_a_record_delivered_again_as_its_window_closes_is_not_billed_twice(
        redis_store: UsageStore) -> None:
    """Staleness was judged on accounting's clock as the batch began, the ids' expiry on
    Redis's as the script ran: redelivered after its ids expired but before it was stale by
    the batch's clock (the batch's earlier chunks took that long, or the clocks are apart),
    a record was applied again. Its ids are kept DEDUP_MARGIN_S past the window."""
    store = UsageStore(redis_store.redis, 1, redis_store.retention)  # a 1 s window
    now_ms = int(time.time() * 1000)
    row = row_for(usage(started_at_ms=now_ms - 1000, ended_at_ms=now_ms - 20), PRICES)
    assert await store.apply([row], now_ms) == [APPLIED]
    assert await store.redis.ttl(REQUEST_KEY.format("r")) > DEDUP_MARGIN_S
    await asyncio.sleep(1.1)  # a window later on Redis's clock
    batch_began_ms = int(time.time() * 1000) - 300  # its earlier chunks took 300 ms
    assert await store.apply([row], batch_began_ms) == [DUPLICATE]
    assert (await store.request_usage("r"))["prompt_tokens"] == 10


async def test_the_guessed_outcomes_are_the_apply_scripts_over_an_empty_redis(
        redis_store: UsageStore) -> None:
    """The script and `guess_outcomes` decide in one order (a wrong guess costs a round
    trip, and `FreshRedisStore` stands for the script): an old record repeating an id of
    the batch with other content is a conflict, not stale; a new id that old is stale,
    and its request id is then nobody's, so a fresh record of another tenant under it is
    billed."""
    oldest_ms = NOW - WEEK_S * 1000
    rows = [row_for(usage(ended_at_ms=NOW), PRICES),
            row_for(usage(ended_at_ms=NOW), PRICES),
            row_for(usage(ended_at_ms=oldest_ms - 1), PRICES),
            row_for(usage(event_id="q#0:final", request_id="q", placement_id="q#0",
                          tenant="globex", ended_at_ms=oldest_ms - 1), PRICES),
            row_for(usage(event_id="q#0:1", request_id="q", placement_id="q#0",
                          final=False, ended_at_ms=NOW), PRICES)]
    guessed = guess_outcomes(rows, oldest_ms)
    assert guessed == [COUNTED, DUPLICATE, CONFLICT, STALE, NEW]
    assert await redis_store.apply(rows, NOW) == [APPLIED if o >= NEW else o for o in guessed]


@pytest.mark.parametrize("day_before_spent", [False, True])
async def test_a_check_as_of_the_day_before_leaves_todays_budget_flag_as_it_is(
        redis_store: UsageStore, day_before_spent: bool) -> None:
    """One instance flagged acme for today; another, whose check was as of 2 s before
    midnight (its batch began then, or its clock is behind), judged the day before: unspent,
    it cleared today's flag; spent too, it replaced it with the day before's, expiring at
    midnight (gone at once), and published that stale event after today's. The router then
    let acme through until the next check."""
    midnight = (int(time.time()) // 86_400 + 10) * D  # the flags expire in real time
    table = b.BudgetTable(budgets=(b.Budget(tenant="acme", period="day", limit=100,
                                            unit="tokens"),))
    events = []

    async def publish(message, topic, key) -> None:
        events.append(message.period)

    if day_before_spent:
        await redis_store.apply([row_for(usage(event_id="y#0:final", request_id="y",
                                               placement_id="y#0", prompt_tokens=500,
                                               ended_at_ms=midnight - 60_000), PRICES)],
                                midnight - 30_000)
    await redis_store.apply([row_for(usage(prompt_tokens=500, started_at_ms=midnight,
                                           ended_at_ms=midnight + 20_000), PRICES)],
                            midnight + 25_000)
    await enforce_budgets(redis_store, table, {"acme"}, midnight + 25_000, publish)
    key = BUDGET_EXHAUSTED_KEY.format("acme")
    today = await redis_store.redis.get(key)
    assert json.loads(today)["period"] == b.period_of(midnight, "day").label
    await enforce_budgets(redis_store, table, {"acme"}, midnight - 2_000, publish)
    assert await redis_store.redis.get(key) == today
    assert events == [b.period_of(midnight, "day").label]
    # a check as of today still clears it once the budget is raised
    raised = b.BudgetTable(budgets=(b.Budget(tenant="acme", period="day", limit=1_000,
                                             unit="tokens"),))
    await enforce_budgets(redis_store, raised, {"acme"}, midnight + 30_000, publish)
    assert await redis_store.redis.get(key) is None


async def test_usage_applied_past_midnight_is_judged_as_of_then_not_when_its_batch_began(
        redis_store: UsageStore) -> None:
    """The batch began 2 s before midnight and its budgets were checked after it, as of
    then: today's spent budget was judged as the day before's, unspent, and not flagged."""
    midnight = (int(time.time()) // 86_400 + 10) * D
    broker = make_broker(KafkaSettings(), "accounting", None, None)
    times = [midnight - 2_000, midnight + 25_000]
    table = b.BudgetTable(budgets=(b.Budget(tenant="acme", period="day", limit=100,
                                            unit="tokens"),))
    handlers.register(broker, redis_store, PRICES, table,
                      lambda: times.pop(0) if len(times) > 1 else times[0], "g", 100, 100,
                      trace.get_tracer("test"), CollectorRegistry())
    spent = usage(prompt_tokens=500, started_at_ms=midnight, ended_at_ms=midnight + 20_000)
    async with TestKafkaBroker(broker) as br:
        await br.publish_batch(spent.to_bytes(), topic=topics.USAGE.name)
    flag = await redis_store.redis.get(BUDGET_EXHAUSTED_KEY.format("acme"))
    assert flag is not None and json.loads(flag)["period"] == b.period_of(midnight, "day").label


async def test_marking_a_flags_event_out_writes_back_no_flag_replaced_or_cleared_since(
        redis_store: UsageStore) -> None:
    """The mark was a plain SET of the flag as it was set: a check as of the day before set
    its flag, another instance replaced it with today's (or cleared it: the budget was
    raised), and the mark put the day before's back, ending at midnight."""
    midnight = (int(time.time()) // 86_400 + 10) * D
    key = BUDGET_EXHAUSTED_KEY.format("acme")

    def flag(at_ms: int) -> tuple[dict, int]:
        window = b.period_of(at_ms, "day")
        return {"period": window.label, "period_start_ms": window.start_ms,
                "reason": window.label}, window.end_ms

    before, before_end_ms = flag(midnight - 2_000)
    today, today_end_ms = flag(midnight + 25_000)
    assert await redis_store.set_exhausted("acme", before, before_end_ms, midnight - 2_000)
    assert await redis_store.set_exhausted("acme", today, today_end_ms, midnight + 25_000)
    await redis_store.announced("acme", before, before_end_ms)
    assert json.loads(await redis_store.redis.get(key)) == today | {"announced": False}
    await redis_store.clear_exhausted("acme", midnight + 30_000)
    await redis_store.announced("acme", today, today_end_ms)
    assert await redis_store.redis.get(key) is None


async def test_a_flag_whose_period_is_over_by_redis_clock_is_not_set_nor_announced_again(
        redis_store: UsageStore) -> None:
    """A check whose clock is behind judged yesterday spent with no flag there: the flag,
    expiring at yesterday's end, was gone at once, and every check published yesterday's
    event again."""
    yesterday = b.period_of(int(time.time() * 1000) - D, "day")
    flag = {"period": yesterday.label, "period_start_ms": yesterday.start_ms, "reason": "x"}
    for _ in range(2):
        assert not await redis_store.set_exhausted("acme", flag, yesterday.end_ms,
                                                   yesterday.end_ms - 2_000)
    assert await redis_store.redis.get(BUDGET_EXHAUSTED_KEY.format("acme")) is None


async def test_marking_a_flags_event_out_keeps_a_flag_of_its_period_set_again_since(
        redis_store: UsageStore) -> None:
    """Another instance set the period's flag again (its budget was raised, and is spent
    again) after this one set it: the mark wrote back this one's older flag, and clients
    read the old limit in the 429 until the next check."""
    midnight = (int(time.time()) // 86_400 + 10) * D
    today = b.period_of(midnight + 25_000, "day")
    key = BUDGET_EXHAUSTED_KEY.format("acme")
    mine = {"period": today.label, "period_start_ms": today.start_ms, "limit": 100}
    theirs = mine | {"limit": 200}
    assert await redis_store.set_exhausted("acme", mine, today.end_ms, midnight + 25_000)
    await redis_store.redis.set(key, json.dumps(theirs | {"announced": True}))
    await redis_store.announced("acme", mine, today.end_ms)
    assert json.loads(await redis_store.redis.get(key))["limit"] == 200


async def test_a_check_that_read_the_spending_before_another_flagged_it_leaves_the_flag(
        redis_store: UsageStore) -> None:
    """Instance A read acme's day at 90 tokens of 100; B then read 120 and flagged it; A,
    judging its older reading, cleared B's flag, and acme got through until the next
    check, which published the day's event a second time. Spending only grows, so the
    larger reading is the later one."""
    midnight = (int(time.time()) // 86_400 + 10) * D
    today = b.period_of(midnight + 25_000, "day")
    key = BUDGET_EXHAUSTED_KEY.format("acme")
    flag = {"period": today.label, "period_start_ms": today.start_ms, "spent": 120.0,
            "unit": "tokens", "limit": 100}
    assert await redis_store.set_exhausted("acme", flag, today.end_ms, midnight + 25_000)
    await redis_store.clear_exhausted("acme", midnight + 26_000, {(today.label, "tokens"): 90})
    assert await redis_store.redis.get(key) is not None
    # the budget was raised to 1,000: a reading as recent as the flag's lifts it
    await redis_store.clear_exhausted("acme", midnight + 27_000, {(today.label, "tokens"): 120})
    assert await redis_store.redis.get(key) is None


async def test_a_check_from_an_older_reading_does_not_shorten_a_months_flag(
        redis_store: UsageStore) -> None:
    """A read the day at 150 of 100 tokens and the month at 900 of 1,000; B then read the
    month at 1,100 and flagged it. A's older judgement replaced the month's flag with the
    day's (another period), announcing the day again and letting the tenant through from
    midnight, though its month was spent."""
    midnight = (int(time.time()) // 86_400 + 10) * D
    day, month = (b.period_of(midnight + 25_000, p) for p in ("day", "month"))
    key = BUDGET_EXHAUSTED_KEY.format("acme")
    months = {"period": month.label, "period_start_ms": month.start_ms, "spent": 1100.0,
              "unit": "tokens"}
    assert await redis_store.set_exhausted("acme", months, month.end_ms, midnight + 25_000,
                                           {(month.label, "tokens"): 1100.0})
    days = {"period": day.label, "period_start_ms": day.start_ms, "spent": 150.0,
            "unit": "tokens"}
    assert not await redis_store.set_exhausted(
        "acme", days, day.end_ms, midnight + 25_000,
        {(day.label, "tokens"): 150.0, (month.label, "tokens"): 900.0})
    assert json.loads(await redis_store.redis.get(key))["period"] == month.label



@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/14"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/14"),
    ("redis://:secret@cache:6380/3?socket_timeout=5", "redis://:secret@cache:6380/14?socket_timeout=5"),
])
def test_the_bench_uses_its_own_database_of_any_redis_url(url: str, expected: str) -> None:
    """`bench accounting --redis` cut the URL at its last '/' to add its database: a URL
    without one, `redis://127.0.0.1:6379`, became `redis://14` (host "14")."""
    from gpusched_accounting.bench import in_database

    assert in_database(url, 14) == expected


@pytest.mark.parametrize("argv, says", [
    (["--events", "0"], "argument --events: '0': Input should be greater than or equal to 1"),
    (["--tenants", "-3"], "argument --tenants: '-3'"),
    (["--batch", "1.5"], "argument --batch: '1.5': Input should be a valid integer"),
    (["--baseline-events", "0"], "argument --baseline-events: '0'"),
    (["--queries", "x"], "argument --queries: 'x'"),
    (["--port-base", "80"], "argument --port-base: '80': Input should be greater than or "
     "equal to 1024"),
    (["--port-base", "65530"], "argument --port-base: '65530': Input should be less than or "
     "equal to 65525"),
])
def test_a_number_the_accounting_bench_cannot_use_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    """The bench read its numbers with int() and never checked them: `--queries 0` failed
    with an IndexError after the whole run. They are refused as the other benches refuse."""
    from gpusched_accounting.bench import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)

    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpusched bench accounting: error: ") and says in err[-1], err
