"""LP prices of sharing requests (``prices.py``), which gpusched's GPU choice is built on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpusched_scheduler.bench import optimal
from gpusched_scheduler.domain.solver import ShapeDistribution, WorkBatch
from gpusched_scheduler.domain.solver.prices import MICRO, price_tables, share_prices
from gpusched_scheduler.domain.solver.solve import policy_params


def test_each_share_costs_its_part_of_an_optimal_packing():
    # 650+320 fills a GPU, 470+470 and 320x3 nearly: with twice as many 320s as 650s the
    # optimum packs 650+320, 470+470 and 320+320+320, so the GPU splits 2/3 | 1/2 | 1/3
    y = share_prices(np.array([650, 470, 320]), np.array([30.0, 30.0, 60.0]))
    assert y == pytest.approx([2 / 3, 1 / 2, 1 / 3])


def test_fill_value_is_what_the_best_fill_of_a_free_share_earns():
    fill_value, price = price_tables(np.array([650, 470, 320]), np.array([30, 30, 60]))
    assert fill_value[1000] == MICRO  # a whole GPU is worth one GPU
    assert fill_value[680] == 666_667  # a 650, or two 320s
    assert fill_value[530] == 500_000  # a 470
    assert fill_value[319] == 0  # nothing of the workload fits
    assert price[470] == 500_000 and price[1000] == MICRO
    assert price[400] == fill_value[400] == 333_333  # a size outside the workload


@pytest.mark.parametrize("seed", range(6))
def test_a_placement_never_earns_more_than_the_free_share_was_worth(seed):
    rng = np.random.default_rng(seed)
    sizes = np.unique(rng.integers(1, 100, rng.integers(1, 12)) * 10)
    fill_value, price = price_tables(sizes, rng.integers(1, 200, len(sizes)))
    for s in [*sizes.tolist(), 1000]:
        free = np.arange(s, 1001)
        assert (fill_value[free] - price[s] - fill_value[free - s] >= 0).all()
    assert fill_value[1000] <= MICRO + len(sizes)  # no GPU is worth more than one (rounding)


@pytest.mark.parametrize("seed", range(4))
def test_prices_reach_the_configuration_lp_optimum(seed):
    pytest.importorskip("ortools")
    rng = np.random.default_rng(seed)
    sizes = sorted(set((rng.integers(5, 99, 8) * 10).tolist()), reverse=True)
    demand = rng.integers(1, 300, len(sizes))
    bound = optimal.min_gpus_for_shares(dict(zip(sizes, demand.tolist())),
                                        optimal.share_patterns(sizes), sizes)
    dual = float(demand @ share_prices(np.array(sizes), demand.astype(float)))
    assert math.ceil(dual - 1e-6) == bound  # strong duality: same optimum as GLOP's primal


def test_without_sharing_requests_every_share_is_worth_nothing():
    fill_value, price = price_tables(np.array([0, 1000]), np.array([5, 7]))
    assert not fill_value.any() and not price.any()


def test_workloads_that_hold_gpu_memory_keep_fgd():
    """The tables see only compute share: where requests also hold GPU memory (LLM serving
    shares a GPU by memory) gpusched keeps FGD's memory-aware shapes."""
    by_share = WorkBatch.from_units(num_gpu=[1, 1], gpu_milli=[470, 320], cpu_milli=[0, 0],
                                    mem_mib=[0, 0])
    by_memory = WorkBatch.from_units(num_gpu=[1, 1], gpu_milli=[1, 1], cpu_milli=[0, 0],
                                     mem_mib=[0, 0], gpu_mem_mib=[20000, 30000])
    assert policy_params(ShapeDistribution.from_batch(by_share), 200.0, 5.0)[5] == 1.0
    memory = ShapeDistribution.from_batch(by_memory)
    assert not memory.fill_value.any()
    assert policy_params(memory, 200.0, 5.0)[5] == 0.0
