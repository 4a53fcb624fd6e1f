"""Struct-of-arrays cluster snapshot and work batch the placement solver works on.

Builders take plain per-node/per-GPU/per-unit lists; everything the kernels read is a
NumPy array. Names are interned to small integer codes (GPU types, models, tenants).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

WHOLE_GPU_MILLI = 1000
"""A GPU's compute share in milli-GPU; a unit asking for 1000 needs a fully free GPU."""

MAX_GANG_GPUS = 8
"""Largest gang (GPUs of one unit, all on one node) the solver accepts."""

ANY_GPU_TYPE = np.int64(-1)
"""Type mask meaning "any GPU type" (all bits set)."""

MAX_GPU_TYPES = 62
"""GPU types are a bit set in an int64; more distinct type names than this is a fault."""

DEFAULT_MODEL_SLOTS = 8
"""Loaded-model ids remembered per GPU; a full GPU forgets new loads (affinity is a hint)."""


class GpuSpec(NamedTuple):
    """One GPU as the cluster reports it (input to ``ClusterState.from_nodes``). A named
    tuple: the scheduler builds one per GPU of every node that changed, every cycle."""

    type_name: str
    milli_free: int = WHOLE_GPU_MILLI
    memory_free_mib: int = 0
    memory_total_mib: int | None = None
    healthy: bool = True
    loaded_models: tuple[str, ...] = ()

    @property
    def memory_capacity_mib(self) -> int:
        """The GPU's memory size: its total when reported, else its free memory."""
        return self.memory_free_mib if self.memory_total_mib is None else self.memory_total_mib


@dataclass(frozen=True)
class NodeSpec:
    """One node: free CPU/memory now (and totals, defaulting to the free values) and GPUs."""

    node_id: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuSpec, ...] = ()
    cpu_total_milli: int | None = None
    memory_total_mib: int | None = None


