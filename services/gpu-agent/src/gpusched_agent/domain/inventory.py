"""GPU inventory: what a node has, from NVML discovery or a simulated spec. Pure data."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpusched_common.catalog import GPU_TYPES


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    gpu_type: str
    """A key of `GPU_TYPES` (the performance model needs it)."""
    memory_total_mib: int
    healthy: bool = True


_SPEC = re.compile(r"^\s*(\d+)\s*x\s*([A-Za-z0-9-]+)\s*$")


def parse_simulated(spec: str, node_id: str) -> list[GpuInfo]:
    """'8xH100-80GB' or '2xA100-40GB,4xL4-24GB' -> GPUs; ValueError says what is wrong."""
    gpus: list[GpuInfo] = []
    for part in spec.split(","):
        match = _SPEC.match(part)
        if match is None:
            raise ValueError(f"simulated inventory '{part.strip()}' is not '<count>x<type>', "
                             "e.g. '8xH100-80GB'")
        count, name = int(match[1]), match[2]
        gpu_type = GPU_TYPES.get(name)
        if gpu_type is None:
            raise ValueError(f"unknown GPU type '{name}'; known: {', '.join(GPU_TYPES)}")
        if not 1 <= count <= 64:
            raise ValueError(f"GPU count {count} in '{part.strip()}' must be 1..64")
        for _ in range(count):
            index = len(gpus)
            gpus.append(GpuInfo(index=index, uuid=f"GPU-sim-{node_id}-{index}",
                                gpu_type=name, memory_total_mib=gpu_type.memory_mib))
    return gpus
