"""openb trace replay under the FGD paper's protocol (ATC'23): load, inflate, shuffle, place.

Arrival-only online replay: pods arrive one at a time, each placed (or failed) before the
next is seen; the allocation ratio is read as arrived GPU request passes 100% and 130%.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpusched_scheduler.domain.solver import (
    ClusterState,
    ShapeDistribution,
    SolverSession,
    WorkBatch,
    solve,
)

NODE_LIST = "openb_node_list_gpu_node.csv"
POD_PREFIX = "openb_pod_list_"
TARGET_RATIO = 1.3


@dataclass(frozen=True)
class PodList:
    name: str  # workload name without the prefix, e.g. "default"
    pod_names: tuple[str, ...]
    cpu_milli: np.ndarray
    memory_mib: np.ndarray
    num_gpu: np.ndarray
    gpu_milli: np.ndarray
    gpu_spec: tuple[str, ...]  # '' or '|'-joined allowed models

    def __len__(self) -> int:
        return len(self.cpu_milli)

    @property
    def gpu_request_milli(self) -> np.ndarray:
        return self.num_gpu * self.gpu_milli

    def batch(self, index: np.ndarray | None = None) -> WorkBatch:
        idx = np.arange(len(self)) if index is None else index
        specs = [self.gpu_spec[i] for i in idx]
        return WorkBatch.from_units(
            num_gpu=self.num_gpu[idx],
            gpu_milli=self.gpu_milli[idx],
            cpu_milli=self.cpu_milli[idx],
            mem_mib=self.memory_mib[idx],
            allowed_gpu_types=[s.split("|") if s else None for s in specs],
        )


@dataclass(frozen=True)
class NodeList:
    sn: tuple[str, ...]
    cpu_milli: np.ndarray
    memory_mib: np.ndarray
    gpu: np.ndarray
    model: tuple[str, ...]

    @property
    def total_gpus(self) -> int:
        return int(self.gpu.sum())

    def state(self) -> ClusterState:
        return ClusterState.from_arrays(
            self.sn, self.cpu_milli, self.memory_mib, self.gpu, self.model
        )

    def take(self, order: np.ndarray) -> NodeList:
        return NodeList(
            sn=tuple(self.sn[i] for i in order),
            cpu_milli=self.cpu_milli[order],
            memory_mib=self.memory_mib[order],
            gpu=self.gpu[order],
            model=tuple(self.model[i] for i in order),
        )


NODE_ORDERS = ("file", "seeded")


def node_order(n_nodes: int, seed: int, how: str = "file") -> np.ndarray:
    """Order the solver sees the nodes in (ties go to the lowest index). ``file``: the node
    list's order. ``seeded``: a permutation drawn from the seed, as the paper's artifact
    does (it prefixes node names with a random permutation index and breaks score ties by
    the lexicographically smallest name)."""
    if how == "file":
        return np.arange(n_nodes, dtype=np.int64)
    if how == "seeded":
        return np.random.default_rng([seed, 1]).permutation(n_nodes).astype(np.int64)
    raise ValueError(f"unknown node order {how!r}; choose one of: {', '.join(NODE_ORDERS)}")


def load_nodes(path: Path) -> NodeList:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return NodeList(
        sn=tuple(r["sn"] for r in rows),
        cpu_milli=np.array([int(r["cpu_milli"]) for r in rows], np.int64),
        memory_mib=np.array([int(r["memory_mib"]) for r in rows], np.int64),
        gpu=np.array([int(r["gpu"]) for r in rows], np.int64),
        model=tuple(r["model"] for r in rows),
    )


def load_pods(path: Path) -> PodList:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    name = path.stem.removeprefix(POD_PREFIX)
    return PodList(
        name=name,
        pod_names=tuple(r["name"] for r in rows),
        cpu_milli=np.array([int(r["cpu_milli"]) for r in rows], np.int64),
        memory_mib=np.array([int(r["memory_mib"]) for r in rows], np.int64),
        num_gpu=np.array([int(r["num_gpu"]) for r in rows], np.int64),
        gpu_milli=np.array([int(r["gpu_milli"]) for r in rows], np.int64),
        gpu_spec=tuple((r.get("gpu_spec") or "").strip() for r in rows),
    )


def pod_list_names(traces: Path) -> list[str]:
    return sorted(p.stem.removeprefix(POD_PREFIX) for p in traces.glob(POD_PREFIX + "*.csv"))


def arrival_sequence(pods: PodList, capacity_milli: int, seed: int) -> np.ndarray:
    """Indices into ``pods`` in arrival order (the paper's step 2).

    Start from the whole list; while its total GPU request is below 1.3x capacity, append a
    pod drawn uniformly with replacement; while above, drop a random pod. Then shuffle.
    """
    rng = np.random.default_rng(seed)
    req = pods.gpu_request_milli
    target = TARGET_RATIO * capacity_milli
    idx = list(range(len(pods)))
    total = int(req.sum())
    while total < target:
        i = int(rng.integers(len(pods)))
        idx.append(i)
        total += int(req[i])
    while total > target:
        j = int(rng.integers(len(idx)))
        total -= int(req[idx[j]])
        idx[j] = idx[-1]
        idx.pop()
    seq = np.array(idx, np.int64)
    rng.shuffle(seq)
    return seq


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    policy: str
    seed: int
    mode: str  # "online" or "batch<N>"
    alloc_pct_100: float
    alloc_pct_130: float
    unalloc_gpus_130: float
    seconds: float
    sequence: np.ndarray  # pod indices in arrival order
    node: np.ndarray  # node index per arrival (-1 failed)
    gpus: np.ndarray  # cluster GPU index per arrival [n, 8]


def allocated_at(
    request_milli: np.ndarray, allocated_milli: np.ndarray, capacity_milli: int, pct: float
) -> int:
    """Milli-GPU allocated right after the arrival that brings arrived request to ``pct``%
    of capacity (the last arrival when the sequence never gets there). An integer, so the
    ratio and the unallocated GPUs derived from it are exact before they are rounded."""
    arrived = np.cumsum(request_milli)
    alloc = np.cumsum(allocated_milli)
    i = int(np.searchsorted(arrived, pct / 100.0 * capacity_milli - 1e-9))
    i = min(i, len(arrived) - 1)
    return int(alloc[i])


def replay(
    nodes: NodeList,
    pods: PodList,
    policy: str,
    seed: int,
    batch_size: int = 1,
    order: str = "file",
) -> ReplayResult:
    """Replay one seed. ``batch_size`` 1 is the paper's online protocol; larger sizes let
    the solver see that many arrivals at once (look-ahead, reported separately). ``order``
    is the node order (see ``node_order``); results always use the node list's indices."""
    import time

    perm = node_order(len(nodes.sn), seed, order)
    state = nodes.take(perm).state()
    capacity = 1000 * nodes.total_gpus
    seq = arrival_sequence(pods, capacity, seed)
    shapes = ShapeDistribution.from_batch(pods.batch())  # the workload's distribution
    batch = pods.batch(seq)
    t0 = time.perf_counter()
    if batch_size <= 1:
        res = solve(state, batch, policy, shapes=shapes)
        node, gpus = res.node, res.gpus
    else:
        node = np.full(len(seq), -1, np.int64)
        gpus = np.full((len(seq), 8), -1, np.int64)
        session = SolverSession(policy, shapes)  # solve()'s decisions, caches kept
        for lo in range(0, len(seq), batch_size):
            part = batch.take(slice(lo, lo + batch_size))
            res = session.solve(state, part, lookahead=True)
            node[lo : lo + batch_size] = res.node
            gpus[lo : lo + batch_size] = res.gpus
            state = res.state
    secs = time.perf_counter() - t0
    # back to the node list's node and GPU indices (the identity in file order)
    start_new = np.concatenate(([0], np.cumsum(nodes.gpu[perm])))
    start_old = np.concatenate(([0], np.cumsum(nodes.gpu)))
    gpus = np.asarray(gpus).copy()
    mask = gpus >= 0
    owner = np.searchsorted(start_new, gpus[mask], side="right") - 1
    gpus[mask] = start_old[perm[owner]] + (gpus[mask] - start_new[owner])
    node = np.where(np.asarray(node) >= 0, perm[np.maximum(node, 0)], -1)
    req = pods.gpu_request_milli[seq]
    allocated = np.where(node >= 0, req, 0)
    at100 = allocated_at(req, allocated, capacity, 100.0)
    at130 = allocated_at(req, allocated, capacity, 130.0)
    return ReplayResult(
        trace=pods.name,
        policy=policy,
        seed=seed,
        mode="online" if batch_size <= 1 else f"batch{batch_size}",
        alloc_pct_100=round(100.0 * at100 / capacity, 3),
        alloc_pct_130=round(100.0 * at130 / capacity, 3),
        unalloc_gpus_130=round((capacity - at130) / 1000.0, 3),  # exact: milli-GPU / 1000
        seconds=secs,
        sequence=seq,
        node=node,
        gpus=gpus,
    )