@dataclass(frozen=True, eq=False)
class ClusterState:
    """Immutable-by-convention snapshot: node arrays (N), GPU arrays (G) in node order.

    GPUs of node ``n`` are ``node_gpu_start[n]:node_gpu_start[n+1]``. ``gpu_models[g]`` holds
    model codes loaded on GPU ``g`` (-1 = empty slot). Solvers never mutate a state they are
    given; ``solve`` returns the state after its placements.
    """

    node_ids: tuple[str, ...]
    node_cpu_free_milli: np.ndarray  # int64[N]
    node_mem_free_mib: np.ndarray  # int64[N]
    node_cpu_total_milli: np.ndarray  # int64[N]
    node_mem_total_mib: np.ndarray  # int64[N]
    node_gpu_start: np.ndarray  # int64[N+1]
    gpu_type: np.ndarray  # int64[G], code into type_names
    gpu_milli_free: np.ndarray  # int64[G]
    gpu_mem_free_mib: np.ndarray  # int64[G]
    gpu_mem_total_mib: np.ndarray  # int64[G]
    gpu_healthy: np.ndarray  # bool[G]
    gpu_models: np.ndarray  # int64[G, K]
    type_names: tuple[str, ...]
    model_names: tuple[str, ...] = ()

    # ---- builders -------------------------------------------------------------------
    @classmethod
    def from_nodes(
        cls, nodes: Iterable[NodeSpec], model_slots: int = DEFAULT_MODEL_SLOTS
    ) -> ClusterState:
        """Build from plain node/GPU records (order is kept: node index = list position)."""
        nodes = list(nodes)
        type_index: dict[str, int] = {}
        model_index: dict[str, int] = {}
        gpus = [g for n in nodes for g in n.gpus]
        for g in gpus:
            type_index.setdefault(g.type_name, len(type_index))
            for m in g.loaded_models:
                model_index.setdefault(m, len(model_index))
        if len(type_index) > MAX_GPU_TYPES:
            raise ValueError(
                f"{len(type_index)} distinct GPU types; the solver supports at most "
                f"{MAX_GPU_TYPES}. Merge type names that are interchangeable."
            )
        slots = max(model_slots, max((len(g.loaded_models) for g in gpus), default=0))
        gpu_models = np.full((len(gpus), slots), -1, np.int64)
        for i, g in enumerate(gpus):
            for j, m in enumerate(g.loaded_models):
                gpu_models[i, j] = model_index[m]
        counts = np.array([len(n.gpus) for n in nodes], np.int64)
        start = np.zeros(len(nodes) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        mem_free = np.array([g.memory_free_mib for g in gpus], np.int64)
        return cls(
            node_ids=tuple(n.node_id for n in nodes),
            node_cpu_free_milli=np.array([n.cpu_milli for n in nodes], np.int64),
            node_mem_free_mib=np.array([n.memory_mib for n in nodes], np.int64),
            node_cpu_total_milli=np.array(
                [n.cpu_milli if n.cpu_total_milli is None else n.cpu_total_milli for n in nodes],
                np.int64,
            ),
            node_mem_total_mib=np.array(
                [n.memory_mib if n.memory_total_mib is None else n.memory_total_mib for n in nodes],
                np.int64,
            ),
            node_gpu_start=start,
            gpu_type=np.array([type_index[g.type_name] for g in gpus], np.int64),
            gpu_milli_free=np.array([g.milli_free for g in gpus], np.int64),
            gpu_mem_free_mib=mem_free,
            gpu_mem_total_mib=np.array([g.memory_capacity_mib for g in gpus], np.int64),
            gpu_healthy=np.array([g.healthy for g in gpus], np.bool_),
            gpu_models=gpu_models,
            type_names=tuple(type_index),
            model_names=tuple(model_index),
        )

    @classmethod
    def from_arrays(
        cls,
        node_ids: Sequence[str],
        node_cpu_milli: Sequence[int],
        node_mem_mib: Sequence[int],
        node_gpu_count: Sequence[int],
        node_gpu_type: Sequence[str],
        gpu_mem_mib: Sequence[int] | int = 0,
    ) -> ClusterState:
        """Fast builder for empty homogeneous-per-node clusters (traces, benchmarks)."""
        type_names = tuple(dict.fromkeys(node_gpu_type))
        code = {t: i for i, t in enumerate(type_names)}
        counts = np.asarray(node_gpu_count, np.int64)
        start = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        n_gpus = int(start[-1])
        gpu_type = np.repeat(np.array([code[t] for t in node_gpu_type], np.int64), counts)
        mem = np.broadcast_to(np.asarray(gpu_mem_mib, np.int64), (n_gpus,)).copy()
        cpu = np.asarray(node_cpu_milli, np.int64).copy()
        node_mem = np.asarray(node_mem_mib, np.int64).copy()
        return cls(
            node_ids=tuple(node_ids),
            node_cpu_free_milli=cpu,
            node_mem_free_mib=node_mem,
            node_cpu_total_milli=cpu.copy(),
            node_mem_total_mib=node_mem.copy(),
            node_gpu_start=start,
            gpu_type=gpu_type,
            gpu_milli_free=np.full(n_gpus, WHOLE_GPU_MILLI, np.int64),
            gpu_mem_free_mib=mem,
            gpu_mem_total_mib=mem.copy(),
            gpu_healthy=np.ones(n_gpus, np.bool_),
            gpu_models=np.full((n_gpus, DEFAULT_MODEL_SLOTS), -1, np.int64),
            type_names=type_names,
        )

    # ---- views ----------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.node_cpu_free_milli)

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_type)

    def copy(self) -> ClusterState:
        """Deep copy of every array (names are immutable tuples and shared)."""
        return replace(
            self,
            **{
                k: getattr(self, k).copy()
                for k in self.__dataclass_fields__
                if isinstance(getattr(self, k), np.ndarray)
            },
        )

    def with_gpus(self, changed: dict[int, GpuSpec]) -> ClusterState | None:
        """A copy with the GPUs at the given indices rebuilt from their specs, or None when
        that cannot keep the code tables (a new GPU type or model name, more models than
        slots): build afresh then. Decisions on it equal those on a fresh build; only the
        code tables may hold names no GPU uses any more."""
        types = {t: i for i, t in enumerate(self.type_names)}
        models = {m: i for i, m in enumerate(self.model_names)}
        slots = self.gpu_models.shape[1]
        for g in changed.values():
            if g.type_name not in types or len(g.loaded_models) > slots \
                    or any(m not in models for m in g.loaded_models):
                return None
        out = self.copy()
        rows = np.fromiter(changed, np.int64, len(changed))
        gpus = changed.values()
        out.gpu_type[rows] = [types[g.type_name] for g in gpus]
        out.gpu_milli_free[rows] = [g.milli_free for g in gpus]
        out.gpu_mem_free_mib[rows] = [g.memory_free_mib for g in gpus]
        out.gpu_mem_total_mib[rows] = [g.memory_capacity_mib for g in gpus]
        out.gpu_healthy[rows] = [g.healthy for g in gpus]
        out.gpu_models[rows] = -1  # empty slots
        for row, g in changed.items():
            out.gpu_models[row, : len(g.loaded_models)] = [models[m] for m in g.loaded_models]
        return out

    def with_models(self, model_names: tuple[str, ...]) -> ClusterState:
        """Same arrays with a longer model-name table (``model_names`` extends the old one)."""
        assert model_names[: len(self.model_names)] == self.model_names
        return replace(self, model_names=model_names)

    def type_mask(self, allowed: Iterable[str] | None) -> int:
        """Bit set of type codes for allowed type names (unknown names match nothing)."""
        if allowed is None:
            return int(ANY_GPU_TYPE)
        mask = 0
        for name in allowed:
            if name in self.type_names:
                mask |= 1 << self.type_names.index(name)
        return mask

    def nbytes(self) -> int:
        """Bytes held by the state's arrays."""
        return sum(
            getattr(self, k).nbytes
            for k in self.__dataclass_fields__
            if isinstance(getattr(self, k), np.ndarray)
        )


