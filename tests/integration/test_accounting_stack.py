"""Accounting against the real Kafka and Redis: usage totals stay exact through replays in
another order, a killed instance, a Redis restart, and three instances sharing the
partitions; budgets flag a tenant and the router answers 429; tenants read only their own
usage. Totals are compared with `recompute`, the reference the reconciliation uses."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from redis.asyncio import Redis
from stack_helpers import ADMIN, end_offsets, eventually, needs_local_infra, read_topic

from gpusched_accounting.domain.usage import (
    PriceTable,
    Totals,
    load_prices,
    pack,
    recompute,
    row_for,
)
from gpusched_accounting.settings import CONSUMER_GROUP, DEDUP_TTL_S
from gpusched_common import topics
from gpusched_common.contracts import DEAD_LETTER, EVENT, RESULT_EVENT, UsageRecord
from gpusched_ops.stack import ServiceSpec

pytestmark = pytest.mark.asyncio(loop_scope="session")
CONFIG = Path(__file__).resolve().parents[2] / "config"
PRICES = load_prices(CONFIG)
FIRST_PORT = 28150 + int(os.environ.get("GPUSCHED_TEST_PORT_OFFSET", "0"))
MODELS = ("qwen2.5-1.5b", "llama-3.1-8b")


def make_usage(tenants: list[str], requests_each: int, seed: int = 1,
               spread_ms: int = 240_000) -> list[UsageRecord]:
    """Each request: two partial records (deltas) then a final one, some preempted and run
    again (a second placement), ending over the last `spread_ms` (a few minutes)."""
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    out = []
    for tenant in tenants:
        for i in range(requests_each):
            rid = f"req-{tenant}-{i}"
            attempts = 2 if i % 7 == 0 else 1
            for attempt in range(attempts):
                pid = f"{rid}#{attempt}"
                ended = now - rnd.randrange(0, spread_ms)
                common = dict(request_id=rid, placement_id=pid, tenant=tenant,
                              model=MODELS[i % 2], priority_class="batch",
                              node_id=f"node-{i % 3}", gpu_type="H100-80GB",
                              started_at_ms=ended - 5000)
                for part in range(2):
                    out.append(UsageRecord(event_id=f"{pid}:p{part}", prompt_tokens=0,
                                           completion_tokens=rnd.randrange(1, 50),
                                           gpu_seconds=rnd.randrange(1, 10**6) / 1e6,
                                           final=False, ended_at_ms=ended - 1000 + part,
                                           **common))
                out.append(UsageRecord(event_id=f"{pid}:final", prompt_tokens=rnd.randrange(
                    1, 500), completion_tokens=rnd.randrange(0, 50), gpu_seconds=0.25,
                    final=True, ended_at_ms=ended, **common))
    return out


async def past_midnight(records_within_s: float, judged_within_s: float) -> None:
    """Wait, if need be, until records ending in the last `records_within_s` and judged
    within `judged_within_s` from now all fall in one UTC day."""
    into_day_s = time.time() % 86_400
    if into_day_s < records_within_s or into_day_s > 86_400 - judged_within_s:
        await asyncio.sleep((records_within_s - into_day_s) % 86_400 + 1)


def expected(records: list[UsageRecord], prices: PriceTable = PRICES) -> dict[str, Totals]:
    per_day = recompute((row_for(r, prices) for r in records), dedup_ttl_s=DEDUP_TTL_S)
    out: dict[str, Totals] = {}
    for (tenant, _), totals in per_day.items():
        out[tenant] = out.get(tenant, Totals()) + totals
    return out


async def produce(stack, records: list[UsageRecord]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap,
                                linger_ms=5, acks="all")
    await producer.start()
    try:
        for r in records:
            await producer.send(topics.USAGE.name, r.to_bytes(), key=r.tenant.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def drained(stack, group: str) -> bool:
    """True when `group` has committed every usage record written so far."""
    ends = await end_offsets(stack.endpoints.kafka_bootstrap, [topics.USAGE.name])
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.endpoints.kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return all(tp in committed and committed[tp].offset >= end for tp, end in ends.items())


def instance(stack, name: str, port: int, group: str, db: int,
             config_dir: Path = CONFIG, max_records: int = 2000) -> ServiceSpec:
    e = stack.endpoints
    return ServiceSpec(name=name, module="gpusched_accounting", env={
        "GPUSCHED_KAFKA_BOOTSTRAP": e.kafka_bootstrap,
        "GPUSCHED_REDIS_URL": e.redis_url.rsplit("/", 1)[0] + f"/{db}",
        "GPUSCHED_OTLP_ENDPOINT": "", "GPUSCHED_HTTP_PORT": str(port),
        "GPUSCHED_CONSUMER_GROUP": group, "GPUSCHED_CONFIG_DIR": str(config_dir),
        "GPUSCHED_FETCH_MAX_RECORDS": str(max_records)},
        health_url=f"http://127.0.0.1:{port}/healthz")


async def totals_of(url: str, tenants: list[str]) -> dict[str, dict]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        out = {}
        for t in tenants:
            r = await http.get("/v1/usage", params={"tenant": t, "start": "0"}, headers=ADMIN)
            r.raise_for_status()
            out[t] = r.json()["tenants"][0]["totals"]
        return out


def public(totals: dict[str, Totals]) -> dict[str, dict]:
    return {t: v.public() for t, v in totals.items()}


def tenants_named(tag: str, n: int) -> list[str]:
    return [f"{tag}-{uuid.uuid4().hex[:6]}-{i}" for i in range(n)]


async def test_replaying_every_event_twice_in_another_order_changes_no_total(stack) -> None:
    tenants = tenants_named("replay", 4)
    records = make_usage(tenants, 25)
    want = public(expected(records))
    await produce(stack, records)
    shuffled = records * 2
    random.Random(7).shuffle(shuffled)
    await produce(stack, shuffled)

    async def settled():
        return await drained(stack, "gpusched-accounting")

    await eventually(settled, timeout_s=60, what="accounting to consume the replays")
    assert await totals_of(stack.accounting_url, tenants) == want
    # the same numbers by model, and the per-request view of a preempted request
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get("/v1/usage", params={"tenant": tenants[0], "group_by": "model",
                                                "start": "0"}, headers=ADMIN)
        groups = r.json()["tenants"][0]["groups"]
        assert sum(g["completion_tokens"] for g in groups) == want[tenants[0]][
            "completion_tokens"]
        r = await http.get(f"/v1/usage/requests/req-{tenants[0]}-0", headers=ADMIN)
        mine = [u for u in records if u.request_id == f"req-{tenants[0]}-0"]
        assert r.json()["requests"] == 1 and r.json()["final"]
        assert r.json()["completion_tokens"] == sum(u.completion_tokens for u in mine)


async def test_a_request_started_over_is_billed_each_position_once_through_replays(
        stack) -> None:
    """Its first attempt billed the prompt and 35 tokens before its node died; the next
    started over (the prompt and those tokens again, 50 in all) and was preempted; the third
    went on after them. The records reach the apply in two fetches (the second attempt's
    overlap is then unknown to the batch: the script's answer corrects the guess), and again,
    shuffled, as redeliveries: 100 prompt and 60 completion tokens are billed, not 200 and
    95, with every record's GPU time."""
    [tenant] = tenants_named("restart", 1)
    rid = f"req-{tenant}"
    now = int(time.time() * 1000)
    common = dict(request_id=rid, tenant=tenant, model=MODELS[0], priority_class="batch",
                  node_id="node-1", gpu_type="H100-80GB", started_at_ms=now - 9000)

    def record(attempt: int, n: str, prompt: tuple[int, int], completion: tuple[int, int],
               ended: int) -> UsageRecord:
        pid = f"{rid}#{attempt}"
        return UsageRecord(placement_id=pid, event_id=f"{pid}:{n}", final=n == "final",
                           prompt_from=prompt[0], prompt_tokens=prompt[1],
                           completion_from=completion[0], completion_tokens=completion[1],
                           gpu_seconds=0.5, ended_at_ms=now - ended, **common)
    first = [record(0, "1", (0, 100), (0, 20), 8000), record(0, "2", (100, 0), (20, 15), 7000)]
    then = [record(1, "final", (0, 100), (0, 50), 4000),
            record(2, "final", (100, 0), (50, 10), 1000)]
    want = public(expected(first + then))
    assert (want[tenant]["prompt_tokens"], want[tenant]["completion_tokens"]) == (100, 60)

    async def billed():
        return await drained(stack, "gpusched-accounting") and \
            await totals_of(stack.accounting_url, [tenant])

    await produce(stack, first)
    await eventually(billed, timeout_s=30, what="the first attempt billed")
    await produce(stack, then)
    assert await eventually(billed, timeout_s=30, what="the next attempts billed") == want
    replays = (first + then) * 2
    random.Random(3).shuffle(replays)
    await produce(stack, replays)
    assert await eventually(billed, timeout_s=30, what="the replays consumed") == want
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get(f"/v1/usage/requests/{rid}", headers=ADMIN)
    mine = r.json()
    assert (mine["prompt_tokens"], mine["completion_tokens"], mine["requests"]) == (100, 60, 1)
    assert mine["gpu_seconds"] == pytest.approx(2.0)
    assert mine["cost_usd"] == want[tenant]["cost_usd"]


async def test_a_bad_usage_record_is_dead_lettered_with_the_field_and_bills_nothing(
        stack) -> None:
    [tenant] = tenants_named("bad-usage", 1)
    good = [r for r in make_usage([tenant], 1) if r.final][-1]
    bad = good.model_copy(update={"event_id": f"{good.placement_id}:bad"}).model_dump(
        mode="json") | {"completion_tokens": -5}
    # billed a year ahead, into a bucket no query or budget would read before then
    ahead = good.model_copy(update={"event_id": f"{good.placement_id}:ahead",
                                    "ended_at_ms": good.ended_at_ms + 365 * 86_400_000})
    producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap)
    await producer.start()
    try:
        for raw in (json.dumps(bad).encode(), f"{tenant} {{not json".encode(),
                    ahead.to_bytes()):
            await producer.send_and_wait(topics.USAGE.name, raw, key=tenant.encode())
    finally:
        await producer.stop()
    await produce(stack, [good])

    async def all_letters():
        found = await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name,
                                 lambda k, v: tenant.encode() in v, timeout_s=2)
        return found if len(found) >= 3 else None

    letters = [DEAD_LETTER.validate_json(v) for _, v in await eventually(
        all_letters, timeout_s=30, what="the bad records dead-lettered")]
    assert [letter.service for letter in letters] == ["accounting"] * 3
    reasons = sorted(letter.reason for letter in letters)
    assert reasons[0] == ("invalid usage record: completion_tokens: Input should be greater "
                          "than or equal to 0")
    assert reasons[1].startswith("invalid usage record: value: Invalid JSON")
    assert reasons[2].startswith("unusable usage record: it ended at") and \
        "its agent's clock is off by more than a day" in reasons[2]

    async def billed():
        return await drained(stack, "gpusched-accounting") and \
            await totals_of(stack.accounting_url, [tenant])

    assert await eventually(billed, timeout_s=30, what="the good record applied") == \
        public(expected([good]))


