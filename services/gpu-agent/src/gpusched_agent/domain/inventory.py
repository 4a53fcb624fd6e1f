"""GPU inventory: what a node has, from NVML readings or a simulated spec. Pure data.

Discovery (NVML, or a spec/YAML for simulation) produces `DeviceReading`s; `build_inventory`
turns them into schedulable `GpuInfo`s (a MIG instance is a device of its own) and decides
health, so real and simulated nodes share every step after discovery.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpusched_common.catalog import GPU_TYPES

UNREADABLE_UUID_PREFIX = "GPU-unreadable-"
"""The UUID of a GPU NVML cannot even name is this and its NVML index: it matches no
CUDA device and no later reading of the GPU once readable again."""


@dataclass(frozen=True)
class MigReading:
    """One MIG instance of a GPU, as NVML (or a simulated spec) reports it."""

    uuid: str
    profile: str
    """e.g. '3g.40gb'."""
    memory_total_mib: int
    memory_used_mib: int = 0


@dataclass(frozen=True)
class DeviceReading:
    """What discovery read about one physical GPU; `error` is set when NVML could not read it."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int = 0
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected_errors: int | None = None
    mig_enabled: bool = False
    mig_instances: tuple[MigReading, ...] = ()
    error: str | None = None
    gpu_type: str | None = None
    """Catalog type when known (simulation); else derived from `name` and memory."""


@dataclass(frozen=True)
class NodeReading:
    devices: tuple[DeviceReading, ...]
    driver_version: str | None = None
    cuda_version: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One schedulable device: a whole GPU or one MIG instance."""

    index: int
    uuid: str
    gpu_type: str
    """A key of `GPU_TYPES` (the performance model needs it); a MIG instance keeps its
    parent's type with its own memory size."""
    memory_total_mib: int
    healthy: bool = True
    name: str = ""
    memory_reserved_mib: int = 0
    """Used by something else when the agent started (other processes); never ours to give.
    0 where the agent's own engine holds that memory (`build_inventory`)."""
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected_errors: int | None = None
    mig_parent_uuid: str | None = None
    unhealthy_reason: str | None = None


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[GpuInfo, ...]
    driver_version: str | None = None
    cuda_version: str | None = None
    physical_gpus: int = field(default=0)


def catalog_type(nvml_name: str, memory_mib: int) -> str:
    """Map an NVML name ('NVIDIA H200') to the catalog type of the size the name gives
    ('NVIDIA A100-SXM4-80GB'), else with the closest memory size (a MIG GPU whose own
    memory NVML does not give has its instances' sum, less than the whole)."""
    family = next((f for f in ("H200", "H100", "A100", "L4") if f in nvml_name), None)
    candidates = [t for t in GPU_TYPES.values() if family and t.name.startswith(family + "-")]
    if not candidates:
        candidates = list(GPU_TYPES.values())
    named = [t for t in candidates if t.name.rsplit("-", 1)[-1] in nvml_name]  # '80GB'
    return min(named or candidates, key=lambda t: abs(t.memory_mib - memory_mib)).name


def health(reading: DeviceReading) -> str | None:
    """Why a GPU must get no work, or None when it is healthy."""
    if reading.error is not None:
        return f"NVML cannot read it: {reading.error}"
    if reading.ecc_uncorrected_errors:
        return f"{reading.ecc_uncorrected_errors} uncorrectable ECC errors"
    if reading.mig_enabled and not reading.mig_instances:
        return "MIG mode is on but no MIG instance exists (create instances with nvidia-smi mig)"
    return None


def build_inventory(node: NodeReading, reserve_memory_in_use: bool = True) -> Inventory:
    """Schedulable devices, numbered 0..n-1 in discovery order; a GPU in MIG mode contributes
    one device per MIG instance (sharing the parent's health). With `reserve_memory_in_use`
    the memory NVML reads as used is another process's (`memory_reserved_mib`), never given
    out; without it, it is the agent's own engine's (an inference server that pre-allocates
    its share of each GPU at start, as vLLM does), all of it gpusched's to schedule."""
    gpus: list[GpuInfo] = []
    for dev in node.devices:
        reason = health(dev)
        gpu_type = dev.gpu_type or catalog_type(dev.name, dev.memory_total_mib)
        common = dict(gpu_type=gpu_type, healthy=reason is None, name=dev.name,
                      utilization_pct=dev.utilization_pct, temperature_c=dev.temperature_c,
                      power_w=dev.power_w, ecc_uncorrected_errors=dev.ecc_uncorrected_errors,
                      unhealthy_reason=reason)
        if dev.mig_enabled and dev.mig_instances:
            for mig in dev.mig_instances:
                gpus.append(_mig(len(gpus), dev, mig, common, reserve_memory_in_use))
        else:
            gpus.append(GpuInfo(index=len(gpus), uuid=dev.uuid,
                                memory_total_mib=dev.memory_total_mib,
                                memory_reserved_mib=dev.memory_used_mib
                                if reserve_memory_in_use else 0,
                                **common))  # type: ignore[arg-type]
    return Inventory(tuple(gpus), node.driver_version, node.cuda_version, len(node.devices))


