"""A node's GPUs as the agent runs them: loaded models, reserved KV cache, active work.

Pure bookkeeping; the executor and adapters call it. Memory never over-commits: a
placement is admitted only when its KV cache (and its model's weights, when not loaded)
fit, after evicting models that nothing is using, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gpusched_agent.domain.gpu_share import ShareMeter
from gpusched_agent.domain.inventory import UNREADABLE_UUID_PREFIX, GpuInfo
from gpusched_common.catalog import SHARD_MARK, ModelSpec, weights_name
from gpusched_common.contracts import GpuState, LoadFailure, NodeState, Placement

GANG_MARK = "@"
"""Joins a gang's shard name and its GPUs in `held_weights`."""


def held_weights(model: str, indices: Sequence[int]) -> str:
    """What the agent holds a placement's weights as on each of its GPUs: `weights_name`,
    and for a gang's shard also the gang's GPUs in rank order (`<model>#tp2@1,2`). A
    shard is rank r of the gang that loaded it, so only a gang of the same GPUs can use it;
    the scheduler, which only steers work to where weights are, sees `weights_name`."""
    weights = weights_name(model, len(indices))
    return weights if len(indices) == 1 else f"{weights}{GANG_MARK}{','.join(map(str, indices))}"


def executor_gpu(held: str, gpu: int) -> int:
    """The GPU under which an executor keeps weights `held` on `gpu` (see `held_weights`):
    `gpu` itself for a whole model, the gang's first GPU for a shard (a gang runs there)."""
    if SHARD_MARK not in held:
        return gpu
    return int(held.rpartition(GANG_MARK)[2].split(",")[0])


def _reported(held: Sequence[str]) -> tuple[str, ...]:
    """`weights_name`s of held weights, each once."""
    return tuple(dict.fromkeys(
        h.rpartition(GANG_MARK)[0] if SHARD_MARK in h else h for h in held))


def _unread_reason(uuid: str) -> str:
    """Why a device that no reading has any more is unhealthy."""
    if uuid.startswith(UNREADABLE_UUID_PREFIX):  # readable again, under its real UUID
        return ("NVML could not read it when the agent started; restart the agent to use it")
    return ("NVML no longer reads it (fallen off the bus, or NVML cannot start); see "
            "nvidia-smi and the kernel log (Xid errors)")


