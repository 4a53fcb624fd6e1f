"""GPU inventory: NVML discovery through an injected fake NVML module, simulated specs and
YAML files, MIG instances as devices of their own, health, and node state on refresh."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpusched_agent.adapters import nvml
from gpusched_agent.domain.inventory import build_inventory, simulated_reading
from gpusched_agent.domain.node import NodeModel, Refused
from gpusched_common.catalog import load_models
from gpusched_common.contracts import InferenceRequest, Placement

MIB = 1024 * 1024
CATALOG = load_models(Path(__file__).resolve().parents[2] / "config")
SMALL = CATALOG.get("qwen2.5-1.5b")


class FakeNvml:
    """The slice of pynvml the agent calls, over a list of GPU dicts."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_TEMPERATURE_GPU = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[dict], init_error: bool = False) -> None:
        self.gpus, self.init_error, self.shutdowns = gpus, init_error, 0

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802
        return b"560.35.03"

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        return 12060

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:  # noqa: N802
        if self.gpus[i].get("broken"):
            raise self.NVMLError("GPU is lost")
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: dict) -> str:  # noqa: N802
        if "uuid_error" in h:
            raise self.NVMLError(h["uuid_error"])
        return h["uuid"]

    def nvmlDeviceGetName(self, h: dict) -> str:  # noqa: N802
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h: dict) -> SimpleNamespace:  # noqa: N802
        if "memory_error" in h:  # NVML_ERROR_GPU_IS_LOST; NO_PERMISSION on a MIG parent
            raise self.NVMLError(h["memory_error"])
        return SimpleNamespace(total=h["mib"] * MIB, used=h.get("used", 0) * MIB)

    def nvmlDeviceGetUtilizationRates(self, h: dict) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=h.get("util", 0), memory=0)

    def nvmlDeviceGetTemperature(self, h: dict, sensor: int) -> int:  # noqa: N802
        return h.get("temp", 40)

    def nvmlDeviceGetPowerUsage(self, h: dict) -> int:  # noqa: N802
        return h.get("power_mw", 100_000)

    def nvmlDeviceGetTotalEccErrors(self, h: dict, kind: int, counter: int) -> int:  # noqa: N802
        if "ecc" not in h:
            raise self.NVMLError_NotSupported()
        return h["ecc"]

    def nvmlDeviceGetMigMode(self, h: dict) -> tuple[int, int]:  # noqa: N802
        if "mig" not in h:
            raise self.NVMLError_NotSupported()
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: dict) -> int:  # noqa: N802
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: dict, i: int) -> dict:  # noqa: N802
        if i >= len(h["mig"]):
            raise self.NVMLError("Not Found")
        return h["mig"][i]


