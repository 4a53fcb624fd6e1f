"""ops/gpu-check on a machine without a GPU, through a stand-in pynvml: its NVML part (the
agent's own start-up discovery and heartbeat re-reads) runs, and it stops where CUDA is
needed, or earlier with the reason. The CUDA part runs only on a lent GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYNVML = '''
import json, os
from types import SimpleNamespace

class NVMLError(Exception):
    pass

class NVMLError_NotSupported(NVMLError):
    pass

NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0
NVML_TEMPERATURE_GPU, NVML_DEVICE_MIG_ENABLE = 0, 1
GPUS = json.loads(os.environ["FAKE_NVML_GPUS"])
MIB = 1024 * 1024

def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return len(GPUS)
def nvmlSystemGetDriverVersion(): return b"580.159.04"
def nvmlSystemGetCudaDriverVersion(): return 13000
def nvmlDeviceGetHandleByIndex(i): return GPUS[i]
def nvmlDeviceGetUUID(h): return h["uuid"]
def nvmlDeviceGetName(h): return h["name"]
def nvmlDeviceGetMemoryInfo(h):
    if h.get("lost"):
        raise NVMLError("GPU is lost")
    return SimpleNamespace(total=h["mib"] * MIB, used=615 * MIB)
def nvmlDeviceGetUtilizationRates(h):
    if "mig" in h:  # NVML: not supported on a GPU in MIG mode
        raise NVMLError_NotSupported()
    return SimpleNamespace(gpu=0, memory=0)
def nvmlDeviceGetTemperature(h, sensor): return 36
def nvmlDeviceGetPowerUsage(h):
    if h.get("no_power"):
        raise NVMLError_NotSupported()
    return 81241
def nvmlDeviceGetTotalEccErrors(h, kind, counter): return 0
def nvmlDeviceGetMigMode(h):
    if "mig" not in h:
        raise NVMLError_NotSupported()
    return (1, 1)
def nvmlDeviceGetMaxMigDeviceCount(h): return 7
def nvmlDeviceGetMigDeviceHandleByIndex(h, i):
    if i >= len(h["mig"]):
        raise NVMLError("Not Found")
    return h["mig"][i]
'''


def h200(i: int, **extra: object) -> dict:
    return {"uuid": f"GPU-9af514ac-{i}", "name": "NVIDIA H200", "mib": 143771, **extra}


def gpu_check(tmp_path: Path, gpus: list[dict]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    env = {**os.environ, "PYTHON": sys.executable, "FAKE_NVML_GPUS": json.dumps(gpus),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    env = {k: v for k, v in env.items() if not k.startswith("GPUSCHED_")}
    return subprocess.run(["bash", str(ROOT / "ops" / "gpu-check")], env=env, text=True,
                           capture_output=True, timeout=300)


def test_it_reads_the_gpus_as_the_agent_starts_and_stops_where_cuda_is_needed(
        tmp_path: Path) -> None:
    done = gpu_check(tmp_path, [h200(0), h200(1)])
    assert "NVML: driver 580.159.04, CUDA 13.0, 2 GPUs, 2 schedulable devices" in done.stdout
    assert "[1] NVIDIA H200 (H200-141GB) GPU-9af514ac-1: 143771 MiB, 615 MiB used" \
        in done.stdout
    assert "heartbeat re-read 2: 2 devices, health unchanged" in done.stdout
    assert "torch sees no CUDA device" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 3


def test_a_gpu_nvml_cannot_read_fails_it_with_the_reason(tmp_path: Path) -> None:
    """An unhealthy GPU, or a reading NVML leaves out, was printed and passed."""
    done = gpu_check(tmp_path, [h200(0, lost=True), h200(1, no_power=True)])
    assert done.returncode == 3, done.stdout + done.stderr  # it goes on to the healthy one
    assert "  - GPU 0 is unhealthy: NVML cannot read it: GPU is lost" in done.stdout
    assert "  - GPU 1: NVML gave no power" in done.stdout
    only_lost = gpu_check(tmp_path, [h200(0, lost=True)])
    assert "no healthy GPU: nothing to run work on" in only_lost.stdout, only_lost.stdout
    assert "GPU 0 is unhealthy: NVML cannot read it" in only_lost.stdout
    assert only_lost.returncode == 6


def test_a_gpu_in_mig_mode_passes_its_nvml_part(tmp_path: Path) -> None:
    """NVML gives no utilization in MIG mode: that is no failure of its instances."""
    instances = [{"uuid": f"MIG-{j}", "name": "NVIDIA H200 MIG 3g.71gb", "mib": 71680}
                 for j in range(2)]
    done = gpu_check(tmp_path, [h200(0, mig=instances)])
    assert "2 schedulable devices" in done.stdout, done.stdout + done.stderr
    assert "MIG of GPU-9af514ac-0" in done.stdout
    assert done.returncode == 3 and "  - " not in done.stdout, done.stdout


@pytest.mark.parametrize("gpus", [[]])
def test_no_gpu_exits_2_with_the_agents_own_reason(tmp_path: Path, gpus: list[dict]) -> None:
    done = gpu_check(tmp_path, gpus)
    assert "no GPU found through NVML" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 2
