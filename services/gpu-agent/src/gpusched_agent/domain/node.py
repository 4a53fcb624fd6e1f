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
        """Reserve the placement on every GPU of its gang, or on none (all or nothing).
        A gang of n GPUs holds 1/n of the weights on each (tensor parallel)."""
        indices = placement.gpu_indices
        if len(set(indices)) != len(indices):
            return Refused(f"GPU indices {indices} repeat")
        missing = [i for i in indices if i >= len(self.gpus)]
        if missing:
            return Refused(f"node has no GPU {missing[0]}")
        slots = [self.gpus[i] for i in indices]
        sick = [s.info.index for s in slots if not s.info.healthy]
        if sick:
            return Refused(f"GPU {sick[0]} is unhealthy")
        if any(placement.placement_id in s.active for s in slots):
            return Refused("placement already running")
        weight_mib = -(-model.weight_memory_mib // len(indices))
        plan: list[tuple[GpuSlot, list[str]]] = []
        for slot in slots:
            need = placement.kv_cache_mib + (0 if model.name in slot.loaded_mib else weight_mib)
            in_use = {m for m, _ in slot.active.values()}
            idle = [m for m in slot.loaded_mib if m not in in_use and m != model.name]
            evict: list[str] = []
            free = slot.free_mib()
            for name in idle:
                if free >= need:
                    break
                free += slot.loaded_mib[name]
                evict.append(name)
            if free < need:
                return Refused(f"GPU {slot.info.index} has {slot.free_mib()} MiB free "
                               f"(after evicting idle models: {free}), needs {need} MiB")
            plan.append((slot, evict))
        needs_load = any(model.name not in slot.loaded_mib for slot in slots)
        evicted: list[str] = []
        for slot, evict in plan:
            for name in evict:
                del slot.loaded_mib[name]
            evicted += evict
            slot.loaded_mib[model.name] = slot.loaded_mib.get(model.name, weight_mib)
            slot.loaded_mib.move_to_end(model.name)
            slot.active[placement.placement_id] = (model.name, placement.kv_cache_mib)
        return Admitted(needs_load=needs_load, evicted=tuple(evicted))

    def finish(self, placement: Placement) -> None:
        for i in placement.gpu_indices:
            self.gpus[i].active.pop(placement.placement_id, None)

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