def h100(i: int, **extra: object) -> dict:
    return {"uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "mib": 81559, **extra}


def test_nvml_discovery_reads_every_field_and_versions() -> None:
    fake = FakeNvml([h100(0, used=500, util=37, temp=61, power_mw=312_000, ecc=0)])
    reading = nvml.discover(fake)
    assert reading is not None and fake.shutdowns == 1
    assert (reading.driver_version, reading.cuda_version) == ("560.35.03", "12.6")
    [gpu] = build_inventory(reading).gpus
    assert (gpu.uuid, gpu.gpu_type, gpu.memory_total_mib) == ("GPU-0", "H100-80GB", 81559)
    assert (gpu.utilization_pct, gpu.temperature_c, gpu.power_w) == (37, 61, 312)
    assert gpu.healthy and gpu.ecc_uncorrected_errors == 0 and gpu.memory_reserved_mib == 500
    node = NodeModel.from_inventory([gpu])
    assert node.gpus[0].free_mib() == 81559 - 500  # memory others use is never ours to give
    # nor reported as the GPU's total: the scheduler judges what can ever fit by it (it
    # waited for good, holding lower classes back, for a request only the whole GPU holds)
    [reported] = node.state("n", 1, 0, 0).gpus
    assert reported.memory_total_mib == 81559 - 500


@pytest.mark.parametrize("executor,admits", [("openai", True), ("torch", False),
                                              ("simulated", False)])
def test_memory_an_openai_nodes_own_engine_holds_is_offered(executor, admits) -> None:
    """vLLM pre-allocates 90% of each GPU (gpu_memory_utilization) and NVML reads it as used:
    taken as another process's, an H100 under the openai executor offered ~8 GB and refused
    llama-3.1-8b, or not, by whether vLLM or the agent started first. That engine is the
    one the agent drives; the other executors run in the agent, and memory in use at start
    stays someone else's."""
    from gpusched_agent.main import discover_inventory
    from gpusched_agent.settings import AgentSettings

    settings = AgentSettings(executor=executor, openai_base_url="http://127.0.0.1:8000",
                             node_id="n")
    inventory, _ = discover_inventory(settings, FakeNvml([h100(0, used=81559 * 9 // 10)]))
    node = NodeModel.from_inventory(inventory.gpus)
    llama = CATALOG.get("llama-3.1-8b")
    request = placement("p", 0).request.model_copy(update={"model": llama.name})
    admitted = node.admit(placement("p", 0).model_copy(update={"request": request}), llama)
    assert isinstance(admitted, Refused) is not admits, admitted
    [reported] = node.state("n", 1, 0, 0).gpus
    assert reported.memory_total_mib == (81559 if admits else 81559 - 81559 * 9 // 10)


def test_nvml_not_available_gives_none() -> None:
    assert nvml.discover(FakeNvml([], init_error=True)) is None
    assert nvml.discover(FakeNvml([])) is None


def test_ecc_errors_and_unreadable_gpus_are_unhealthy_and_get_no_work() -> None:
    fake = FakeNvml([h100(0, ecc=3), h100(1, broken=True), h100(2)])
    inventory = build_inventory(nvml.discover(fake))
    assert [g.healthy for g in inventory.gpus] == [False, False, True]
    assert "uncorrectable ECC" in inventory.gpus[0].unhealthy_reason
    assert "cannot read" in inventory.gpus[1].unhealthy_reason
    node = NodeModel.from_inventory(inventory.gpus)
    for index in (0, 1):
        refused = node.admit(placement("p", index), SMALL)
        assert isinstance(refused, Refused) and "unhealthy" in refused.reason
    state = node.state("n", 1, 0, 0)
    assert [g.healthy for g in state.gpus] == [False, False, True]
    assert state.gpus[0].unhealthy_reason and state.gpus[2].unhealthy_reason is None


def test_mig_instances_are_devices_of_their_own() -> None:
    migs = [{"uuid": f"MIG-{j}", "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "mib": 40192}
            for j in range(2)]
    fake = FakeNvml([h100(0, mig=migs), h100(1)])
    inventory = build_inventory(nvml.discover(fake))
    assert [g.uuid for g in inventory.gpus] == ["MIG-0", "MIG-1", "GPU-1"]
    assert [g.index for g in inventory.gpus] == [0, 1, 2]
    assert [g.memory_total_mib for g in inventory.gpus] == [40192, 40192, 81559]
    assert inventory.gpus[0].mig_parent_uuid == "GPU-0" and "3g.40gb" in inventory.gpus[0].name
    state = NodeModel.from_inventory(inventory.gpus).state("n", 1, 0, 0)
    assert state.gpus[1].mig_parent_uuid == "GPU-0" and state.gpus[2].mig_parent_uuid is None


def test_a_mig_gpu_whose_own_memory_nvml_keeps_from_the_agent_is_still_used() -> None:
    """NVML gives a GPU's memory in MIG mode to a privileged process only: an agent without
    root lost the whole GPU ('NVML cannot read it', none of its instances listed)."""
    migs = [{"uuid": f"MIG-{j}", "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "mib": 40192,
             "used": 100 * j} for j in range(2)]
    reading = nvml.discover(FakeNvml([h100(0, mig=migs, memory_error="Insufficient "
                                                                     "Permissions")]))
    [gpu] = reading.devices
    assert (gpu.uuid, gpu.error, gpu.memory_total_mib, gpu.memory_used_mib) == (
        "GPU-0", None, 2 * 40192, 100)
    inventory = build_inventory(reading)
    assert [(g.uuid, g.healthy, g.gpu_type) for g in inventory.gpus] == [
        ("MIG-0", True, "H100-80GB"), ("MIG-1", True, "H100-80GB")]
    assert [g.memory_reserved_mib for g in inventory.gpus] == [0, 100]
    # one 40 GB instance of an 80 GB A100: the name says which A100 it is (its price)
    a100 = {"uuid": "GPU-a", "name": "NVIDIA A100-SXM4-80GB", "mib": 81920,
            "memory_error": "Insufficient Permissions",
            "mig": [{"uuid": "MIG-a", "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "mib": 40192}]}
    [instance] = build_inventory(nvml.discover(FakeNvml([a100]))).gpus
    assert (instance.uuid, instance.gpu_type, instance.memory_total_mib) == (
        "MIG-a", "A100-80GB", 40192)


@pytest.mark.parametrize("fault", ["memory_error", "uuid_error"])
def test_a_mig_instance_nvml_cannot_read_makes_its_gpu_unhealthy_not_the_node(fault) -> None:
    """One MIG instance NVML could not read raised out of discovery: the agent did not start
    (a raw traceback), and once started every heartbeat's read failed, for all its GPUs."""
    migs = [{"uuid": f"MIG-{j}", "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "mib": 40192}
            for j in range(2)]
    node = NodeModel.from_inventory(build_inventory(nvml.discover(
        FakeNvml([h100(0, mig=migs), h100(1)]))).gpus)
    migs[1][fault] = "Insufficient Permissions"
    inventory = build_inventory(nvml.discover(FakeNvml([h100(0, mig=migs), h100(1)])))
    assert [(g.uuid, g.healthy) for g in inventory.gpus] == [("MIG-0", False), ("GPU-1", True)]
    assert inventory.gpus[0].unhealthy_reason == (
        "NVML cannot read it: MIG instance 1 unreadable: Insufficient Permissions")
    assert node.refresh(inventory.gpus) is True
    assert [g.info.healthy for g in node.gpus] == [False, False, True]


@pytest.mark.parametrize("spec,types,memory", [
    ("8xH100-80GB", ["H100-80GB"] * 8, 81559 * 8),
    ("2xA100-40GB,4xL4-24GB", ["A100-40GB"] * 2 + ["L4-24GB"] * 4, 2 * 40960 + 4 * 23034),
    ("1xH200-141GB", ["H200-141GB"], 143771),
])
def test_simulated_shapes_produce_the_right_node_state(spec, types, memory) -> None:
    inventory = build_inventory(simulated_reading(spec, "n1"))
    state = NodeModel.from_inventory(inventory.gpus, inventory.driver_version,
                                     inventory.cuda_version).state("n1", 1, 0, 5, "ready",
                                                                   "simulated")
    assert [g.gpu_type for g in state.gpus] == types
    assert sum(g.memory_free_mib for g in state.gpus) == memory
    assert all(g.healthy and g.kv_cache_free_mib == g.memory_free_mib for g in state.gpus)
    assert state.executor == "simulated" and state.driver_version == "simulated"


def test_yaml_inventory_with_a_sick_gpu_and_mig(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("driver_version: '550.1'\ngpus:\n"
                    "  - {type: A100-80GB, count: 1, mig: [{profile: 3g.40gb, memory_mib: 40192},"
                    " {profile: 3g.40gb, memory_mib: 40192}]}\n"
                    "  - {type: L4-24GB, count: 2, ecc_uncorrected_errors: 2}\n")
    inventory = build_inventory(simulated_reading(str(path), "n1"))
    assert [g.memory_total_mib for g in inventory.gpus] == [40192, 40192, 23034, 23034]
    assert [g.healthy for g in inventory.gpus] == [True, True, False, False]
    assert inventory.driver_version == "550.1"


def test_refresh_takes_new_health_and_reports_the_change() -> None:
    first = build_inventory(nvml.discover(FakeNvml([h100(0, ecc=0)]))).gpus
    node = NodeModel.from_inventory(first)
    again = build_inventory(nvml.discover(FakeNvml([h100(0, ecc=1, temp=88)]))).gpus
    assert node.refresh(again) is True
    assert not node.gpus[0].info.healthy and node.gpus[0].info.temperature_c == 88
    assert node.refresh(again) is False


def test_a_gpu_nvml_stops_reading_after_start_is_unhealthy_until_read_again() -> None:
    """A GPU fallen off the bus after start stayed healthy and kept getting work: NVML's
    GPU_IS_LOST on its memory read turned it into a 'GPU-unreadable-i' that matched no
    device, and NVML unable to start any more (a reading of no GPU) changed nothing."""
    def read(*gpus: dict) -> tuple:
        return build_inventory(nvml.discover(FakeNvml(list(gpus)))).gpus

    node = NodeModel.from_inventory(read(h100(0, used=500), h100(1), h100(2)))
    assert node.refresh(read(h100(0, memory_error="GPU is lost"), h100(1, broken=True),
                             h100(2))) is True
    assert [g.info.healthy for g in node.gpus] == [False, False, True]
    assert node.gpus[0].info.unhealthy_reason == "NVML cannot read it: GPU is lost"
    assert "NVML no longer reads it" in node.gpus[1].info.unhealthy_reason
    refused = node.admit(placement("p", 1), SMALL)
    assert isinstance(refused, Refused) and "no longer reads" in refused.reason
    [lost, gone, well] = node.state("n", 1, 0, 0).gpus  # what it was at start, unhealthy
    assert (lost.uuid, lost.memory_total_mib, lost.gpu_type) == ("GPU-0", 81559 - 500,
                                                                 "H100-80GB")
    assert not lost.healthy and not gone.healthy and well.healthy
    assert node.refresh(read(h100(0), h100(1), h100(2))) is True  # back: healthy again
    assert all(g.info.healthy for g in node.gpus) and node.gpus[0].free_mib() == 81559 - 500
    assert node.refresh(()) is True  # NVML cannot start any more: no GPU read
    assert {g.info.unhealthy_reason for g in node.gpus} == {node.gpus[0].info.unhealthy_reason}
    assert "NVML no longer reads it" in node.gpus[0].info.unhealthy_reason
    assert node.refresh(()) is False


def test_a_gpu_unreadable_at_start_that_reads_again_asks_for_a_restart() -> None:
    node = NodeModel.from_inventory(build_inventory(nvml.discover(
        FakeNvml([h100(0, broken=True)]))).gpus)
    assert node.gpus[0].info.uuid == "GPU-unreadable-0"
    assert node.refresh(build_inventory(nvml.discover(FakeNvml([h100(0)]))).gpus) is False
    assert "restart the agent" in node.gpus[0].info.unhealthy_reason


def placement(pid: str, gpu: int) -> Placement:
    req = InferenceRequest(request_id=pid, tenant="t", model=SMALL.name, prompt="x",
                           created_at_ms=0)
    return Placement(placement_id=f"{pid}#0", node_id="n", gpu_indices=(gpu,), kv_cache_mib=10,
                     scheduler_epoch=1, placed_at_ms=0, request=req)
