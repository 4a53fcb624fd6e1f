"""GPU discovery through NVML: reads every GPU (and MIG instance) into `DeviceReading`s.

The NVML module is passed in (`pynvml`, or a fake in tests), so discovery is testable
without a GPU; health and MIG expansion happen afterwards in `domain.inventory`.
"""

from __future__ import annotations

import logging
import warnings
from types import ModuleType
from typing import Any

from gpusched_agent.domain.inventory import (
    UNREADABLE_UUID_PREFIX,
    DeviceReading,
    MigReading,
    NodeReading,
)

log = logging.getLogger(__name__)
MIB = 1024 * 1024


def load_pynvml() -> ModuleType | None:
    try:
        with warnings.catch_warnings():  # the 'pynvml' shim warns that it is deprecated
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml
    except ImportError:
        return None
    return pynvml


def discover(nvml: Any) -> NodeReading | None:
    """Every GPU NVML sees, or None when NVML cannot start (no driver, no GPU). A GPU that
    NVML cannot read is still listed, with `error` set (it becomes unhealthy)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        log.info("NVML not available (%s); use a simulated inventory", exc)
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        devices = tuple(read_device(nvml, index) for index in range(count))
        if not devices:
            return None
        return NodeReading(devices, _text(_try(nvml, nvml.nvmlSystemGetDriverVersion)),
                           _cuda_version(_try(nvml, nvml.nvmlSystemGetCudaDriverVersion)))
    finally:
        nvml.nvmlShutdown()


def read_device(nvml: Any, index: int) -> DeviceReading:
    """GPU `index` as NVML reads it; never raises NVMLError. One NVML cannot read has `error`
    set, and keeps its UUID when NVML still gives that (NVML_ERROR_GPU_IS_LOST comes from
    the memory read of a GPU fallen off the bus), so the agent knows which GPU went; one it
    cannot even name gets `UNREADABLE_UUID_PREFIX` and its index."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    except nvml.NVMLError as exc:
        return DeviceReading(index=index, uuid=f"{UNREADABLE_UUID_PREFIX}{index}",
                             name="unreadable", memory_total_mib=0, error=_why(exc))
    mig_enabled, migs, mig_error = _mig(nvml, handle)
    name = "unreadable"
    try:
        name = _text(nvml.nvmlDeviceGetName(handle))
        # in MIG mode NVML gives the parent's memory to a privileged process only; the
        # agent schedules its instances' memory, not the parent's
        memory = (_try(nvml, nvml.nvmlDeviceGetMemoryInfo, handle) if mig_enabled
                  else nvml.nvmlDeviceGetMemoryInfo(handle))
    except nvml.NVMLError as exc:
        return DeviceReading(index=index, uuid=uuid, name=name, memory_total_mib=0,
                             error=_why(exc))
    total_mib, used_mib = ((int(memory.total // MIB), int(memory.used // MIB))
                           if memory is not None else
                           (sum(m.memory_total_mib for m in migs),
                            sum(m.memory_used_mib for m in migs)))
    util = _try(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    temperature = _try(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    power_mw = _try(nvml, nvml.nvmlDeviceGetPowerUsage, handle)
    ecc, ecc_error = _ecc(nvml, handle)
    return DeviceReading(
        index=index, uuid=uuid, name=name, memory_total_mib=total_mib,
        memory_used_mib=used_mib,
        utilization_pct=float(util.gpu) if util is not None else None,
        temperature_c=float(temperature) if temperature is not None else None,
        power_w=power_mw / 1000.0 if power_mw is not None else None,
        ecc_uncorrected_errors=ecc, mig_enabled=mig_enabled, mig_instances=migs,
        error="; ".join(e for e in (ecc_error, mig_error) if e) or None)


def _ecc(nvml: Any, handle: Any) -> tuple[int | None, str | None]:
    """(uncorrectable volatile ECC errors, or None where ECC is unsupported; read error)."""
    try:
        return int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)), None
    except nvml.NVMLError_NotSupported:
        return None, None
    except nvml.NVMLError as exc:
        return None, f"ECC counters unreadable: {exc}"


def _mig(nvml: Any, handle: Any) -> tuple[bool, tuple[MigReading, ...], str | None]:
    """(MIG mode on, the instances NVML could read, why some could not: their GPU is then
    unhealthy, instances and all); never raises NVMLError."""
    mode = _try(nvml, nvml.nvmlDeviceGetMigMode, handle)
    if mode is None or mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
        return False, (), None
    instances, errors = [], []
    for slot in range(_try(nvml, nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
        mig = _try(nvml, nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        if mig is None:
            continue  # an empty slot
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(mig)
            uuid = _text(nvml.nvmlDeviceGetUUID(mig))
        except nvml.NVMLError as exc:
            errors.append(f"MIG instance {slot} unreadable: {_why(exc)}")
            continue
        name = _text(_try(nvml, nvml.nvmlDeviceGetName, mig) or "MIG")
        instances.append(MigReading(uuid=uuid, profile=name.rsplit(" ", 1)[-1],
                                    memory_total_mib=int(memory.total // MIB),
                                    memory_used_mib=int(memory.used // MIB)))
    return True, tuple(instances), "; ".join(errors) or None


def _try(nvml: Any, func: Any, *args: Any) -> Any:
    """NVML's value, or None when this GPU or driver does not support the query."""
    try:
        return func(*args)
    except nvml.NVMLError:
        return None


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(value: int | None) -> str | None:
    """NVML gives 12040 for CUDA 12.4."""
    return None if value is None else f"{value // 1000}.{value % 1000 // 10}"