async def test_a_record_under_a_reused_event_id_is_dead_lettered_and_bills_nobody(
        stack) -> None:
    """A second request under a used request id has the same event ids ('<rid>#0:final'):
    its record was taken for a redelivery of the first one's, billed to nobody and
    dead-lettered nowhere. A redelivery of the first is still a silent duplicate."""
    first, second = tenants_named("reused", 2)
    [original] = [r for r in make_usage([first], 1) if r.final][:1]
    want = public(expected([original]))
    await produce(stack, [original])

    async def billed():
        return await drained(stack, "gpusched-accounting") and \
            await totals_of(stack.accounting_url, [first])

    assert await eventually(billed, timeout_s=30, what="the first record applied") == want
    reused = original.model_copy(update={"tenant": second,
                                         "completion_tokens": original.completion_tokens + 7})
    # its next attempt: no id of it was applied, the request id is another tenant's
    retried = reused.model_copy(update={"placement_id": f"{reused.request_id}#1",
                                        "event_id": f"{reused.request_id}#1:final"})
    await produce(stack, [original, reused, retried])  # a redelivery, and the reuse

    async def letters():
        return await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name,
                                lambda k, v: original.request_id.encode() in v, timeout_s=2)

    async def both_letters():
        return len(found := await letters()) == 2 and found
    found = await eventually(both_letters, timeout_s=30, what="the reused ids dead-lettered")
    for (_, raw), record in zip(found, (reused, retried), strict=True):
        letter = DEAD_LETTER.validate_json(raw)
        assert letter.reason.startswith(f"event id {record.event_id} reused with other "
                                        "content: not billed")
        assert json.loads(letter.payload)["event_id"] == record.event_id
    assert await eventually(billed, timeout_s=30, what="both consumed") == want
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get("/v1/usage", params={"tenant": second, "start": "0"}, headers=ADMIN)
    assert r.status_code == 404, r.text  # never billed


