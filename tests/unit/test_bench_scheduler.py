"""The scheduler benchmark's pure helpers: what it produces parses as the contracts say,
and "sustained" means what its report claims."""

import asyncio
import json
import math

from gpusched_common.contracts import NODE_STATE, REQUEST, USAGE
from gpusched_scheduler.bench.scheduler import (
    LIVE_CYCLE_PER_CLASS,
    Step,
    engine_only,
    machine_steal,
    metric_sums,
    node_states,
    percentile,
    request_bytes,
    request_kv_mib,
    steal_pct,
    sustained,
    usage_bytes,
)


def _step(rate: int, placed: float, p99: float, missing: int = 0, changes: int = 0) -> Step:
    nan = math.nan
    return Step(offered_req_s=rate, sent_req_s=rate, placements_per_s=placed, p50_ms=1.0,
                p99_ms=p99, max_ms=p99, scheduler_p99_ms=p99, measured=rate, missing=missing,
                scheduler_cpu_pct=nan, bench_cpu_pct=nan, kafka_cpu_pct=nan,
                scheduler_cpu_us_per_placement=nan, scheduler_cpu_wait_pct=nan, steal_pct=nan,
                cycles_per_s=nan, cycle_mean_ms=nan, solver_mean_ms=nan, leader_changes=changes)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_sustained_is_the_highest_rate_that_kept_up_within_the_latency_limit() -> None:
    steps = [_step(500, 500, 10), _step(1000, 990, 40), _step(2000, 1500, 30),
             _step(3000, 3000, 400)]
    assert sustained(steps).offered_req_s == 1000
    assert sustained([_step(500, 500, 10, missing=1)]) is None
    assert sustained([_step(500, 500, 10, changes=1)]) is None


def test_steal_is_the_share_of_the_machines_ticks_since_a_reading() -> None:
    since = machine_steal()
    share = steal_pct(since)
    assert math.isnan(share) or 0.0 <= share <= 100.0
    assert math.isnan(steal_pct((0, 0))) or 0.0 <= steal_pct((0, 0)) <= 100.0


def test_bench_records_parse_as_the_contracts() -> None:
    request = REQUEST.validate_json(request_bytes("b-1", "acme", "batch", 123))
    assert (request.request_id, request.priority_class, request.created_at_ms) == \
        ("b-1", "batch", 123)
    placement = {"placement_id": "b-1#0", "node_id": "bench-node-000", "placed_at_ms": 200,
                 "request": json.loads(request.to_bytes())}
    usage = USAGE.validate_json(usage_bytes(placement, 300))
    assert usage.final and usage.placement_id == "b-1#0" and usage.tenant == "acme"
    states = node_states(2, 8, 1, 0, 10, free_mib=2 * request_kv_mib())
    assert len(states) == 2 and all(len(s.gpus) == 8 for s in states)
    assert NODE_STATE.validate_json(states[0].to_bytes()).gpus[0].memory_free_mib == \
        2 * request_kv_mib()


def test_metric_sums_add_every_label() -> None:
    text = ('# HELP x\nm_count{a="1"} 2.0\nm_count{a="2"} 3.0\nm_sum 0.5\nother 9\n')
    assert metric_sums(text, ("m_count", "m_sum")) == {"m_count": 5.0, "m_sum": 0.5}


def test_the_engine_alone_places_every_request_of_each_round_at_a_live_cycles_size() -> None:
    result = asyncio.run(engine_only(4, 8, LIVE_CYCLE_PER_CLASS, rounds=3))
    assert result["placements"] == 3 * 3 * LIVE_CYCLE_PER_CLASS  # rounds x classes x per class
    assert result["us_per_placement"] > 0
