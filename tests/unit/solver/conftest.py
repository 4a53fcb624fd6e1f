"""Shared builders and hypothesis strategies for the solver's unit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from gpusched_scheduler.domain.solver import ClusterState, GpuSpec, NodeSpec, WorkBatch

SHARED_OPENB = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "openb"

GPU_TYPES = ("A", "B", "C")
MODELS = ("m0", "m1", "m2")


@pytest.fixture
def openb_dir() -> Path:
    if not (SHARED_OPENB / "openb_node_list_gpu_node.csv").exists():
        pytest.skip(f"openb trace not found at {SHARED_OPENB} (../shared is absent)")
    return SHARED_OPENB


gpus_st = st.builds(
    GpuSpec,
    type_name=st.sampled_from(GPU_TYPES),
    milli_free=st.sampled_from([0, 100, 250, 400, 500, 750, 1000, 1000]),
    memory_free_mib=st.integers(0, 16),
    memory_total_mib=st.none(),  # the total defaults to the free memory
    healthy=st.sampled_from([True, True, True, False]),
    loaded_models=st.lists(st.sampled_from(MODELS), max_size=2, unique=True).map(tuple),
)


@st.composite
def clusters(draw, max_nodes: int = 5, max_gpus: int = 4) -> ClusterState:
    n = draw(st.integers(1, max_nodes))
    nodes = []
    for i in range(n):
        gpus = tuple(draw(st.lists(gpus_st, max_size=max_gpus)))
        cpu = draw(st.integers(0, 8))
        mem = draw(st.integers(0, 8))
        nodes.append(NodeSpec(f"n{i}", cpu, mem, gpus, cpu_total_milli=8, memory_total_mib=8))
    return ClusterState.from_nodes(nodes, model_slots=3)


@st.composite
def batches(draw, max_units: int = 8) -> WorkBatch:
    n = draw(st.integers(1, max_units))
    k = draw(st.lists(st.sampled_from([0, 1, 1, 1, 2, 3, 9]), min_size=n, max_size=n))
    milli = [
        draw(st.sampled_from([0, 100, 250, 300, 500, 750, 1000, 1000])) if x > 0 else 0
        for x in k
    ]
    allowed = draw(
        st.lists(
            st.none() | st.lists(st.sampled_from(GPU_TYPES), min_size=1, max_size=2),
            min_size=n,
            max_size=n,
        )
    )
    return WorkBatch.from_units(
        num_gpu=k,
        gpu_milli=milli,
        cpu_milli=draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)),
        mem_mib=draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)),
        # half the batches reserve no GPU memory: gpusched then places by its price tables
        gpu_mem_mib=draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)
                         | st.just([0] * n)),
        allowed_gpu_types=allowed,
        model_id=draw(st.lists(st.none() | st.sampled_from(MODELS), min_size=n, max_size=n)),
        model_weight_mib=draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)),
        priority=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)),
        tenant=draw(st.lists(st.sampled_from(["t0", "t1"]), min_size=n, max_size=n)),
    )


def assert_never_overcommits(state: ClusterState, after: ClusterState) -> None:
    """Free amounts stay non-negative wherever they started non-negative."""
    for name in ("node_cpu_free_milli", "node_mem_free_mib", "gpu_milli_free",
                 "gpu_mem_free_mib"):
        a = getattr(after, name)
        b = getattr(state, name)
        assert np.all((a >= 0) | (a == b)), name