@dataclass
class GpuSlot:
    info: GpuInfo
    loaded_mib: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Weights (`held_weights`: a model, or a gang's shard of one) -> MiB, least recently
    used first."""
    active: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Placement id -> (its weights, KV cache MiB)."""
    meter: ShareMeter = field(default_factory=ShareMeter)

    def free_mib(self) -> int:
        kv = sum(mib for _, mib in self.active.values())
        return (self.info.memory_total_mib - self.info.memory_reserved_mib
                - sum(self.loaded_mib.values()) - kv)

    def idle_models(self) -> list[str]:
        """Loaded weights nothing runs now, least recently used first (evictable)."""
        in_use = {m for m, _ in self.active.values()}
        return [m for m in self.loaded_mib if m not in in_use]

    def kv_cache_free_mib(self) -> int:
        """What a new request of a loaded model could reserve, evicting idle models."""
        return self.free_mib() + sum(self.loaded_mib[m] for m in self.idle_models())


@dataclass(frozen=True)
class Admitted:
    needs_load: bool
    evicted: tuple[tuple[int, str], ...]
    """(GPU index, weights) unloaded to make room; the executor must free them too."""


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass
class NodeModel:
    gpus: list[GpuSlot]

    driver_version: str | None = None
    cuda_version: str | None = None
    down: str | None = None
    """Why the executor's engine cannot run work now: every GPU is reported unhealthy with
    this reason and admits nothing until it is cleared."""

    @classmethod
    def from_inventory(cls, inventory: Sequence[GpuInfo], driver_version: str | None = None,
                       cuda_version: str | None = None) -> NodeModel:
        return cls([GpuSlot(info) for info in inventory], driver_version, cuda_version)

    def refresh(self, inventory: Sequence[GpuInfo]) -> bool:
        """Take new readings (health, telemetry) of the same devices; True when health
        changed. Devices are matched by UUID; unknown ones are ignored. A device keeps what
        it was at start (index, type, name, memory), as a reading of a GPU NVML cannot read
        has none of it. One missing from the readings (NVML lists it no more, or cannot
        start: `()`) is unhealthy until a reading has it again."""
        by_uuid = {g.uuid: g for g in inventory}
        changed = False
        for slot in self.gpus:
            old = slot.info
            new = by_uuid.get(old.uuid)
            if new is None:
                new = replace(old, healthy=False, unhealthy_reason=_unread_reason(old.uuid))
            changed |= new.healthy != old.healthy
            slot.info = replace(new, index=old.index, gpu_type=old.gpu_type, name=old.name,
                                memory_total_mib=old.memory_total_mib,
                                memory_reserved_mib=old.memory_reserved_mib,
                                mig_parent_uuid=old.mig_parent_uuid)
        return changed

    def admit(self, placement: Placement, model: ModelSpec) -> Admitted | Refused:
        """Reserve the placement on every GPU of its gang, or on none (all or nothing).
        A gang of n GPUs holds 1/n of the weights on each (tensor parallel), which only a
        gang of the same model on the same GPUs uses (`held_weights`). A request longer than
        the model's context is refused as the scheduler refuses it (it never reaches an
        agent from there: a placement does, from any Kafka client)."""
        request = placement.request
        if (tokens := request.prompt_token_count + request.max_tokens) \
                > model.context_limit_tokens:
            return Refused(f"prompt plus max_tokens ({tokens} tokens) exceeds {model.name}'s "
                           f"context limit of {model.context_limit_tokens}")
        indices = placement.gpu_indices
        if len(set(indices)) != len(indices):
            return Refused(f"GPU indices {indices} repeat")
        missing = [i for i in indices if not 0 <= i < len(self.gpus)]
        if missing:
            return Refused(f"node has no GPU {missing[0]}")
        if self.down is not None:
            return Refused(self.down)
        slots = [self.gpus[i] for i in indices]
        sick = [s.info.index for s in slots if not s.info.healthy]
        if sick:
            reason = self.gpus[sick[0]].info.unhealthy_reason or "unhealthy"
            return Refused(f"GPU {sick[0]} is unhealthy: {reason}")
        if any(placement.placement_id in s.active for s in slots):
            return Refused("placement already running")
        weight_mib = -(-model.weight_memory_mib // len(indices))
        weights = held_weights(model.name, indices)
        plan: list[tuple[GpuSlot, list[str]]] = []
        for slot in slots:
            need = placement.kv_cache_mib + (0 if weights in slot.loaded_mib else weight_mib)
            idle = [m for m in slot.idle_models() if m != weights]
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
        needs_load = any(weights not in slot.loaded_mib for slot in slots)
        evicted: list[tuple[int, str]] = []
        for slot, evict in plan:
            for name in evict:
                del slot.loaded_mib[name]
            evicted += [(slot.info.index, name) for name in evict]
            slot.loaded_mib[weights] = slot.loaded_mib.get(weights, weight_mib)
            slot.loaded_mib.move_to_end(weights)
            slot.active[placement.placement_id] = (weights, placement.kv_cache_mib)
        return Admitted(needs_load=needs_load, evicted=tuple(evicted))

    def finish(self, placement: Placement) -> None:
        for i in placement.gpu_indices:
            self.gpus[i].active.pop(placement.placement_id, None)

    def forget_weights(self, model: str, indices: Sequence[int]) -> bool:
        """The executor failed to load `model` for a placement on GPUs `indices`: stop
        counting (and reporting) its weights there (`held_weights`) on each of those GPUs
        where no running placement uses them. True when any went."""
        weights = held_weights(model, indices)
        forgotten = False
        for i in indices:
            slot = self.gpus[i]
            if weights in slot.loaded_mib and all(w != weights for w, _ in slot.active.values()):
                del slot.loaded_mib[weights]
                forgotten = True
        return forgotten

    def state(self, node_id: str, seq: int, started_at_ms: int, now_ms: int,
              status: str = "ready", executor: str | None = None,
              models: tuple[str, ...] | None = None,
              load_failures: tuple[LoadFailure, ...] | None = None) -> NodeState:
        return NodeState(
            node_id=node_id, status=status, seq=seq, started_at_ms=started_at_ms,  # type: ignore[arg-type]
            reported_at_ms=now_ms, driver_version=self.driver_version,
            cuda_version=self.cuda_version, executor=executor, models=models,
            load_failures=load_failures,
            gpus=tuple(
                GpuState(index=s.info.index, uuid=s.info.uuid, gpu_type=s.info.gpu_type,
                         # what gpusched may ever use: the scheduler rejects, or waits
                         # for, work by it (memory others held at start never frees)
                         memory_total_mib=s.info.memory_total_mib - s.info.memory_reserved_mib,
                         memory_free_mib=s.free_mib(),
                         healthy=s.info.healthy and self.down is None,
                         loaded_models=_reported(s.loaded_mib),
                         running_requests=len(s.active), name=s.info.name,
                         mig_parent_uuid=s.info.mig_parent_uuid,
                         kv_cache_free_mib=s.kv_cache_free_mib(),
                         idle_models=_reported(s.idle_models()) or None,
                         utilization_pct=s.info.utilization_pct,
                         temperature_c=s.info.temperature_c, power_w=s.info.power_w,
                         ecc_uncorrected_errors=s.info.ecc_uncorrected_errors,
                         unhealthy_reason=s.info.unhealthy_reason or self.down)
                for s in self.gpus),
            active_placement_ids=tuple(p for s in self.gpus for p in s.active),
        )
