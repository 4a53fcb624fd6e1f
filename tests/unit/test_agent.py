"""GPU agent domain: inventories, memory admission with eviction, GPU-second shares, stop
strings."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched_agent.domain import perf_model
from gpusched_agent.domain.gpu_share import ShareMeter
from gpusched_agent.domain.inventory import GpuInfo, catalog_type, parse_simulated
from gpusched_agent.domain.node import Admitted, NodeModel, Refused
from gpusched_agent.domain.stop_strings import StopScan
from gpusched_common.catalog import GPU_TYPES, load_models
from gpusched_common.contracts import InferenceRequest, Placement

CATALOG = load_models(Path(__file__).resolve().parents[2] / "config")
SMALL, BIG = CATALOG.get("qwen2.5-1.5b"), CATALOG.get("llama-3.1-8b")


def placement(pid: str, gpu: int, kv_mib: int, model: str) -> Placement:
    req = InferenceRequest(request_id=pid, tenant="t", model=model, prompt="x",
                           created_at_ms=0)
    return Placement(placement_id=f"{pid}#0", node_id="n", gpu_indices=(gpu,), kv_cache_mib=kv_mib,
                     scheduler_epoch=1, placed_at_ms=0, request=req)


@pytest.mark.parametrize("spec,count,types", [
    ("8xH100-80GB", 8, {"H100-80GB"}),
    ("2xA100-40GB,4xL4-24GB", 6, {"A100-40GB", "L4-24GB"}),
    (" 1 x H200-141GB ", 1, {"H200-141GB"}),
])
def test_simulated_inventories(spec: str, count: int, types: set[str]) -> None:
    gpus = parse_simulated(spec, "n1")
    assert len(gpus) == count and {g.gpu_type for g in gpus} == types
    assert [g.index for g in gpus] == list(range(count))
    assert len({g.uuid for g in gpus}) == count


@pytest.mark.parametrize("spec,needle", [("8xB200", "unknown GPU type"), ("eight", "<count>x"),
                                         ("0xH100-80GB", "1..64")])
def test_bad_inventory_spec_says_what_is_wrong(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        parse_simulated(spec, "n1")


def test_node_state_reports_every_gpu_and_health() -> None:
    node = NodeModel.from_inventory([GpuInfo(0, "u0", "L4-24GB", 23034),
                                     GpuInfo(1, "u1", "L4-24GB", 23034, healthy=False)])
    state = node.state("n", seq=1, started_at_ms=0, now_ms=5)
    assert [g.healthy for g in state.gpus] == [True, False]
    assert state.gpus[0].memory_free_mib == 23034


def test_unhealthy_gpu_gets_no_work() -> None:
    node = NodeModel.from_inventory([GpuInfo(0, "u0", "L4-24GB", 23034, healthy=False)])
    assert isinstance(node.admit(placement("p", 0, 10, SMALL.name), SMALL), Refused)


def test_admission_loads_once_then_evicts_idle_models_when_memory_is_needed() -> None:
    node = NodeModel.from_inventory(parse_simulated("1xL4-24GB", "n"))
    first = node.admit(placement("p1", 0, 100, SMALL.name), SMALL)
    assert isinstance(first, Admitted) and first.needs_load
    second = node.admit(placement("p2", 0, 100, SMALL.name), SMALL)
    assert isinstance(second, Admitted) and not second.needs_load
    # BIG does not fit next to SMALL while SMALL is in use...
    assert isinstance(node.admit(placement("p3", 0, 6000, BIG.name), BIG), Refused)
    assert node.state("n", 2, 0, 5).gpus[0].idle_models is None
    assert b"idle_models" not in node.state("n", 2, 0, 5).to_bytes()  # read one release back
    node.finish(placement("p1", 0, 100, SMALL.name))
    node.finish(placement("p2", 0, 100, SMALL.name))
    [gpu] = node.state("n", 3, 0, 5).gpus  # the scheduler counts on the memory it holds
    assert gpu.idle_models == (SMALL.name,)
    assert gpu.kv_cache_free_mib - gpu.memory_free_mib == SMALL.weight_memory_mib
    # ...and does once SMALL is idle and can be evicted.
    third = node.admit(placement("p3", 0, 6000, BIG.name), BIG)
    assert isinstance(third, Admitted) and third.evicted == ((0, SMALL.name),)
    assert node.gpus[0].free_mib() == 23034 - BIG.weight_memory_mib - 6000


def test_gpu_shares_add_up_to_busy_time() -> None:
    meter = ShareMeter()
    meter.start("a", 0.0)
    meter.start("b", 1.0)   # a alone for 1 s
    a = meter.stop("a", 3.0)  # shared for 2 s
    b = meter.stop("b", 4.0)  # b alone for 1 s
    assert a == pytest.approx(2.0) and b == pytest.approx(2.0)
    assert a + b == pytest.approx(4.0)


def test_partial_takes_are_deltas_that_sum_to_the_total() -> None:
    meter = ShareMeter()
    meter.start("a", 0.0)
    parts = [meter.take("a", 1.0), meter.take("a", 2.5), meter.stop("a", 4.0)]
    assert sum(parts) == pytest.approx(4.0)


def test_a_clock_that_steps_back_bills_no_interval_twice() -> None:
    """The meter's clock is injected: one stepping back 5 s used to bill those 5 s again
    once it caught up (10 GPU-seconds billed 15)."""
    meter = ShareMeter()
    meter.start("a", 0.0)
    parts = [meter.take("a", 10.0), meter.take("a", 5.0), meter.take("a", 10.0),
             meter.stop("a", 12.0)]
    assert parts == pytest.approx([10.0, 0.0, 0.0, 2.0])


def test_performance_model_orders_gpus_and_models_sensibly() -> None:
    h100, l4 = GPU_TYPES["H100-80GB"], GPU_TYPES["L4-24GB"]
    assert perf_model.decode_step_s(SMALL, h100, 0) < perf_model.decode_step_s(SMALL, l4, 0)
    assert perf_model.decode_step_s(SMALL, h100, 0) < perf_model.decode_step_s(BIG, h100, 0)
    assert perf_model.decode_step_s(BIG, h100, 10_000) > perf_model.decode_step_s(BIG, h100, 0)
    # an 8B model decodes at roughly 100-200 tokens/s on one H100 (bandwidth-bound)
    assert 100 < 1 / perf_model.decode_step_s(BIG, h100, 0) < 200


@pytest.mark.parametrize("name,mib,expected", [
    ("NVIDIA H200", 143771, "H200-141GB"), ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"), ("NVIDIA L4", 23034, "L4-24GB"),
    ("NVIDIA A100 80GB PCIe", 40192, "A100-80GB"),  # MIG: one instance's memory, not root
])
def test_nvml_names_map_to_catalog_types(name: str, mib: int, expected: str) -> None:
    assert catalog_type(name, mib) == expected


def test_a_gang_is_admitted_on_all_its_gpus_or_none() -> None:
    node = NodeModel.from_inventory(parse_simulated("2xH100-80GB", "n"))
    huge = CATALOG.get("llama-3.1-70b")
    gang = placement("g", 0, 1000, huge.name).model_copy(update={"gpu_indices": (0, 1)})
    out = node.admit(gang, huge)
    assert isinstance(out, Admitted) and out.needs_load
    per_gpu = -(-huge.weight_memory_mib // 2) + 1000
    assert [g.free_mib() for g in node.gpus] == [81559 - per_gpu] * 2
    node.finish(gang)
    # GPU 1 unhealthy: nothing is reserved anywhere
    sick = NodeModel.from_inventory([GpuInfo(0, "a", "H100-80GB", 81559),
                                     GpuInfo(1, "b", "H100-80GB", 81559, healthy=False)])
    assert isinstance(sick.admit(gang, huge), Refused)
    assert [g.free_mib() for g in sick.gpus] == [81559, 81559]


def test_a_gangs_shards_serve_only_work_of_the_same_model_and_gang_size() -> None:
    """A 2-GPU gang of the 70B leaves half its weights idle on each H100. A 1-GPU placement
    of the 70B on GPU 0 needs all 134 GiB there and is refused; another 2-GPU gang of the 70B
    uses the shards; one of the 8B next to an 8B shard loads its weights whole. Before,
    a shard counted as the model loaded, and the whole 70B was admitted on one 80 GB GPU."""
    node = NodeModel.from_inventory(parse_simulated("2xH100-80GB", "n"))
    huge, eight = CATALOG.get("llama-3.1-70b"), CATALOG.get("llama-3.1-8b")

    def gang(pid: str, model: str) -> Placement:
        return placement(pid, 0, 1000, model).model_copy(update={"gpu_indices": (0, 1)})

    for pid, model in (("g1", huge), ("g2", eight)):
        node.admit(gang(pid, model.name), model)
        node.finish(gang(pid, model.name))
    assert node.state("n", 1, 0, 0).gpus[0].loaded_models == (
        "llama-3.1-70b#tp2", "llama-3.1-8b#tp2")
    refused = node.admit(placement("one", 0, 1000, huge.name), huge)
    assert isinstance(refused, Refused) and "needs" in refused.reason
    again = node.admit(gang("g3", huge.name), huge)
    assert isinstance(again, Admitted) and not again.needs_load
    node.finish(gang("g3", huge.name))
    single = node.admit(placement("8b", 1, 1000, eight.name), eight)
    assert isinstance(single, Admitted) and single.needs_load


def test_a_gangs_shards_serve_only_a_gang_of_the_same_gpus() -> None:
    """GPU 1's shard of a (0, 1) gang is rank 1 of that gang: a (1, 2) gang needs rank 0 on
    GPU 1, so it loads its own shards. Before, the shards of (0, 1) and (2, 3) counted as
    loaded for (1, 2), and the torch executor failed it ('not loaded on GPU 1')."""
    node = NodeModel.from_inventory(parse_simulated("4xH100-80GB", "n"))
    huge = CATALOG.get("llama-3.1-70b")

    def gang(pid: str, gpus: tuple[int, ...]) -> Placement:
        return placement(pid, 0, 1000, huge.name).model_copy(update={"gpu_indices": gpus})

    for pid, gpus in (("a", (0, 1)), ("b", (2, 3))):
        assert node.admit(gang(pid, gpus), huge).needs_load
    across = node.admit(gang("c", (1, 2)), huge)
    assert isinstance(across, Refused)  # the shards of a and b and c's do not fit together
    node.finish(gang("a", (0, 1)))
    node.finish(gang("b", (2, 3)))
    across = node.admit(gang("c", (1, 2)), huge)
    assert isinstance(across, Admitted) and across.needs_load
    assert sorted(across.evicted) == [(1, "llama-3.1-70b#tp2@0,1"), (2, "llama-3.1-70b#tp2@2,3")]
    node.finish(gang("c", (1, 2)))
    assert not node.admit(gang("d", (1, 2)), huge).needs_load
    assert [g.loaded_models for g in node.state("n", 1, 0, 0).gpus] == [
        ("llama-3.1-70b#tp2",)] * 4  # the scheduler sees weights_name only


@pytest.mark.parametrize("tokens,stops,end", [
    (["ab", "xENDy", "zz"], ["END"], 3),  # inside one token
    (["he", "ll", "o wor", "ld"], ["o w"], 4),  # across tokens
    (["hel", "lo world"], ["world", "lo"], 3),  # the earliest of two found at once
    (["STOP", "more"], ["STOP"], 0),  # at the very start: empty text
    (["a", "b", "c"], ["x"], None),
    (["a", "b", "c"], None, None),
])
def test_stop_strings_end_the_text_before_the_first_one(tokens, stops, end) -> None:
    scan = StopScan(stops)
    for token in tokens:
        if scan.feed(token):
            break
    assert scan.end_chars == end


def test_text_that_could_still_start_a_stop_string_is_held_back() -> None:
    scan = StopScan(["END", "\n\n"])
    scan.feed("abcdE")
    assert scan.final_chars == 3  # "E" and the "d" before it wait: "END" is 3 long
    scan.feed("N")
    assert scan.final_chars == 4 and scan.end_chars is None
    assert scan.feed("D!") and scan.final_chars == scan.end_chars == 4
    assert StopScan(None).feed("abc") is False


@given(tokens=st.lists(st.text("ab\n", min_size=1, max_size=4), max_size=12),
       stops=st.lists(st.text("ab\n", min_size=1, max_size=3), min_size=1, max_size=4))
def test_stop_scan_matches_searching_the_whole_text_after_every_token(tokens, stops) -> None:
    """Stops at the first token after which the text holds a stop string, ends before the
    earliest one, and never marks final any text that the stop then cuts off."""
    scan, expected_end, final_seen = StopScan(stops), None, 0
    for k in range(1, len(tokens) + 1):
        text = "".join(tokens[:k])
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        stopped = scan.feed(tokens[k - 1])
        assert stopped == bool(hits)
        final_seen = max(final_seen, scan.final_chars)
        if hits:
            expected_end = min(hits)
            break
    assert scan.end_chars == expected_end
    if expected_end is not None:
        assert final_seen <= expected_end
