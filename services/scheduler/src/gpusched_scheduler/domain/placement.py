"""First placement policy of the live scheduler: best fit by GPU memory, model affinity first.

Pure: takes the free GPUs and one request, returns `Placed` or `Unschedulable` (values).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched_common.catalog import ModelSpec
from gpusched_scheduler.domain.cluster import FreeGpu


@dataclass(frozen=True)
class Placed:
    node_id: str
    gpu_index: int
    kv_cache_mib: int
    memory_mib: int
    """What this placement takes from the GPU: KV cache, plus weights when not loaded."""


@dataclass(frozen=True)
class Unschedulable:
    reason: str
    permanent: bool = False
    """True when no GPU of the fleet as it is could ever hold it (not worth waiting for)."""


def place_one(request_tokens: int, model: ModelSpec, gpus: list[FreeGpu]) -> Placed | Unschedulable:
    """Pick the GPU that leaves the least memory free after the placement, preferring GPUs
    where the model is already loaded (no load, no weight memory)."""
    kv_mib = model.kv_cache_mib(request_tokens)
    best: tuple[tuple[int, int], FreeGpu, int] | None = None
    could_ever = False
    for g in gpus:
        loaded = model.name in g.models
        need = kv_mib if loaded else kv_mib + model.weight_memory_mib
        if g.gpu.memory_total_mib >= kv_mib + model.weight_memory_mib:
            could_ever = True
        if g.free_mib < need:
            continue
        key = (0 if loaded else 1, g.free_mib - need)
        if best is None or key < best[0]:
            best = (key, g, need)
    if best is None:
        if not gpus:
            return Unschedulable("no ready node with a healthy GPU")
        if not could_ever:
            return Unschedulable(
                f"{model.name} needs {kv_mib + model.weight_memory_mib} MiB on one GPU "
                f"(weights {model.weight_memory_mib} + KV cache {kv_mib}); no GPU has that much",
                permanent=True)
        return Unschedulable("waiting for GPU memory")
    _, g, need = best
    return Placed(node_id=g.node_id, gpu_index=g.gpu.index, kv_cache_mib=kv_mib, memory_mib=need)
