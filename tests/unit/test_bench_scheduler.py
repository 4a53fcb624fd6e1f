"""The scheduler benchmark's pure helpers: what it produces parses as the contracts say,
and "sustained" means what its report claims; its options are checked before anything
starts."""

import argparse
import asyncio
import json
import math

import pytest

from gpusched_common.contracts import NODE_STATE, REQUEST, USAGE
from gpusched_scheduler.bench import scheduler as bench_scheduler
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


class _Started(Exception):
    """Bench was made: the arguments passed their checks."""


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """Bench (Kafka, Redis, the schedulers) replaced by one that records its arguments and
    stops the run there."""
    made: list[argparse.Namespace] = []

    def bench(args: argparse.Namespace) -> None:
        made.append(args)
        raise _Started
    monkeypatch.setattr(bench_scheduler, "Bench", bench)
    return made


@pytest.mark.parametrize("argv, says", [
    (["--soak", "-5"], "argument --soak: '-5': Input should be greater than or equal to 0"),
    (["--soak", "nan"], "argument --soak: 'nan': Input should be a finite number"),
    (["--soak", "inf"], "argument --soak: 'inf': Input should be a finite number"),
    (["--step-s", "0"], "argument --step-s: '0': Input should be greater than 0"),
    (["--warmup-s", "-1"], "argument --warmup-s: '-1'"),
    (["--warm-broker-s", "NaN"], "argument --warm-broker-s: 'NaN': Input should be a finite"),
    (["--hold-ms=-inf"], "argument --hold-ms: '-inf': Input should be a finite number"),
    (["--full-s", "-20"], "argument --full-s: '-20'"),
    (["--nodes", "0"], "argument --nodes: '0': Input should be greater than or equal to 1"),
    (["--gpus", "-8"], "argument --gpus: '-8'"),
    (["--full-rate", "0"], "argument --full-rate: '0'"),
    (["--rates", "250,-500"], "argument --rates: '-500': Input should be greater than or "
     "equal to 1"),
    (["--rates", "250,,500"], "argument --rates: '': Input should be a valid integer"),
    (["--instances", "1,3"], "argument --instances: '3': Input should be less than or equal "
     "to 2"),
    (["--fetch-max-records", "0"], "argument --fetch-max-records: '0'"),
    (["--fetch-max-records", "20000"], "Input should be less than or equal to 10000"),
    (["--window-ms", "nan"], "argument --window-ms: 'nan': Input should be a finite number"),
    (["--window-ms", "-1"], "argument --window-ms: '-1'"),
    (["--port-base", "0"], "argument --port-base: '0'"),
])
def test_a_number_the_bench_cannot_use_is_refused_before_anything_starts(
        nothing_starts: list[argparse.Namespace], capsys: pytest.CaptureFixture[str],
        argv: list[str], says: str) -> None:
    """`--soak -5` (or nan, inf) ran the whole benchmark, minutes of it, with no soak: a
    number was read with float() or int() and never checked. Each option now refuses what
    it cannot use, on one line naming it, with exit 2, as the solver bench does."""
    with pytest.raises(SystemExit) as exit_:
        bench_scheduler.main(argv)

    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpusched bench scheduler: error: ") and says in err[-1], err
    assert nothing_starts == []


def test_the_bench_reads_its_numbers_and_lists_as_given(
        nothing_starts: list[argparse.Namespace]) -> None:
    with pytest.raises(_Started):
        bench_scheduler.main(["--soak", "0", "--rates", "100,200", "--instances", "2",
                              "--window-ms", "0.5", "--hold-ms", "0"])
    with pytest.raises(_Started):
        bench_scheduler.main(["--quick", "--soak", "1.5"])

    given, quick = nothing_starts
    assert (given.soak, given.rates, given.instances, given.window_ms, given.hold_ms,
            given.fetch_max_records) == (0.0, [100, 200], [2], 0.5, 0.0, 256)
    assert (given.step_s, given.warmup_s, given.full_s) == (8.0, 2.0, 20.0)
    assert (quick.soak, quick.rates, quick.instances, quick.step_s) == (1.5, [500, 1000], [1],
                                                                         3.0)
