"""A node's GPUs as the agent runs them: loaded models, reserved KV cache, active work.

Pure bookkeeping; the executor and adapters call it. Memory never over-commits: a
placement is admitted only when its KV cache (and its model's weights, when not loaded)
fit, after evicting models that nothing is using, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gpusched_agent.domain.gpu_share import ShareMeter
from gpusched_agent.domain.inventory import GpuInfo
from gpusched_common.catalog import ModelSpec
from gpusched_common.contracts import GpuState, NodeState, Placement


@dataclass
class GpuSlot:
    info: GpuInfo
    loaded_mib: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Model name -> weight MiB, least recently used first."""
    active: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Placement id -> (model, KV cache MiB)."""
    meter: ShareMeter = field(default_factory=ShareMeter)

    def free_mib(self) -> int:
        kv = sum(mib for _, mib in self.active.values())
        return self.info.memory_total_mib - sum(self.loaded_mib.values()) - kv


@dataclass(frozen=True)
class Admitted:
    needs_load: bool
    evicted: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass
class NodeModel:
    gpus: list[GpuSlot]

    @classmethod
    def from_inventory(cls, inventory: list[GpuInfo]) -> NodeModel:
        return cls([GpuSlot(info) for info in inventory])

    def admit(self, placement: Placement, model: ModelSpec) -> Admitted | Refused:
        if placement.gpu_index >= len(self.gpus):
            return Refused(f"node has no GPU {placement.gpu_index}")
        slot = self.gpus[placement.gpu_index]
        if not slot.info.healthy:
            return Refused(f"GPU {placement.gpu_index} is unhealthy")
        if placement.placement_id in slot.active:
            return Refused("placement already running")
        loaded = model.name in slot.loaded_mib
        need = placement.kv_cache_mib + (0 if loaded else model.weight_memory_mib)
        evicted: list[str] = []
        if slot.free_mib() < need:
            in_use = {m for m, _ in slot.active.values()}
            for name in [m for m in slot.loaded_mib if m not in in_use and m != model.name]:
                if slot.free_mib() >= need:
                    break
                del slot.loaded_mib[name]
                evicted.append(name)
        if slot.free_mib() < need:
            return Refused(f"GPU {placement.gpu_index} has {slot.free_mib()} MiB free, "
                           f"needs {need} MiB")
        slot.loaded_mib[model.name] = model.weight_memory_mib
        slot.loaded_mib.move_to_end(model.name)
        slot.active[placement.placement_id] = (model.name, placement.kv_cache_mib)
        return Admitted(needs_load=not loaded, evicted=tuple(evicted))

    def finish(self, placement_id: str, gpu_index: int) -> None:
        self.gpus[gpu_index].active.pop(placement_id, None)

    def state(self, node_id: str, seq: int, started_at_ms: int, now_ms: int,
              status: str = "ready") -> NodeState:
        return NodeState(
            node_id=node_id, status=status, seq=seq, started_at_ms=started_at_ms,  # type: ignore[arg-type]
            reported_at_ms=now_ms,
            gpus=tuple(
                GpuState(index=s.info.index, uuid=s.info.uuid, gpu_type=s.info.gpu_type,
                         memory_total_mib=s.info.memory_total_mib, memory_free_mib=s.free_mib(),
                         healthy=s.info.healthy, loaded_models=tuple(s.loaded_mib),
                         running_requests=len(s.active))
                for s in self.gpus),
            active_placement_ids=tuple(p for s in self.gpus for p in s.active),
        )