async def test_an_event_id_applied_before_digests_were_kept_is_a_duplicate(stack) -> None:
    """A rolling upgrade: a request record written by a release that kept no content digests
    lists its ids bare; a record under one of them is a duplicate, as that release took it,
    never a conflict."""
    [tenant] = tenants_named("undigested", 1)
    [record] = [r for r in make_usage([tenant], 1) if r.final][:1]
    owner = f"{tenant} {record.model}".encode()
    redis = Redis.from_url(stack.endpoints.redis_url)
    try:  # as the release before wrote it: counters, flags, "tenant model", the ids
        await redis.set(f"gpusched:usage:req:{record.request_id}", pack(Totals(
            prompt_tokens=1)) + bytes([1, 1]) + len(owner).to_bytes(2, "little") + owner
            + f"\n~{record.event_id[len(record.request_id):]}\n".encode(), ex=3600)
        other = record.model_copy(update={"completion_tokens": record.completion_tokens + 7})
        await produce(stack, [other])

        async def consumed():
            return await drained(stack, "gpusched-accounting")

        await eventually(consumed, timeout_s=30, what="the record consumed")
        assert await read_topic(stack.endpoints.kafka_bootstrap, topics.DEAD_LETTERS.name,
                                lambda k, v: record.request_id.encode() in v, timeout_s=2) == []
        assert not await redis.sismember("gpusched:usage:tenants", tenant)  # not billed
    finally:
        await redis.aclose()


