"""GPU discovery through NVML (pynvml); None when NVML or a GPU is not there."""

from __future__ import annotations

import logging

from gpusched_agent.domain.inventory import GpuInfo
from gpusched_common.catalog import GPU_TYPES

log = logging.getLogger(__name__)


def discover() -> list[GpuInfo] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML not available (%s); use a simulated inventory", exc)
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            memory_mib = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            gpus.append(GpuInfo(index=index, uuid=uuid, gpu_type=catalog_type(name, memory_mib),
                                memory_total_mib=int(memory_mib), healthy=_healthy(handle)))
        return gpus or None
    finally:
        pynvml.nvmlShutdown()


def catalog_type(nvml_name: str, memory_mib: int) -> str:
    """Map an NVML name ('NVIDIA H200') to the catalog type with the closest memory size."""
    family = next((f for f in ("H200", "H100", "A100", "L4") if f in nvml_name), None)
    candidates = [t for t in GPU_TYPES.values() if family and t.name.startswith(family + "-")]
    if not candidates:
        candidates = list(GPU_TYPES.values())
    return min(candidates, key=lambda t: abs(t.memory_mib - memory_mib)).name


def _healthy(handle: object) -> bool:
    import pynvml

    try:
        errors = pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return errors == 0
    except pynvml.NVMLError_NotSupported:
        return True
    except pynvml.NVMLError:
        return False