def _mig(index: int, dev: DeviceReading, mig: MigReading, common: dict,
         reserve_memory_in_use: bool) -> GpuInfo:
    return GpuInfo(index=index, uuid=mig.uuid, memory_total_mib=mig.memory_total_mib,
                   memory_reserved_mib=mig.memory_used_mib if reserve_memory_in_use else 0,
                   mig_parent_uuid=dev.uuid,
                   **{**common, "name": f"{dev.name} MIG {mig.profile}"})


_SPEC = re.compile(r"^\s*(\d+)\s*x\s*([A-Za-z0-9-]+)\s*$")


def simulated_reading(spec: str, node_id: str) -> NodeReading:
    """'8xH100-80GB', '2xA100-40GB,4xL4-24GB', or the path of a YAML file (see
    `parse_simulated_yaml`) -> readings as NVML would give them; ValueError says what is wrong."""
    if spec.strip().endswith((".yaml", ".yml")):
        return parse_simulated_yaml(Path(spec.strip()), node_id)
    entries: list[dict] = []
    for part in spec.split(","):
        match = _SPEC.match(part)
        if match is None:
            raise ValueError(f"simulated inventory '{part.strip()}' is not '<count>x<type>', "
                             "e.g. '8xH100-80GB' (or a .yaml file)")
        entries.append({"type": match[2], "count": int(match[1]), "_where": part.strip()})
    return _readings(entries, node_id)


def parse_simulated_yaml(path: Path, node_id: str) -> NodeReading:
    """A YAML inventory: `gpus: [{type: H100-80GB, count: 2, ecc_uncorrected_errors: 0,
    nvml_error: null, mig: [{profile: 3g.40gb, memory_mib: 40192}]}]`, plus optional
    `driver_version` and `cuda_version`."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ValueError(f"simulated inventory file {path} does not exist") from exc
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise ValueError(f"{path} must hold a mapping with a 'gpus' list")
    entries = [{**e, "_where": f"{path} gpus[{i}]"} if isinstance(e, dict) else e
               for i, e in enumerate(data["gpus"])]
    reading = _readings(entries, node_id)
    return NodeReading(reading.devices, str(data.get("driver_version") or "simulated"),
                       str(data.get("cuda_version") or "simulated"))


def _readings(entries: list, node_id: str) -> NodeReading:
    devices: list[DeviceReading] = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError(f"inventory entry {entry!r} must be a mapping with 'type'")
        where = entry.get("_where", "")
        name = str(entry.get("type", ""))
        gpu_type = GPU_TYPES.get(name)
        if gpu_type is None:
            raise ValueError(f"unknown GPU type '{name}' in '{where}'; known: "
                             f"{', '.join(GPU_TYPES)}")
        count = entry.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= 64:
            raise ValueError(f"GPU count {count} in '{where}' must be 1..64")
        migs = entry.get("mig") or []
        for _ in range(count):
            index = len(devices)
            uuid = f"GPU-sim-{node_id}-{index}"
            devices.append(DeviceReading(
                index=index, uuid=uuid, name=f"Simulated {name}", gpu_type=name,
                memory_total_mib=gpu_type.memory_mib,
                ecc_uncorrected_errors=int(entry.get("ecc_uncorrected_errors", 0)),
                error=entry.get("nvml_error"), mig_enabled=bool(migs),
                mig_instances=tuple(
                    MigReading(uuid=f"MIG-sim-{node_id}-{index}-{j}", profile=str(m["profile"]),
                               memory_total_mib=int(m["memory_mib"]))
                    for j, m in enumerate(migs))))
    return NodeReading(tuple(devices), "simulated", "simulated")


def parse_simulated(spec: str, node_id: str) -> list[GpuInfo]:
    """The schedulable devices of a simulated spec (see `simulated_reading`)."""
    return list(build_inventory(simulated_reading(spec, node_id)).gpus)