async def test_a_record_from_an_agent_clock_ahead_keeps_its_id_as_long_as_it_is_redeliverable(
        stack) -> None:
    """A record is applied until its end + the dedup window; its id used to expire one
    window after the apply, so a record ending hours ahead, redelivered at the window's
    end, was billed twice. Then a later record of the same request, from a clock that is
    right, cut the id's time back to one window."""
    [tenant] = tenants_named("ahead", 1)
    [record] = [r for r in make_usage([tenant], 1) if r.final][:1]
    ahead_ms = 20 * 3_600_000  # within the day accounting takes
    record = record.model_copy(update={"ended_at_ms": record.ended_at_ms + ahead_ms})
    later = record.model_copy(update={"event_id": f"{record.placement_id}:later",
                                      "ended_at_ms": record.ended_at_ms - ahead_ms})
    key = f"gpusched:usage:req:{record.request_id}"
    redis = Redis.from_url(stack.endpoints.redis_url)
    try:
        await produce(stack, [record])

        async def kept_s():
            return await redis.ttl(key) if await redis.exists(key) else None

        first_s = await eventually(kept_s, timeout_s=30, what="the record applied")
        await produce(stack, [later])

        async def both():
            raw = await redis.get(key)
            return raw is not None and b"later" in raw

        await eventually(both, timeout_s=30, what="the later record applied")
        ttl_s = await redis.ttl(key)
    finally:
        await redis.aclose()
    window_s = 7 * 86_400  # GPUSCHED_DEDUP_TTL_S's default
    assert first_s >= window_s + ahead_ms // 1000 - 600
    assert ttl_s >= window_s + ahead_ms // 1000 - 600


