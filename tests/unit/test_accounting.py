"""Accounting domain: which counters a usage record touches, in exact integer units."""

from gpusched_accounting.domain.usage import increment_for, totals_from_hash
from gpusched_common.contracts import UsageRecord


def usage(**kw) -> UsageRecord:
    base = dict(event_id="p#0:final", request_id="r", placement_id="p#0", tenant="acme",
                model="m", priority_class="batch", node_id="n", gpu_type="H100-80GB",
                prompt_tokens=10, completion_tokens=5, gpu_seconds=0.1234567, final=True,
                started_at_ms=0, ended_at_ms=1)
    return UsageRecord(**(base | kw))


def test_increment_touches_tenant_and_tenant_model_counters() -> None:
    inc = increment_for(usage())
    assert inc.hashes == ("gpusched:usage:tenant:acme", "gpusched:usage:tenant:acme:model:m")
    assert dict(inc.fields) == {"prompt_tokens": 10, "completion_tokens": 5, "requests": 1,
                                "gpu_us": 123457}
    assert inc.dedup_key.endswith("p#0:final")


def test_partial_records_do_not_count_a_request() -> None:
    assert dict(increment_for(usage(final=False)).fields)["requests"] == 0


def test_totals_convert_microseconds_back() -> None:
    totals = totals_from_hash({b"gpu_us": b"1500000", b"prompt_tokens": b"7"})
    assert totals == {"prompt_tokens": 7, "completion_tokens": 0, "requests": 0,
                      "gpu_seconds": 1.5}