@dataclass(frozen=True, eq=False)
class WorkBatch:
    """Pending work units, one row each, in the order they should be considered.

    ``type_set[u]`` indexes ``type_sets`` (-1 = any GPU type); ``model[u]`` indexes
    ``model_names`` (-1 = no model); ``tenant[u]`` indexes ``tenant_names``. Per-GPU fields
    (``gpu_milli``, ``gpu_mem_mib``, ``model_weight_mib``) apply to each of ``num_gpu`` GPUs.
    """

    num_gpu: np.ndarray  # int64[U], 0..8
    gpu_milli: np.ndarray  # int64[U], 0..1000 per GPU
    gpu_mem_mib: np.ndarray  # int64[U], per GPU
    cpu_milli: np.ndarray  # int64[U]
    mem_mib: np.ndarray  # int64[U]
    type_set: np.ndarray  # int64[U]
    model: np.ndarray  # int64[U]
    model_weight_mib: np.ndarray  # int64[U], per GPU, charged only where not loaded
    priority: np.ndarray  # int64[U], larger = more important
    tenant: np.ndarray  # int64[U]
    type_sets: tuple[frozenset[str], ...] = ()
    model_names: tuple[str, ...] = ()
    tenant_names: tuple[str, ...] = ()
    unit_ids: tuple[str, ...] | None = None
    _extra: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.num_gpu)

    @classmethod
    def from_units(
        cls,
        num_gpu: Sequence[int],
        gpu_milli: Sequence[int],
        cpu_milli: Sequence[int],
        mem_mib: Sequence[int],
        gpu_mem_mib: Sequence[int] | None = None,
        allowed_gpu_types: Sequence[Iterable[str] | None] | None = None,
        model_id: Sequence[str | None] | None = None,
        model_weight_mib: Sequence[int] | None = None,
        priority: Sequence[int] | None = None,
        tenant: Sequence[str | None] | None = None,
        unit_ids: Sequence[str] | None = None,
    ) -> WorkBatch:
        """Build from per-unit columns; omitted optional columns take neutral defaults."""
        n = len(num_gpu)

        def col(values, default=0):
            if values is None:
                return np.full(n, default, np.int64)
            arr = np.asarray(values, np.int64)
            if arr.shape != (n,):
                raise ValueError(f"column has {arr.shape} values, expected {n}")
            return arr.copy()

        type_sets: dict[frozenset[str], int] = {}
        type_set = np.full(n, -1, np.int64)
        if allowed_gpu_types is not None:
            for i, allowed in enumerate(allowed_gpu_types):
                if allowed is not None:
                    key = frozenset(allowed)
                    type_set[i] = type_sets.setdefault(key, len(type_sets))
        model_codes, model_names = _intern(model_id, n)
        tenant_codes, tenant_names = _intern(tenant, n)
        return cls(
            num_gpu=col(num_gpu),
            gpu_milli=col(gpu_milli),
            gpu_mem_mib=col(gpu_mem_mib),
            cpu_milli=col(cpu_milli),
            mem_mib=col(mem_mib),
            type_set=type_set,
            model=model_codes,
            model_weight_mib=col(model_weight_mib),
            priority=col(priority),
            tenant=tenant_codes,
            type_sets=tuple(type_sets),
            model_names=model_names,
            tenant_names=tenant_names,
            unit_ids=None if unit_ids is None else tuple(unit_ids),
        )

    def take(self, index: np.ndarray | slice) -> WorkBatch:
        """Rows ``index`` as a new batch sharing the name tables."""
        arrays = {
            k: getattr(self, k)[index]
            for k in self.__dataclass_fields__
            if isinstance(getattr(self, k), np.ndarray)
        }
        ids = None
        if self.unit_ids is not None:
            ids = tuple(np.asarray(self.unit_ids, dtype=object)[index])
        return replace(self, unit_ids=ids, _extra={}, **arrays)


def _intern(values: Sequence[str | None] | None, n: int) -> tuple[np.ndarray, tuple[str, ...]]:
    codes = np.full(n, -1, np.int64)
    names: dict[str, int] = {}
    if values is not None:
        for i, v in enumerate(values):
            if v is not None:
                codes[i] = names.setdefault(v, len(names))
    return codes, tuple(names)