async def test_killed_instance_and_redis_restart_leave_totals_exact(stack) -> None:
    needs_local_infra(stack)
    tenants = tenants_named("crash", 6)
    records = make_usage(tenants, 120, seed=2)
    want = public(expected(records))
    group, port = f"test-crash-{uuid.uuid4().hex[:6]}", FIRST_PORT
    spec = instance(stack, "acct-crash", port, group, db=1, max_records=100)
    url = f"http://127.0.0.1:{port}"
    redis = Redis.from_url(spec.env["GPUSCHED_REDIS_URL"])
    await produce(stack, records)
    try:
        stack.processes.start_service(spec)

        async def some_applied():
            return (await redis.scard("gpusched:usage:tenants")) > 0

        await eventually(some_applied, timeout_s=30, interval_s=0.05, what="first batch")
        stack.processes.kill_service("acct-crash")  # mid-stream, before its commit
        stack.processes.start_service(spec)
        stack.processes.stop_component("redis")  # AOF on: a graceful restart keeps all
        stack.processes.start_component("redis")

        async def settled():
            return await drained(stack, group)

        await eventually(settled, timeout_s=90, what="the restarted instance to catch up")
        assert await totals_of(url, tenants) == want
    finally:
        stack.processes.stop_service("acct-crash")
        stack.processes.start_component("redis")  # idempotent: leave the stack as found
        await redis.aclose()


async def test_three_instances_and_one_give_identical_totals(stack) -> None:
    tenants = tenants_named("scale", 12)  # enough keys to land on every partition
    records = make_usage(tenants, 20, seed=3)
    want = public(expected(records))
    await produce(stack, records)
    three, one = f"test-three-{uuid.uuid4().hex[:6]}", f"test-one-{uuid.uuid4().hex[:6]}"
    names = [f"acct-three-{i}" for i in range(3)]
    specs = [instance(stack, n, FIRST_PORT + 1 + i, three, db=2) for i, n in enumerate(names)]
    specs.append(instance(stack, "acct-one", FIRST_PORT + 4, one, db=3))
    try:
        for spec in specs:
            stack.processes.start_service(spec)

        async def settled():
            return await drained(stack, three) and await drained(stack, one)

        await eventually(settled, timeout_s=90, what="both groups to consume the topic")
        from_three = await totals_of(f"http://127.0.0.1:{FIRST_PORT + 1}", tenants)
        from_one = await totals_of(f"http://127.0.0.1:{FIRST_PORT + 4}", tenants)
    finally:
        for spec in specs:
            stack.processes.stop_service(spec.name)
    assert from_three == from_one == want


