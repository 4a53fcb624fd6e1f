"""Solver throughput: placements per second and batch latency, Numba kernels vs reference.

Clusters repeat the openb node mix until they hold the requested GPU count; batches are
single-GPU units drawn from the openb single-GPU shapes, with GPU share, CPU and memory
scaled down together when needed so a batch asks for ~90% of the cluster (so the run
measures placements, not rejections).
"""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from gpusched_scheduler.domain.solver import ClusterState, ShapeDistribution, WorkBatch, solve
from gpusched_scheduler.domain.solver.reference import reference_solve

from .openb import NodeList, PodList

FILL_TARGET = 0.9


def cluster_of(nodes: NodeList, n_gpus: int) -> ClusterState:
    """The openb node list repeated (GPU nodes in file order) and cut at ``n_gpus`` GPUs."""
    reps = n_gpus // max(nodes.total_gpus, 1) + 1
    idx = np.tile(np.arange(len(nodes.sn)), reps)
    csum = np.cumsum(nodes.gpu[idx])
    last = int(np.searchsorted(csum, n_gpus))
    idx = idx[: last + 1]
    gpu = nodes.gpu[idx].copy()
    gpu[-1] -= int(csum[last] - n_gpus)  # trim the last node to hit n_gpus exactly
    keep = gpu > 0
    idx, gpu = idx[keep], gpu[keep]
    return ClusterState.from_arrays(
        [f"{nodes.sn[i]}-{j}" for j, i in enumerate(idx)],
        nodes.cpu_milli[idx],
        nodes.memory_mib[idx],
        gpu,
        [nodes.model[i] for i in idx],
    )


def single_gpu_batch(pods: PodList, n_units: int, n_gpus: int, seed: int) -> WorkBatch:
    """``n_units`` single-GPU units from the trace's single-GPU shapes, scaled to ~90% fill."""
    rng = np.random.default_rng(seed)
    pool = np.flatnonzero(pods.num_gpu == 1)
    pick = pool[rng.integers(len(pool), size=n_units)]
    milli = pods.gpu_milli[pick].astype(np.float64)
    scale = min(1.0, FILL_TARGET * 1000.0 * n_gpus / milli.sum())
    return WorkBatch.from_units(
        num_gpu=np.ones(n_units, np.int64),
        gpu_milli=np.maximum(1, np.floor(milli * scale)).astype(np.int64),
        cpu_milli=np.floor(pods.cpu_milli[pick] * scale).astype(np.int64),
        mem_mib=np.floor(pods.memory_mib[pick] * scale).astype(np.int64),
    )


@dataclass(frozen=True)
class ThroughputRow:
    policy: str
    order: str  # "arrival" (batch order) or "lookahead" (the policy's look-ahead order)
    gpus: int
    batch: int
    numba_per_s: float
    reference_per_s: float
    speedup: float
    p50_ms: float
    p99_ms: float
    placed_pct: float
    peak_mib: float
    reference_units: int
    shapes_ms: float  # building the batch's shapes and price tables, outside the timed solves


def measure(
    policy: str,
    state: ClusterState,
    batch: WorkBatch,
    repeats: int,
    reference_budget_s: float,
    lookahead: bool = False,
) -> ThroughputRow:
    """Time ``repeats`` solves of the whole batch (each against the same snapshot) and the
    reference on a prefix that fits ``reference_budget_s``; peak memory of one solve. The
    solves are handed the batch's shapes (as FGD, the workload's distribution is known
    beforehand); building them is timed apart (median of 3), since the live scheduler
    builds them for each cycle's batch."""
    built = []
    for _ in range(3):
        t0 = time.perf_counter()
        shapes = ShapeDistribution.from_batch(batch)
        built.append(time.perf_counter() - t0)
    # warm the JIT/cache
    solve(state, batch.take(slice(0, 16)), policy, shapes=shapes, lookahead=lookahead)
    lat = []
    res = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = solve(state, batch, policy, shapes=shapes, lookahead=lookahead)
        lat.append(time.perf_counter() - t0)
    tracemalloc.start()
    solve(state, batch, policy, shapes=shapes, lookahead=lookahead)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the kernel's own scratch arrays (Numba's allocator, invisible to tracemalloc):
    # change log and order-sized arrays, per-node stamps/groups, the per-unit node lists
    # (pending, scores, GPUs, scan, group scores/epochs), build_groups' hashes and table
    n = state.num_nodes
    peak += 8 * (2 * len(batch) + 4 * n + 11 * n + 64)
    # reference: grow the prefix until the time budget is used
    n_ref, ref_s = 0, 0.0
    limit = 4
    while ref_s < reference_budget_s and n_ref < len(batch):
        t0 = time.perf_counter()
        reference_solve(state, batch, policy, shapes=shapes, limit=limit, lookahead=lookahead)
        ref_s = time.perf_counter() - t0
        n_ref = min(limit, len(batch))
        limit *= 4
    lat_arr = np.array(lat)
    numba_rate = len(batch) / float(np.median(lat_arr))
    ref_rate = n_ref / ref_s if ref_s > 0 else float("nan")
    return ThroughputRow(
        policy=policy,
        order="lookahead" if lookahead else "arrival",
        gpus=state.num_gpus,
        batch=len(batch),
        numba_per_s=round(numba_rate, 1),
        reference_per_s=round(ref_rate, 2),
        speedup=round(numba_rate / ref_rate, 1) if ref_rate > 0 else float("nan"),
        p50_ms=round(1000 * float(np.percentile(lat_arr, 50)), 3),
        p99_ms=round(1000 * float(np.percentile(lat_arr, 99)), 3),
        placed_pct=round(100.0 * float(res.placed.mean()), 2),
        peak_mib=round(peak / 2**20, 2),
        reference_units=n_ref,
        shapes_ms=round(1000 * float(np.median(built)), 3),
    )