async def test_spent_budget_flags_the_tenant_publishes_an_event_and_router_answers_429(
        stack, tmp_path: Path) -> None:
    tenant = tenants_named("budget", 1)[0]
    for name in ("tenants.yaml", "models.yaml", "prices.yaml"):
        shutil.copy(CONFIG / name, tmp_path / name)
    tenants = yaml.safe_load((CONFIG / "tenants.yaml").read_text())  # a budget is a tenant's
    tenants["tenants"].append({"name": tenant, "api_keys": [f"sk-{tenant}"]})
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    (tmp_path / "budgets.yaml").write_text(
        f"budgets:\n  - {{tenant: {tenant}, period: day, limit: 100, unit: tokens}}\n")
    group, port = f"test-budget-{uuid.uuid4().hex[:6]}", FIRST_PORT + 5
    spec = instance(stack, "acct-budget", port, group, db=4, config_dir=tmp_path)
    redis = Redis.from_url(spec.env["GPUSCHED_REDIS_URL"])
    # A day budget counts the records of the UTC day it is judged in: records made just
    # after midnight ending before it, or judged after it, spend nothing (a run at 00:00
    # waited 30 s for a flag never set)
    await past_midnight(records_within_s=30, judged_within_s=60)
    await produce(stack, make_usage([tenant], 3, spread_ms=20_000))  # well over 100 tokens
    try:
        stack.processes.start_service(spec)

        async def flagged():
            return await redis.get(f"gpusched:budget:exhausted:{tenant}")

        flag = await eventually(flagged, timeout_s=30, what="the budget flag")
        assert 0 < await redis.pttl(f"gpusched:budget:exhausted:{tenant}") <= 86_400_000
        # the budget is raised and the service restarted, as the 429 says to: the tenant is
        # unblocked at once (before, the flag stayed until the period's end)
        stack.processes.stop_service("acct-budget")
        (tmp_path / "budgets.yaml").write_text(
            f"budgets:\n  - {{tenant: {tenant}, period: day, limit: 1000000, unit: tokens}}\n")
        stack.processes.start_service(spec)

        async def cleared():
            return await redis.get(f"gpusched:budget:exhausted:{tenant}") is None

        await eventually(cleared, timeout_s=30, what="the flag cleared")
    finally:
        stack.processes.stop_service("acct-budget")
        await redis.aclose()
    assert b"day budget" in flag
    events = await read_topic(stack.endpoints.kafka_bootstrap, topics.EVENTS.name,
                              lambda k, v: k == tenant.encode())
    assert [EVENT.validate_json(v).type for _, v in events] == ["budget_exhausted"]

    # the router reads the same flag (set here by hand for a tenant it knows) and says why;
    # a retry of a request that ran before, with its Idempotency-Key, still gets its reply
    shared = Redis.from_url(stack.endpoints.redis_url)
    keyed = {"Authorization": "Bearer sk-acme-demo", "Idempotency-Key": uuid.uuid4().hex}
    try:
        async with httpx.AsyncClient(base_url=stack.router_url, timeout=30) as http:
            before = await http.post("/v1/completions", headers=keyed, json={
                "model": MODELS[0], "prompt": "before", "max_tokens": 3})
            await shared.set("gpusched:budget:exhausted:acme", flag, px=60_000)
            again = await http.post("/v1/completions", headers=keyed, json={
                "model": MODELS[0], "prompt": "before", "max_tokens": 3})
            r = await http.post("/v1/completions", json={"model": MODELS[0], "prompt": "hi"},
                                headers={"Authorization": "Bearer sk-acme-demo"})
        # one produced straight to Kafka is refused by the scheduler, with the same reason
        # (once its read of acme's flag, for the request above, is a second old)
        await asyncio.sleep(1.2)
        rid = f"budget-kafka-{uuid.uuid4().hex[:8]}"
        producer = AIOKafkaProducer(bootstrap_servers=stack.endpoints.kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topics.REQUESTS["standard"].name, json.dumps({
                "request_id": rid, "tenant": "acme", "model": MODELS[0], "prompt": "x",
                "max_tokens": 3}).encode(), key=rid.encode())
        finally:
            await producer.stop()

        async def answered():
            found = await read_topic(stack.endpoints.kafka_bootstrap, topics.RESULTS.name,
                                     lambda k, v: k == rid.encode(), timeout_s=2)
            return next((e for _, v in found if (e := RESULT_EVENT.validate_json(v)).type
                         in ("rejection", "request_result")), None)
        refused = await eventually(answered, timeout_s=30, what="the scheduler's answer")
    finally:
        await shared.delete("gpusched:budget:exhausted:acme")
        await shared.aclose()
    assert (refused.type, refused.status_code, refused.code) == (
        "rejection", 429, "insufficient_quota")
    assert "day budget" in refused.reason
    assert r.status_code == 429
    assert "day budget" in r.json()["error"]["message"]
    # no retry fits before the period ends: say when it does, and that the SDK not retry
    assert r.headers["x-should-retry"] == "false"
    assert 0 < int(r.headers["retry-after"]) <= 60
    assert before.status_code == again.status_code == 200
    assert again.json() == before.json()  # the same request's reply: nothing ran again


async def test_a_tenant_reads_only_its_own_usage(stack) -> None:
    acme = {"Authorization": "Bearer sk-acme-demo"}
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        assert (await http.get("/v1/usage", headers=acme)).json()["tenants"][0][
            "tenant"] == "acme"
        for path, params in [("/v1/usage", {"tenant": "globex"}),
                             ("/v1/usage/export.csv", {"tenant": "globex"}),
                             ("/v1/usage/top", {})]:
            r = await http.get(path, params=params, headers=acme)
            assert r.status_code == 403, (path, r.text)
        other = tenants_named("other", 1)[0]
        await produce(stack, make_usage([other], 1))

        async def billed():
            r = await http.get(f"/v1/usage/requests/req-{other}-0", headers=ADMIN)
            return r if r.status_code == 200 else None

        await eventually(billed, what="the other tenant's request to be billed")
        r = await http.get(f"/v1/usage/requests/req-{other}-0", headers=acme)
        assert r.status_code == 404  # as unknown: not told whose it is
        assert (await http.get("/v1/usage", headers={"Authorization": "Bearer nope"})
                ).status_code == 401
        csv_text = (await http.get("/v1/usage/export.csv", params={"tenant": other},
                                   headers=ADMIN)).text
        assert csv_text.startswith("bucket_start,") and f",{other},total," in csv_text
        rows = list(csv.DictReader(io.StringIO(csv_text)))
        assert all(len(r["gpu_seconds"].split(".")[1]) == 6 and "e" not in r["cost_usd"]
                   for r in rows)  # fixed point, not 4e-06 (spreadsheets, diffs)
        top = (await http.get("/v1/usage/top", params={"by": "tokens"}, headers=ADMIN)).json()
        assert top["tenants"] and top["by"] == "tokens"
        schema = (await http.get("/openapi.json")).json()
        assert {"/v1/usage", "/v1/usage/top", "/v1/usage/requests/{request_id}",
                "/v1/usage/export.csv"} <= set(schema["paths"])


@pytest.mark.parametrize("params,status,reason", [
    ({"start": "100", "end": "50"}, 400, "start (100) must be before end (50)"),
    ({"start": "yesterday"}, 400, "ISO 8601"),
    # every row is one tenant already: grouping by tenant would be an empty split
    ({"group_by": "tenant"}, 422, "'model', 'node', 'gpu_type' or 'priority_class'"),
    ({"start": "1764500000"}, 400, "looks like epoch seconds; send epoch milliseconds"),
    ({"start": "\u00b2"}, 400, "ISO 8601"),  # a digit to str.isdigit, not to int()
    # a misspelt tenant is not read as one that used nothing
    ({"tenant": "acmee"}, 404, "no tenant 'acmee': it is not configured and has no usage"),
    # expired, not empty: no window of zeros for usage that is no longer kept
    ({"end": "1"}, 400, "days and this window ends (1) before that"),
])
async def test_a_bad_usage_query_gets_4xx_with_the_reason(stack, params, status, reason) -> None:
    async with httpx.AsyncClient(base_url=stack.accounting_url) as http:
        r = await http.get("/v1/usage", params=params, headers=ADMIN)
    assert r.status_code == status and reason in r.text, r.text


async def test_reconcile_agrees_with_live_totals_and_reports_a_tampered_one(stack) -> None:
    import argparse

    from gpusched_accounting import reconcile
    from gpusched_accounting.adapters.store import bucket_key

    tenant = tenants_named("reconcile", 1)[0]
    records = make_usage([tenant], 5, seed=5)
    await produce(stack, records)

    async def settled():
        return await drained(stack, "gpusched-accounting")

    await eventually(settled, timeout_s=60, what="accounting to consume the records")
    args = argparse.Namespace(kafka=stack.endpoints.kafka_bootstrap,
                              redis=stack.endpoints.redis_url,
                              tenant=tenant, config_dir=CONFIG, dedup_ttl_s=DEDUP_TTL_S,
                              consumer_group=CONSUMER_GROUP)
    report = await reconcile.run(args)
    assert report["differences"] == [] and report["tenant_days_checked"] >= 1
    redis = Redis.from_url(stack.endpoints.redis_url)
    try:
        day = records[0].ended_at_ms // 86_400_000 * 86_400
        await redis.hset(bucket_key(tenant, "day", day), "t", pack(Totals(prompt_tokens=1)))
        report = await reconcile.run(args)
    finally:
        await redis.aclose()
    assert [d["tenant"] for d in report["differences"]] == [tenant]
    assert report["differences"][0]["live"]["prompt_tokens"] == 1
    # a misspelt tenant passed as agreeing (0 checked, exit 0)
    with pytest.raises(reconcile.NamesNothing, match="no tenant 'reconcile-nosuch'"):
        await reconcile.run(argparse.Namespace(**vars(args) | {"tenant": "reconcile-nosuch"}))
